"""The JAX engine class: options and availability only; jax is imported inside ``prepare``."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

from fasttrain.engines.base import Engine, Job, Session, option


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
        # Engines share one process (and GPU) in a benchmark: JAX must not grab 75% of the GPU's memory up
        # front, its default, or the engines after it would run short. Read when JAX starts its backend.
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
        from fasttrain.engines.jax.session import JaxSession

        return JaxSession(job, self.options)
