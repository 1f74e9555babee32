"""Many models at once: a numpy sweep is each model's own run, the CLI's lists and their errors, the sweep's
folder, the memory check before any work, divergence as a finding, and the many suite."""

from __future__ import annotations

import csv
import io
import json
import re

import numpy as np
import pytest

import fasttrain
from conftest import make_synthetic
from fasttrain.contract import default_config, parse_model
from fasttrain.errors import FasttrainError
from fasttrain.sweep import model_label, run_sweep, sweep_configs
from fasttrain.training import load_weights, run
from tests_support import run_cli


@pytest.fixture(scope="module")
def data():
    return make_synthetic(300, 100)


@pytest.fixture
def cli_data(monkeypatch, data):
    """The CLI's sweeps load the tiny synthetic data instead of MNIST."""
    monkeypatch.setattr("fasttrain.sweep.load_dataset", lambda name="mnist", data_dir=None: data)
    return data


# --- each model is its own run -------------------------------------------------------------


@pytest.mark.parametrize("model, config", [
    ("logreg", dict(epochs=3, batch_size=64, eval_every=2, log_every=5)),
    ("mlp:16x2", dict(steps=11, batch_size=32, log_every=4)),
])
def test_every_model_of_a_numpy_sweep_is_bit_identical_to_its_own_run(data, model, config):
    spec = parse_model(model)
    configs = sweep_configs(default_config(spec, **config), [0.05, 0.2], [0, 3])
    records, weights, timing = run_sweep("numpy", spec, configs, data, {"threads": 1})
    assert [model_label(c) for c in configs] == ["lr0.05-seed0", "lr0.05-seed3", "lr0.2-seed0", "lr0.2-seed3"]
    assert timing["models"] == 4 and timing["train_ms"] > 0 and timing["model_epochs_per_s"] > 0
    for config, record, model_weights in zip(configs, records, weights):
        single, single_weights = run("numpy", spec, config, data, {"threads": 1})
        for (w, b), (w1, b1) in zip(model_weights, single_weights):
            assert np.array_equal(w, w1) and np.array_equal(b, b1)
        strip = ("train_ms", "eval_ms")
        assert [{k: v for k, v in e.items() if k not in strip} for e in record.epochs] == \
               [{k: v for k, v in e.items() if k not in strip} for e in single.epochs]
        assert record.curve == single.curve and record.final == single.final and record.config == single.config
        assert record.environment["sweep"]["label"] == model_label(config)


# --- the command line ----------------------------------------------------------------------


def test_cli_sweep_writes_a_record_per_model_and_the_summary(cli_data, tmp_path, capsys):
    out, weights = tmp_path / "sweep", tmp_path / "weights"
    code, stdout, stderr = run_cli(["train", "--lr", "0.05,0.2", "--seed", "0,1", "--epochs", "2", "--batch-size",
                                    "64", "--out", str(out), "--save-weights", str(weights)], capsys)
    assert code == 0, stderr
    labels = ["lr0.05-seed0", "lr0.05-seed1", "lr0.2-seed0", "lr0.2-seed1"]
    assert sorted(p.name for p in out.iterdir()) == sorted([f"{x}.json" for x in labels] +
                                                          ["sweep.json", "sweep.md", "sweep.png"])
    assert sorted(p.name for p in weights.iterdir()) == [f"{x}.npz" for x in labels]
    summary = json.loads((out / "sweep.json").read_text())
    assert summary["kind"] == "fasttrain sweep" and summary["engine"] == "numpy" and summary["model"]["name"] == "logreg"
    assert summary["lrs"] == [0.05, 0.2] and summary["seeds"] == [0, 1]
    assert "lr" not in summary["config"] and summary["config"]["epochs"] == 2
    assert {"setup_ms", "train_ms", "eval_ms", "model_epochs_per_s"} <= set(summary["timing"])
    assert [m["label"] for m in summary["models"]] == labels
    assert all(m["diverged"] is None and 0 <= m["test_acc"] <= 1 and m["final_train_loss"] > 0 for m in summary["models"])
    record = fasttrain.RunRecord.load(out / "lr0.2-seed1.json")
    assert record.config["lr"] == 0.2 and record.config["seed"] == 1
    assert record.final["test_acc"] == summary["models"][3]["test_acc"]
    assert len(load_weights(weights / "lr0.2-seed1.npz")) == 1
    md = (out / "sweep.md").read_text()
    assert all(f"| {x} |" in md for x in labels) and "model-epochs/s" in md
    assert all(x in stdout for x in labels) and "model-epochs/s" in stdout
    assert stderr.count("epoch ") == 2   # one progress line per epoch, not per model


