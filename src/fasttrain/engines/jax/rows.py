"""The JAX engine's lines in the benchmark suites (``Engine.rows``)."""

from __future__ import annotations

from fasttrain.engines.rows import Row

_FP16 = {"precision": "fp16"}
_BF16 = {"precision": "bf16"}
_MLPS = ("mlp:128x3", "mlp:1024x3", "mlp:8192x3")


def rows(suite: str) -> tuple[Row, ...]:
    if suite == "ladder":
        return (Row("jax", "jax", "-"),)
    if suite == "sweep":   # the yardstick of the CUDA rows in each precision (bench/report.peer_ratios)
        return (Row("jax fp16", "jax", "-", {}, _FP16), Row("jax bf16", "jax", "-", {}, _BF16))
    if suite == "record":
        # the strongest framework peer, in the same process and precision: the record's speed-up baseline
        return (Row("jax fp16", "jax", "-", {}, _FP16, baseline=True),
                Row("jax bf16", "jax", "-", {}, _BF16, models=("logreg",), baseline=True))
    if suite == "many":   # K models at once: the step vmapped over the models (JaxSweepSession)
        return (Row("jax vmap fp16", "jax", "vmap", {"device": "gpu"}, {"precision": "fp16"}, baseline=True),)
    if suite == "peers":
        logreg = ("logreg",)
        return (Row("jax jit(lax.scan) (defaults)", "jax", "-", models=logreg),
                Row("jax jit(lax.scan), unroll 1", "jax", "unroll 1", {"unroll": 1}, models=logreg),
                Row("jax jit(lax.scan), unroll 16", "jax", "unroll 16", {"unroll": 16}, models=logreg),
                Row("jax (defaults) bf16", "jax", "-", {}, _BF16, models=logreg),
                Row("jax (defaults) fp16", "jax", "-", {}, _FP16),
                Row("jax unroll 1 fp16", "jax", "unroll 1", {"unroll": 1}, _FP16, models=_MLPS))
    return ()
