"""The transformer lab: train and measure a causal language model with any set of techniques.

``fasttrain.lab.run(config, model=module)`` (:mod:`fasttrain.lab.api`) trains any module mapping
token ids to logits and returns a :class:`~fasttrain.lab.record.RunRecord`. Imported on first use:
importing the package stays cheap (no torch).
"""

from __future__ import annotations

_LAZY = {"run": ("fasttrain.lab.api", "run"), "wrap_module": ("fasttrain.lab.api", "wrap_module"),
         "RunRecord": ("fasttrain.lab.record", "RunRecord"), "LabConfig": ("fasttrain.lab.config", "LabConfig"),
         "LabModel": ("fasttrain.lab.models", "LabModel"), "preset": ("fasttrain.lab.config", "preset")}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'fasttrain.lab' has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *_LAZY])


__all__ = ["run", "wrap_module", "RunRecord", "LabConfig", "LabModel", "preset"]
