"""The engine protocol.

An engine is a class with a ``name``, a one-line ``description``, an ``Options`` dataclass (its
own flags, e.g. ``--rung``), the precisions it supports, ``available()`` (``None`` when it can run
here, else the reason) and ``prepare(job)`` which uploads data and weights, compiles, warms up,
and returns a :class:`Session`. The shared driver (:mod:`fasttrain.training`) times the session's
epochs and builds the run record, so every engine is measured the same way.

Heavy dependencies are imported inside methods, never at module scope, so listing engines
never imports torch, jax, triton or cupy.
"""

from __future__ import annotations

import dataclasses
import os
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from fasttrain.contract import ModelSpec, Schedule, TrainConfig
from fasttrain.data.datasets import Dataset
from fasttrain.errors import FasttrainError

Weights = list[tuple[np.ndarray, np.ndarray]]


# An integer option without its own ``bounds`` must lie in this range (0 is "auto" for several).
INT_OPTION_BOUNDS = (0, 2**31 - 1)


def option(default, help: str, choices: tuple | None = None, flag_value: Any = None, type: type | None = None,
           bounds: tuple[int, int] | None = None):
    """A field of an engine's ``Options`` dataclass, with its CLI help.

    ``choices``: the allowed values. ``flag_value``: the value the bare flag means when its
    argument is left out (``--compile`` alone = ``--compile default``). ``type``: the value's type
    when the default (``None``: "the engine decides") does not say it. ``bounds``: the inclusive
    range of an integer option (default :data:`INT_OPTION_BOUNDS`).
    """
    return dataclasses.field(default=default, metadata={"help": help, "choices": choices, "flag_value": flag_value,
                                                        "type": type, "bounds": bounds})


@dataclass(frozen=True)
class NoOptions:
    pass


@dataclass(frozen=True)
class Job:
    """Everything an engine needs, fixed by the contract."""

    spec: ModelSpec
    config: TrainConfig
    data: Dataset
    init_weights: Weights  # float64, shared by every engine
    schedule: Schedule


@dataclass
class EpochStats:
    """What one training epoch reports.

    ``loss_sum`` and ``correct`` cover the ``count`` examples seen (the mean train loss is
    ``loss_sum / count``); ``None`` when the engine did not measure them this epoch (a rung that
    computes loss only every few epochs). ``step_losses``: the mean loss of each step, for the
    loss curve, or ``None`` when not recorded.
    """

    count: int
    loss_sum: float | None = None
    correct: int | None = None
    step_losses: np.ndarray | None = None


class Session(ABC):
    """A prepared training run: data and initial weights resident, compiled and warmed up."""

    @abstractmethod
    def train_epoch(self, epoch: int, order: np.ndarray, steps: int) -> EpochStats:
        """Run ``steps`` SGD steps over the batches of ``order`` (the epoch's permutation)."""

    @abstractmethod
    def evaluate(self) -> tuple[float, float]:
        """(mean loss, accuracy) on the whole test set with the current weights."""

    @abstractmethod
    def weights(self) -> Weights:
        """The current weights as NumPy arrays (master copies), ``W`` (fan_in, fan_out)."""

    def sync(self) -> None:
        """Block until queued device work is done (the timer calls it around timed regions)."""

    def environment(self) -> dict:
        """Engine-specific facts for the run record (device, library versions)."""
        return {}

    def close(self) -> None:
        pass


@dataclass(frozen=True)
class SweepJob:
    """K models trained at once (``fasttrain train --lr a,b --seed x,y``): model ``k`` is the single run of
    ``configs[k]`` (its own lr and seed, so its own initial weights and batch orders); every other field of
    the configs is equal, so every model has the same ``schedule``."""

    spec: ModelSpec
    configs: tuple[TrainConfig, ...]
    data: Dataset
    init_weights: tuple[Weights, ...]  # float64, init_weights[k] = the contract's weights of configs[k].seed
    schedule: Schedule

    @property
    def k(self) -> int:
        return len(self.configs)

    @property
    def config(self) -> TrainConfig:
        """What the models share (batch, precision, length); lr and seed are those of model 0."""
        return self.configs[0]

    def single(self, k: int) -> Job:
        """Model ``k`` as the job of its own run."""
        return Job(self.spec, self.configs[k], self.data, self.init_weights[k], self.schedule)


