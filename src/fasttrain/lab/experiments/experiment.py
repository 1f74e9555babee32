"""The lab's experiments: rows of overrides of one base configuration, and the runner they share.

The technique table (``fasttrain bench lab``: ``bench/lab.py``, its report ``bench/lab_report.py``), the
speedrun ladder (``lab/experiments/speedrun_ladder.py``'s rungs, run by ``lab/experiments/speedrun.py``, reported by
``lab/experiments/speedrun_report.py``) and the scaling sweep (``lab/experiments/scaling.py``, ``lab/experiments/scaling_report.py``) are one
shape: a list of :class:`Experiment` rows -- each a label and overrides of a base
:class:`~fasttrain.lab.config.LabConfig` -- and a runner that trains every row through the lab's one
trainer. What differs between them is the function that runs one row (one lab run per seed; the record
protocol's fixed steps for every seed on one built model; one process tree per run) and the report beside
the runner. An experiment's own fields (a technique, a rung's change, a run's process count) are fields of
a subclass of :class:`Experiment`.

The runner's contract:

1. :func:`prepare`: every row's configuration is built -- the base with the row's overrides, typed by
   ``lab/overrides.py`` (the one parser of lab settings), then whatever the experiment adds (a token
   budget, a name) -- and validated before anything trains. A bad override is refused in one line naming
   the row. A row that cannot run here (a ``gpu_only`` row without a CUDA GPU, a configuration
   :func:`~fasttrain.lab.config.validate` refuses) is refused the same way, unless the experiment records
   such rows (``skip=True``: the technique table's row says why it did not run).
2. :func:`run`: each row through the experiment's function, in order (a row that cannot run here through
   its ``skipped`` function), and every finished row handed to ``on_row`` at once, so that a run cut short
   keeps the rows it finished.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import KW_ONLY, dataclass, field
from typing import Generic, TypeVar

from fasttrain.errors import FasttrainError
from fasttrain.lab.config import LabConfig, validate
from fasttrain.lab.overrides import kind_of, parse_value


@dataclass(frozen=True)
class Experiment:
    """One row. ``overrides``: LabConfig fields -> values (typed, or the text a flag or ``--set`` takes);
    ``seeds``: the seeds it trains (empty: the configuration's own seed, as many as the experiment repeats);
    ``compared_with``: the label of the row it is measured against (None: none); ``gpu_only``: why it cannot
    run without a CUDA GPU (None: it runs anywhere)."""

    label: str
    _: KW_ONLY
    overrides: Mapping[str, object] = field(default_factory=dict)
    seeds: Sequence[int] = ()
    compared_with: str | None = None
    gpu_only: str | None = None

    def shown(self) -> str:
        """The row's name in a message (a subclass may name it otherwise: a rung by its name, not its number)."""
        return self.label

    def settings(self) -> dict:
        """The overrides typed by the one parser; an unknown setting or a bad value is one line naming the row."""
        try:
            return {kind_of(name).name: parse_value(name, value) for name, value in self.overrides.items()}
        except FasttrainError as exc:
            raise FasttrainError(f"{self.shown()}: {exc}") from None

    def config(self, base: LabConfig) -> LabConfig:
        """``base`` with this row's overrides (validated by :func:`prepare`, with the rest of the rows)."""
        return base.with_(**self.settings())

    def cannot_run(self, cuda: bool | None) -> str | None:
        """Why the row cannot run on this machine (``cuda``: it has a CUDA GPU; None: not judged here)."""
        return self.gpu_only if cuda is False else None

    def seed_list(self, cfg: LabConfig, repeats: int = 1) -> list[int]:
        """The seeds the row trains: its own, else ``repeats`` seeds from the configuration's."""
        return list(self.seeds) if self.seeds else [cfg.seed + i for i in range(repeats)]


E = TypeVar("E", bound=Experiment)
R = TypeVar("R")


@dataclass(frozen=True)
class Prepared(Generic[E]):
    """A row with its built configuration and, when it cannot run here, why (None: it runs)."""

    experiment: E
    config: LabConfig
    unable: str | None = None


def prepare(experiments: Sequence[E], base: LabConfig | None = None, *,
            config: Callable[[E], LabConfig] | None = None, cuda: bool | None = None,
            skip: bool = False) -> list[Prepared[E]]:
    """Every row's configuration, built and validated before anything trains.

    ``config(row)``: how the experiment builds a row's configuration (default: ``row.config(base)``, the base
    with the row's overrides). A bad override is refused in one line naming the row. A row that cannot run
    here (``cuda``: whether this machine has a CUDA GPU, None: not judged) or whose configuration does not
    validate is refused the same way -- every row with the same reason named in the line -- or, with ``skip``,
    kept with its reason for :func:`run` to hand to the experiment's ``skipped`` function."""
    if config is None:
        if base is None:
            raise TypeError("prepare needs the base configuration or a config function")

        def config(row: E) -> LabConfig:
            return row.config(base)

    out: list[Prepared[E]] = []
    for row in experiments:
        cfg = config(row)
        unable = row.cannot_run(cuda)
        if unable is None:
            try:
                cfg = validate(cfg)
            except FasttrainError as exc:
                unable = str(exc)
        out.append(Prepared(row, cfg, unable))
    if not skip:
        _refuse_unable(out)
    return out


def _refuse_unable(prepared: Sequence[Prepared]) -> None:
    first = next((p for p in prepared if p.unable is not None), None)
    if first is not None:
        names = [p.experiment.shown() for p in prepared if p.unable == first.unable]
        raise FasttrainError(f"{', '.join(names)}: {first.unable}")


def run(prepared: Sequence[Prepared[E]], run_one: Callable[[E, LabConfig], R], *,
        skipped: Callable[[E, LabConfig, str], R] | None = None,
        on_row: Callable[[E, R], None] | None = None) -> list[R]:
    """Each prepared row through ``run_one(row, config)`` (the experiment's function, which trains through the
    lab's one trainer), in order; a row that cannot run here through ``skipped(row, config, reason)`` (without
    one, such a row is refused before any row runs). ``on_row(row, result)`` after every row."""
    if skipped is None:
        _refuse_unable(prepared)
    results: list[R] = []
    for p in prepared:
        result = run_one(p.experiment, p.config) if p.unable is None else skipped(p.experiment, p.config, p.unable)
        results.append(result)
        if on_row is not None:
            on_row(p.experiment, result)
    return results


__all__ = ["Experiment", "Prepared", "prepare", "run"]
