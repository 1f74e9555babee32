"""Many models at once on the cuda engine (fasttrain.engines.cuda.fused.sweep).

GPU (marker ``gpu``): every model of a rung-8 cluster sweep (logreg, an MLP of width 128, the compact build) is
bit-identical in weights and per-step losses to its own single run, also when there are more clusters than the
GPU holds at once (waves); the grid and rung 7 sweeps (one model after another on shared data) likewise; test
scores agree to float rounding (batched GEMMs against one model's); a sweep too large for the GPU's memory is
refused before any work with the largest K that fits.
CPU: the rungs without a sweep are refused in one line.
"""

from __future__ import annotations

import numpy as np
import pytest

from fasttrain.contract import default_config, parse_model
from fasttrain.errors import FasttrainError
from fasttrain.sweep import run_sweep, sweep_configs
from fasttrain.training import run


def assert_each_model_is_its_own_run(spec, configs, data, options, check=None):
    records, weights, timing = run_sweep("cuda", spec, configs, data, options)
    assert timing["models"] == len(configs)
    if spec.is_logreg and options.get("rung") == 8:
        # a logreg sweep picks its cluster size for K models (fewer CTAs a cluster, more clusters at once): the
        # single run of that size computes the same function in the same order
        options = {**options, "logreg_cluster": records[0].environment["cluster"]}
    picks = range(len(configs)) if check is None else check
    for k in picks:
        single, single_weights = run("cuda", spec, configs[k], data, options)
        for (w, b), (w1, b1) in zip(weights[k], single_weights):
            assert np.array_equal(w, w1) and np.array_equal(b, b1), f"model {k} ({configs[k].lr}, {configs[k].seed})"
        got = [row["train_loss"] for row in records[k].epochs]
        want = [row["train_loss"] for row in single.epochs]
        assert got == want
        assert [p["loss"] for p in records[k].curve] == [p["loss"] for p in single.curve]
        assert records[k].final["test_loss"] == pytest.approx(single.final["test_loss"], rel=1e-5)
        assert records[k].final["test_acc"] == pytest.approx(single.final["test_acc"], abs=1e-9)
    return records, weights, timing


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
@pytest.mark.parametrize("model,length", [("logreg", {"epochs": 2}), ("mlp:128x3", {"steps": 40, "batch_size": 32}),
                                          ("mlp:64x2", {"steps": 30}), ("mlp:100x1", {"steps": 30})])
def test_cluster_sweep_models_are_their_own_runs(tiny_data, model, length, precision):
    spec = parse_model(model)
    length = {"batch_size": 37, **length}   # mlp:128x3 fits rung 8's shared memory at batch 32, not 37
    base = default_config(spec, precision=precision, log_every=5, **length)
    configs = sweep_configs(base, [base.lr, base.lr * 3], [0, 5])
    assert_each_model_is_its_own_run(spec, configs, tiny_data, {"rung": 8})


@pytest.mark.gpu
def test_more_clusters_than_the_gpu_holds_run_in_waves(tiny_data):
    """40 logreg clusters of 7 CTAs (280 CTAs, more than any GPU's SMs hold at once)."""
    spec = parse_model("logreg")
    base = default_config(spec, epochs=1, batch_size=64, precision="bf16")
    configs = sweep_configs(base, [0.01 * (i + 1) for i in range(20)], [1, 2])
    records, _, timing = assert_each_model_is_its_own_run(spec, configs, tiny_data, {"rung": 8, "logreg_cluster": 7},
                                                          check=[0, 21, 39])
    assert timing["models"] == 40 and records[0].environment["waves"] >= 2


@pytest.mark.gpu
def test_a_logreg_sweep_of_another_cluster_size_tracks_the_single_run(tiny_data):
    """40 models: the sweep runs clusters of fewer than 7 CTAs (more at once); each model then sums its logits in
    another order than the default single run, so it agrees to the mixed-precision tolerance, not bit for bit."""
    spec = parse_model("logreg")
    base = default_config(spec, epochs=2, batch_size=64, precision="fp16")
    configs = sweep_configs(base, [0.05 * (i + 1) for i in range(20)], [1, 2])
    records, weights, _ = run_sweep("cuda", spec, configs, tiny_data, {"rung": 8})
    assert records[0].environment["cluster"] < 7
    for k in (0, 39):
        single, _ = run("cuda", spec, configs[k], tiny_data, {"rung": 8})
        for got, want in zip(records[k].epochs, single.epochs):
            assert got["train_loss"] == pytest.approx(want["train_loss"], rel=0.02)
        assert abs(records[k].final["test_acc"] - single.final["test_acc"]) <= 0.03 + 1e-9


@pytest.mark.gpu
@pytest.mark.parametrize("model,options", [("mlp:256x2", {"rung": 8}), ("mlp:96x1", {"rung": 7})])
def test_grid_and_rung7_sweeps_are_their_own_runs(tiny_data, model, options):
    spec = parse_model(model)
    base = default_config(spec, steps=25, batch_size=37, precision="fp16")
    configs = sweep_configs(base, [base.lr, base.lr * 2], [0, 1])
    assert_each_model_is_its_own_run(spec, configs, tiny_data, options)


@pytest.mark.gpu
def test_a_sweep_too_large_for_the_gpu_is_refused_with_the_largest_k(tiny_data):
    import cupy as cp

    spec = parse_model("mlp:8192x3")
    base = default_config(spec, steps=10, precision="fp16")
    free_before, _ = cp.cuda.runtime.memGetInfo()
    configs = sweep_configs(base, [0.001 * (i + 1) for i in range(200)], [0, 1, 2, 3, 4])   # 1000 models
    with pytest.raises(FasttrainError, match=r"at most (\d+) models fit") as info:
        run_sweep("cuda", spec, configs, tiny_data, {"rung": 7})
    largest = int(info.value.args[0].split("at most ")[1].split()[0])
    assert 1 <= largest < 1000
    free_after, _ = cp.cuda.runtime.memGetInfo()
    assert free_after >= free_before - (64 << 20)   # refused before allocating anything of size


def test_rungs_without_a_sweep_are_refused_in_one_line(tiny_data):
    from fasttrain.engines.cuda.engine import CudaEngine, CudaOptions
    from fasttrain.engines.base import SweepJob
    from fasttrain.contract import initial_weights, schedule

    spec = parse_model("logreg")
    configs = tuple(sweep_configs(default_config(spec, epochs=1), [0.1, 0.2], [0]))
    job = SweepJob(spec, configs, tiny_data, tuple(initial_weights(spec, c.seed) for c in configs),
                   schedule(configs[0], tiny_data.n_train))
    with pytest.raises(FasttrainError, match="rungs 7 and 8, not 6"):
        CudaEngine(CudaOptions(rung=6)).prepare_sweep(job)
