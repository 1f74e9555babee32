"""Known-harmless third-party noise, kept out of the lab's output (and tune's).

Importing torchao (through peft, or for ``--optim adamw_8bit``) logs a "Failed to load ..._C*.so"
line per C++ extension built for another Python or GPU (its Python kernels are used instead), and
compiling its sources warns of invalid escape sequences in its docstrings; torch logs one
deprecation line per Enum torchao registers with pytree; liger-kernel logs a line per optional
backend of other hardware it cannot import (CuTe DSL, Ascend: its Triton kernels are used), and
torch.compile warns that it traces through the ``lru_cache`` of liger's SwiGLU; transformers logs
that ``use_return_dict`` is deprecated (its own code reads it). None says anything about the run.
:func:`filter_known_noise` drops exactly those records and warnings (by logger or warning category,
message and file), counts them, and :func:`summary` gives one line for them (printed without
``--quiet``). Anything else a library logs or warns still comes through; ``tune --verbose`` installs
no filter.
"""

from __future__ import annotations

import logging
import re

# (logger name, message pattern, what the records mean in one phrase)
KNOWN = (
    ("torchao", re.compile(r"^Failed to load .*torchao/_C[^/]*\.so"),
     "torchao's prebuilt C++ extensions do not load here (its Python kernels are used)"),
    ("torch.utils._pytree", re.compile(r"is an Enum subclass and is now natively supported by torch\.compile"),
     "torch's deprecation notes on Enum types torchao registers"),
    ("liger_kernel.backends.registry", re.compile(r"^Backend impl '[^']*' for op '[^']*' could not be imported"),
     "liger-kernel's backends for other hardware do not import here (its Triton kernels are used)"),
    ("transformers.configuration_utils", re.compile(r"`use_return_dict` is deprecated"),
     "transformers' note that its own use_return_dict is deprecated"),
)
# warnings: (category, message pattern, pattern of the file it is attributed to, meaning)
KNOWN_WARNINGS = (
    (SyntaxWarning, re.compile(r"^invalid escape sequence"), re.compile(r"[/\\]torchao[/\\]"),
     "torchao's docstrings' invalid escape sequences (warned when its sources compile)"),
    (UserWarning, re.compile(r"Dynamo detected a call to a `functools\.lru_cache`-wrapped function at 'swiglu\.py"),
     None, "torch.compile tracing through liger-kernel's cached SwiGLU helper"),
)


class _KnownNoise(logging.Filter):
    def __init__(self, pattern, meaning: str):
        super().__init__()
        self.pattern, self.meaning, self.count = pattern, meaning, 0

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:           # a record that cannot format itself is not ours to judge
            return True
        if self.pattern.search(message):
            self.count += 1
            return False
        return True


class _KnownWarnings:
    """``warnings.showwarning`` in front of the one there: a known warning is counted, not shown."""

    def __init__(self, show):
        self.show = show
        self.counts = {meaning: 0 for *_, meaning in KNOWN_WARNINGS}

    def __call__(self, message, category, filename, lineno, file=None, line=None):
        for kind, pattern, where, meaning in KNOWN_WARNINGS:
            if issubclass(category, kind) and pattern.search(str(message)) and (
                    where is None or where.search(str(filename))):
                self.counts[meaning] += 1
                return None
        return self.show(message, category, filename, lineno, file, line)


_installed: list[_KnownNoise] = []
_warnings: list[_KnownWarnings] = []


def filter_known_noise() -> None:
    """Install the filters (once per process), before the libraries are imported."""
    if _installed:
        return
    import warnings

    for name, pattern, meaning in KNOWN:
        f = _KnownNoise(pattern, meaning)
        logging.getLogger(name).addFilter(f)
        _installed.append(f)
    _warnings.append(_KnownWarnings(warnings.showwarning))
    warnings.showwarning = _warnings[0]


def summary() -> str | None:
    """One line for what was dropped, or None when nothing was."""
    counts = [(f.meaning, f.count) for f in _installed] + [kv for w in _warnings for kv in w.counts.items()]
    parts = [f"{meaning} ({n} line{'s' if n > 1 else ''})" for meaning, n in counts if n]
    return ("third-party notes left out: " + "; ".join(parts)) if parts else None


__all__ = ["filter_known_noise", "summary"]
