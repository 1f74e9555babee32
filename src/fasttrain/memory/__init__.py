"""Training-memory and cost estimator for transformer training (independent of the engines).

- ``estimate(setup, "playbook")``: the Ultra-Scale Playbook widget's formulas, quirks included;
- ``estimate(setup, "precise")``: the peak of one GPU during a step of the reference PyTorch
  implementation, validated on a GPU (``fasttrain.memory.validate``);
- ``fasttrain.memory.cost``: FLOPs, GPU-hours, dollars, implied MFU;
- ``fasttrain.memory.page``: the self-contained interactive page.

See MODEL.md beside this file for every formula, quirk and difference.
"""

from fasttrain.memory.breakdown import Breakdown, Line, format_gib
from fasttrain.memory.config import PRESETS, Setup, check, preset


def estimate(setup: Setup, mode: str = "precise") -> Breakdown:
    """The memory breakdown of ``setup`` in ``mode`` (``playbook`` or ``precise``)."""
    check(setup, mode)
    if mode == "playbook":
        from fasttrain.memory import playbook

        return playbook.estimate(setup)
    from fasttrain.memory import precise

    return precise.estimate(setup)


__all__ = ["Breakdown", "Line", "PRESETS", "Setup", "check", "estimate", "format_gib", "preset"]