def test_a_single_value_is_the_single_run_as_before(cli_data, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("fasttrain.training.load_dataset", lambda name="mnist", data_dir=None: cli_data)
    out = tmp_path / "run.json"
    code, stdout, stderr = run_cli(["train", "--lr", "0.10", "--seed", "2", "--epochs", "1", "--out", str(out),
                                    "--quiet"], capsys)
    assert code == 0, stderr
    record = json.loads(out.read_text())
    assert record["config"]["lr"] == 0.1 and record["config"]["seed"] == 2 and "sweep" not in record["environment"]


@pytest.mark.parametrize("args, pattern", [
    (["--lr", "0.1,0.3,0.10"], r"--lr lists 0\.1 twice"),
    (["--seed", "1,2,1"], r"--seed lists 1 twice"),
    (["--lr", "0.1,abc"], r"--lr: 'abc' is not a number"),
    (["--lr", "0.1,-1"], r"lr must be a positive number"),
    (["--lr", "0.1,0"], r"lr must be a positive number"),
    (["--lr", "0.1,nan"], r"lr must be a positive number \(finite\)"),
    (["--lr", "inf,0.1"], r"lr must be a positive number \(finite\)"),
    (["--seed", "0,1.5"], r"--seed: '1\.5' is not an integer"),
    (["--seed", "0,-1"], r"seed must be an integer from 0"),
    (["--seed", f"0,{2**40}"], r"seed must be an integer from 0 at most"),
    (["--lr", "0.1,,0.3"], r"--lr '0\.1,,0\.3': an empty item"),
    (["--seed", "0,1,"], r"--seed '0,1,': an empty item"),
])
def test_list_errors_are_one_line_before_any_work(cli_data, tmp_path, capsys, monkeypatch, args, pattern):
    monkeypatch.setattr("fasttrain.sweep.run_sweep", lambda *a, **k: pytest.fail("a bad list must not train"))
    out = tmp_path / "out"
    code, stdout, stderr = run_cli(["train", *args, "--epochs", "1", "--out", str(out), "--quiet"], capsys)
    lines = stderr.strip().splitlines()
    assert code != 0 and len(lines) == 1 and lines[0].startswith("error: "), stderr
    assert re.search(pattern, lines[0]), lines[0]
    assert list(tmp_path.iterdir()) == []


def test_an_engine_without_sweep_is_refused_naming_those_that_have_one(cli_data, tmp_path, capsys):
    from fasttrain.engines import registry

    unable = [name for name, cls in registry().items() if cls.sweep is None]
    if not unable:
        pytest.skip("every registered engine trains sweeps")
    able = [name for name, cls in registry().items() if cls.sweep is not None]
    code, _out, stderr = run_cli(["train", "--engine", unable[0], "--lr", "0.1,0.2", "--epochs", "1", "--quiet"], capsys)
    line = stderr.strip()
    assert code == 1 and "\n" not in line
    assert f"engine {unable[0]} does not train several models at once; engines that do: {', '.join(able)}" in line


def test_a_sweep_too_large_for_memory_is_refused_before_any_work_with_the_largest_k(data, tmp_path, monkeypatch):
    from fasttrain.engines.numpy import engine as numpy_engine

    spec = parse_model("logreg")
    config = default_config(spec, epochs=1)
    need = numpy_engine.NumpyEngine().sweep_memory(spec, config, data.n_train, len(data.test_labels), 1)
    monkeypatch.setattr(numpy_engine, "host_available_bytes", lambda: need.shared + 3 * need.per_model + 1)
    monkeypatch.setattr(numpy_engine.NumpyEngine, "prepare_sweep", lambda self, job: pytest.fail("work began"))
    with pytest.raises(FasttrainError, match=r"a sweep of 4 logreg models needs .* at most 3 models fit"):
        fasttrain.train_sweep("numpy", "logreg", lrs=[0.1, 0.2], seeds=[0, 1], data=data, epochs=1,
                              out=tmp_path / "sweep")
    assert list(tmp_path.iterdir()) == []


def test_not_even_one_model_fitting_says_so(data, monkeypatch):
    from fasttrain.engines.numpy import engine as numpy_engine

    monkeypatch.setattr(numpy_engine, "host_available_bytes", lambda: 1000)
    with pytest.raises(FasttrainError, match="not even one model fits"):
        fasttrain.train_sweep("numpy", "logreg", lrs=[0.1, 0.2], seeds=[0], data=data, epochs=1)


def test_diverged_models_are_a_finding_not_an_error(cli_data, tmp_path, capsys):
    out = tmp_path / "sweep"
    code, stdout, stderr = run_cli(["train", "--lr", "0.1,1e38", "--epochs", "3", "--out", str(out)], capsys)
    assert code == 0, stderr
    summary = json.loads((out / "sweep.json").read_text(), parse_constant=lambda c: pytest.fail(f"bare {c}"))
    ok, bad = summary["models"]
    assert ok["diverged"] is None and ok["test_acc"] is not None
    assert bad["diverged"]["epoch"] == 1 and bad["test_loss"] is None
    assert json.loads((out / "lr1e+38-seed0.json").read_text())["diverged"]["epoch"] == 1
    assert len(json.loads((out / "lr0.1-seed0.json").read_text())["epochs"]) == 3   # the others train on
    assert re.search(r"lr1e\+38-seed0 .*yes, epoch 1", stdout), stdout


def test_every_model_diverging_exits_1_in_one_line_and_keeps_the_records(cli_data, tmp_path, capsys):
    out = tmp_path / "sweep"
    code, _stdout, stderr = run_cli(["train", "--lr", "1e37,1e38", "--epochs", "3", "--out", str(out), "--quiet"],
                                    capsys)
    assert code == 1 and stderr.strip().count("\n") == 0
    assert "every model of the sweep diverged (from epoch 1); lower --lr (now 1e+37,1e+38)" in stderr
    assert (out / "sweep.json").is_file() and (out / "lr1e+38-seed0.json").is_file()


# --- the sweep's folder --------------------------------------------------------------------


def test_a_folder_holding_other_files_is_refused_before_any_work(data, tmp_path, monkeypatch):
    monkeypatch.setattr("fasttrain.sweep.run_sweep", lambda *a, **k: pytest.fail("work began"))
    folder = tmp_path / "results"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine\n")
    with pytest.raises(FasttrainError, match=r"--out .*results: the folder holds 'notes.txt', not a sweep's"):
        fasttrain.train_sweep("numpy", "logreg", lrs=[0.1, 0.2], seeds=[0], data=data, epochs=1, out=folder)
    with pytest.raises(FasttrainError, match=r"--save-weights .*: the folder holds 'notes.txt'"):
        fasttrain.train_sweep("numpy", "logreg", lrs=[0.1, 0.2], seeds=[0], data=data, epochs=1, save_weights_to=folder)
    with pytest.raises(FasttrainError, match="does not exist; create it first"):
        fasttrain.train_sweep("numpy", "logreg", lrs=[0.1, 0.2], seeds=[0], data=data, epochs=1,
                              out=tmp_path / "missing" / "sweep")
    with pytest.raises(FasttrainError, match="that is a file, not a folder"):
        fasttrain.train_sweep("numpy", "logreg", lrs=[0.1, 0.2], seeds=[0], data=data, epochs=1,
                              out=folder / "notes.txt")
    assert [p.name for p in folder.iterdir()] == ["notes.txt"]


def test_a_rerun_replaces_the_earlier_sweep_whole(data, tmp_path):
    folder = tmp_path / "sweep"
    fasttrain.train_sweep("numpy", "logreg", lrs=[0.1, 0.2], seeds=[0], data=data, epochs=1, out=folder)
    fasttrain.train_sweep("numpy", "logreg", lrs=[0.3], seeds=[0, 1], data=data, epochs=1, out=folder)
    assert sorted(p.name for p in folder.iterdir()) == ["lr0.3-seed0.json", "lr0.3-seed1.json", "sweep.json",
                                                        "sweep.md", "sweep.png"]
    assert json.loads((folder / "sweep.json").read_text())["lrs"] == [0.3]


def test_the_api_checks_before_the_data(tmp_path, monkeypatch):
    monkeypatch.setattr("fasttrain.sweep.load_dataset", lambda *a, **k: pytest.fail("data loaded"))
    for kwargs, pattern in [
        (dict(lrs=[0.1, 0.1], seeds=[0]), "--lr lists 0.1 twice"),
        (dict(lrs=[], seeds=[0]), "--lr: give at least one value"),
        (dict(lrs=[0.1], seeds=[0.5]), "--seed: 0.5 is not an integer"),
        (dict(lrs=[0.1], seeds=[0], lr=0.2), r"give lrs=\[...\] for a sweep"),
        (dict(lrs=[0.1], seeds=[0], precision="fp16"), "does not support precision fp16"),
        (dict(lrs=[0.1, 0.2], seeds=[0], out=tmp_path / "a", save_weights_to=tmp_path / "a"), "name the same file"),
    ]:
        with pytest.raises(FasttrainError, match=pattern):
            fasttrain.train_sweep("numpy", "logreg", epochs=1, **kwargs)


# --- the many suite ------------------------------------------------------------------------


def test_many_suite_grids_and_cases():
    from fasttrain.bench import suites
    from fasttrain.bench.suites import many

    assert many.lr_factors(1) == [1.0] and len(many.lr_factors(8)) == 8
    assert all(1.0 in many.lr_factors(n) and max(many.lr_factors(n)) <= 4 for n in (1, 2, 4, 8))
    lrs, seeds = many.sweep_grid(16, 0.1, repeat=2)
    assert len(lrs) == 4 and 0.1 in lrs and seeds == [8, 9, 10, 11]
    with pytest.raises(FasttrainError, match="K = n x n"):
        many.sweep_grid(8, 0.1, 0)
    suite = suites.build("many")
    assert suite.ks == (1, 4, 16, 64) and suite.models == ("logreg", "mlp:128x3", "mlp:1024x3")
    assert suite.config_for("logreg")["epochs"] == 20 and suite.config_for("mlp:128x3")["steps"] == 5000
    numpy_cases = [(c.model, c.k) for c in suite.cases() if c.row.engine == "numpy"]
    assert numpy_cases == [("logreg", 1), ("logreg", 4)]
    assert suites.build("many", quick=True).ks == (1, 4)
    keys = [c.key for c in suite.cases()]
    assert len(keys) == len(set(keys))


def _many_case(label, engine, model, k, train_ms, rate):
    from fasttrain.bench.results import CaseResult

    metric = "model_epochs_per_s" if model == "logreg" else "model_runs_per_s"
    stat = lambda v: {"p20": v, "p50": v, "p80": v, "mean": v, "n": 1, "unit": ""}   # noqa: E731
    return CaseResult("many", label, engine, "", model, "fp32", {}, {"epochs": 20, "steps": None, "batch_size": 128, "lr": 0.1},
                      None, "ok", records=[{"environment": {}}], k=k,
                      metrics={"train_ms": stat(train_ms), metric: stat(rate), "test_acc": stat(0.9)})


def test_many_report_goal_lines_and_ratios():
    from fasttrain.bench.results import SuiteResult
    from fasttrain.bench.suites import many

    cases = [
        _many_case("jax vmap", "jax", "logreg", 1, 1000.0, 20.0), _many_case("jax vmap", "jax", "logreg", 16, 4000.0, 80.0),
        _many_case("cuda rung 8", "cuda", "logreg", 1, 100.0, 200.0),
        _many_case("cuda rung 8", "cuda", "logreg", 16, 120.0, 2667.0),
        _many_case("cuda rung 8", "cuda", "mlp:128x3", 1, 1000.0, 1.0),
        _many_case("cuda rung 8", "cuda", "mlp:128x3", 16, 2500.0, 6.4),
    ]
    result = SuiteResult("many", "Many", False, "fasttrain bench many", "t",
                         {"name": "mnist", "n_train": 60000, "n_test": 10000}, {}, 3, cases)
    lines = many.goal_lines(result)
    assert lines[0].startswith("- 16 logreg models in **1.2×** the time of one (cuda rung 8; goal ≤ 1.5×: met); "
                               "others: jax vmap 4×")
    assert "16 mlp:128x3 models in **2.5×** the time of one (cuda rung 8; goal ≤ 2×: **not met**)" in lines[1]
    assert "cuda rung 8 · logreg K=16: **33.3×**" in lines[2]
    text = many.markdown(result)
    assert "| cuda rung 8 | 200 | 2,667 |" in text and "| cuda rung 8 | 1× | 1.2× |" in text


@pytest.mark.slow
def test_bench_many_quick_on_numpy_writes_its_files(tmp_path, capsys):
    from fasttrain.cli import main

    out = tmp_path / "results"
    assert main(["bench", "many", "--quick", "--synthetic", "--engines", "numpy", "--out", str(out)]) == 0
    for name in ("many.json", "many.csv", "many.md", "many.png", "results.csv", "README.md"):
        assert (out / name).is_file(), name
    rows = list(csv.DictReader(io.StringIO((out / "many.csv").read_text())))
    rates = {r["models"]: float(r["p50"]) for r in rows if r["metric"] == "model_epochs_per_s"}
    assert set(rates) == {"1", "4"} and all(v > 0 for v in rates.values())
    saved = json.loads((out / "many.json").read_text())
    k4 = next(c for c in saved["cases"] if c["k"] == 4)
    assert k4["records"][0]["sweep"]["models"] == 4 and k4["records"][0]["sweep"]["kept"] == "lr0.1-seed0"
    assert "| numpy loop |" in (out / "many.md").read_text()
    # the listing names the K of every case
    assert main(["bench", "many", "--list"]) == 0
    assert "K=4" in capsys.readouterr().out


def test_many_rows_of_an_engine_without_sweep_are_skipped_with_the_reason(monkeypatch):
    from fasttrain.bench import runner, suites
    from fasttrain.engines.rows import Row
    from fasttrain.engines import registry

    unable = [name for name, cls in registry().items() if cls.sweep is None and cls.available() is None]
    if not unable:
        pytest.skip("every engine that runs here trains sweeps")
    suite = suites.with_rows(suites.build("many", quick=True), [Row("numpy loop", "numpy", max_k=4, models=("logreg",)),
                                                        Row("other", unable[0], models=("logreg",))])
    reasons = {(c.row.label, c.k): reason for c, reason in runner.plan(suite)}
    assert reasons[("numpy loop", 4)] is None
    assert reasons[("other", 1)] == f"engine {unable[0]} does not train several models at once (its class sets no sweep)"
