"""torch-eager and torch-fast against the float64 reference, on identical weights and batches.

CPU (CI): tiny synthetic data, awkward shapes (batch 37 leaves a partial batch of 8; hidden 100).
GPU (marked ``gpu``, run on the device machine): fp32 with TF32 off within 1e-3; fp16/bf16 on real
MNIST: every epoch's train loss within 2% of the reference, final test accuracy within 0.5 pp.
"""

from __future__ import annotations

import shutil
import subprocess
import sys

import numpy as np
import pytest

from fasttrain.contract import default_config, epoch_order, initial_weights, parse_model, schedule
from fasttrain.engines import get_engine
from fasttrain.engines.base import Job, make_options
from fasttrain.errors import FasttrainError
from fasttrain.parity import loss_deviation, parity_run, reference_run, weight_error
from fasttrain.training import run

torch = pytest.importorskip("torch")

CPU_FAST = {"device": "cpu"}  # defaults resolve to: preload, --step func, no compile, no graphs


def _parity(engine, model, data, options, **config):
    record, ref_record, weights, ref_weights = parity_run(engine, model, data, options, **config)
    return record, ref_record, weight_error(weights, ref_weights)


# --- CPU: fp32 parity after one epoch ------------------------------------------------------------


@pytest.mark.parametrize("model", ["logreg", "mlp:100x2"])
@pytest.mark.parametrize(
    "engine,options",
    [
        ("torch-eager", {"device": "cpu"}),
        ("torch-fast", CPU_FAST),
        ("torch-fast", {**CPU_FAST, "preload": False}),
        ("torch-fast", {**CPU_FAST, "step": "autograd"}),
        ("torch-fast", {**CPU_FAST, "step": "autograd", "fused_sgd": False}),
    ],
    ids=["eager", "fast-func", "fast-func-host-fed", "fast-autograd-fused", "fast-autograd-foreach"],
)
def test_fp32_one_epoch_matches_reference(tiny_data, engine, options, model):
    record, ref, err = _parity(engine, model, tiny_data, options, epochs=1, batch_size=37, lr=0.05)
    assert err <= 1e-4, f"max|W - W_ref| / max|W_ref| = {err:.3g}"
    assert record.epochs[0]["steps"] == 17  # 16 batches of 37 and the partial one of 8
    assert loss_deviation(record, ref) < 1e-5
    assert record.epochs[0]["train_acc"] == pytest.approx(ref.epochs[0]["train_acc"])
    assert record.final["test_acc"] == pytest.approx(ref.final["test_acc"])
    assert len(record.curve) == len(ref.curve)


@pytest.mark.parametrize("engine", ["torch-eager", "torch-fast"])
def test_fp64_is_the_reference_to_rounding(tiny_data, engine):
    _, _, err = _parity(engine, "mlp:100x2", tiny_data, {"device": "cpu"}, epochs=1, batch_size=37, lr=0.05,
                        precision="fp64")
    assert err <= 1e-12


@pytest.mark.parametrize("engine", ["torch-eager", "torch-fast"])
def test_steps_schedule_and_drop_last(tiny_data, engine):
    # 40 steps of 37 with drop_last: epochs of 16, 16 and 8 steps, no partial batch anywhere.
    record, ref, err = _parity(engine, "mlp:100x2", tiny_data, {"device": "cpu"}, steps=40, batch_size=37,
                               lr=0.05, drop_last=True)
    assert [row["steps"] for row in record.epochs] == [16, 16, 8]
    assert err <= 1e-4
    assert loss_deviation(record, ref) < 1e-5


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
@pytest.mark.parametrize("engine", ["torch-eager", "torch-fast"])
def test_mixed_precision_tracks_reference_on_cpu(tiny_data, engine, precision):
    record, ref, err = _parity(engine, "mlp:100x2", tiny_data, {"device": "cpu"}, epochs=2, batch_size=37,
                               lr=0.05, precision=precision)
    assert loss_deviation(record, ref) <= 0.02
    assert 0 < err < 0.05  # half-precision GEMMs: close to the reference, but not equal to it


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_func_step_computes_what_autocast_computes(tiny_data, precision):
    # Half weight copies refreshed by the update hold half(W32), which autocast recomputes each step;
    # only the GEMM kernels may differ (rounding of fp16 sums), far below the 2% loss tolerance.
    spec = parse_model("mlp:100x2")
    cfg = default_config(spec, epochs=2, batch_size=37, lr=0.05, precision=precision)
    _, w_func = run("torch-fast", spec, cfg, tiny_data, {**CPU_FAST, "step": "func"})
    _, w_autograd = run("torch-fast", spec, cfg, tiny_data, {**CPU_FAST, "step": "autograd"})
    assert weight_error(w_func, [(w.astype(np.float64), b.astype(np.float64)) for w, b in w_autograd]) <= 1e-4


