"""The jax engine against the float64 reference, on identical weights and batches.

CPU (CI): tiny synthetic data, batch 37 (a partial last batch of 8), hidden width 100.
GPU (marked ``gpu``): fp32 at 'highest' within 1e-3; fp16/bf16 on real MNIST: every epoch's train
loss within 2% of the reference and the final test accuracy within 0.5 pp.
"""

from __future__ import annotations

import pytest

from fasttrain.contract import default_config, parse_model
from fasttrain.errors import FasttrainError
from fasttrain.parity import loss_deviation, parity_run, reference_run, weight_error
from fasttrain.training import run

pytest.importorskip("jax")

CPU = {"device": "cpu"}


def _parity(model, data, options, **config):
    return parity_run("jax", model, data, options, **config)


@pytest.mark.parametrize("model", ["logreg", "mlp:100x2"])
@pytest.mark.parametrize("unroll", [1, 4])
def test_fp32_one_epoch_matches_reference(tiny_data, model, unroll):
    record, ref, weights, ref_weights = _parity(model, tiny_data, {**CPU, "unroll": unroll}, epochs=1,
                                                batch_size=37, lr=0.05)
    assert weight_error(weights, ref_weights) <= 1e-4
    assert record.epochs[0]["steps"] == 17  # 16 scanned batches of 37, then the partial one of 8
    assert loss_deviation(record, ref) < 1e-5
    assert record.epochs[0]["train_acc"] == pytest.approx(ref.epochs[0]["train_acc"])
    assert record.final["test_loss"] == pytest.approx(ref.final["test_loss"], rel=1e-5)
    assert [p["step"] for p in record.curve] == [p["step"] for p in ref.curve]


def test_steps_schedule_compiles_each_epoch_length(tiny_data):
    # 40 steps of 37: epochs of 17 (ending with the batch of 8), 17 and 6 steps.
    record, ref, weights, ref_weights = _parity("mlp:100x2", tiny_data, CPU, steps=40, batch_size=37, lr=0.05,
                                                log_every=5)
    assert [row["steps"] for row in record.epochs] == [17, 17, 6]
    assert weight_error(weights, ref_weights) <= 1e-4
    assert len(record.curve) == 8


def test_drop_last(tiny_data):
    record, _, weights, ref_weights = _parity("logreg", tiny_data, CPU, epochs=2, batch_size=37, lr=0.05,
                                              drop_last=True)
    assert [row["steps"] for row in record.epochs] == [16, 16]
    assert weight_error(weights, ref_weights) <= 1e-4


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_tracks_reference_on_cpu(tiny_data, precision):
    record, ref, weights, ref_weights = _parity("mlp:100x2", tiny_data, CPU, epochs=2, batch_size=37, lr=0.05,
                                                precision=precision)
    assert loss_deviation(record, ref) <= 0.02
    assert 0 < weight_error(weights, ref_weights) < 0.05  # half-precision GEMMs: close, not equal


def test_bad_options(tiny_data):
    with pytest.raises(FasttrainError, match="--unroll must be a positive integer"):
        run("jax", parse_model("logreg"), default_config("logreg", epochs=1), tiny_data, {**CPU, "unroll": 0})
    with pytest.raises(FasttrainError, match="does not support precision fp64"):
        run("jax", parse_model("logreg"), default_config("logreg", epochs=1, precision="fp64"), tiny_data, CPU)


# --- GPU (device machine) ------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("model", ["logreg", "mlp:100x3"])
def test_gpu_fp32_parity_highest(tiny_data, model):
    record, ref, weights, ref_weights = _parity(model, tiny_data, {"device": "gpu"}, epochs=2, batch_size=37,
                                                lr=0.05)
    assert weight_error(weights, ref_weights) <= 1e-3
    assert loss_deviation(record, ref) < 1e-4
    assert record.environment["device"].startswith("gpu")


AMP_CASES = [
    ("logreg", {"epochs": 3}),
    ("mlp:128x3", {"steps": 2500}),  # an epoch of 1875 steps, then one of 625
]


@pytest.mark.gpu
@pytest.mark.mnist
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
@pytest.mark.parametrize("model,config", AMP_CASES, ids=[m for m, _ in AMP_CASES])
def test_gpu_mixed_precision_on_mnist(mnist, precision, model, config):
    spec = parse_model(model)
    ref = reference_run(spec, default_config(spec, **config), mnist)[0]
    record, _ = run("jax", spec, default_config(spec, precision=precision, **config), mnist, {"device": "gpu"})
    for row, ref_row in zip(record.epochs, ref.epochs, strict=True):
        assert abs(row["train_loss"] - ref_row["train_loss"]) <= 0.02 * ref_row["train_loss"], (row, ref_row)
    assert abs(record.final["test_acc"] - ref.final["test_acc"]) <= 0.005
