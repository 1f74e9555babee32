"""One conformance suite for every registered engine (parametrized over the registry).

Each engine, with each of its ``conformance_options``, is held to the same three promises:
- parity: trained on identical weights and batches, it tracks the NumPy float64 reference (fp32: to
  rounding; fp16/bf16: within the mixed-precision tolerance);
- warm-up does not train: the session ``prepare`` returns holds exactly the initial weights;
- it refuses, in one line and before any data loads, every precision it does not list.

An engine whose ``needs_gpu`` is set has its cases marked ``gpu`` (they skip without one). Engines outside the
package join through ``$FASTTRAIN_ENGINE_PATH`` (see ``fasttrain.engines``); the last test builds a toy engine
that way and runs it through these checks and through ``fasttrain bench``.
"""

from __future__ import annotations

import json
import sys
import textwrap

import numpy as np
import pytest

from fasttrain.contract import default_config, initial_weights, parse_model, schedule
from fasttrain.engines import registry
from fasttrain.engines.base import Job, make_options
from fasttrain.errors import FasttrainError
from fasttrain.parity import loss_deviation, reference_run, weight_error
from fasttrain.training import run

PRECISIONS = ("fp32", "fp64", "fp16", "bf16")
MODEL = "mlp:100x2"   # hidden width 100 and batch 37: padded tiles and a partial last batch of 8
CONFIG = dict(epochs=1, batch_size=37, lr=0.05)
TOLERANCE = {  # precision: (max relative train-loss deviation per epoch, max|W - W_ref| / max|W_ref|)
    "fp64": (1e-10, 1e-10), "fp32": (1e-4, 1e-3), "fp16": (0.03, 0.1), "bf16": (0.05, 0.15)}


_REFERENCES: dict = {}


def _split(options: dict, engine_cls) -> tuple[dict, str]:
    options = dict(options)
    return options, options.pop("precision", engine_cls.precisions[0])


def cases() -> list:
    out = []
    for name, engine_cls in registry().items():
        marks = [pytest.mark.gpu] if engine_cls.needs_gpu else []
        for i, options in enumerate(engine_cls.conformance_options):
            out.append(pytest.param(name, options, marks=marks, id=f"{name}-{i}"))
    return out


def engines() -> list:
    return [pytest.param(name, marks=[pytest.mark.gpu] if cls.needs_gpu else [], id=name)
            for name, cls in registry().items()]


def _skip_if_unavailable(name: str) -> None:
    reason = registry()[name].available()
    if reason:
        pytest.skip(f"engine {name} cannot run here: {reason}")


# --- the checks (shared with the toy engine below) --------------------------------------------


def check_parity(name: str, options: dict, data) -> None:
    engine_cls = registry()[name]
    options, precision = _split(options, engine_cls)
    spec = parse_model(MODEL)
    config = default_config(spec, precision=precision, **CONFIG)
    key = (id(data), precision == "fp64", config.with_(precision="fp64"))
    if key not in _REFERENCES:
        _REFERENCES[key] = reference_run(spec, config, data)
    ref_record, ref_weights = _REFERENCES[key]
    record, weights = run(name, spec, config, data, options)
    max_loss_dev, max_weight_err = TOLERANCE[precision]
    assert [row["steps"] for row in record.epochs] == [17]
    assert loss_deviation(record, ref_record) <= max_loss_dev
    assert weight_error(weights, ref_weights) <= max_weight_err
    assert abs(record.final["test_acc"] - ref_record.final["test_acc"]) <= (0.002 if precision in ("fp32", "fp64")
                                                                             else 0.03)
    assert record.engine == name


def check_warm_up_does_not_train(name: str, options: dict, data) -> None:
    engine_cls = registry()[name]
    options, precision = _split(options, engine_cls)
    spec = parse_model(MODEL)
    config = default_config(spec, precision=precision, **CONFIG)
    job = Job(spec, config, data, initial_weights(spec, config.seed), schedule(config, data.n_train))
    engine = engine_cls(make_options(engine_cls, options))
    engine.check(job)
    session = engine.prepare(job)
    try:
        dtype = np.float64 if precision == "fp64" else np.float32
        for (w, b), (w0, b0) in zip(session.weights(), job.init_weights):
            np.testing.assert_array_equal(np.asarray(w, dtype), w0.astype(dtype))
            np.testing.assert_array_equal(np.asarray(b, dtype), b0.astype(dtype))
    finally:
        session.close()


def check_refused_precisions(name: str) -> None:
    engine_cls = registry()[name]
    spec = parse_model(MODEL)
    for precision in PRECISIONS:
        if precision in engine_cls.precisions:
            continue
        engine = engine_cls(make_options(engine_cls, {}))
        with pytest.raises(FasttrainError, match=f"does not support precision {precision}") as info:
            engine.check_config(spec, default_config(spec, precision=precision, **CONFIG))
        assert "\n" not in str(info.value)


# --- every registered engine --------------------------------------------------------------------


