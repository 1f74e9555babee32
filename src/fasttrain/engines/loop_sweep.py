"""The reference way to train K models at once: K single sessions, one after the other each epoch.

An engine without a batched sweep of its own returns one of these from ``prepare_sweep`` (the numpy
engine always; the cuda engine below its cluster kernel's sizes), and every batched sweep is held to
it: each model's numbers are exactly those of its own run.
"""

from __future__ import annotations

import numpy as np

from fasttrain.engines.base import EpochStats, SweepSession, Weights


class LoopSweepSession(SweepSession):
    """K single sessions trained one after the other each epoch: the reference a sweep engine is held to
    (each model's numbers are exactly those of its own run)."""

    def __init__(self, sessions):
        self.sessions = list(sessions)

    def train_epoch(self, epoch: int, orders: list[np.ndarray], steps: int) -> list[EpochStats]:
        return [s.train_epoch(epoch, order, steps) for s, order in zip(self.sessions, orders)]

    def evaluate(self) -> list[tuple[float, float]]:
        return [s.evaluate() for s in self.sessions]

    def weights(self) -> list[Weights]:
        return [s.weights() for s in self.sessions]

    def sync(self) -> None:
        for s in self.sessions:
            s.sync()

    def environment(self) -> dict:
        return self.sessions[0].environment() if self.sessions else {}

    def close(self) -> None:
        for s in self.sessions:
            s.close()
