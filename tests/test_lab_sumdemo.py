"""`fasttrain lab sum`: the summation methods on cases whose results are known exactly."""

from __future__ import annotations

import csv
import random

import numpy as np
import pytest
from click.testing import CliRunner

from fasttrain.errors import FasttrainError
from fasttrain.lab.experiments import sumdemo as S

ALL = (S.sum_in_order, S.sum_sorted, S.sum_heap, S.sum_pairwise, S.sum_kahan)


def test_fp16_in_order_stalls_at_2048_and_the_others_recover():
    # fp16 has 11 significant bits: above 2048 the spacing is 2, so 2048 + 1 rounds (to even) to 2048
    assert S.sum_in_order([2048.0, 1.0], "fp16") == 2048.0
    values = [2048.0, 1.0, 1.0, 1.0, 1.0]
    assert S.exact_sum(values) == 2052.0
    assert S.sum_in_order(values, "fp16") == 2048.0
    assert S.sum_kahan(values, "fp16") == 2052.0        # the lost ones are carried in c
    assert S.sum_pairwise(values, "fp16") == 2052.0
    assert S.sum_heap(values, "fp16") == 2052.0         # 1+1, 1+1, 2+2, then 4 + 2048


def test_many_ones_in_fp16():
    ones = [1.0] * 3000
    assert S.sum_in_order(ones, "fp16") == 2048.0        # stalls for good
    assert S.sum_sorted(ones, "fp16") == 2048.0
    for f in (S.sum_heap, S.sum_pairwise, S.sum_kahan):
        assert f(ones, "fp16") == 3000.0, f.__name__


def test_sorted_against_unsorted():
    values = [2048.0] + [1.0] * 8
    assert S.sum_in_order(values, "fp16") == 2048.0      # every 1 is lost against 2048
    assert S.sum_sorted(values, "fp16") == 2056.0        # the ones first: 8, then 8 + 2048 exactly
    # bf16 (8 bits): 256 + 1 is lost, 128 ones first are not
    assert S.sum_in_order([256.0] + [1.0] * 128, "bf16") == 256.0
    assert S.sum_sorted([256.0] + [1.0] * 128, "bf16") == 384.0
    # fp32 (24 bits): 2^24 + 1 is lost
    assert S.sum_in_order([2.0 ** 24, 1.0], "fp32") == 2.0 ** 24
    assert S.sum_kahan([2.0 ** 24, 1.0, 1.0], "fp32") == 2.0 ** 24 + 2


def test_exact_integers_every_method_agrees():
    values = [float(i) for i in range(1, 21)]          # 210: every partial sum fits in 8 bits (bf16)
    for f in ALL:
        for dtype in S.DTYPES:
            assert f(values, dtype) == 210.0, (f.__name__, dtype)


def test_bf16_rounding_is_one_rounding_from_float64():
    # just above the midpoint between two bf16 neighbours of 1 (1 and 1 + 2^-7): rounds up, where
    # going through float32 first would land on the midpoint and round to even (down)
    x = 1 + 2 ** -8 + 2 ** -30
    assert S.round_array([x], "bf16")[0] == 1 + 2 ** -7
    assert S.round_array([1 + 2 ** -8], "bf16")[0] == 1.0           # the tie goes to even


def test_rounding_equals_torch_casts():
    torch = pytest.importorskip("torch")
    rng = random.Random(0)
    xs = [rng.uniform(-1e4, 1e4) * 2.0 ** rng.randint(-20, 10) for _ in range(4000)]
    xs += [1 + 2 ** -8, 1 + 3 * 2 ** -8, 1 + 2 ** -11, 2049.0, 2051.0, 0.0, -0.0, 65519.0, 1e-8, 3e38, 1e-40]
    # float32 inputs: torch casts float32 -> fp16/bf16 in one rounding (from float64 it goes
    # through float32, rounding twice)
    xs = np.asarray(xs, dtype=np.float32).astype(np.float64).tolist()
    t = torch.tensor(xs, dtype=torch.float32)
    for dtype, tdt in (("fp32", torch.float32), ("fp16", torch.float16), ("bf16", torch.bfloat16)):
        expect = t.to(tdt).double().numpy()
        got = S.round_array(xs, dtype)
        assert np.array_equal(got, expect), (dtype, [(x, a, b) for x, a, b in zip(xs, got, expect) if a != b][:3])
        r = S.rounder(dtype)
        assert [r(x) for x in xs[:200]] == expect[:200].tolist()


def test_torch_sum_rows_and_their_accumulation():
    pytest.importorskip("torch")
    low, acc32, device = S.torch_sums([1.0] * 3000, "fp16")
    assert acc32 == 3000.0 and device in ("cpu", "cuda")
    rows = S.run(300, dtypes=("fp16",), points=3, seed=1)
    assert S.fp32_accumulated(rows, "fp16") in (True, False)
    assert {r["method"] for r in rows} == set(S.METHODS)


def test_run_rows_are_long_format_with_the_exact_sum():
    rows = S.run(500, dtypes=("fp32", "bf16"), points=4, seed=3, use_torch=False)
    ns = sorted({r["n"] for r in rows})
    assert ns[0] == 2 and ns[-1] == 500
    for r in rows:
        assert set(r) == set(S.FIELDS)
        assert r["abs_error"] == abs(r["value"] - r["exact"])
    values = S.make_values(500, "bf16", 3)
    assert next(r for r in rows if r["dtype"] == "bf16" and r["n"] == 500)["exact"] == S.exact_sum(values)
    with pytest.raises(FasttrainError, match="--n must be"):
        S.run(1)


def test_cli_writes_csv_and_png(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "sum"
    result = CliRunner().invoke(S.command, ["--n", "200", "--dtype", "fp16", "--points", "3", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "in order" in result.output and "torch.sum ran on" in result.output
    with open(out / "sum.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert rows and set(rows[0]) == set(S.FIELDS) and {r["dtype"] for r in rows} == {"fp16"}
    assert (out / "sum.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not [p for p in out.iterdir() if p.name.startswith(".")]          # no temporary file left
    bad = CliRunner().invoke(S.command, ["--n", "1"])
    assert bad.exit_code != 0 and isinstance(bad.exception, FasttrainError)


@pytest.mark.parametrize("args,message", [
    (["--n", str(S.MAX_N + 1)], f"--n must be an integer from 2 to {S.MAX_N:,}"),
    (["--n", "1000", "--seed", "-5"], "--seed must be an integer >= 0"),
])
def test_cli_bounds_are_checked_before_any_work(tmp_path, args, message):
    out = tmp_path / "sum"
    result = CliRunner().invoke(S.command, [*args, "--no-torch", "--out", str(out)])
    assert result.exit_code != 0 and isinstance(result.exception, FasttrainError)
    assert message in str(result.exception)
    assert not out.exists()                      # refused before the folder is made


def test_run_reports_progress_over_all_values():
    seen = []
    S.run(1000, ("fp32", "fp16"), points=3, use_torch=False, progress=lambda done, total: seen.append((done, total)))
    grid_total = seen[-1][1]
    assert seen[-1][0] == grid_total and all(t == grid_total for _, t in seen)
    assert [d for d, _ in seen] == sorted(d for d, _ in seen) and len(seen) == 2 * 3