@pytest.mark.parametrize("name,options", cases())
def test_parity_with_the_fp64_reference_on_identical_batches(tiny_data, name, options):
    _skip_if_unavailable(name)
    check_parity(name, options, tiny_data)


@pytest.mark.parametrize("name,options", cases())
def test_warm_up_does_not_train(tiny_data, name, options):
    _skip_if_unavailable(name)
    check_warm_up_does_not_train(name, options, tiny_data)


@pytest.mark.parametrize("name", [pytest.param(n, id=n) for n in registry()])
def test_refused_precisions_are_one_line_errors(name):
    check_refused_precisions(name)   # no device needed: refused before any data loads


def test_every_engine_declares_how_it_is_shown():
    orders = [cls.order for cls in registry().values()]
    assert orders == sorted(orders)
    for name, cls in registry().items():
        assert cls.description and cls.precisions and cls.conformance_options, name
        import matplotlib

        matplotlib.colormaps[cls.color]   # a colormap that exists
    assert [n for n, cls in registry().items() if cls.reference] == ["numpy"]


# --- a new engine is its package and nothing else ------------------------------------------------

TOY_PACKAGE = '''
"""A toy engine: plain NumPy float32 SGD, written in a test's temporary folder."""

from dataclasses import dataclass

import numpy as np

from fasttrain.engines.rows import Row
from fasttrain.contract import batch_bounds
from fasttrain.data.datasets import to_inputs
from fasttrain.engines.base import Engine, EpochStats, Session, option
from fasttrain.reference import evaluate, sgd_step


@dataclass(frozen=True)
class ToyOptions:
    scale: float = option(1.0, "multiplies nothing; shows an option reaches the session")


class ToySession(Session):
    def __init__(self, job):
        self.job = job
        self.x = to_inputs(job.data.train_images, np.float32)
        self.y = job.data.train_labels.astype(np.int64)
        self.params = [(w.astype(np.float32), b.astype(np.float32)) for w, b in job.init_weights]
        self.bounds = batch_bounds(job.data.n_train, job.config.batch_size, job.config.drop_last)

    def train_epoch(self, epoch, order, steps):
        losses, loss_sum, correct, count = np.empty(steps), 0.0, 0, 0
        for k, (start, stop) in enumerate(self.bounds[:steps]):
            idx = order[start:stop]
            losses[k], ok = sgd_step(self.params, self.x[idx], self.y[idx], self.job.config.lr)
            loss_sum, correct, count = loss_sum + losses[k] * (stop - start), correct + ok, count + stop - start
        return EpochStats(count=count, loss_sum=loss_sum, correct=correct, step_losses=losses)

    def evaluate(self):
        return evaluate(self.params, self.job.data, np.float32)

    def weights(self):
        return [(w.copy(), b.copy()) for w, b in self.params]


class ToyEngine(Engine):
    name = "toy"
    description = "a toy engine from a test"
    Options = ToyOptions
    precisions = ("fp32",)
    order = 5
    color = "YlOrBr"

    @classmethod
    def rows(cls, suite):
        return (Row("toy", "toy", "-"),) if suite in ("ladder", "curves") else ()

    def prepare(self, job):
        return ToySession(job)


ENGINES = [ToyEngine]
'''


@pytest.fixture
def toy_engine(tmp_path, monkeypatch):
    """The toy package in a folder of its own, joined through $FASTTRAIN_ENGINE_PATH; no file of the
    repository is touched. Afterwards the registry forgets it again."""
    import fasttrain.engines as engines

    folder = tmp_path / "engines"
    (folder / "toy_engine").mkdir(parents=True)
    (folder / "toy_engine" / "__init__.py").write_text(textwrap.dedent(TOY_PACKAGE))
    monkeypatch.setenv(engines.ENGINE_PATH_VARIABLE, str(folder))
    path_before = list(engines.__path__)
    registry.cache_clear()
    yield "toy"
    engines.__path__[:] = path_before
    sys.modules.pop("fasttrain.engines.toy_engine", None)
    registry.cache_clear()


def test_a_toy_engine_runs_through_conformance_and_bench(toy_engine, tiny_data, tmp_path):
    from fasttrain.cli import main

    assert toy_engine in registry() and list(registry())[:2] == ["numpy", "toy"]   # its own display order
    check_parity(toy_engine, {}, tiny_data)
    check_warm_up_does_not_train(toy_engine, {}, tiny_data)
    check_refused_precisions(toy_engine)

    out = tmp_path / "bench"
    assert main(["bench", "ladder", "--quick", "--synthetic", "--engines", "toy,numpy", "--out", str(out)]) == 0
    ladder = json.loads((out / "ladder.json").read_text())
    toy = [c for c in ladder["cases"] if c["engine"] == "toy"]
    assert [c["status"] for c in toy] == ["ok"] and toy[0]["records"][0]["engine"] == "toy"
    assert "| toy |" in (out / "ladder.md").read_text()
