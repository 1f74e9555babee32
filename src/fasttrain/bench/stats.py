"""Figures from run records, and their statistics across repeated runs.

Per run (one record): ``epoch_ms`` = mean epoch time over the second half of training, recomputed
from the record's epochs with :func:`fasttrain.timing.second_half_mean`; ``train_ms`` = the
sum of all epochs' times (every SGD step, no setup, no evaluation); ``setup_ms``; ``total_ms``;
``test_acc`` = the final test accuracy. Across runs (seeds): p20/p50/p80 (NumPy's linear
interpolation), the mean and ``n``.
"""

from __future__ import annotations

from collections.abc import Sequence


from fasttrain.timing import second_half_mean, summarize

# metric -> (unit, how to read it from a run record as a dict)
METRICS: dict[str, tuple[str, object]] = {
    "epoch_ms": ("ms", lambda r: second_half_mean([e["train_ms"] for e in r["epochs"]])),
    "train_ms": ("ms", lambda r: float(sum(e["train_ms"] for e in r["epochs"]))),
    "setup_ms": ("ms", lambda r: float(r["setup_ms"])),
    "total_ms": ("ms", lambda r: float(r["total_ms"])),
    "test_acc": ("fraction", lambda r: r["final"]["test_acc"]),
}


def run_metrics(record: dict) -> dict[str, float | None]:
    return {name: read(record) for name, (_unit, read) in METRICS.items()}


def case_metrics(records: Sequence[dict]) -> dict[str, dict]:
    """Each metric summarized across a case's runs."""
    per_run = [run_metrics(r) for r in records]
    return {name: {"unit": unit, **summarize([m[name] for m in per_run])} for name, (unit, _) in METRICS.items()}


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or denominator is None or denominator == 0:
        return None
    return numerator / denominator
