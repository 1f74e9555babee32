"""The PyTorch engines' lines in the benchmark suites (``Engine.rows``)."""

from __future__ import annotations

from fasttrain.engines.rows import OFF, Row

COMPILE_NOTE = "left out of --quick: torch.compile takes a minute or more to compile"
SEED_EAGER_MS = 10500.0    # the seed study's figures (ms per epoch, logreg, batch 128; measured elsewhere)
SEED_COMPILED_MS = 600.0   # "+ torch.compile(), pinned memory, AMP, preloading dataset"
_FP16 = {"precision": "fp16"}
_MLPS = ("mlp:128x3", "mlp:1024x3", "mlp:8192x3")

# torch-fast rungs: every flag named, each rung switches on one more (the seed's "+ torch.compile(),
# pinned memory, AMP, preloading dataset" is the +compile rung). pin_memory only matters without
# preload; it stays on throughout, as in the seed's optimized version. torch-fast's mixed precision
# follows the config's precision, so the +amp rungs set precision fp16 and name amp to match.
_TF_BASE = dict(preload=True, pin_memory=True, amp=OFF, compile=OFF, cuda_graph=OFF, fused_sgd=OFF)
_AUTOGRAD = {"step": "autograd"}
_ALL_OFF = {"step": "autograd", "compile": OFF, "cuda_graph": OFF, "fused_sgd": False}


def _fast(label: str, rung: str, overrides: dict | None = None, quick: bool = True, seed_ms=None, **changes) -> Row:
    return Row(label, "torch-fast", rung, {**_TF_BASE, **changes}, dict(overrides or {}), quick=quick,
               quick_note="" if quick else COMPILE_NOTE, seed_ms=seed_ms)


def eager_rows(suite: str) -> tuple[Row, ...]:
    if suite == "ladder":
        return (Row("torch-eager", "torch-eager", "-", seed_ms=SEED_EAGER_MS, baseline=True),)
    if suite == "sweep":
        return (Row("torch-eager fp16", "torch-eager", "-", {}, _FP16, baseline=True),)
    if suite == "peers":
        return (Row("torch-eager, tutorial DataLoader", "torch-eager", "-", models=("logreg",)),
                Row("torch-eager fp16", "torch-eager", "-", {}, _FP16, models=_MLPS))
    return ()


def fast_rows(suite: str) -> tuple[Row, ...]:
    if suite == "ladder":
        return (
            _fast("torch-fast preload", "preload"),
            _fast("torch-fast +amp", "+amp", _FP16, amp="fp16"),
            _fast("torch-fast +compile", "+compile", _FP16, False, seed_ms=SEED_COMPILED_MS, amp="fp16",
                  compile="default"),
            # fused SGD first: with fp16, GradScaler's unfused step reads an overflow flag on the host every
            # step, which a CUDA graph cannot capture.
            _fast("torch-fast +fused-sgd", "+fused-sgd", _FP16, False, amp="fp16", compile="default", fused_sgd=True),
            _fast("torch-fast +cuda-graph", "+cuda-graph", _FP16, False, amp="fp16", compile="default",
                  fused_sgd=True, cuda_graph="epoch"),
            # The engine's own best setting (every flag on its default), in fp32 like the rows above it.
            Row("torch-fast (defaults)", "torch-fast", "defaults", quick=False, quick_note=COMPILE_NOTE),
        )
    if suite == "sweep":
        return (
            Row("torch-fast compiled fp16", "torch-fast", "compile",
                {**_TF_BASE, "amp": "fp16", "compile": "reduce-overhead"}, _FP16, quick=False, quick_note=COMPILE_NOTE),
            Row("torch-fast CUDA graph fp16", "torch-fast", "cuda-graph",
                {**_TF_BASE, "amp": "fp16", "fused_sgd": True, "cuda_graph": "epoch"}, _FP16),
            # The engine's own best setting (compiled functional step in a CUDA graph): the strongest PyTorch peer.
            Row("torch-fast (defaults) fp16", "torch-fast", "defaults", {}, _FP16, quick=False,
                quick_note=COMPILE_NOTE),
        )
    if suite == "many":   # K models at once: batched matmuls over the stacked weights (FastSweepSession)
        return (Row("torch-fast bmm fp16", "torch-fast", "bmm", {"device": "cuda"}, {"precision": "fp16"}),)
    if suite == "peers":
        slow = dict(quick=False, quick_note=COMPILE_NOTE)
        logreg = ("logreg",)
        return (
            # the seed study's rungs one at a time, then the best settings
            Row("torch-fast host-fed batches, pinned memory", "torch-fast", "host-fed",
                {**_ALL_OFF, "preload": False, "pin_memory": True}, models=logreg),
            Row("torch-fast preload", "torch-fast", "preload", _ALL_OFF, models=logreg),
            Row("torch-fast preload + AMP", "torch-fast", "+amp", _ALL_OFF, _FP16, models=logreg),
            Row("torch-fast preload + AMP + compile", "torch-fast", "+compile", {**_ALL_OFF, "compile": "default"},
                _FP16, models=logreg, **slow),
            Row("torch-fast ... + fused SGD", "torch-fast", "+fused-sgd",
                {**_ALL_OFF, "compile": "default", "fused_sgd": True}, _FP16, models=logreg, **slow),
            Row("torch-fast ... + CUDA graph per step", "torch-fast", "+graph-step", {**_AUTOGRAD, "cuda_graph": "step"},
                _FP16, models=logreg, **slow),
            Row("torch-fast ... + CUDA graph per epoch", "torch-fast", "+graph-epoch", _AUTOGRAD, _FP16,
                models=logreg, **slow),
            Row("torch-fast all on (defaults) fp16", "torch-fast", "defaults", {}, _FP16, **slow),
            Row("torch-fast autograd, compile, fused SGD, CUDA graph fp16", "torch-fast", "autograd", _AUTOGRAD,
                _FP16, models=_MLPS, **slow),
            Row("torch-fast all on (defaults) fp32", "torch-fast", "defaults", {}, models=logreg, **slow),
            Row("torch-fast all on (defaults) bf16", "torch-fast", "defaults", {}, {"precision": "bf16"},
                models=logreg, **slow),
        )
    return ()