class SweepSession(ABC):
    """K models of a :class:`SweepJob` resident and trained at once; lists are indexed by model."""

    @abstractmethod
    def train_epoch(self, epoch: int, orders: list[np.ndarray], steps: int) -> list[EpochStats]:
        """Run ``steps`` SGD steps of every model, model ``k`` over the batches of ``orders[k]``."""

    @abstractmethod
    def evaluate(self) -> list[tuple[float, float]]:
        """(mean test loss, test accuracy) of every model."""

    @abstractmethod
    def weights(self) -> list[Weights]:
        """Every model's current weights (as :meth:`Session.weights`)."""

    def sync(self) -> None:
        """Block until queued device work of every model is done."""

    def environment(self) -> dict:
        return {}

    def close(self) -> None:
        pass


@dataclass(frozen=True)
class SweepMemory:
    """What a sweep of K models needs where they train: ``shared`` bytes once (data, orders, workspace) plus
    ``per_model`` bytes each, against ``available`` bytes (free device memory, or the host's available memory
    for a CPU engine) in ``where``."""

    shared: int
    per_model: int
    available: int
    where: str

    def largest_k(self) -> int:
        return max(0, (self.available - self.shared) // max(1, self.per_model))


def host_available_bytes() -> int:
    """Memory the host can give now (free plus reclaimable page cache), from /proc/meminfo where it exists: what
    a sweep on the CPU is held to (:class:`SweepMemory`)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


class Engine(ABC):
    """An engine declares, besides how it trains, how the house shows it: ``order`` (its place in listings,
    tables and plots, lower first), ``color`` (a matplotlib colormap name: its rows' hue, darker for later
    rows), ``libraries`` (the distributions whose versions go into every run record), ``needs_gpu`` (its
    conformance cases are marked ``gpu``), ``reference`` (the float64 reference the curves and the record
    suite compare against; one engine) and :meth:`rows` (its lines in each benchmark suite)."""

    name: ClassVar[str]
    description: ClassVar[str]
    Options: ClassVar[type] = NoOptions
    precisions: ClassVar[tuple[str, ...]] = ("fp32",)
    order: ClassVar[int] = 1000
    color: ClassVar[str] = "Greys"
    libraries: ClassVar[tuple[str, ...]] = ()
    needs_gpu: ClassVar[bool] = False
    reference: ClassVar[bool] = False
    # the options the conformance suite (tests/test_conformance.py) runs this engine with, one case each; an
    # entry's "precision" key sets the config's precision instead (default: the engine's first precision)
    conformance_options: ClassVar[tuple[dict, ...]] = ({},)
    # benchmark suites this engine brings (name -> one-line help): its rows over the four benchmarks
    suites: ClassVar[dict[str, str]] = {}

    @classmethod
    def rows(cls, suite: str) -> tuple:
        """This engine's lines (:class:`fasttrain.engines.rows.Row`) in the benchmark suite ``suite``
        (``ladder``, ``sweep``, ``curves``, ``record``, ...); none by default."""
        return ()

    # how this engine trains many models at once ("a loop", "vmap", ...), shown by ``fasttrain engines``;
    # None: it does not (fasttrain train refuses a --lr/--seed list for it)
    sweep: ClassVar[str | None] = None

    def __init__(self, options=None):
        self.options = options if options is not None else self.Options()

    @classmethod
    def available(cls) -> str | None:
        """``None`` when the engine can run here, else the reason it cannot (with the fix)."""
        return None

    @abstractmethod
    def prepare(self, job: Job) -> Session:
        """Upload data and weights, compile and warm up; timed as ``setup_ms``.

        The returned session must hold exactly ``job.init_weights`` (warm-up must not train)."""

    def prepare_sweep(self, job: SweepJob) -> SweepSession:
        """Upload data and every model's weights, compile and warm up (timed as ``setup_ms``); every model must
        hold exactly its ``job.init_weights[k]``. Engines with ``sweep`` set override it."""
        raise FasttrainError(f"engine {self.name} does not train several models at once")

    def sweep_memory(self, spec: ModelSpec, config: TrainConfig, n_train: int, n_test: int,
                     n_epochs: int) -> SweepMemory | None:
        """The memory a sweep of this model needs here (:class:`SweepMemory`), or None when not estimated.
        Called before any data moves, so a sweep too large is refused with the largest K that fits."""
        return None

    def check_config(self, spec: ModelSpec, config: TrainConfig) -> None:
        """Reject a model/config this engine cannot run (with these options), with a one-line reason.
        Runs before any data is loaded; engines override it to add their own limits."""
        if config.precision not in self.precisions:
            raise FasttrainError(
                f"engine {self.name} does not support precision {config.precision}; "
                f"it supports: {', '.join(self.precisions)}"
            )

    def check(self, job: Job) -> None:
        """Reject a job this engine cannot run, with a one-line reason."""
        self.check_config(job.spec, job.config)


# --- options: parsed from CLI words or given as a dict -------------------------------------


def option_fields(options_cls: type) -> list[dataclasses.Field]:
    return list(dataclasses.fields(options_cls))


def _coerce(engine: str, fld: dataclasses.Field, raw: Any) -> Any:
    flag = "--" + fld.name.replace("_", "-")
    target = fld.metadata.get("type") or (type(fld.default) if fld.default is not None else str)
    if raw is None and fld.default is None:
        return None
    try:
        if target is bool and isinstance(raw, str):
            lowered = raw.lower()
            if lowered not in ("1", "0", "true", "false", "yes", "no", "on", "off"):
                raise ValueError
            value = lowered in ("1", "true", "yes", "on")
        elif target is bool:
            value = bool(raw)
        else:
            value = target(raw)
    except (TypeError, ValueError):
        raise FasttrainError(f"engine {engine}: {flag} expects {target.__name__}, got {raw!r}") from None
    choices = fld.metadata.get("choices")
    if choices and value not in choices:
        raise FasttrainError(f"engine {engine}: {flag} must be one of {', '.join(map(str, choices))}, got {raw!r}")
    if target is int and not choices:
        low, high = fld.metadata.get("bounds") or INT_OPTION_BOUNDS
        if not low <= value <= high:
            raise FasttrainError(f"engine {engine}: {flag} must be between {low} and {high}, got {raw!r}")
    return value


def make_options(engine_cls: type[Engine], values: dict | None = None):
    """Build ``engine_cls.Options`` from a dict, checking names, types and choices."""
    values = dict(values or {})
    fields = {f.name: f for f in option_fields(engine_cls.Options)}
    unknown = [k for k in values if k.replace("-", "_") not in fields]
    if unknown:
        known = ", ".join("--" + n.replace("_", "-") for n in fields) or "none"
        raise FasttrainError(f"engine {engine_cls.name} has no option --{unknown[0].replace('_', '-')} (its options: {known})")
    kwargs = {k.replace("-", "_"): _coerce(engine_cls.name, fields[k.replace("-", "_")], v) for k, v in values.items()}
    return engine_cls.Options(**kwargs)


def parse_option_words(engine_cls: type[Engine], words: list[str]) -> dict:
    """Parse CLI words (``--rung 3``, ``--preload``, ``--no-preload``, ``--compile[=mode]``) into a dict."""
    fields = {f.name: f for f in option_fields(engine_cls.Options)}
    values: dict[str, Any] = {}
    i = 0
    while i < len(words):
        word = words[i]
        if not word.startswith("--"):
            raise FasttrainError(f"unexpected argument {word!r}; engine options look like --name value")
        name, eq, inline = word[2:].partition("=")
        key = name.replace("-", "_")
        negated = key.startswith("no_") and key[3:] in fields and fields[key[3:]].default is not None \
            and type(fields[key[3:]].default) is bool
        if negated:
            values[key[3:]] = False
            i += 1
            continue
        if key not in fields:
            known = ", ".join("--" + n.replace("_", "-") for n in fields) or "none"
            raise FasttrainError(f"no such option {word.split('=')[0]} for engine {engine_cls.name} (its options: {known})")
        fld = fields[key]
        is_bool = type(fld.default) is bool
        if eq:
            values[key] = inline
            i += 1
        elif is_bool:
            values[key] = True
            i += 1
        elif i + 1 < len(words) and not words[i + 1].startswith("--"):
            values[key] = words[i + 1]
            i += 2
        elif fld.metadata.get("flag_value") is not None:
            values[key] = fld.metadata["flag_value"]
            i += 1
        else:
            raise FasttrainError(f"option --{name} of engine {engine_cls.name} needs a value")
    return values


def options_dict(options) -> dict:
    return dataclasses.asdict(options)
