"""The NumPy engine and the float64 reference: gradients, precision, accuracy, saved weights."""

from __future__ import annotations

import numpy as np
import pytest

import fasttrain
from fasttrain.contract import default_config, initial_weights, parse_model
from fasttrain.data.datasets import to_inputs
from fasttrain.parity import reference_run, weight_error
from fasttrain.reference import loss_and_grads
from fasttrain.training import RunRecord, run


def test_finite_difference_gradients_fp64(tiny_data):
    """Analytic gradients of the reference against central differences, every layer, W and b."""
    spec = parse_model("mlp:7x2")
    weights = initial_weights(spec, 0)
    x = to_inputs(tiny_data.train_images[:13], np.float64)
    y = tiny_data.train_labels[:13].astype(np.int64)
    _, _, grads = loss_and_grads(weights, x, y)
    rng = np.random.default_rng(0)
    eps = 1e-6
    for layer, (w, b) in enumerate(weights):
        for param, grad in ((w, grads[layer][0]), (b, grads[layer][1])):
            for _ in range(6):
                idx = tuple(rng.integers(0, n) for n in param.shape)
                saved = param[idx]
                param[idx] = saved + eps
                plus = loss_and_grads(weights, x, y)[0]
                param[idx] = saved - eps
                minus = loss_and_grads(weights, x, y)[0]
                param[idx] = saved
                numeric = (plus - minus) / (2 * eps)
                assert abs(numeric - grad[idx]) <= 1e-7 + 1e-5 * abs(numeric), (layer, idx)


@pytest.mark.parametrize("model", ["logreg", "mlp:100x2"])
def test_fp32_matches_fp64_on_identical_batches(tiny_data, model):
    config = default_config(model, epochs=1, batch_size=37, lr=0.05)
    _, ref = reference_run(model, config, tiny_data)
    record, got = run("numpy", parse_model(model), config, tiny_data)
    assert weight_error(got, ref) <= 1e-4
    assert record.epochs[0]["steps"] == 17  # 600 = 16 * 37 + 8: the partial batch runs


def test_run_record_fields(tiny_data, tmp_path):
    fasttrain.train("numpy", "mlp:16x1", data=tiny_data, epochs=3, batch_size=50, lr=0.1, log_every=5,
                             eval_every=2, out=tmp_path / "r.json")
    data = RunRecord.load(tmp_path / "r.json").to_dict()
    for key in ("schema", "engine", "engine_options", "model", "config", "environment", "setup_ms", "epochs",
                "curve", "total_ms", "avg_epoch_ms_second_half", "final"):
        assert key in data
    assert data["schema"] == 1 and data["engine_options"] == {"threads": 0}
    assert [e["test_acc"] is None for e in data["epochs"]] == [True, False, False]  # eval every 2, and the last
    assert [p["step"] for p in data["curve"]][:3] == [5, 10, 15] and data["curve"][-1]["step"] == 36
    assert data["avg_epoch_ms_second_half"] == pytest.approx(np.mean([e["train_ms"] for e in data["epochs"][1:]]))
    assert data["total_ms"] >= data["setup_ms"] + sum(e["train_ms"] + e["eval_ms"] for e in data["epochs"]) * 0.999
    assert {"cpu", "cores", "libraries", "git_sha", "gpu"} <= set(data["environment"])
    assert data["final"]["test_acc"] > 0.5  # the synthetic classes are learnable


def test_saved_weights_reload_to_the_recorded_accuracy(tiny_data, tmp_path):
    path = tmp_path / "w.npz"
    record = fasttrain.train("numpy", "mlp:32x1", data=tiny_data, epochs=2, precision="fp64", save_weights_to=path)
    weights = fasttrain.load_weights(path)
    assert [w.shape for w, _ in weights] == [(784, 32), (32, 10)]
    loss, acc = fasttrain.evaluate_weights(weights, tiny_data)
    assert acc == record.final["test_acc"] and loss == pytest.approx(record.final["test_loss"], rel=1e-12)


@pytest.mark.mnist
def test_logreg_passes_90_percent_on_mnist_in_two_epochs(mnist):
    # the default suite's check of the real data (the 20 epochs below take a minute of one core)
    record = fasttrain.train("numpy", "logreg", data=mnist, epochs=2)
    assert record.final["test_acc"] >= 0.90


@pytest.mark.mnist
@pytest.mark.slow
def test_logreg_reaches_92_percent_on_mnist(mnist, tmp_path):
    record = fasttrain.train("numpy", "logreg", data=mnist, epochs=20, save_weights_to=tmp_path / "w.npz")
    assert record.final["test_acc"] >= 0.92
    _, acc = fasttrain.evaluate_weights(fasttrain.load_weights(tmp_path / "w.npz"), mnist)
    assert abs(acc - record.final["test_acc"]) <= 2e-4  # fp32 weights scored in fp64: at most a couple of digits flip


def test_curve_skips_windows_with_unrecorded_losses():
    """An engine that records losses only in some epochs gets points only for fully recorded windows."""
    from fasttrain.training import _Curve

    curve = _Curve(log_every=4)
    curve.add_epoch(1, 6, np.arange(1.0, 7.0))     # steps 1-6: point at 4 = mean(1..4)
    curve.add_epoch(7, 6, None)                     # steps 7-12 unrecorded: no point at 8 or 12
    curve.add_epoch(13, 6, np.arange(13.0, 19.0))   # steps 13-18: point at 16 = mean(13..16)
    assert curve.finish(18) == [{"step": 4, "loss": 2.5}, {"step": 16, "loss": 14.5}, {"step": 18, "loss": 17.5}]
    partial = _Curve(log_every=4)
    partial.add_epoch(1, 2, np.array([1.0, 2.0]))
    partial.add_epoch(3, 2, None)                   # the window 1-4 is half unrecorded: no point
    assert partial.finish(4) == []
