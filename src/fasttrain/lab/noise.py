"""Known-harmless third-party noise, kept out of the lab's output.

Importing torchao (through peft, or for ``--optim adamw_8bit``) logs a "Failed to load ..._C*.so"
line per C++ extension built for another Python or GPU (its Python kernels are used instead) and
torch logs one deprecation line per Enum torchao registers with pytree. None says anything about
the run. :func:`filter_known_noise` drops exactly those records (by logger and message), counts
them, and :func:`summary` gives one line for them (printed without ``--quiet``). Anything else a
library logs still comes through.
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


_installed: list[_KnownNoise] = []


def filter_known_noise() -> None:
    """Install the filters (once per process), before the libraries are imported."""
    if _installed:
        return
    for name, pattern, meaning in KNOWN:
        f = _KnownNoise(pattern, meaning)
        logging.getLogger(name).addFilter(f)
        _installed.append(f)


def summary() -> str | None:
    """One line for what was dropped, or None when nothing was."""
    parts = [f"{f.meaning} ({f.count} line{'s' if f.count > 1 else ''})" for f in _installed if f.count]
    return ("third-party notes left out: " + "; ".join(parts)) if parts else None


__all__ = ["filter_known_noise", "summary"]
