"""The JAX engine class: options and availability only; jax is imported inside ``prepare``."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

from fasttrain.contract import INPUT_DIM
from fasttrain.engines.base import (Engine, Job, Session, SweepJob, SweepMemory, SweepSession,
                                   host_available_bytes, option)


@dataclass(frozen=True)
class JaxOptions:
    device: str = option("auto", "gpu or cpu (auto: JAX's default backend)", choices=("auto", "gpu", "cpu"))
    # 8: logreg fp32 epochs of 11.2 / 8.55 / 9.9 ms at unroll 1 / 8 / 32 on an H200 (dev/peers/probe_peers.py).
    unroll: int = option(8, "lax.scan unroll factor: steps per loop iteration of the compiled epoch")


class JaxEngine(Engine):
    name = "jax"
    description = "JAX: jit of a whole epoch as lax.scan over its batches, donated weights, fp32 at 'highest' or bf16/fp16 mixed"
    Options = JaxOptions
    precisions = ("fp32", "fp16", "bf16")
    order = 30
    color = "Purples"
    libraries = ("jax", "jaxlib")
    conformance_options = ({"device": "cpu"},)

    @classmethod
    def rows(cls, suite: str) -> tuple:
        from fasttrain.engines.jax.rows import rows

        return rows(suite)

    @classmethod
    def available(cls) -> str | None:
        if importlib.util.find_spec("jax") is None:
            return "JAX is not installed; install it with: pip install 'fasttrain[jax]' (jax[cuda13] for the GPU)"
        return None

    def prepare(self, job: Job) -> Session:
        _no_preallocation()
        from fasttrain.engines.jax.session import JaxSession

        return JaxSession(job, self.options)

    sweep = "vmap over the models' parameters and learning rates"

    def prepare_sweep(self, job: SweepJob) -> SweepSession:
        _no_preallocation()
        from fasttrain.engines.jax.session import JaxSweepSession

        return JaxSweepSession(job, self.options)

    def sweep_memory(self, spec, config, n_train: int, n_test: int, n_epochs: int) -> SweepMemory:
        _no_preallocation()
        from fasttrain.engines.jax.session import pick_device

        device = pick_device(self.options.device)
        # shared: the data as uint8 pixels and int32 labels, train and test sets
        shared = (n_train + n_test) * (INPUT_DIM + 4)
        # a model: fp32 weights three times over in a step (weights, gradients, updated weights), its
        # batch gathered and converted (uint8 and fp32), the step's activations (z and h of every layer,
        # their gradients: ~4 per unit), every epoch's order (int32), and its share of the vmapped
        # test-set evaluation (each model's widest activation over the whole test set, z and h)
        per_model = (spec.n_params * 4 * 3 + config.batch_size * INPUT_DIM * 5
                     + config.batch_size * sum(spec.widths) * 4 * 4 + n_epochs * n_train * 4
                     + n_test * max(spec.widths) * 4 * 2)
        stats = device.memory_stats() if device.platform != "cpu" else None
        if stats and stats.get("bytes_limit"):
            available = int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
            where = f"{device.platform} memory ({getattr(device, 'device_kind', device)})"
        else:
            available, where = host_available_bytes(), "host memory"
        return SweepMemory(shared, per_model, available, where)


def _no_preallocation() -> None:
    # Engines share one process (and GPU) in a benchmark: JAX must not grab 75% of the GPU's memory up
    # front, its default, or the engines after it would run short. Read when JAX starts its backend.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
