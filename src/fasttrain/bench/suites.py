"""The benchmark suites, as data.

A suite is a list of :class:`Row` (label, engine, engine options, config overrides) crossed with
a list of models. Rows name engines that may not exist yet, or not run on this machine: the
runner skips those with the engine's own reason, and they appear by themselves once the engine
is built. Nothing here imports an engine.

``OFF`` in a row's options means "this flag switched off", whatever the engine calls that
(``False`` for a boolean flag, ``off``/``none`` for a flag with choices), so a rung can name every
flag explicitly and measure exactly one optimization more than the row above it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from fasttrain.contract import parse_model


class _Off:
    def __repr__(self) -> str:
        return "OFF"


OFF = _Off()

SEED_NOTE = "measured elsewhere, unknown GPU"
COMPILE_NOTE = "left out of --quick: torch.compile takes a minute or more to compile"

# The seed study's figures (ms per epoch, logreg, batch 128): measured elsewhere on an unknown GPU.
# Rows whose seed counterpart is unambiguous carry their figure in the ladder's seed column.
SEED_MS = {
    "numpy": 12500.0,
    "torch-eager": 10500.0,
    "torch-fast +compile": 600.0,  # "+ torch.compile(), pinned memory, AMP, preloading dataset"
}
# The seed's CUDA ladder has six figures for our seven rungs 0..6; which rung each belongs to is not
# known, so they are shown beside the table (and as a band in the plot), not matched to rows.
SEED_CUDA_MS = (38.0, 27.0, 20.7, 19.0, 18.0, 17.0)


@dataclass(frozen=True)
class Row:
    """One line of a suite: an engine with its flags and config overrides.

    ``rung``: the short name of the optimization step (``"3"``, ``"+amp"``); ``overrides``:
    :class:`~fasttrain.contract.TrainConfig` fields this row changes (e.g. precision);
    ``max_hidden``: the largest hidden width this row runs at (a slow CPU baseline);
    ``quick``: ``False`` leaves the row out of ``--quick`` (the reason is ``quick_note``).
    """

    label: str
    engine: str
    rung: str = ""
    options: dict = field(default_factory=dict)
    overrides: dict = field(default_factory=dict)
    max_hidden: int | None = None
    quick: bool = True
    quick_note: str = ""

    @property
    def seed_ms(self) -> float | None:
        return SEED_MS.get(self.label)

    @property
    def precision(self) -> str:
        return self.overrides.get("precision", "fp32")


@dataclass(frozen=True)
class Case:
    """A row run on one model under one config (the unit the runner repeats over seeds)."""

    suite: str
    row: Row
    model: str
    config: dict  # TrainConfig fields (before the seed is set)

    @property
    def key(self) -> tuple[str, str]:
        return (self.row.label, self.model)


@dataclass(frozen=True)
class Suite:
    name: str
    title: str
    rows: tuple[Row, ...]
    models: tuple[str, ...]
    config: dict
    repeats: int
    quick: bool = False
    reference: bool = False  # curves: also run the NumPy fp64 reference per model

    def cases(self) -> list[Case]:
        cases = []
        for model in self.models:
            spec = parse_model(model)
            width = max(spec.hidden, default=0)
            for row in self.rows:
                if row.max_hidden is not None and width > row.max_hidden:
                    continue
                cases.append(Case(self.name, row, model, {**self.config, **row.overrides}))
        return cases


# torch-fast rungs: every flag named, each rung switches on one more (the seed's "+ torch.compile(),
# pinned memory, AMP, preloading dataset" is the +compile rung). pin_memory only matters without
# preload; it stays on throughout, as in the seed's optimized version. torch-fast's mixed precision
# follows the config's precision, so the +amp rungs set precision fp16 and name amp to match.
_TF_BASE = dict(preload=True, pin_memory=True, amp=OFF, compile=OFF, cuda_graph=OFF, fused_sgd=OFF)
_FP16 = {"precision": "fp16"}


def _torch_fast(label: str, rung: str, overrides: dict | None = None, quick: bool = True, **changes) -> Row:
    return Row(label, "torch-fast", rung, {**_TF_BASE, **changes}, dict(overrides or {}), quick=quick,
               quick_note="" if quick else COMPILE_NOTE)


LADDER_ROWS: tuple[Row, ...] = (
    Row("numpy", "numpy", "-"),
    Row("torch-eager", "torch-eager", "-"),
    _torch_fast("torch-fast preload", "preload"),
    _torch_fast("torch-fast +amp", "+amp", _FP16, amp="fp16"),
    _torch_fast("torch-fast +compile", "+compile", _FP16, False, amp="fp16", compile="default"),
    # fused SGD first: with fp16, GradScaler's unfused step reads an overflow flag on the host every
    # step, which a CUDA graph cannot capture.
    _torch_fast("torch-fast +fused-sgd", "+fused-sgd", _FP16, False, amp="fp16", compile="default", fused_sgd=True),
    _torch_fast("torch-fast +cuda-graph", "+cuda-graph", _FP16, False, amp="fp16", compile="default",
                fused_sgd=True, cuda_graph="epoch"),
    # The engine's own best setting (every flag on its default), in fp32 like the rows above it.
    Row("torch-fast (defaults)", "torch-fast", "defaults", quick=False, quick_note=COMPILE_NOTE),
    Row("jax", "jax", "-"),
    *(Row(f"cuda rung {n}", "cuda", str(n), {"rung": n}) for n in range(7)),
    Row("cuda rung 7", "cuda", "7", {"rung": 7}, _FP16),
    Row("cuda rung 8", "cuda", "8", {"rung": 8}, _FP16),
    Row("triton", "triton", "-"),
)

SWEEP_ROWS: tuple[Row, ...] = (
    # A CPU baseline; above h=1024 it would take minutes per run.
    Row("numpy fp32", "numpy", "-", max_hidden=1024),
    Row("torch-eager fp16", "torch-eager", "-", {}, _FP16),
    Row("torch-fast compiled fp16", "torch-fast", "compile",
        {**_TF_BASE, "amp": "fp16", "compile": "reduce-overhead"}, _FP16, quick=False, quick_note=COMPILE_NOTE),
    Row("torch-fast CUDA graph fp16", "torch-fast", "cuda-graph",
        {**_TF_BASE, "amp": "fp16", "fused_sgd": True, "cuda_graph": "epoch"}, _FP16),
    # The engine's own best setting (compiled functional step in a CUDA graph): the strongest PyTorch peer.
    Row("torch-fast (defaults) fp16", "torch-fast", "defaults", {}, _FP16, quick=False, quick_note=COMPILE_NOTE),
    Row("jax fp16", "jax", "-", {}, _FP16),
    Row("cuda rung 6 fp32", "cuda", "6", {"rung": 6}),
    Row("cuda rung 7 fp16", "cuda", "7", {"rung": 7}, _FP16),
    Row("cuda rung 8 fp16", "cuda", "8", {"rung": 8}, _FP16),
    Row("triton fp16", "triton", "-", {}, _FP16),
)

SWEEP_HIDDEN = (128, 256, 512, 1024, 2048, 4096, 8192)
QUICK_HIDDEN = (128, 256, 512)
# The relative-speed plot divides the baseline's time by each row's (the reference project's pair of graphs).
SWEEP_BASELINE = "torch-eager fp16"

QUICK_DATA = (10000, 2000)  # --quick trains on the first 10,000 / 2,000 examples


def ladder(quick: bool = False, repeats: int | None = None) -> Suite:
    config = dict(epochs=3 if quick else 20, steps=None, batch_size=128, lr=0.1)
    return Suite("ladder", "Ladder: logreg, batch 128, lr 0.1", LADDER_ROWS, ("logreg",), config,
                 repeats or (1 if quick else 3), quick)


def sweep(quick: bool = False, repeats: int | None = None, hidden: tuple[int, ...] | None = None) -> Suite:
    hidden = tuple(hidden or (QUICK_HIDDEN if quick else SWEEP_HIDDEN))
    config = dict(epochs=None, steps=100 if quick else 5000, batch_size=32, lr=0.003)
    return Suite("sweep", "Sweep: mlp:Hx3, batch 32, lr 0.003", SWEEP_ROWS, tuple(f"mlp:{h}x3" for h in hidden),
                 config, repeats or (1 if quick else 3), quick)


def curves(quick: bool = False) -> Suite:
    # One seed, every ladder row, loss every few steps; test accuracy only at the end.
    epochs = 1 if quick else 3
    config = dict(epochs=epochs, steps=None, batch_size=128, lr=0.1, log_every=5 if quick else 10, eval_every=epochs)
    return Suite("curves", "Loss curves: logreg, batch 128, lr 0.1, seed 0", LADDER_ROWS, ("logreg",), config,
                 1, quick, reference=True)


SUITES = ("ladder", "sweep", "curves")


def build(name: str, quick: bool = False, repeats: int | None = None, hidden=None) -> Suite:
    if name == "ladder":
        return ladder(quick, repeats)
    if name == "sweep":
        return sweep(quick, repeats, hidden)
    if name == "curves":
        return curves(quick)
    raise ValueError(name)


def with_rows(suite: Suite, rows) -> Suite:
    return replace(suite, rows=tuple(rows))
