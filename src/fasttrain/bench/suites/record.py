"""The record: the fastest rows on the four benchmarks against their targets, the float64 parity beside
them and the speed-up over the baseline rows, in one process (laid out as :mod:`~fasttrain.bench.suites.table`)."""

from __future__ import annotations

from fasttrain.bench.results import SuiteResult
from fasttrain.bench.suite import Images, Suite, SuiteSpec, engine_rows
from fasttrain.bench.suites import table
from fasttrain.bench.workloads import workloads


def build(quick: bool = False, repeats: int | None = None, hidden=None) -> Suite:
    models, configs = workloads(quick)
    return Suite("record", "Record: the four benchmarks against their targets", engine_rows("record"), models, {},
                 repeats or (1 if quick else 3), quick, reference=True, model_config=configs,
                 reference_models=tuple(m for m in models if m != "mlp:8192x3"),   # fp64 NumPy at 8192: hours
                 metric="train_ms", model_metric={"logreg": "epoch_ms"})


def markdown(result: SuiteResult, images: Images = None, suite: Suite | None = None) -> str:
    """The table (its targets and parity columns from the suite as defined, the record's own by default)."""
    return table.markdown(result, images, suite or build(result.quick))


SPEC = SuiteSpec("record", "The record table: the fastest rows on the four benchmarks against their targets, the "
                          "float64 parity beside them and the speed-up over the baseline rows, in one process.", build, markdown)
