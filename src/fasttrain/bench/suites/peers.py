"""The peers: the peer frameworks' settings, one at a time, on the four benchmarks (laid out as
:mod:`~fasttrain.bench.suites.table`)."""

from __future__ import annotations

from fasttrain.bench.suite import SuiteSpec
from fasttrain.bench.suites import table

build = table.workload_suite("peers", "Peers: each framework setting on the four benchmarks")

SPEC = SuiteSpec("peers", "The peer frameworks' settings, one at a time, on the four benchmarks.", build, table.markdown)
