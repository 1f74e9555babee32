"""On the GPU: the precise estimate against torch.cuda.max_memory_allocated (three quick cases)."""

from __future__ import annotations

import pytest


@pytest.mark.gpu
def test_precise_estimate_within_10_percent_of_measured_peak():
    from fasttrain.lab.experiments import memory_check
    from fasttrain.memory import validate

    rows, env = memory_check.run(list(validate.QUICK), log=lambda m: None)
    assert len(rows) == len(validate.QUICK)
    for row in rows:
        assert row["error"] == "", row
        assert abs(row["error_pct"]) <= 10.0, row
        assert row["measured_mib"] > 100, row      # a real workload, not an empty run
