"""Sweeps of the jax engine (vmap) and of torch-fast (bmm): every model of a sweep is its own run.

Each of K models (different learning rates and seeds) trained at once is held to two runs on identical
weights and batches:
- its single run of the same engine. jax on the CPU: bit-identical (XLA:CPU computes the vmapped dots as
  the same per-model dots, in the same order). torch-fast: within rounding, not bit-identical: the sweep
  multiplies with bmm and its backward is written out, the single step uses addmm and autograd, so sums
  are taken in a different order (fp64: 1e-12; fp32: 1e-5; fp16/bf16: a half-precision rounding that
  lands differently can move a weight by one half ulp and training carries it, so 1e-2 on the weights and
  1e-4 on the loss, far inside the mixed-precision tolerance against the reference);
- the NumPy fp64 reference, within the conformance suite's tolerance for its precision.

CPU cases are tiny (synthetic data, batch 37 with a partial last batch of 8, K = 4); the ``gpu`` cases run
the same on CUDA (torch-fast's CUDA graphs) and on jax's GPU backend.
"""

from __future__ import annotations

import numpy as np
import pytest

from fasttrain.contract import default_config, initial_weights, parse_model, schedule
from fasttrain.engines import get_engine
from fasttrain.engines.base import SweepJob, make_options
from fasttrain.errors import FasttrainError
from fasttrain.parity import loss_deviation, reference_run, weight_error
from fasttrain.sweep import check_sweep_memory, run_sweep, sweep_configs
from fasttrain.training import run
from tests_support import slow_beyond  # noqa: E402

LRS, SEEDS = (0.02, 0.05), (0, 1)  # K = 4 models, lr major
CONFIG = dict(epochs=2, batch_size=37)
REFERENCE_TOLERANCE = {  # as the conformance suite: (train-loss deviation per epoch, max|W - W_ref| / max|W_ref|)
    "fp64": (1e-10, 1e-10), "fp32": (1e-4, 1e-3), "fp16": (0.03, 0.1), "bf16": (0.05, 0.15)}
SINGLE_TOLERANCE = {"fp64": (1e-12, 1e-12), "fp32": (1e-5, 1e-5), "fp16": (1e-4, 1e-2), "bf16": (1e-4, 1e-2)}
CPU = {"device": "cpu"}


def _needs(engine: str) -> None:
    pytest.importorskip("jax" if engine == "jax" else "torch")


def _configs(model: str, precision: str, lrs=LRS, **config):
    spec = parse_model(model)
    base = default_config(spec, precision=precision, **{**CONFIG, **config})
    return spec, sweep_configs(base, list(lrs), list(SEEDS))


def _as64(weights):
    return [(np.asarray(w, np.float64), np.asarray(b, np.float64)) for w, b in weights]


def check_sweep(engine: str, model: str, precision: str, options: dict, data, exact: bool, reference: bool = True,
                models: tuple[int, ...] = (0, 1, 2, 3), own_tolerance: dict = SINGLE_TOLERANCE, **config):
    """The sweep's ``models`` against their own runs of ``engine`` (within ``own_tolerance`` unless ``exact``) and
    (``reference``) the fp64 reference."""
    spec, configs = _configs(model, precision, **config)
    records, weights, timing = run_sweep(engine, spec, configs, data, options)
    assert len(records) == len(weights) == len(configs) == timing["models"] == 4
    single_loss, single_weights = own_tolerance[precision]
    ref_loss, ref_weights = REFERENCE_TOLERANCE[precision]
    for k, (config, record, model_weights) in enumerate(zip(configs, records, weights)):
        assert record.config["lr"] == config.lr and record.config["seed"] == config.seed
        assert record.environment["sweep"]["index"] == k
        if k not in models:
            continue
        own_record, own_weights = run(engine, spec, config, data, options)
        assert [r["steps"] for r in record.epochs] == [r["steps"] for r in own_record.epochs]
        if exact:
            for (w, b), (w1, b1) in zip(model_weights, own_weights):
                np.testing.assert_array_equal(w, w1)
                np.testing.assert_array_equal(b, b1)
            assert [r["train_loss"] for r in record.epochs] == [r["train_loss"] for r in own_record.epochs]
            # the test set is one (n_test, 784) product per model, which XLA:CPU may sum in another order
            # vmapped (half precision: rounded in half): the test loss within rounding
            half = precision in ("fp16", "bf16")
            assert record.final["test_acc"] == pytest.approx(own_record.final["test_acc"], abs=0.01 if half else 0)
            assert record.final["test_loss"] == pytest.approx(own_record.final["test_loss"], rel=1e-3 if half else 1e-6)
        else:
            assert weight_error(_as64(model_weights), _as64(own_weights)) <= single_weights, config
            assert loss_deviation(record, own_record) <= single_loss, config
            assert abs(record.final["test_acc"] - own_record.final["test_acc"]) <= 0.01
        if not reference:
            continue
        ref_record, reference_weights = reference_run(spec, config, data)
        assert loss_deviation(record, ref_record) <= ref_loss, config
        assert weight_error(_as64(model_weights), reference_weights) <= ref_weights, config
    # the models differ: each trained on its own lr and seed
    assert weight_error(_as64(weights[0]), _as64(weights[3])) > 1e-2
    return records


