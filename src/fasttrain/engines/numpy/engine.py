"""NumPy on the CPU: the seed study's first rung (12,500 ms per epoch there) done right.

Whole-batch matrix products through the BLAS NumPy links, inputs converted to floats once at
setup (``x = pixel / 255``), each batch gathered from that matrix by the shared order, weights
updated in place. In fp64 this is the reference every other engine is held to.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from fasttrain.contract import INPUT_DIM, batch_bounds
from fasttrain.data.datasets import to_inputs
from fasttrain.engines.base import (Engine, EpochStats, Job, Session, SweepJob, SweepMemory, SweepSession,
                                   host_available_bytes, option)
from fasttrain.reference import evaluate, sgd_step


@dataclass(frozen=True)
class NumpyOptions:
    threads: int = option(0, "BLAS threads (0 = one per core)", bounds=(0, 1024))


class NumpySession(Session):
    def __init__(self, job: Job, threads: int, inputs: np.ndarray | None = None):
        from threadpoolctl import threadpool_limits

        self._limits = threadpool_limits(limits=threads, user_api="blas")
        self.threads = threads
        self.dtype = np.float64 if job.config.precision == "fp64" else np.float32
        self.config = job.config
        self.data = job.data
        # the models of a sweep share one converted copy of the training set (read only)
        self.x = to_inputs(job.data.train_images, self.dtype) if inputs is None else inputs
        self.y = job.data.train_labels.astype(np.int64)
        self.params = [(w.astype(self.dtype), b.astype(self.dtype)) for w, b in job.init_weights]
        self.bounds = batch_bounds(job.data.n_train, job.config.batch_size, job.config.drop_last)

    def train_epoch(self, epoch: int, order: np.ndarray, steps: int) -> EpochStats:
        losses = np.empty(steps)
        loss_sum, correct, count = 0.0, 0, 0
        for k, (start, stop) in enumerate(self.bounds[:steps]):
            idx = order[start:stop]
            loss, ok = sgd_step(self.params, self.x[idx], self.y[idx], self.config.lr)
            losses[k] = loss
            loss_sum += loss * (stop - start)
            correct += ok
            count += stop - start
        return EpochStats(count=count, loss_sum=loss_sum, correct=correct, step_losses=losses)

    def evaluate(self) -> tuple[float, float]:
        return evaluate(self.params, self.data, self.dtype)

    def weights(self):
        return [(w.copy(), b.copy()) for w, b in self.params]

    def environment(self) -> dict:
        return {"device": "cpu", "blas_threads": self.threads}

    def close(self) -> None:
        self._limits.restore_original_limits()


class NumpyEngine(Engine):
    name = "numpy"
    description = "NumPy on the CPU, vectorized batches; fp64 is the reference every engine is held to"
    Options = NumpyOptions
    precisions = ("fp32", "fp64")
    order = 0
    color = "Greys"
    reference = True
    conformance_options = ({"threads": 1},)

    @classmethod
    def rows(cls, suite: str) -> tuple:
        from fasttrain.engines.rows import Row

        if suite == "ladder":
            return (Row("numpy", "numpy", "-", seed_ms=12500.0),)   # the seed study's figure, measured elsewhere
        if suite == "sweep":   # a CPU baseline; above h=1024 it would take minutes per run
            return (Row("numpy fp32", "numpy", "-", max_hidden=1024),)
        if suite == "many":    # a loop over the models: the CPU baseline, on logreg up to 4 models (slow beyond)
            return (Row("numpy loop", "numpy", "loop", models=("logreg",), max_k=4),)
        return ()

    def prepare(self, job: Job) -> Session:
        return NumpySession(job, self.options.threads or os.cpu_count() or 1)

    # a sweep is K sessions trained one after the other (fasttrain.engines.loop_sweep.LoopSweepSession): the reference
    # every sweep engine is held to, each model exactly its own run
    sweep = "a loop over the models"

    def prepare_sweep(self, job: SweepJob) -> SweepSession:
        from fasttrain.engines.loop_sweep import LoopSweepSession

        threads = self.options.threads or os.cpu_count() or 1
        dtype = np.float64 if job.config.precision == "fp64" else np.float32
        inputs = to_inputs(job.data.train_images, dtype)
        return LoopSweepSession(NumpySession(job.single(k), threads, inputs) for k in range(job.k))

    def sweep_memory(self, spec, config, n_train: int, n_test: int, n_epochs: int) -> SweepMemory:
        itemsize = 8 if config.precision == "fp64" else 4
        # shared: the converted training set and one test-set pass (inputs plus the widest activation);
        # a model: its weights plus, during a step, gradients and the batch's activations (pre and post ReLU)
        shared = (n_train + n_test) * INPUT_DIM * itemsize + n_test * max(spec.widths) * itemsize * 2
        per_model = spec.n_params * itemsize * 2 + config.batch_size * sum(spec.widths) * itemsize * 3
        return SweepMemory(shared, per_model, host_available_bytes(), "host memory")
