"""The benchmark suites, as data.

A suite is a list of :class:`Row` (label, engine, engine options, config overrides) crossed with
a list of models. The rows come from the engines (``Engine.rows(suite)``), so a new engine brings
its own lines and nothing here names one; rows that cannot run on this machine are skipped by the
runner with the engine's own reason.

``OFF`` in a row's options means "this flag switched off", whatever the engine calls that
(``False`` for a boolean flag, ``off``/``none`` for a flag with choices), so a rung can name every
flag explicitly and measure exactly one optimization more than the row above it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from fasttrain.contract import parse_model


class _Off:
    def __repr__(self) -> str:
        return "OFF"


OFF = _Off()

SEED_NOTE = "measured elsewhere, unknown GPU"
# The seed study's CUDA ladder: six figures (ms per epoch, logreg, batch 128, unknown GPU) for seven rungs, so
# they are shown beside the ladder (a band in its plot), not matched to rows.
SEED_CUDA_MS = (38.0, 27.0, 20.7, 19.0, 18.0, 17.0)


@dataclass(frozen=True)
class Row:
    """One line of a suite: an engine with its flags and config overrides (engines declare their rows).

    ``rung``: the short name of the optimization step (``"3"``, ``"+amp"``); ``overrides``:
    :class:`~fasttrain.contract.TrainConfig` fields this row changes (e.g. precision);
    ``max_hidden``: the largest hidden width this row runs at (a slow CPU baseline); ``models``: the
    only models this row runs on (None: every model of the suite); ``quick``: ``False`` leaves the row
    out of ``--quick`` (the reason is ``quick_note``); ``seed_ms``: the seed study's figure for this
    row (measured elsewhere); ``baseline``: the row the others are compared with (the speed-up
    columns); ``target_ms`` / ``floor``: the goal this row's figure is held to and the estimated floor
    (the record suite); ``max_k``: the most models this row trains at once in the ``many`` suite (None: every
    K of the suite; a slow loop engine stops early).
    """

    label: str
    engine: str
    rung: str = ""
    options: dict = field(default_factory=dict)
    overrides: dict = field(default_factory=dict)
    max_hidden: int | None = None
    models: tuple[str, ...] | None = None
    quick: bool = True
    quick_note: str = ""
    seed_ms: float | None = None
    baseline: bool = False
    target_ms: float | None = None
    floor: str = ""
    max_k: int | None = None

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
    k: int | None = None  # the many suite: models trained at once (None: one run, the other suites)

    @property
    def key(self) -> tuple[str, str, int | None]:
        return (self.row.label, self.model, self.k)


@dataclass(frozen=True)
class Suite:
    """Rows crossed with models. ``model_config``: config overrides of one model (a suite of several
    workloads); ``metric`` / ``model_metric``: the figure its tables lead with (``epoch_ms``: mean epoch
    time over the second half; ``train_ms``: the whole run's training time), per model where they differ;
    ``reference``: also run the float64 reference engine on ``reference_models`` (None: every model) and
    hold each row's seed-0 run against it; ``ks``: the many suite's numbers of models trained at once (a case
    per row, model and K; each K a square, lr values x seeds), () for the suites of single runs."""

    name: str
    title: str
    rows: tuple[Row, ...]
    models: tuple[str, ...]
    config: dict
    repeats: int
    quick: bool = False
    reference: bool = False
    model_config: dict = field(default_factory=dict)
    reference_models: tuple[str, ...] | None = None
    metric: str = "epoch_ms"
    model_metric: dict = field(default_factory=dict)
    ks: tuple[int, ...] = ()

    def config_for(self, model: str) -> dict:
        return {**self.config, **self.model_config.get(model, {})}

    def metric_for(self, model: str) -> str:
        return self.model_metric.get(model, self.metric)

    def baselines(self) -> list[str]:
        return list(dict.fromkeys(row.label for row in self.rows if row.baseline))

    def cases(self) -> list[Case]:
        cases = []
        for model in self.models:
            spec = parse_model(model)
            width = max(spec.hidden, default=0)
            for row in self.rows:
                if row.models is not None and model not in row.models:
                    continue
                if row.max_hidden is not None and width > row.max_hidden:
                    continue
                config = {**self.config_for(model), **row.overrides}
                if not self.ks:
                    cases.append(Case(self.name, row, model, config))
                    continue
                cases += [Case(self.name, row, model, config, k) for k in self.ks
                          if row.max_k is None or k <= row.max_k]
        return cases


def engine_rows(suite: str) -> tuple[Row, ...]:
    """Every registered engine's rows of ``suite``, engines in display order."""
    from fasttrain.engines import registry

    return tuple(row for engine_cls in registry().values() for row in engine_cls.rows(suite))


# --- the suites ------------------------------------------------------------------------------
# A suite is a builder registered under its name: `fasttrain bench <name>` runs it (the CLI makes one
# command per entry), `bench render/merge` and the folder's README pick its files up. Adding a suite is
# adding a builder here (or, from another module, calling `register`) and, in the engines, its rows; an
# engine can also bring a suite of its own (`Engine.suites`), run over the four benchmarks.

SuiteBuilder = Callable[..., Suite]
SUITES: dict[str, tuple[SuiteBuilder, str]] = {}


def register(name: str, help: str):
    """Register ``builder(quick, repeats, hidden) -> Suite`` as the suite ``name`` (``help``: its one line)."""

    def wrap(builder: SuiteBuilder) -> SuiteBuilder:
        SUITES[name] = (builder, help)
        return builder

    return wrap


SWEEP_HIDDEN = (128, 256, 512, 1024, 2048, 4096, 8192)
QUICK_HIDDEN = (128, 256, 512)
QUICK_DATA = (10000, 2000)  # --quick trains on the first 10,000 / 2,000 examples
LOGREG = dict(epochs=20, steps=None, batch_size=128, lr=0.1)
MLP = dict(epochs=None, steps=5000, batch_size=32, lr=0.003)
WORKLOADS = ("logreg", "mlp:128x3", "mlp:1024x3", "mlp:8192x3")   # the seed study's four benchmarks


def _workloads(quick: bool) -> tuple[tuple[str, ...], dict]:
    """The four benchmarks and their configs (--quick: the first three, 2 epochs or 100 steps)."""
    logreg = {**LOGREG, "epochs": 2} if quick else LOGREG
    mlp = {**MLP, "steps": 100} if quick else MLP
    models = WORKLOADS[:3] if quick else WORKLOADS
    return models, {m: (logreg if m == "logreg" else mlp) for m in models}


@register("ladder", "The seed study's table: every engine and rung on logreg, 20 epochs, batch 128.")
def ladder(quick: bool = False, repeats: int | None = None, hidden=None) -> Suite:
    config = dict(epochs=3 if quick else 20, steps=None, batch_size=128, lr=0.1)
    return Suite("ladder", "Ladder: logreg, batch 128, lr 0.1", engine_rows("ladder"), ("logreg",), config,
                 repeats or (1 if quick else 3), quick)


@register("sweep", "Time against hidden size: mlp:Hx3, 5000 steps, batch 32, lr 0.003, fp16 (JAX and rungs 7-8 also bf16), "
                   "3 seeds; each CUDA row against JAX of its precision.")
def sweep(quick: bool = False, repeats: int | None = None, hidden: tuple[int, ...] | None = None) -> Suite:
    hidden = tuple(hidden or (QUICK_HIDDEN if quick else SWEEP_HIDDEN))
    config = dict(epochs=None, steps=100 if quick else 5000, batch_size=32, lr=0.003)
    return Suite("sweep", "Sweep: mlp:Hx3, batch 32, lr 0.003", engine_rows("sweep"), tuple(f"mlp:{h}x3" for h in hidden),
                 config, repeats or (1 if quick else 3), quick, metric="train_ms")


@register("curves", "Loss curves of every engine on seed 0 against the float64 reference.")
def curves(quick: bool = False, repeats: int | None = None, hidden=None) -> Suite:
    # One seed, every ladder row, loss every few steps; test accuracy only at the end.
    epochs = 1 if quick else 3
    config = dict(epochs=epochs, steps=None, batch_size=128, lr=0.1, log_every=5 if quick else 10, eval_every=epochs)
    return Suite("curves", "Loss curves: logreg, batch 128, lr 0.1, seed 0", engine_rows("ladder"), ("logreg",), config,
                 1, quick, reference=True)


@register("record", "The record table: the fastest rows on the four benchmarks against their targets, the "
                    "float64 parity beside them and the speed-up over the baseline rows, in one process.")
def record(quick: bool = False, repeats: int | None = None, hidden=None) -> Suite:
    models, configs = _workloads(quick)
    return Suite("record", "Record: the four benchmarks against their targets", engine_rows("record"), models, {},
                 repeats or (1 if quick else 3), quick, reference=True, model_config=configs,
                 reference_models=tuple(m for m in models if m != "mlp:8192x3"),   # fp64 NumPy at 8192: hours
                 metric="train_ms", model_metric={"logreg": "epoch_ms"})


# the peer frameworks' settings one at a time on the four benchmarks
register("peers", "The peer frameworks' settings, one at a time, on the four benchmarks.")(
    lambda quick=False, repeats=None, hidden=None: workload_suite("peers", "Peers: each framework setting on the "
                                                                  "four benchmarks")(quick, repeats, hidden))


@register("lab", "The lecture's table of single-GPU techniques, measured on the lab's transformer (speed, "
                 "memory, loss, the estimator), with a batch-size sweep to the out-of-memory edge.")
def lab(quick: bool = False, repeats: int | None = None, hidden=None) -> Suite:
    # the rows as data (labels, techniques); the lab's own runner (fasttrain.bench.lab) runs them
    from fasttrain.bench.lab import lab_rows, title
    from fasttrain.lab.config import PRESETS

    preset = "shakespeare-char"
    rows = tuple(Row(r.label, "lab", rung=r.technique, baseline=r.label == "baseline")
                 for r in lab_rows(PRESETS[preset]["per_device_train_batch_size"]))
    return Suite("lab", title(preset), rows, (preset,), {}, repeats or 1, quick)


MANY_K = (1, 4, 16, 64)
QUICK_MANY_K = (1, 4)
MANY_MODELS = ("logreg", "mlp:128x3", "mlp:1024x3")


@register("many", "Many models at once: throughput of K = 1, 4, 16, 64 models (lr x seed grids) trained in one "
                  "process, per engine, on logreg (20 epochs) and mlp:128x3, mlp:1024x3 (5000 steps).")
def many(quick: bool = False, repeats: int | None = None, hidden=None) -> Suite:
    # K = n x n models: n learning rates around the model's default (fasttrain.bench.many.sweep_grid) x n seeds;
    # logreg is measured in model-epochs per second of training, the MLPs in model-runs per second
    logreg = {**LOGREG, "epochs": 2} if quick else LOGREG
    mlp = {**MLP, "steps": 100} if quick else MLP
    return Suite("many", "Many models at once: K models (lr × seed) trained in one process", engine_rows("many"),
                 MANY_MODELS, {}, repeats or (1 if quick else 3), quick,
                 model_config={m: (logreg if m == "logreg" else mlp) for m in MANY_MODELS},
                 metric="model_runs_per_s", model_metric={"logreg": "model_epochs_per_s"},
                 ks=QUICK_MANY_K if quick else MANY_K)


def workload_suite(name: str, title: str) -> SuiteBuilder:
    """A suite of the four benchmarks whose rows come from the engines (what an engine's own suite is)."""

    def builder(quick: bool = False, repeats: int | None = None, hidden=None) -> Suite:
        models, configs = _workloads(quick)
        return Suite(name, title, engine_rows(name), models, {}, repeats or (1 if quick else 3), quick,
                     model_config=configs, metric="train_ms", model_metric={"logreg": "epoch_ms"})

    return builder


def all_suites() -> dict[str, tuple[SuiteBuilder, str]]:
    """The suites registered here and those the engines bring (``Engine.suites``: name -> one-line help)."""
    from fasttrain.engines import registry

    out = dict(SUITES)
    for engine_cls in registry().values():
        for name, help in engine_cls.suites.items():
            out.setdefault(name, (workload_suite(name, help.rstrip(".")), help))
    return out


def build(name: str, quick: bool = False, repeats: int | None = None, hidden=None) -> Suite:
    suites = all_suites()
    if name not in suites:
        raise ValueError(name)
    return suites[name][0](quick, repeats, hidden)


def with_rows(suite: Suite, rows) -> Suite:
    return replace(suite, rows=tuple(rows))