# --- CPU -----------------------------------------------------------------------------------------


# all slow (XLA compiles each for 10-20 s of CPU): the default suite's JAX sweep is the warm-up test below
@pytest.mark.parametrize("model,precision", slow_beyond([("logreg", "fp32"), ("mlp:16x2", "fp32"), ("mlp:16x2", "bf16"),
                                                         ("mlp:16x2", "fp16")], keep=0))
def test_jax_sweep_is_each_models_own_run_bit_for_bit(tiny_data, model, precision):
    _needs("jax")
    check_sweep("jax", model, precision, CPU, tiny_data, exact=True)


@pytest.mark.parametrize("model,precision", slow_beyond([("logreg", "fp32"), ("mlp:16x2", "fp32"), ("mlp:16x2", "fp64"),
                                                         ("logreg", "fp64"), ("mlp:16x2", "bf16"), ("mlp:16x2", "fp16")],
                                                        keep=2))
def test_torch_fast_sweep_is_each_models_own_run(tiny_data, model, precision):
    _needs("torch")
    records = check_sweep("torch-fast", model, precision, CPU, tiny_data, exact=False)
    assert records[0].environment["resolved"]["cuda_graph"] == "off"


@pytest.mark.parametrize("engine", ["jax", "torch-fast"])
@pytest.mark.slow
def test_epochs_of_every_length_and_drop_last(tiny_data, engine):
    # 40 steps of 37: epochs of 17 (ending with the batch of 8), 17 and 6 steps, each its own program
    _needs(engine)
    records = check_sweep(engine, "mlp:16x2", "fp32", CPU, tiny_data, exact=engine == "jax", reference=False,
                          models=(0, 3), epochs=None, steps=40)
    assert [r["steps"] for r in records[0].epochs] == [17, 17, 6]
    records = check_sweep(engine, "logreg", "fp32", CPU, tiny_data, exact=engine == "jax", reference=False,
                          models=(1, 2), drop_last=True)
    assert [r["steps"] for r in records[0].epochs] == [16, 16]


WARM_UP_CASES = [("jax", "fp32"), ("torch-fast", "fp32"), ("torch-fast", "fp16"), ("jax", "fp16")]


@pytest.mark.parametrize("engine,precision", slow_beyond(WARM_UP_CASES, keep=3),
                         ids=[f"{precision}-{engine}" for engine, precision in WARM_UP_CASES])
def test_warm_up_does_not_train_any_model(tiny_data, engine, precision):
    _needs(engine)
    spec, configs = _configs("mlp:16x2", precision)
    job = SweepJob(spec, tuple(configs), tiny_data, tuple(initial_weights(spec, c.seed) for c in configs),
                   schedule(configs[0], tiny_data.n_train))
    engine_cls = get_engine(engine)
    session = engine_cls(make_options(engine_cls, CPU)).prepare_sweep(job)
    try:
        for model_weights, init in zip(session.weights(), job.init_weights):
            for (w, b), (w0, b0) in zip(model_weights, init):
                np.testing.assert_array_equal(w, w0.astype(np.float32))
                np.testing.assert_array_equal(b, b0.astype(np.float32))
    finally:
        session.close()


@pytest.mark.slow
def test_torch_fast_fp16_scales_each_models_loss_on_its_own(tiny_data, monkeypatch):
    # Model 1 starts at a loss scale of 2**40: its scaled gradients overflow fp16, so its first steps are
    # skipped and its scale halved until they fit; the other models train from the first step, as alone.
    _needs("torch")
    spec, configs = _configs("mlp:16x2", "fp16")
    job = SweepJob(spec, tuple(configs), tiny_data, tuple(initial_weights(spec, c.seed) for c in configs),
                   schedule(configs[0], tiny_data.n_train))
    engine_cls = get_engine("torch-fast")
    session = engine_cls(make_options(engine_cls, CPU)).prepare_sweep(job)
    try:
        session.scale[1] = 2.0**40
        from fasttrain.contract import epoch_order

        orders = [epoch_order(c.seed, 1, tiny_data.n_train) for c in configs]
        session.train_epoch(1, orders, 1)
        scales = session.scale.tolist()
        after_one = session.weights()
    finally:
        session.close()
    assert scales == [2.0**10, 2.0**39, 2.0**10, 2.0**10]
    for k, (model_weights, init) in enumerate(zip(after_one, job.init_weights)):
        unchanged = all(np.array_equal(w, w0.astype(np.float32)) for pair, pair0 in zip(model_weights, init)
                        for w, w0 in zip(pair, pair0))
        assert unchanged == (k == 1), k
    # every model starting at 2**40: each skips and halves on its own steps, as its single run does
    import fasttrain.engines.torch.fast as fast
    import fasttrain.engines.torch.sweep as torch_sweep

    _, weights, _ = run_sweep("torch-fast", spec, configs, tiny_data, CPU)
    monkeypatch.setattr(torch_sweep, "FP16_INIT_SCALE", 2.0**40)
    monkeypatch.setattr(fast, "FP16_INIT_SCALE", 2.0**40)
    records_high, weights_high, _ = run_sweep("torch-fast", spec, configs, tiny_data, CPU)
    for config, record, model_weights, usual in zip(configs, records_high, weights_high, weights):
        own_record, own_weights = run("torch-fast", spec, config, tiny_data, CPU)
        assert weight_error(_as64(model_weights), _as64(own_weights)) <= 1e-2
        assert loss_deviation(record, own_record) <= 1e-4
        assert all(np.isfinite(r["train_loss"]) for r in record.epochs)
        assert weight_error(_as64(model_weights), _as64(usual)) > 1e-4  # skipped steps: fewer updates


