"""The cuda engine (rungs 0..6): CPU checks of its options, errors and GEMM layout, and, on the
GPU (marker ``gpu``), every rung against the NumPy float64 reference on identical batches."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fasttrain.contract import default_config, initial_weights, parse_model, schedule
from fasttrain.engines import get_engine
from fasttrain.engines.base import Job, make_options, parse_option_words
from fasttrain.engines.cuda.kernels import kernel_names, ladder_sources
from fasttrain.engines.cuda.layout import OP_T, cublas_gemm_args, naive_strides
from fasttrain.errors import FasttrainError
from fasttrain.parity import curve_deviation, engine_run, reference_run, weight_error

RUNGS = list(range(7))
SRC = Path(__file__).resolve().parents[1] / "src"


def make_job(data, model="logreg", **config):
    spec = parse_model(model)
    cfg = default_config(spec, **config)
    return Job(spec, cfg, data, initial_weights(spec, cfg.seed), schedule(cfg, data.n_train))


# --- CPU ------------------------------------------------------------------------------------


def test_registered_with_rung_and_debug_options():
    engine = get_engine("cuda")
    assert engine.precisions == ("fp32", "fp16", "bf16")
    opts = make_options(engine, parse_option_words(engine, ["--rung", "3", "--debug"]))
    assert (opts.rung, opts.debug) == (3, True)
    assert make_options(engine, {}).rung == 6
    with pytest.raises(FasttrainError, match="--rung must be one of"):
        make_options(engine, {"rung": 9})


def test_importing_the_engine_does_not_import_cupy():
    code = "import sys, fasttrain.engines.cuda as m; assert m.ENGINES; print('cupy' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_available_says_why_not_in_one_line():
    from conftest import has_cuda_gpu

    reason = get_engine("cuda").available()
    if has_cuda_gpu():
        assert reason is None
    else:
        assert isinstance(reason, str) and reason and "\n" not in reason
        assert "CUDA" in reason or "CuPy" in reason


@pytest.mark.parametrize("rung", RUNGS)
def test_fp32_rungs_reject_mixed_precision(tiny_data, rung):
    engine_cls = get_engine("cuda")
    engine = engine_cls(make_options(engine_cls, {"rung": rung}))
    engine.check(make_job(tiny_data, precision="fp32"))
    with pytest.raises(FasttrainError, match="fp32 only"):
        engine.check(make_job(tiny_data, precision="bf16"))


def test_fused_rungs_accept_mixed_precision(tiny_data):
    engine_cls = get_engine("cuda")
    for precision in ("fp16", "bf16", "fp32"):
        engine_cls(make_options(engine_cls, {"rung": 7})).check(make_job(tiny_data, precision=precision))
    with pytest.raises(FasttrainError, match="does not support precision fp64"):
        engine_cls(make_options(engine_cls, {"rung": 7})).check(make_job(tiny_data, precision="fp64"))


def test_fused_rung_without_its_module_is_a_clear_error(tiny_data, monkeypatch):
    monkeypatch.setitem(sys.modules, "fasttrain.engines.cuda.fused", None)  # as if the file were absent
    engine_cls = get_engine("cuda")
    with pytest.raises(FasttrainError, match="rung 8 needs fasttrain.engines.cuda.fused"):
        engine_cls(make_options(engine_cls, {"rung": 8})).prepare(make_job(tiny_data))


def _colmajor_sgemm(transa, transb, m, n, k, a, lda, b, ldb, ldc):
    """BLAS sgemm on flat buffers, column-major, as the reference BLAS defines it."""
    def operand(buf, trans, rows, cols, ld):  # op(X) is rows x cols
        stored = (cols, rows) if trans == OP_T else (rows, cols)
        x = np.lib.stride_tricks.as_strided(buf, shape=stored, strides=(buf.itemsize, ld * buf.itemsize))
        return x.T if trans == OP_T else x

    c = np.zeros(ldc * n)
    cm = np.lib.stride_tricks.as_strided(c, shape=(m, n), strides=(c.itemsize, ldc * c.itemsize))
    cm[...] = operand(a, transa, m, k, lda) @ operand(b, transb, k, n, ldb)
    return c


@pytest.mark.parametrize("trans_a", [False, True])
@pytest.mark.parametrize("trans_b", [False, True])
def test_row_major_product_through_column_major_sgemm(trans_a, trans_b):
    rng = np.random.default_rng(7)
    M, N, K = 37, 11, 23
    A = rng.standard_normal((K, M) if trans_a else (M, K))
    B = rng.standard_normal((N, K) if trans_b else (K, N))
    want = (A.T if trans_a else A) @ (B.T if trans_b else B)
    g = cublas_gemm_args(M, N, K, trans_a, trans_b)
    flat = {"A": A.ravel(), "B": B.ravel()}
    c = _colmajor_sgemm(g.transa, g.transb, g.m, g.n, g.k, flat[g.first], g.lda, flat[g.second], g.ldb, g.ldc)
    np.testing.assert_allclose(c[: M * N].reshape(M, N), want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("trans_a", [False, True])
@pytest.mark.parametrize("trans_b", [False, True])
def test_naive_matmul_strides(trans_a, trans_b):
    rng = np.random.default_rng(8)
    M, N, K = 13, 7, 29
    A = rng.standard_normal((K, M) if trans_a else (M, K))
    B = rng.standard_normal((N, K) if trans_b else (K, N))
    a_rs, a_cs, b_rs, b_cs = naive_strides(M, N, K, trans_a, trans_b)
    a, b = A.ravel(), B.ravel()
    i, j, k = np.ogrid[:M, :N, :K]  # C[i, j] = sum_k A[i*a_rs + k*a_cs] * B[k*b_rs + j*b_cs]
    got = (a[i * a_rs + k * a_cs] * b[k * b_rs + j * b_cs]).sum(axis=2)
    np.testing.assert_allclose(got, (A.T if trans_a else A) @ (B.T if trans_b else B), rtol=1e-12)


def test_every_kernel_the_session_launches_exists():
    defined = {name for path in ladder_sources() for name in kernel_names(path)}
    session_src = (SRC / "fasttrain/engines/cuda/ladder_session.py").read_text()
    used = set(re.findall(r'"(\w+_kernel\d+)"', session_src))
    assert used and used <= defined, f"missing kernels: {used - defined}"
    assert defined <= used, f"kernels no rung uses: {defined - used}"


# --- GPU: parity with the float64 reference ------------------------------------------------

_REFERENCES: dict = {}


def reference(data, model, config):
    key = (id(data), model, config)
    if key not in _REFERENCES:
        _REFERENCES[key] = reference_run(model, config, data)
    return _REFERENCES[key]


def check_parity(data, model, config, rung, **options):
    ref_record, ref_weights = reference(data, model, config)
    record, weights = engine_run("cuda", model, config, data, {"rung": rung, **options})
    err = weight_error(weights, ref_weights)
    print(f"\nparity {data.name} {model} batch {config.batch_size} rung {rung} {options or ''}: weight error {err:.2e}, "
          f"test acc {record.final['test_acc']:.4f} vs {ref_record.final['test_acc']:.4f}")
    assert err <= 1e-3, f"rung {rung} {model}: max|W - W_ref| / max|W_ref| = {err:.2e}"
    acc, ref_acc = record.final["test_acc"], ref_record.final["test_acc"]
    assert abs(acc - ref_acc) <= 0.001 + 1e-12, f"rung {rung} {model}: test acc {acc} vs reference {ref_acc}"
    return record, err


@pytest.mark.gpu
@pytest.mark.parametrize("rung", RUNGS)
@pytest.mark.parametrize("model,batch", [("logreg", 128), ("mlp:100x2", 37)])
def test_parity_one_epoch_mnist(mnist, rung, model, batch):
    # lr: logreg the seed's 0.1; mlp the contract's 0.003. At lr 0.02..0.1 this MLP's fp32 run leaves
    # the fp64 one by ~1e-2 within one epoch whatever the engine: NumPy fp32 itself lands at 1.2e-2
    # (lr 0.02), and at lr 0.05/0.1 one ulp on the logits or p = e * (1/s) for e / s moves it between
    # 1e-6 and 4e-2 (results/cuda/NOTES.md). At lr 0.003 NumPy fp32 sits at 8.7e-5 under all of those.
    config = default_config(parse_model(model), epochs=1, steps=None, batch_size=batch,
                            lr=0.1 if model == "logreg" else 0.003)
    record, _ = check_parity(mnist, model, config, rung)
    row = record.epochs[0]
    ref_row = reference(mnist, model, config)[0].epochs[0]
    # one epoch is also the last, so rungs 3..6 measure the loss in it too
    assert row["train_loss"] == pytest.approx(ref_row["train_loss"], rel=1e-4)
    assert row["train_acc"] == pytest.approx(ref_row["train_acc"], abs=1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("rung", RUNGS)
@pytest.mark.parametrize("model", ["logreg", "mlp:100x2", "mlp:17x3"])
def test_parity_awkward_shapes_tiny(tiny_data, rung, model):
    # 600 examples, batch 37: 16 full batches and a partial one of 8, three epochs
    config = default_config(parse_model(model), epochs=3, steps=None, batch_size=37, lr=0.05)
    record, _ = check_parity(tiny_data, model, config, rung)
    ref_record = reference(tiny_data, model, config)[0]
    if rung < 3:  # every step's loss recorded: the same curve
        assert [p["step"] for p in record.curve] == [p["step"] for p in ref_record.curve]
        assert curve_deviation(record, ref_record) < 1e-4
    else:  # only the last epoch's steps: the curve ends at the same step
        assert record.curve[-1]["step"] == ref_record.curve[-1]["step"] == 51


@pytest.mark.gpu
@pytest.mark.parametrize("rung", [0, 2, 5, 6])
def test_step_schedule_with_short_last_epoch(tiny_data, rung):
    # 40 steps of batch 37 over 600 examples: epochs of 17, 17 and 6 steps (a graph each at rung 6)
    config = default_config(parse_model("mlp:100x2"), steps=40, batch_size=37, lr=0.05)
    record, _ = check_parity(tiny_data, "mlp:100x2", config, rung)
    assert [row["steps"] for row in record.epochs] == [17, 17, 6]


@pytest.mark.gpu
@pytest.mark.parametrize("rung", [1, 6])
def test_drop_last(tiny_data, rung):
    config = default_config(parse_model("logreg"), epochs=2, batch_size=37, drop_last=True)
    record, _ = check_parity(tiny_data, "logreg", config, rung)
    assert record.epochs[0]["steps"] == 16


@pytest.mark.gpu
@pytest.mark.parametrize("rung", [3, 4, 5, 6])
def test_loss_only_every_tenth_epoch_from_rung_3(tiny_data, rung):
    config = default_config(parse_model("logreg"), epochs=12, batch_size=64)
    record, _ = check_parity(tiny_data, "logreg", config, rung)
    ref_record = reference(tiny_data, "logreg", config)[0]
    measured = [row["epoch"] for row in record.epochs if row["train_loss"] is not None]
    assert measured == [10, 12]
    for row in record.epochs:
        assert (row["train_acc"] is None) == (row["train_loss"] is None)
        if row["train_loss"] is not None:
            ref = ref_record.epochs[row["epoch"] - 1]
            assert row["train_loss"] == pytest.approx(ref["train_loss"], rel=1e-4)
            assert row["train_acc"] == pytest.approx(ref["train_acc"], abs=1e-9)


@pytest.mark.gpu
@pytest.mark.parametrize("rung", [0, 2])
def test_every_step_loss_below_rung_3(tiny_data, rung):
    config = default_config(parse_model("logreg"), epochs=2, batch_size=37, log_every=1)
    record, _ = check_parity(tiny_data, "logreg", config, rung)
    ref_curve = reference(tiny_data, "logreg", config)[0].curve
    assert [p["step"] for p in record.curve] == [p["step"] for p in ref_curve] == list(range(1, 35))
    np.testing.assert_allclose([p["loss"] for p in record.curve], [p["loss"] for p in ref_curve], rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("rung", [0, 6])
def test_debug_mode_checks_and_matches(tiny_data, rung):
    config = default_config(parse_model("mlp:100x2"), epochs=1, steps=None, batch_size=37, lr=0.05)
    check_parity(tiny_data, "mlp:100x2", config, rung, debug=True)


@pytest.mark.gpu
@pytest.mark.parametrize("rung", RUNGS)
def test_prepare_holds_the_initial_weights(tiny_data, rung):
    engine_cls = get_engine("cuda")
    job = make_job(tiny_data, "mlp:100x2", epochs=12, batch_size=37)
    session = engine_cls(make_options(engine_cls, {"rung": rung})).prepare(job)
    try:
        for (w, b), (w0, b0) in zip(session.weights(), job.init_weights):
            np.testing.assert_array_equal(w, w0.astype(np.float32))
            np.testing.assert_array_equal(b, b0.astype(np.float32))
        assert "device" in session.environment()
    finally:
        session.close()


@pytest.mark.gpu
@pytest.mark.parametrize("rung", RUNGS)
def test_cli_trains_logreg_and_mlp(mnist, mnist_dir, tmp_path, rung):
    """``fasttrain train --engine cuda --rung N`` end to end: its saved weights and test accuracy
    against the float64 reference of the same config (the model's CLI defaults)."""
    import json

    from fasttrain.training import load_weights

    for model, length in (("logreg", {"epochs": 1}), ("mlp:64x2", {"steps": 300})):
        stem = tmp_path / f"run-{rung}-{model.replace(':', '_')}"
        flags = [w for k, v in length.items() for w in (f"--{k}", str(v))]
        cmd = [sys.executable, "-m", "fasttrain", "train", "--engine", "cuda", "--model", model, *flags,
               "--data-dir", mnist_dir, "--out", f"{stem}.json", "--save-weights", f"{stem}.npz", "--quiet",
               "--rung", str(rung)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-2000:]
        record = json.loads(Path(f"{stem}.json").read_text())
        assert record["engine_options"]["rung"] == rung
        ref_record, ref_weights = reference(mnist, model, default_config(parse_model(model), **length))
        err = weight_error(load_weights(f"{stem}.npz"), ref_weights)
        assert err <= 1e-3, f"CLI rung {rung} {model}: weight error {err:.2e}"
        assert abs(record["final"]["test_acc"] - ref_record.final["test_acc"]) <= 0.001 + 1e-12