def test_func_loss_scaling_skips_overflowing_steps_like_grad_scaler(tiny_data, monkeypatch):
    # Start at a scale of 2**40: scaled gradients overflow fp16, so steps are skipped and the scale
    # halved until they fit, then training proceeds. GradScaler and the func step must agree on which.
    import fasttrain.engines.torch.fast as fast

    monkeypatch.setattr(fast, "FP16_INIT_SCALE", 2.0**40)
    spec = parse_model("mlp:100x2")
    cfg = default_config(spec, epochs=2, batch_size=37, lr=0.05, precision="fp16")
    rec_func, w_func = run("torch-fast", spec, cfg, tiny_data, {**CPU_FAST, "step": "func"})
    _, w_autograd = run("torch-fast", spec, cfg, tiny_data, {**CPU_FAST, "step": "autograd"})
    init = initial_weights(spec, cfg.seed)
    assert weight_error(w_func, [(w.astype(np.float64), b.astype(np.float64)) for w, b in w_autograd]) <= 1e-4
    assert weight_error(w_func, init) > 1e-3  # the later steps did train
    monkeypatch.setattr(fast, "FP16_INIT_SCALE", 2.0**10)
    _, w_normal = run("torch-fast", spec, cfg, tiny_data, {**CPU_FAST, "step": "func"})
    assert weight_error(w_func, w_normal) > 1e-3  # ... but fewer of them than without overflow
    assert all(np.isfinite(loss) for loss in (row["train_loss"] for row in rec_func.epochs))


# --- setup rules ---------------------------------------------------------------------------------


def _job(model, data, **config):
    spec = parse_model(model)
    cfg = default_config(spec, **config)
    return Job(spec, cfg, data, initial_weights(spec, cfg.seed), schedule(cfg, data.n_train))


def test_strict_fp32_switches_are_set_and_restored(tiny_data):
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        job = _job("logreg", tiny_data, epochs=1)
        engine_cls = get_engine("torch-fast")
        session = engine_cls(make_options(engine_cls, CPU_FAST)).prepare(job)
        assert torch.backends.cuda.matmul.allow_tf32 is False
        assert torch.backends.cudnn.allow_tf32 is False
        assert torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction is False
        session.close()
        assert torch.backends.cuda.matmul.allow_tf32 is True
    finally:
        torch.backends.cuda.matmul.allow_tf32 = False


@pytest.mark.parametrize(
    "options,precision,message",
    [
        ({"amp": "fp16"}, "fp32", "--amp fp16 contradicts --precision fp32"),
        ({"amp": "off"}, "bf16", "--amp off contradicts --precision bf16"),
        ({"cuda_graph": "epoch"}, "fp32", "--cuda-graph needs --device cuda"),
    ],
)
def test_bad_option_combinations_fail_in_one_line(tiny_data, options, precision, message):
    with pytest.raises(FasttrainError, match=message) as info:
        run("torch-fast", parse_model("logreg"), default_config("logreg", epochs=1, precision=precision), tiny_data,
            {**CPU_FAST, **options})
    assert "\n" not in str(info.value)


def test_cli_words_parse_into_fast_options():
    from fasttrain.engines.base import parse_option_words

    engine_cls = get_engine("torch-fast")
    words = ["--compile", "--cuda-graph", "step", "--no-fused-sgd", "--amp", "bf16"]
    opts = make_options(engine_cls, parse_option_words(engine_cls, words))
    assert (opts.compile, opts.cuda_graph, opts.fused_sgd, opts.amp) == ("default", "step", False, "bf16")
    with pytest.raises(FasttrainError, match="must be one of"):
        make_options(engine_cls, {"compile": "fastest"})


