"""A benchmark suite, as data, and what its registration carries.

A suite is a list of :class:`~fasttrain.engines.rows.Row` (label, engine, engine options, config
overrides) crossed with a list of models. The rows come from the engines (``Engine.rows(suite)``), so
a new engine brings its own lines and nothing here names one; rows that cannot run on this machine are
skipped by the runner with the engine's own reason.

A :class:`SuiteSpec` is a suite's registration (``fasttrain.bench.suites``): its builder, its one-line
help, and what it writes, each by the suite's own module: its Markdown, its plots (the files with their
alt text, and the function that draws them) and, for a suite whose cases are not single runs, its runner.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from fasttrain.contract import parse_model
from fasttrain.engines.rows import Row
from fasttrain.bench.results import SuiteResult

QUICK_DATA = (10000, 2000)  # --quick trains on the first 10,000 / 2,000 examples


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


Images = list[tuple[str, str]] | None   # (alt text, link) of each plot a report shows
SuiteBuilder = Callable[..., Suite]


def no_plots(result: SuiteResult, out: Path) -> list[Path]:
    """The plots of a suite that has none (its report is tables only)."""
    return []


@dataclass(frozen=True)
class SuiteSpec:
    """A registered suite: ``build(quick, repeats, hidden) -> Suite`` and ``help`` (its one line, the
    command's help); ``markdown(result, images, suite) -> str`` its report (``suite``: the suite as
    defined today, None when no longer buildable); ``plot_files``: (alt text, file name) of each PNG it
    writes, drawn by ``write_plots(result, out) -> paths``; ``case_runner``: how a case of K models runs
    (``runner(engine, spec, config, data, options, k)``, the many suite's), None for single runs;
    ``run``: the suite's own runner when its rows are not engine rows (the lab's ``run_lab(plan, ...)``),
    None for the suites :func:`fasttrain.bench.runner.run_suite` runs;
    ``shared_protocol``: the suite is measured by the MNIST driver's protocol, which the folder's README
    states once above the tables (a suite that states its own in its notes, the lab's, says False)."""

    name: str
    help: str
    build: SuiteBuilder
    markdown: Callable[[SuiteResult, Images, Suite | None], str]
    plot_files: tuple[tuple[str, str], ...] = ()
    write_plots: Callable[[SuiteResult, Path], list[Path]] = no_plots
    case_runner: Callable | None = None
    run: Callable | None = None
    shared_protocol: bool = True

    def suite(self, quick: bool = False) -> Suite | None:
        """The suite as defined today, for reports of results written earlier (None: it no longer builds)."""
        try:
            return self.build(quick)
        except (ValueError, KeyError):
            return None
