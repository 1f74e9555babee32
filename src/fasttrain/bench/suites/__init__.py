"""The registered suites: one module per suite, each holding its builder, its Markdown, its plots and
(where its cases are not single runs) its runner, registered here as a :class:`~fasttrain.bench.suite.SuiteSpec`.

``fasttrain bench <name>`` appears for every suite here (the CLI makes one command per entry), and
``bench render/merge`` and the folder's README pick its files up. Adding a suite is adding a module
beside these with a ``SPEC`` and listing it below (or, from another module, calling :func:`register`)
and, in the engines, its rows; an engine can also bring a suite of its own (``Engine.suites``), run over
the four benchmarks and laid out as :mod:`~fasttrain.bench.suites.table`.
"""

from __future__ import annotations

from dataclasses import replace

from fasttrain.bench.suite import Suite, SuiteSpec
from fasttrain.bench.suites import curves, ladder, lab, many, peers, record, sweep, table

SUITES: dict[str, SuiteSpec] = {}


def register(spec: SuiteSpec) -> SuiteSpec:
    """Register ``spec`` under its name (a later registration of the same name replaces it)."""
    SUITES[spec.name] = spec
    return spec


for _module in (ladder, sweep, curves, record, peers, lab, many):
    register(_module.SPEC)


def all_suites() -> dict[str, SuiteSpec]:
    """The suites registered here and those the engines bring (``Engine.suites``: name -> one-line help)."""
    from fasttrain.engines import registry

    out = dict(SUITES)
    for engine_cls in registry().values():
        for name, help in engine_cls.suites.items():
            out.setdefault(name, table.workload_spec(name, help))
    return out


def spec(name: str) -> SuiteSpec:
    """The registration of the suite ``name``; ValueError when there is none."""
    suites = all_suites()
    if name not in suites:
        raise ValueError(name)
    return suites[name]


def build(name: str, quick: bool = False, repeats: int | None = None, hidden=None) -> Suite:
    return spec(name).build(quick, repeats, hidden)


def with_rows(suite: Suite, rows) -> Suite:
    return replace(suite, rows=tuple(rows))
