"""The triton engine and its kernels.

Without a GPU every kernel runs on the CPU through Triton's interpreter (``TRITON_INTERPRET=1``,
set here before the kernel modules are imported) on tiny, awkward shapes (batch 37, hidden 100),
checked against the float64 NumPy reference. With a GPU the same checks compile the real kernels,
and the tests marked ``gpu`` train on the real MNIST: fp32 weight parity after one epoch, fp16/bf16
train loss within 2% per epoch and final test accuracy within 0.3 points of the reference.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import has_cuda_gpu, make_synthetic

from fasttrain.contract import default_config, initial_weights, parse_model, schedule
from fasttrain.engines import get_engine
from fasttrain.engines.base import Job, make_options, parse_option_words
from fasttrain.errors import FasttrainError
from fasttrain.parity import engine_run, loss_deviation, reference_run, weight_error
import re
from tests_support import slow_beyond  # noqa: E402

GPU = has_cuda_gpu()
DEVICE = "cuda" if GPU else "cpu"
SRC = Path(__file__).resolve().parents[1] / "src"


def _import_kernels():
    """Import the kernel modules with the interpreter switched on (no GPU), then restore the
    environment: ``@triton.jit`` reads TRITON_INTERPRET when each kernel is defined."""
    old = os.environ.get("TRITON_INTERPRET")
    if not GPU:
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        from fasttrain.engines.triton import linear_backward, linear_forward, persistent, softmax_xent
    finally:
        if old is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = old
    return linear_forward, softmax_xent, linear_backward, persistent


try:
    linear_forward, softmax_xent, linear_backward, persistent = _import_kernels()
except ImportError as exc:  # triton/torch missing: the whole module is skipped with the reason
    pytest.skip(f"triton engine dependencies missing: {exc}", allow_module_level=True)


@pytest.fixture(autouse=True)
def _interpreter_env(monkeypatch):
    """The engine asks TRITON_INTERPRET whether it may run without a GPU; keep it set per test."""
    if not GPU:
        monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture(scope="module")
def small_data():
    # 160 training examples: batch 37 gives 4 full batches and a partial one of 12
    return make_synthetic(n_train=160, n_test=64, seed=3)


def make_job(data, model="logreg", **config):
    spec = parse_model(model)
    cfg = default_config(spec, **config)
    return Job(spec, cfg, data, initial_weights(spec, cfg.seed), schedule(cfg, data.n_train))


# --- registration, options, errors (no kernels run) ------------------------------------------


def test_package_imports_no_heavy_dependency():
    code = ("import sys, fasttrain.engines.triton as t; assert t.ENGINES[0].name == 'triton'; "
            "print(sorted(m for m in ('torch', 'triton') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(SRC)})
    assert out.stdout.strip() == "[]"


@pytest.mark.skipif(GPU, reason="checks the reason given on a machine without a GPU")
def test_unavailable_without_gpu_names_the_fix():
    code = "from fasttrain.engines import get_engine; print(get_engine('triton').available())"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**env, "PYTHONPATH": str(SRC)})
    assert "CUDA GPU" in out.stdout and "TRITON_INTERPRET=1" in out.stdout


def test_options_parse_and_reject():
    engine = get_engine("triton")
    assert engine.precisions == ("fp32", "fp16", "bf16")
    opts = make_options(engine, parse_option_words(engine, ["--mode", "graph", "--programs", "25", "--no-fused",
                                                            "--fp32-dot", "tf32x3"]))
    assert (opts.mode, opts.programs, opts.fused, opts.fp32_dot) == ("graph", 25, False, "tf32x3")
    with pytest.raises(FasttrainError, match="must be one of"):
        make_options(engine, {"mode": "fastest"})


def test_job_errors_are_one_line(small_data):
    engine_cls = get_engine("triton")
    wide = make_job(small_data, "mlp:512x2", steps=2)
    with pytest.raises(FasttrainError, match="use --mode graph"):
        engine_cls(make_options(engine_cls, {"mode": "persistent"})).check(wide)
    with pytest.raises(FasttrainError, match="does not support precision fp64"):
        engine_cls().check(make_job(small_data, precision="fp64", epochs=1))
    if not GPU:
        with pytest.raises(FasttrainError, match="bf16"):
            engine_cls().check(make_job(small_data, precision="bf16", epochs=1))
        with pytest.raises(FasttrainError, match="--programs 1"):
            engine_cls(make_options(engine_cls, {"programs": 49})).check(make_job(small_data, epochs=1))


# --- kernels against float64 NumPy ------------------------------------------------------------


@pytest.mark.parametrize("prec,tol", [("ieee", 1e-5), ("fp16", 1e-2)])
def test_linear_forward_kernels(prec, tol):
    errors = linear_forward.check(DEVICE, m=37, k=100, n=100, prec=prec)
    assert errors.pop("v3_correct_diff") <= (0 if prec == "ieee" else 1)
    assert errors.pop("v3_untouched_step0") == 0
    assert max(errors.values()) < tol, errors


def test_softmax_xent_kernel():
    errors = softmax_xent.check(DEVICE, m=37)
    assert errors["correct_diff"] == 0 and errors["other_steps"] == 0
    assert max(errors["dlogits"], errors["loss"]) < 1e-5, errors


@pytest.mark.parametrize("prec,tol", [("ieee", 1e-5), ("fp16", 1e-2)])
def test_linear_backward_kernels(prec, tol):
    errors = linear_backward.check(DEVICE, m=37, k=100, n=100, prec=prec)
    assert max(errors.values()) < tol, errors


PERSISTENT_CASES = [
    ("logreg", 1, False),  # version 1: one program
    ("logreg", 49 if GPU else 1, True),  # version 2: features split over programs (one under the interpreter)
    ("mlp:100x1", 1, None),  # version 3, no middle layer
    ("mlp:100x2", 1, None),
    ("mlp:20x3", 1, None),
]


@pytest.mark.parametrize("model,programs,split", PERSISTENT_CASES)
def test_persistent_epoch_kernels(model, programs, split):
    # 100 examples, batch 37: steps of 37, 37 and a partial 26; lr 0.5 moves the weights far
    result = persistent.check(DEVICE, model=model, n=100, batch=37, steps=3, lr=0.5, programs=programs, split=split)
    assert result["weights"] < 1e-5, result
    assert abs(result["moved"] - 1) < 1e-3, result  # it trained as far as the reference did
    assert result["loss"] < 1e-5 and result["correct_in_range"], result


def test_persistent_mixed_precision_tracks_reference():
    result = persistent.check(DEVICE, model="mlp:100x2", n=100, batch=37, steps=3, lr=0.5, prec="fp16")
    assert result["weights"] < 5e-2 and result["loss"] < 1e-3, result


# --- the engine -----------------------------------------------------------------------------------

ENGINE_CASES = [
    ("logreg", {}),  # persistent
    ("logreg", {"mode": "eager"}),
    ("logreg", {"mode": "eager", "fused": False}),
    ("mlp:100x2", {}),  # auto: graph (eager without a GPU)
    ("mlp:100x2", {"mode": "persistent"}),
    ("mlp:100x2", {"mode": "eager", "fused": False}),
    ("mlp:100x2", {"mode": "eager", "backward": "v3"}),
]
if GPU:
    ENGINE_CASES += [("logreg", {"mode": "graph"}), ("mlp:100x2", {"mode": "eager"}),
                     ("mlp:100x2", {"mode": "graph", "backward": "v3"}),
                     ("logreg", {"programs": 1}), ("logreg", {"programs": 13})]


@pytest.mark.parametrize("model,options", slow_beyond(ENGINE_CASES, keep=3), ids=lambda v: str(v))
def test_engine_fp32_parity(small_data, model, options):
    # steps=6 with 5 batches per epoch: a full epoch (last batch partial) then an epoch of 1 step
    cfg = default_config(parse_model(model), steps=6, batch_size=37, lr=0.2)
    ref, ref_w = reference_run(model, cfg, small_data)
    record, weights = engine_run("triton", model, cfg, small_data, options)
    assert weight_error(weights, ref_w) < 1e-5
    assert loss_deviation(record, ref) < 1e-5
    assert [r["train_acc"] for r in record.epochs] == [r["train_acc"] for r in ref.epochs]
    assert [len(record.epochs), record.epochs[-1]["steps"]] == [2, 1]
    assert abs(record.final["test_loss"] - ref.final["test_loss"]) < 1e-5
    assert record.final["test_acc"] == ref.final["test_acc"]
    expected = options.get("mode") or ("persistent" if model == "logreg" else "graph")
    assert record.environment["mode"] == (expected if GPU or expected != "graph" else "eager")


def test_prepare_holds_initial_weights_and_drop_last(small_data):
    engine_cls = get_engine("triton")
    job = make_job(small_data, "mlp:100x2", epochs=1, batch_size=37, drop_last=True)
    session = engine_cls().prepare(job)  # warm-up trained a step: the weights must be back
    try:
        for (w, b), (w0, b0) in zip(session.weights(), job.init_weights):
            np.testing.assert_array_equal(w, w0.astype(np.float32))
            np.testing.assert_array_equal(b, b0.astype(np.float32))
        from fasttrain.contract import epoch_order

        stats = session.train_epoch(1, epoch_order(0, 1, small_data.n_train), 4)
        assert stats.count == 4 * 37 and len(stats.step_losses) == 4  # the partial batch is dropped
    finally:
        session.close()


# --- GPU, real MNIST ------------------------------------------------------------------------------


_REFERENCES: dict = {}


def _ref(mnist, model, **config):
    """The float64 reference run for (model, config), computed once per session."""
    key = (model, tuple(sorted(config.items())))
    if key not in _REFERENCES:
        _REFERENCES[key] = reference_run(model, default_config(parse_model(model), **config), mnist)
    return _REFERENCES[key]


@pytest.mark.gpu
@pytest.mark.parametrize("model,options", [
    ("logreg", {}), ("logreg", {"warps": 4}), ("logreg", {"warps": 16}), ("logreg", {"programs": 1}),
    ("logreg", {"mode": "graph"}), ("logreg", {"fp32_dot": "tf32x3"}), ("logreg", {"mode": "graph", "fused": False}),
    ("mlp:128x3", {}), ("mlp:128x3", {"mode": "persistent"}),
], ids=lambda v: str(v))
def test_gpu_fp32_weight_parity_one_epoch(mnist, model, options):
    batch, lr = (128, 0.1) if model == "logreg" else (32, 0.003)
    ref, ref_w = _ref(mnist, model, epochs=1, batch_size=batch, lr=lr)
    cfg = default_config(parse_model(model), epochs=1, batch_size=batch, lr=lr)
    record, weights = engine_run("triton", model, cfg, mnist, options)
    assert weight_error(weights, ref_w) <= 1e-3
    assert abs(record.final["test_acc"] - ref.final["test_acc"]) <= 0.003


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
@pytest.mark.parametrize("model,config,options", [
    ("logreg", dict(epochs=5, batch_size=128, lr=0.1), {}),
    ("mlp:128x3", dict(steps=5000, batch_size=32, lr=0.003), {}),
    ("mlp:128x3", dict(steps=5000, batch_size=32, lr=0.003), {"mode": "persistent"}),
    ("mlp:1024x3", dict(steps=1000, batch_size=32, lr=0.003), {"mode": "graph"}),
    ("mlp:1024x3", dict(steps=1000, batch_size=32, lr=0.003), {"mode": "graph", "backward": "v3"}),
], ids=lambda v: str(v))
def test_gpu_mixed_precision_tracks_reference(mnist, precision, model, config, options):
    ref, _ = _ref(mnist, model, **config)
    cfg = default_config(parse_model(model), precision=precision, **config)
    record, _ = engine_run("triton", model, cfg, mnist, options)
    assert loss_deviation(record, ref) <= 0.02
    assert abs(record.final["test_acc"] - ref.final["test_acc"]) <= 0.003


# --- the kernels' source -----------------------------------------------------------------------------


def test_triton_masks_are_built_as_boolean_blocks():
    """``block & (pid == 0)`` mixes a block with a scalar bool; newer Triton interpreters refuse it
    as a mask (``mask has unsupported dtype``). Kernels combine such conditions through mask_and,
    which the interpreter tests of tests/test_triton_engine.py run (linear_backward, persistent)."""
    scalar_and = re.compile(r"&\s*\(\s*(pid\w*\s*==|\w+\s*<\s*steps|s\s*\+\s*\d+\s*<\s*steps)")
    offenders = []
    for path in (SRC / "fasttrain" / "engines" / "triton").glob("*.py"):
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            if scalar_and.search(line) and "mask_and" not in line:
                offenders.append(f"{path.name}:{number}: {line.strip()}")
    assert not offenders, offenders
