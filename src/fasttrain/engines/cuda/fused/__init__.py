"""Rungs 7 and 8 of the CUDA ladder: fused mixed-precision training on the tensor cores.

The ``cuda`` engine's ``prepare`` hands rungs 7 and 8 to :func:`make_session`. Both rungs do fp16 or bf16
``mma.sync`` GEMMs with fp32 accumulation and fp32 master weights (``--precision fp16|bf16``), follow the
shared initial weights and batch order, and report per-epoch train loss and accuracy.

- :mod:`.build`: compiling ``kernels/fused_*.cu`` (NVRTC, nvcc as the fallback);
- :mod:`.plans`: each kernel's configuration and the mirror of its shared-memory layout (pure arithmetic);
- :mod:`.base`: what both rungs' sessions share (device data, evaluation, the side-stream test score);
- :mod:`.step`: rung 7, one CUDA graph an epoch of fused step kernels, for any model;
- :mod:`.persistent`: rung 8, one persistent kernel an epoch (logreg, MLPs up to width 1024).

The kernels' earlier versions, the profiling tools and the notes with each version's prediction and
measured outcome live in ``dev/cuda/``. CuPy provides memory, streams, graphs and NVRTC; nothing here
imports it at module scope.
"""

from __future__ import annotations

from fasttrain.engines.base import Job, Session
from fasttrain.engines.cuda.fused.plans import grid_plan, mlp_plan, pad16
from fasttrain.errors import FasttrainError


def check_precision(precision: str, rung: int) -> None:
    if precision not in ("fp16", "bf16"):
        raise FasttrainError(
            f"engine cuda rung {rung} trains on the tensor cores in mixed precision; "
            f"use --precision fp16 or --precision bf16 (got {precision})"
        )


def make_session(job: Job, options) -> Session:
    """The session for rung 7 or 8 (``options.rung``), tuned by the engine's typed options."""
    check_precision(job.config.precision, options.rung)
    if options.rung == 8:
        from fasttrain.engines.cuda.fused.persistent import (
            PersistentGridSession,
            PersistentLogregSession,
            PersistentMlpSession,
        )

        if job.spec.is_logreg:
            return PersistentLogregSession(job, options)
        if pad16(max(job.spec.hidden)) <= 128:
            mlp_plan(job.spec, job.config.batch_size, options.mlp_stages, options.mlp_layout)  # raises before any device work
            return PersistentMlpSession(job, options)
        grid_plan(job.spec, job.config.batch_size)   # the same
        return PersistentGridSession(job, options)
    if options.rung == 7:
        from fasttrain.engines.cuda.fused.step import FusedStepSession

        return FusedStepSession(job, options)
    raise FasttrainError(f"fasttrain.engines.cuda.fused runs rungs 7 and 8, not {options.rung}")
