"""The interactive page: one self-contained HTML file (inline CSS and JavaScript, no network).

The formulas run in the browser from ``assets/memory.js``, a line-by-line port of
``playbook.py``, ``precise.py`` (with ``training_state.py``) and ``cost.py``;
``tests/test_memory_page.py`` checks every number it computes against the Python modules on
the same setups, and drives the page's controls in headless Chromium. The presets, the published Llama 3.1 figures and the list of quirks and
differences are generated into the page from the Python modules (one source of truth).
"""

from __future__ import annotations

import html
import json
import re
from dataclasses import asdict
from pathlib import Path

from fasttrain.memory.config import PRESET_NOTES, PRESETS, Setup, preset

ASSETS = Path(__file__).with_name("assets")


def _numbered(doc: str, letter: str) -> list[str]:
    """The ``Q1 ...``/``D1 ...`` items of a module docstring, each joined into one line."""
    items, current = [], None
    for line in doc.splitlines():
        m = re.match(rf"^{letter}(\d+)\s+(.*)", line)
        if m:
            if current:
                items.append(current)
            current = f"{letter}{m.group(1)}: {m.group(2).strip()}"
        elif current is not None and line.startswith("    ") and line.strip():
            current += " " + line.strip()
        elif current is not None:
            items.append(current)
            current = None
    if current:
        items.append(current)
    return items


def quirks() -> list[str]:
    from fasttrain.memory import playbook

    return _numbered(playbook.__doc__, "Q")


def differences() -> list[str]:
    from fasttrain.memory import precise

    return _numbered(precise.__doc__, "D")


def _setup_dict(s: Setup) -> dict:
    d = asdict(s)
    d["kv_heads"] = s.g
    return d


# Setup fields the page's JavaScript does not model (a transformers model's: hf_config.py), at their defaults
_NOT_ON_PAGE = {"head_dim": None, "qkv_bias": None, "proj_bias": None, "mlp_bias": None, "positions": None,
                "modules": "lab", "keep_logits": False}


def _check_lab_model(setup: Setup) -> None:
    """The page models the lab's GPT only, with the widget's ZeRO: refuse a setup that sets a transformers
    model's fields, or FSDP2's layout (``fsdp``: the page's JavaScript has no port of it)."""
    from fasttrain.errors import FasttrainError

    changed = sorted(k for k, default in _NOT_ON_PAGE.items() if getattr(setup, k) != default)
    if changed:
        raise FasttrainError(f"the memory page models the lab's GPT; this setup sets {', '.join(changed)} "
                             "(a transformers model): use the command line without --html")
    if setup.fsdp:
        raise FasttrainError("the memory page models ZeRO as the widget does, not FSDP2's layout (--strategy fsdp): "
                             "use the command line without --html")


def render(setup: Setup | None = None, mode: str = "precise", preset_name: str = "llama3-8b") -> str:
    """The page's HTML, starting at ``setup`` (default: the preset) in ``mode``."""
    from fasttrain.memory.cost import PUBLISHED

    if setup is None:
        setup = preset(preset_name)
    _check_lab_model(setup)
    presets = {name: _setup_dict(preset(name)) for name in PRESETS}
    published = {}
    for name, (arch, tokens, _seq, hours) in PUBLISHED.items():
        # shown when the architecture preset is selected with the published token count
        published[arch] = {"run": name, "tokens": tokens, "gpu_hours": hours}
    js = (ASSETS / "memory.js").read_text()
    page = (ASSETS / "page.html").read_text()

    def esc(items):
        # ``code`` in the docstrings -> <code>code</code>, the rest escaped
        return json.dumps([re.sub(r"``(.+?)``", r"<code>\1</code>", html.escape(x, quote=False)) for x in items])

    return _filled(page, {
        "/*MEMORY_JS*/": js,
        "/*PRESETS*/": json.dumps(presets),
        "/*PRESET_NOTES*/": json.dumps(PRESET_NOTES),
        "/*PUBLISHED*/": json.dumps(published),
        "/*INITIAL*/": json.dumps({"setup": _setup_dict(setup), "mode": mode,
                                   "preset": preset_name if _setup_dict(setup) == presets.get(preset_name) else "custom"}),
        "/*QUIRKS*/": esc(quirks()),
        "/*DIFFS*/": esc(differences()),
    })


def _filled(page: str, values: dict) -> str:
    """The template with each ``/*KEY*/`` replaced (a ``</script`` inside escaped: it would end the script)."""
    for key, value in values.items():
        assert key in page, key
        page = page.replace(key, value.replace("</script", "<\\/script"))
    return page


# the GPU counts a page of a transformers model ranks (with the one asked for)
PAGE_GPUS = (1, 2, 4, 8)


def hf_page_data(setup: Setup, breakdown, *, model: str, nproc_per_node: int, gpu_gb: float, bf16: bool,
                 strategy: str) -> dict:
    """What the page of a transformers model shows: the breakdown asked for and, for each GPU count, every
    strategy x checkpointing choice with its per-GPU peak (:func:`fasttrain.memory.fit.rank`), all
    computed here; the page only filters them by the GPU memory typed in."""
    from fasttrain.memory.fit import precision_words, rank

    counts = sorted({*PAGE_GPUS, nproc_per_node})
    rankings = {str(n): [r.to_dict() for r in rank(setup, n, gpu_gb * 1e9, bf16)] for n in counts}
    s = setup
    summary = (f"{breakdown.params:,.0f} parameters · micro-batch {s.micro_batch} x {s.seq} tokens · "
               f"{precision_words(strategy, bf16)} · attention {s.attention} · optimizer {s.optim} · as asked: "
               f"{strategy} on {nproc_per_node} GPU{'s' if nproc_per_node > 1 else ''}, recompute {s.recompute}")
    lines = [{"name": x.name, "bytes": x.bytes, "note": x.note} for x in breakdown.lines if x.in_total]
    return {"model": model, "summary": summary, "lines": lines, "total": breakdown.total, "params": breakdown.params,
            "rankings": rankings, "nproc_per_node": nproc_per_node, "gpu_gb": gpu_gb}


def render_hf(data: dict) -> str:
    """The page of a transformers model (``assets/hf_page.html``) holding ``data`` (:func:`hf_page_data`)."""
    page = (ASSETS / "hf_page.html").read_text()
    return _filled(page, {"/*MEMORY_JS*/": (ASSETS / "memory.js").read_text(), "/*HF_DATA*/": json.dumps(data)})


def write_hf_page(path, setup: Setup, breakdown, **options) -> Path:
    """``fasttrain memory --hf-config X --html PATH``: written whole or not at all."""
    from fasttrain.files import atomic_write_text, check_output_path

    check_output_path(path, "--html")
    atomic_write_text(path, render_hf(hf_page_data(setup, breakdown, **options)))
    return Path(path)


def write_page(path, setup: Setup | None = None, mode: str = "precise", preset: str = "llama3-8b") -> Path:
    """Write the page whole or not at all, into a folder that must already exist."""
    from fasttrain.files import atomic_write_text, check_output_path

    check_output_path(path, "--html")
    out = Path(path)
    atomic_write_text(out, render(setup, mode, preset))
    return out