def test_listing_engines_does_not_import_torch():
    code = ("import sys; from fasttrain.engines import registry; r = registry(); "
            "assert 'torch-eager' in r and 'torch-fast' in r; "
            "[r[name].available() for name in ('torch-eager', 'torch-fast')]; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                    reason="torch.compile on the CPU needs a C++ compiler")
def test_compile_happens_in_setup_not_in_epochs(tiny_data):
    from torch._dynamo.utils import counters

    job = _job("logreg", tiny_data, epochs=2, batch_size=37, lr=0.05)
    engine_cls = get_engine("torch-fast")
    session = engine_cls(make_options(engine_cls, {**CPU_FAST, "compile": "default"})).prepare(job)
    try:
        compiled = dict(counters["stats"])
        assert compiled.get("unique_graphs", 0) >= 2  # the batch of 37 and the last batch of 8
        for epoch in (1, 2):
            session.train_epoch(epoch, epoch_order(0, epoch, tiny_data.n_train), 17)
        assert dict(counters["stats"]).get("unique_graphs", 0) == compiled.get("unique_graphs", 0)
    finally:
        session.close()


# --- GPU (device machine) ------------------------------------------------------------------------

GPU_FAST_RUNGS = [
    {},  # the defaults: preload, --step func, compile, whole-epoch CUDA graph
    {"step": "autograd"},  # preload, compile, whole-epoch CUDA graph, fused SGD, GradScaler
    {"compile": "off", "cuda_graph": "step"},
    {"compile": "off", "cuda_graph": "off", "preload": False, "pin_memory": True},
]


@pytest.mark.gpu
@pytest.mark.parametrize("model", ["logreg", "mlp:100x3"])
@pytest.mark.parametrize("engine,options", [("torch-eager", {})] + [("torch-fast", o) for o in GPU_FAST_RUNGS],
                         ids=["eager", "fast-default", "fast-autograd", "fast-step-graph", "fast-pinned"])
def test_gpu_fp32_parity_tf32_off(tiny_data, engine, options, model):
    record, ref, err = _parity(engine, model, tiny_data, {"device": "cuda", **options}, epochs=2, batch_size=37,
                               lr=0.05)
    assert err <= 1e-3, f"max|W - W_ref| / max|W_ref| = {err:.3g}"
    assert loss_deviation(record, ref) < 1e-4
    assert record.environment["device"] != "cpu"


@pytest.mark.gpu
def test_gpu_compile_and_capture_stay_in_setup(tiny_data):
    from torch._dynamo.utils import counters

    job = _job("mlp:100x3", tiny_data, steps=40, batch_size=37, lr=0.05)  # epochs of 17, 17, 6 steps
    engine_cls = get_engine("torch-fast")
    session = engine_cls(make_options(engine_cls, {"device": "cuda"})).prepare(job)
    try:
        assert set(session.graphs) == {17, 6}
        before = counters["stats"].get("unique_graphs", 0)
        for epoch, steps in enumerate(job.schedule.steps_per_epoch, start=1):
            session.train_epoch(epoch, epoch_order(0, epoch, tiny_data.n_train), steps)
        assert counters["stats"].get("unique_graphs", 0) == before
    finally:
        session.close()


@pytest.fixture(scope="module")
def mnist_references(mnist):
    """fp64 reference runs on real MNIST, shared by the mixed-precision tests."""
    cache = {}

    def get(model, **config):
        key = (model, tuple(sorted(config.items())))
        if key not in cache:
            spec = parse_model(model)
            cache[key] = reference_run(spec, default_config(spec, **config), mnist)[0]
        return cache[key]

    return get


AMP_CASES = [
    ("logreg", {"epochs": 3}),
    ("mlp:128x3", {"steps": 2500, "eval_every": 1}),  # an epoch of 1875 steps and one of 625
]


@pytest.mark.gpu
@pytest.mark.mnist
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
@pytest.mark.parametrize("engine,options", [("torch-eager", {}), ("torch-fast", {}), ("torch-fast", {"step": "autograd"})],
                         ids=["eager", "fast-default", "fast-autograd"])
@pytest.mark.parametrize("model,config", AMP_CASES, ids=[m for m, _ in AMP_CASES])
def test_gpu_mixed_precision_on_mnist(mnist, mnist_references, engine, options, precision, model, config):
    ref = mnist_references(model, **config)
    spec = parse_model(model)
    record, _ = run(engine, spec, default_config(spec, precision=precision, **config), mnist,
                    {"device": "cuda", **options})
    for row, ref_row in zip(record.epochs, ref.epochs, strict=True):
        assert abs(row["train_loss"] - ref_row["train_loss"]) <= 0.02 * ref_row["train_loss"], (row, ref_row)
    assert abs(record.final["test_acc"] - ref.final["test_acc"]) <= 0.005