def test_torch_fast_sweep_refuses_what_it_does_not_do(tiny_data):
    _needs("torch")
    spec, configs = _configs("logreg", "fp32")
    for options, message in [({"preload": False}, "keeps the training set on the device"),
                             ({"compile": "default"}, "leave out --compile"),
                             ({"cuda_graph": "epoch"}, "--cuda-graph needs --device cuda")]:
        with pytest.raises(FasttrainError, match=message) as info:
            run_sweep("torch-fast", spec, configs, tiny_data, {**CPU, **options})
        assert "\n" not in str(info.value)


@pytest.mark.parametrize("engine", ["jax", "torch-fast"])
def test_sweep_memory_is_estimated_against_host_memory_on_the_cpu(engine):
    _needs(engine)
    engine_cls = get_engine(engine)
    engine_obj = engine_cls(make_options(engine_cls, CPU))
    assert engine_cls.sweep
    spec = parse_model("mlp:1024x3")
    config = default_config(spec)
    memory = engine_obj.sweep_memory(spec, config, 60000, 10000, 3)
    assert memory.where == "host memory" and memory.available > 0
    assert memory.shared >= 70000 * 784  # the pixels of both sets
    assert memory.per_model >= spec.n_params * 4 * 2  # weights and gradients at least
    big = parse_model("mlp:8192x3")
    more = engine_obj.sweep_memory(big, default_config(big), 60000, 10000, 3)
    assert more.per_model > memory.per_model
    too_many = more.largest_k() + 1
    with pytest.raises(FasttrainError, match=f"at most {more.largest_k()} models fit"):
        check_sweep_memory(more, too_many, big)


# --- GPU (the device machine) --------------------------------------------------------------------

GPU_CASES = [("logreg", "fp32"), ("mlp:100x3", "fp32"), ("mlp:100x3", "bf16"), ("mlp:100x3", "fp16")]
# On the GPU the K models' products are batched GEMMs, which cuBLAS sums in another order than one model's GEMMs;
# the last-bit differences grow over the steps (at lr 0.05 on mlp:100x3 fp32, 1% of a weight after 34 steps on an
# H200). There each model is held to its own run and to the fp64 reference by the parity tolerance every engine
# is held to, at learning rates of the MLP's scale (its default 0.003, and twice it).
GPU_OWN_TOLERANCE = REFERENCE_TOLERANCE


def _gpu_lrs(model: str) -> tuple:
    return LRS if model == "logreg" else (0.003, 0.006)


@pytest.mark.gpu
@pytest.mark.parametrize("model,precision", GPU_CASES)
def test_gpu_jax_sweep_is_each_models_own_run(tiny_data, model, precision):
    # on the GPU a vmapped dot is one batched GEMM, which cuBLAS may sum in another order than K GEMMs:
    # held to the single run within rounding, not bit for bit
    _needs("jax")
    records = check_sweep("jax", model, precision, {"device": "gpu"}, tiny_data, exact=False,
                          own_tolerance=GPU_OWN_TOLERANCE, lrs=_gpu_lrs(model))
    assert records[0].environment["device"].startswith("gpu")


@pytest.mark.gpu
@pytest.mark.parametrize("model,precision", GPU_CASES + [("mlp:100x3", "fp64")])
@pytest.mark.parametrize("graph", ["auto", "step", "off"])
def test_gpu_torch_fast_sweep_is_each_models_own_run(tiny_data, model, precision, graph):
    _needs("torch")
    options = {"device": "cuda", "cuda_graph": graph}
    records = check_sweep("torch-fast", model, precision, options, tiny_data, exact=False,
                          own_tolerance=GPU_OWN_TOLERANCE, lrs=_gpu_lrs(model))
    resolved = records[0].environment["resolved"]
    assert resolved["cuda_graph"] == {"auto": "epoch", "step": "step", "off": "off"}[graph], resolved
    assert records[0].environment["device"] != "cpu"


@pytest.mark.gpu
@pytest.mark.parametrize("engine,options", [("jax", {"device": "gpu"}), ("torch-fast", {"device": "cuda"})])
def test_gpu_sweep_memory_reads_the_device(engine, options):
    _needs(engine)
    engine_cls = get_engine(engine)
    spec = parse_model("mlp:1024x3")
    memory = engine_cls(make_options(engine_cls, options)).sweep_memory(spec, default_config(spec), 60000, 10000, 3)
    assert memory.where != "host memory" and 0 < memory.available < 200 * 2**30
    assert memory.largest_k() >= 16
