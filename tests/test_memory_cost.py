"""Training cost: 6 N T + attention FLOPs -> GPU-hours -> dollars, and the MFU implied by the
published Llama 3.1 GPU-hours."""

from __future__ import annotations

import pytest

from fasttrain.errors import FasttrainError
from fasttrain.memory import cost as C


def test_flops_terms():
    f = C.training_flops(1e9, 1e12, layers=10, hidden=1000, seq=2000)
    assert f["dense"] == 6e21
    assert f["attention"] == 12 * 10 * 1000 * 2000 * 1e12
    assert f["total"] == f["dense"] + f["attention"]


def test_gpu_hours_and_dollars_at_a_throughput():
    c = C.cost("x", 1e9, 1e12, mfu=0.5, peak_tflops=1000, price=3.0)
    assert c.tflops_sustained == 500
    assert c.gpu_hours == pytest.approx(6e21 / 500e12 / 3600)
    assert c.dollars == pytest.approx(3.0 * c.gpu_hours)
    assert C.cost("x", 1e9, 1e12, tflops=250).gpu_hours == pytest.approx(2 * c.gpu_hours)


def test_published_llama31_runs_and_implied_mfu():
    rows = {r.name: r for r in C.published()}
    assert set(rows) == {"llama3.1-8b", "llama3.1-70b", "llama3.1-405b"}
    assert [rows[n].published_gpu_hours for n in ("llama3.1-8b", "llama3.1-70b", "llama3.1-405b")] == [1.46e6, 7.0e6, 30.84e6]
    r = rows["llama3.1-405b"]
    # 6 x 405.85e9 x 15.6e12 + 12 x 126 x 16384 x 8192 x 15.6e12 over 30.84M h at 989.4 TFLOP/s
    flops = 6 * 405_853_388_800 * 15.6e12 + 12 * 126 * 16384 * 8192 * 15.6e12
    assert r.flops == pytest.approx(flops)
    assert r.implied_mfu == pytest.approx(flops / (30.84e6 * 3600 * 989.4e12))
    assert 0.35 < r.implied_mfu < 0.40              # the paper reports 38-43% for its kernels
    assert rows["llama3.1-8b"].implied_mfu < rows["llama3.1-70b"].implied_mfu < r.implied_mfu
    assert r.implied_mfu_dense_only < r.implied_mfu


@pytest.mark.parametrize("kwargs, message", [
    (dict(mfu=0.0), "--mfu must be in"), (dict(mfu=1.2), "--mfu must be in"), (dict(tflops=-1), "--tflops must be positive"),
    (dict(price=-1), "--price must be >= 0"), (dict(mfu=0.3, tflops=100), "not both"),
])
def test_bad_cost_input(kwargs, message):
    with pytest.raises(FasttrainError, match=message):
        C.cost("x", 1e9, 1e12, **kwargs)
    with pytest.raises(FasttrainError, match="tokens must be positive"):
        C.training_flops(1e9, 0)
