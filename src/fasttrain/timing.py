"""Timing: the one place that decides what a measured millisecond means.

Timed region of an epoch: from just before the engine's ``train_epoch`` is called to the moment
its queued device work has finished (the session's ``sync()`` runs before the clock is read at
both ends), i.e. every SGD step of the epoch plus the engine's own train-loss/accuracy
bookkeeping. Test-set evaluation is timed apart (``eval_ms``). Warm-up, compilation, graph
capture and data upload happen in ``prepare`` and are reported as ``setup_ms``, never inside an
epoch. ``total_ms`` is the wall time of the whole run: setup, every epoch and every evaluation.

Statistics over epochs: the seed study's figure is the mean epoch time over the second half of
training (epochs ``n//2+1 .. n``, so warm caches and clocks dominate); alongside it the median
and the 20th/80th percentiles (linear interpolation, as NumPy's default).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np


class Stopwatch:
    """Wall-clock timer that synchronizes the device before reading the clock."""

    def __init__(self, sync: Callable[[], None] | None = None):
        self._sync = sync or (lambda: None)
        self._start = 0.0

    def start(self) -> None:
        self._sync()
        self._start = time.perf_counter()

    def stop_ms(self) -> float:
        self._sync()
        return (time.perf_counter() - self._start) * 1e3

    def time_ms(self, fn: Callable[[], object]) -> tuple[float, object]:
        self.start()
        result = fn()
        return self.stop_ms(), result


def second_half_mean(values: Sequence[float]) -> float:
    """Mean over the second half: items ``n//2 .. n-1`` (all of them when n == 1)."""
    if len(values) == 0:
        raise ValueError("no values")
    return float(np.mean(values[len(values) // 2 :]))


def percentiles(values: Sequence[float], qs: Sequence[float] = (20, 50, 80)) -> dict[str, float]:
    """``{'p20': .., 'p50': .., 'p80': ..}`` with NumPy's linear interpolation."""
    if len(values) == 0:
        raise ValueError("no values")
    return {f"p{q:g}": float(np.percentile(np.asarray(values, dtype=np.float64), q)) for q in qs}


def summarize(values: Sequence[float | None]) -> dict:
    """``{p20, p50, p80, mean, n}`` of the values that are not None (``n == 0``: all None): the
    statistics of every result across steps or runs."""
    present = [float(v) for v in values if v is not None]
    if not present:
        return {"p20": None, "p50": None, "p80": None, "mean": None, "n": 0}
    return {**percentiles(present), "mean": float(np.mean(present)), "n": len(present)}


def summarize_epochs(epoch_ms: Sequence[float]) -> dict[str, float]:
    """The epoch-time statistics stored in a run record."""
    stats = {"mean_second_half": second_half_mean(epoch_ms), "mean": float(np.mean(epoch_ms))}
    stats.update(percentiles(epoch_ms))
    return stats
