"""The training contract: model names, configs, shared weights and order, schedules, engine options."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pytest

from fasttrain.contract import (
    TrainConfig,
    batch_bounds,
    default_config,
    epoch_order,
    initial_weights,
    parse_model,
    schedule,
)
from fasttrain.engines import get_engine, registry
from fasttrain.engines.base import Engine, make_options, option, parse_option_words
from fasttrain.errors import FasttrainError


def test_model_names():
    assert parse_model("logreg").widths == (784, 10)
    assert parse_model("mlp:128x3").widths == (784, 128, 128, 128, 10)
    assert parse_model("mlp:100x1").hidden == (100,)
    for bad in ("mlp", "mlp:0x3", "mlp:128x0", "mlp:128", "resnet", "mlp:12.5x2"):
        with pytest.raises(FasttrainError, match="unknown model"):
            parse_model(bad)


def test_defaults_per_model():
    logreg = default_config("logreg")
    assert (logreg.epochs, logreg.steps, logreg.batch_size, logreg.lr) == (20, None, 128, 0.1)
    mlp = default_config("mlp:128x3")
    assert (mlp.epochs, mlp.steps, mlp.batch_size, mlp.lr) == (None, 5000, 32, 0.003)
    assert default_config("logreg", steps=10).epochs is None
    assert default_config("mlp:8x1", epochs=2).steps is None


@pytest.mark.parametrize("changes, message", [
    (dict(batch_size=0), "batch_size must be a positive integer"),
    (dict(lr=-1.0), "lr must be a positive number"),
    (dict(lr=float("nan")), "lr must be a positive number"),
    (dict(precision="fp8"), "unknown precision"),
    (dict(epochs=None), "exactly one of epochs and steps"),
    (dict(steps=5), "exactly one of epochs and steps"),
])
def test_bad_configs(changes, message):
    with pytest.raises(FasttrainError, match=message):
        TrainConfig(**changes)


def test_initial_weights_shared_and_bounded():
    spec = parse_model("mlp:100x2")
    a, b = initial_weights(spec, 3), initial_weights(spec, 3)
    assert [w.shape for w, _ in a] == [(784, 100), (100, 100), (100, 10)]
    for (wa, ba), (wb, bb), (fan_in, _) in zip(a, b, spec.layer_shapes()):
        np.testing.assert_array_equal(wa, wb)
        np.testing.assert_array_equal(ba, bb)
        bound = 1 / math.sqrt(fan_in)
        assert np.abs(wa).max() <= bound and np.abs(ba).max() <= bound
        assert np.abs(wa).max() > 0.9 * bound  # uniform over the whole range, not a narrower one
    assert not np.array_equal(a[0][0], initial_weights(spec, 4)[0][0])


def test_epoch_order_is_a_fresh_permutation_per_epoch():
    first, second = epoch_order(0, 1, 1000), epoch_order(0, 2, 1000)
    assert sorted(first.tolist()) == list(range(1000))
    assert not np.array_equal(first, second)
    np.testing.assert_array_equal(first, epoch_order(0, 1, 1000))
    assert first.dtype == np.int64


def test_batches_and_schedules():
    assert len(batch_bounds(60000, 128, False)) == 469 and batch_bounds(60000, 128, False)[-1] == (59904, 60000)
    assert len(batch_bounds(60000, 128, True)) == 468
    assert schedule(default_config("logreg"), 60000).steps_per_epoch == (469,) * 20
    plan = schedule(default_config("mlp:128x3"), 60000)
    assert plan.steps_per_epoch == (1875, 1875, 1250) and plan.total_steps == 5000
    with pytest.raises(FasttrainError, match="larger than the 37 training examples"):
        schedule(default_config("logreg", batch_size=100, drop_last=True), 37)


def test_registry_lists_numpy_and_rejects_unknown():
    assert "numpy" in registry()
    assert get_engine("numpy").available() is None
    with pytest.raises(FasttrainError, match="unknown engine 'nope'"):
        get_engine("nope")


@dataclass(frozen=True)
class _Opts:
    rung: int = option(0, "rung", choices=tuple(range(9)))
    preload: bool = option(True, "preload")
    compile: str = option("none", "mode", choices=("none", "default", "max-autotune"), flag_value="default")


class _Fake(Engine):
    name = "fake"
    description = "options parsing only"
    Options = _Opts

    def prepare(self, job):
        raise NotImplementedError


def test_engine_option_words():
    assert parse_option_words(_Fake, ["--rung", "3", "--no-preload", "--compile"]) == {
        "rung": "3", "preload": False, "compile": "default"}
    assert parse_option_words(_Fake, ["--compile=max-autotune", "--preload"]) == {"compile": "max-autotune", "preload": True}
    opts = make_options(_Fake, {"rung": "3", "preload": False})
    assert opts.rung == 3 and opts.preload is False
    with pytest.raises(FasttrainError, match="no such option --turbo for engine fake"):
        parse_option_words(_Fake, ["--turbo"])
    with pytest.raises(FasttrainError, match="--rung must be one of"):
        make_options(_Fake, {"rung": 9})
    with pytest.raises(FasttrainError, match="--rung expects int"):
        make_options(_Fake, {"rung": "x"})
    with pytest.raises(FasttrainError, match="has no option --speed"):
        make_options(_Fake, {"speed": 1})
