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


# a sweep's figures (the many suite): its record carries the sweep's timing (fasttrain.sweep.sweep_timing)
SWEEP_METRICS: dict[str, tuple[str, object]] = {
    "model_epochs_per_s": ("model-epochs/s", lambda r: r["sweep"]["timing"]["model_epochs_per_s"]),
    "model_runs_per_s": ("model-runs/s", lambda r: r["sweep"]["timing"]["model_runs_per_s"]),
}


def case_metrics(records: Sequence[dict]) -> dict[str, dict]:
    """Each metric summarized across a case's runs (and, for sweeps, the sweep's throughput)."""
    metrics = dict(METRICS)
    if records and all("sweep" in r for r in records):
        metrics.update(SWEEP_METRICS)
    return {name: {"unit": unit, **summarize([read(r) for r in records])} for name, (unit, read) in metrics.items()}


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or denominator is None or denominator == 0:
        return None
    return numerator / denominator
