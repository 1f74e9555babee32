"""Benchmark statistics and writers (CSV, JSON, Markdown, PNG) on made-up run records."""

from __future__ import annotations

import csv
import io
import json

import pytest

from fasttrain.bench import report, stats, tables
from fasttrain.bench.results import CaseResult, SuiteResult
from fasttrain.bench.suites import curves as curves_suite
from fasttrain.bench.suites import ladder as ladder_suite
from fasttrain.bench.suites import record as record_suite
from fasttrain.bench.suites import sweep as sweep_suite
from fasttrain.bench.suites.ladder import SEED_NOTE
from fasttrain import timing

SPEC_COLUMNS = ["suite", "engine", "rung", "model", "metric", "unit", "p20", "p50", "p80", "n", "gpu", "versions",
                "git_sha", "timestamp"]
H100 = {"name": "NVIDIA H100 80GB HBM3", "driver": "580.1", "memory_mib": "81559", "max_sm_clock_mhz": "1980",
        "max_mem_clock_mhz": "2619", "count": 1}


def record(epoch_ms, test_acc=0.9, setup_ms=5.0, total_ms=None, curve=None, gpu=None, train_loss=None):
    """A run record as the driver writes it (as a dict), with the given epoch times."""
    epochs = []
    for i, ms in enumerate(epoch_ms, start=1):
        last = i == len(epoch_ms)
        epochs.append({"epoch": i, "steps": 10, "train_ms": ms, "eval_ms": 1.0,
                       "train_loss": (train_loss or [1.0 / i] * len(epoch_ms))[i - 1], "train_acc": 0.5,
                       "test_loss": 0.3 if last else None, "test_acc": test_acc if last else None})
    return {
        "schema": 1, "engine": "numpy", "engine_options": {}, "model": {"name": "logreg"},
        "config": {"epochs": len(epoch_ms), "steps": None, "batch_size": 128, "lr": 0.1}, "dataset": "mnist",
        "environment": {"cpu": "Test CPU", "cores": 2, "gpu": gpu, "python": "3.11.7",
                        "libraries": {"numpy": "2.4.6", "torch": "2.13.0"}, "git_sha": "abc1234"},
        "setup_ms": setup_ms, "epochs": epochs, "curve": curve or [],
        "total_ms": total_ms if total_ms is not None else setup_ms + sum(epoch_ms) + len(epoch_ms),
        "avg_epoch_ms_second_half": 0.0, "epoch_ms": {}, "final": {"test_loss": 0.3, "test_acc": test_acc},
    }


def case(label, engine, records, suite="ladder", model="logreg", precision="fp32", seed_ms=None, status="ok",
         reason=None, deviation=None, config=None):
    return CaseResult(
        suite=suite, label=label, engine=engine, rung="-", model=model, precision=precision, options={},
        config=config or {"epochs": 20, "steps": None, "batch_size": 128, "lr": 0.1, "precision": precision},
        seed_ms=seed_ms, status=status, reason=reason, seeds=list(range(len(records))), records=records,
        metrics=stats.case_metrics(records) if records else {}, deviation=deviation, timestamp="2026-11-21T08:00:00+00:00",
    )


def suite_result(name, cases, reference=None, gpu=None):
    env = {"cpu": "Test CPU", "cores": 2, "gpu": gpu, "python": "3.11.7", "libraries": {"numpy": "2.4.6"},
           "git_sha": "abc1234"}
    return SuiteResult(name, f"{name} title", False, f"fasttrain bench {name}", "2026-11-21T08:00:00+00:00",
                       {"name": "mnist", "n_train": 60000, "n_test": 10000, "synthetic": False, "subset": False},
                       env, 3, cases, reference or {}, [f"fasttrain bench {name}"])


def table_rows(markdown: str, first_header: str) -> list[list[str]]:
    """The body cells of the Markdown table whose header starts with ``first_header``."""
    lines = markdown.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {first_header}"))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.replace("\\|", "¦").strip("|").split("|")])
    return rows


# --- statistics ----------------------------------------------------------------------------


def test_second_half_mean_is_computed_from_the_epochs():
    # epochs n//2+1..n: (10 + 20) / 2; odd n=5: epochs 3..5; one epoch: itself
    assert stats.run_metrics(record([100, 50, 10, 20]))["epoch_ms"] == pytest.approx(15.0)
    assert stats.run_metrics(record([5, 4, 3, 2, 1]))["epoch_ms"] == pytest.approx(2.0)
    assert stats.run_metrics(record([7]))["epoch_ms"] == pytest.approx(7.0)
    assert stats.run_metrics(record([100, 50, 10, 20]))["train_ms"] == pytest.approx(180.0)


def test_percentiles_across_runs_interpolate_linearly():
    runs = [record([999, v, v], test_acc=acc) for v, acc in zip([50, 10, 40, 20, 30], [0.9, 0.8, 0.7, 0.6, 0.5])]
    m = stats.case_metrics(runs)
    # sorted 10..50, linear interpolation: p20 at index 0.8 -> 18, p80 at index 3.2 -> 42
    assert (m["epoch_ms"]["p20"], m["epoch_ms"]["p50"], m["epoch_ms"]["p80"]) == pytest.approx((18.0, 30.0, 42.0))
    assert m["epoch_ms"]["n"] == 5 and m["epoch_ms"]["unit"] == "ms"
    assert m["test_acc"]["mean"] == pytest.approx(0.7)
    assert m["setup_ms"]["p50"] == pytest.approx(5.0)


def test_summarize_ignores_missing_values():
    assert timing.summarize([None, 4.0, None, 2.0])["n"] == 2
    assert timing.summarize([None, 4.0, None, 2.0])["p50"] == pytest.approx(3.0)
    assert timing.summarize([None]) == {"p20": None, "p50": None, "p80": None, "mean": None, "n": 0}


def test_number_formatting():
    assert tables.fmt_num(12500.0) == "12,500"
    assert tables.fmt_num(38.21) == "38.2"
    assert tables.fmt_num(5.234) == "5.23"
    assert tables.fmt_num(0.4123) == "0.412"
    assert tables.fmt_num(None) == "-"
    assert tables.fmt_ratio(12.5) == "12.5×"


# --- CSV and JSON --------------------------------------------------------------------------


def test_csv_is_long_format_with_the_specified_columns():
    ok = case("cuda rung 3", "cuda", [record([9, 3, 3], gpu=H100), record([9, 5, 5], gpu=H100)])
    skipped = case("triton", "triton", [], status="skipped", reason="engine triton is not built yet")
    text = report.to_csv([suite_result("ladder", [ok, skipped], gpu=H100)])
    reader = csv.DictReader(io.StringIO(text))
    assert reader.fieldnames[: len(SPEC_COLUMNS)] == SPEC_COLUMNS
    rows = list(reader)
    assert {r["metric"] for r in rows} == set(stats.METRICS)
    assert all(r["engine"] == "cuda" and r["label"] == "cuda rung 3" for r in rows)  # skipped rows are not measurements
    epoch = next(r for r in rows if r["metric"] == "epoch_ms")
    assert float(epoch["p20"]) == pytest.approx(3.4) and float(epoch["p50"]) == pytest.approx(4.0)
    assert float(epoch["p80"]) == pytest.approx(4.6) and epoch["n"] == "2" and epoch["unit"] == "ms"
    assert epoch["gpu"] == H100["name"] and epoch["git_sha"] == "abc1234"
    assert epoch["versions"] == "numpy=2.4.6; torch=2.13.0"
    assert epoch["timestamp"] == "2026-11-21T08:00:00+00:00" and epoch["suite"] == "ladder"
    acc = next(r for r in rows if r["metric"] == "test_acc")
    assert acc["unit"] == "fraction" and float(acc["mean"]) == pytest.approx(0.9)


def test_csv_carries_curve_deviations_and_no_gpu_as_none():
    dev = {"curve_max_abs": 2.5e-5, "train_loss_max_rel": 1e-5, "test_acc_diff_pp": -0.1}
    text = report.to_csv([suite_result("curves", [case("jax", "jax", [record([3])], suite="curves", deviation=dev)])])
    rows = {r["metric"]: r for r in csv.DictReader(io.StringIO(text))}
    assert float(rows["curve_max_abs_dev"]["p50"]) == pytest.approx(2.5e-5)
    assert rows["test_acc_diff"]["unit"] == "pp" and rows["epoch_ms"]["gpu"] == "none"


def test_json_round_trip_keeps_every_case(tmp_path):
    result = suite_result("ladder", [case("numpy", "numpy", [record([3, 2])]),
                                     case("jax", "jax", [], status="failed", reason="RuntimeError: boom")])
    path = tmp_path / "ladder.json"
    path.write_text(report.to_json(result))
    back = report.load_result(path)
    assert back.to_dict() == json.loads(report.to_json(result))
    assert [c.status for c in back.cases] == ["ok", "failed"]
    assert back.cases[0].metric("epoch_ms") == pytest.approx(2.0)


def test_load_result_errors_are_one_line(tmp_path):
    from fasttrain.errors import FasttrainError

    with pytest.raises(FasttrainError, match="no benchmark results"):
        report.load_result(tmp_path / "ladder.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(FasttrainError, match="not a fasttrain benchmark results file"):
        report.load_result(tmp_path / "bad.json")


# --- Markdown ------------------------------------------------------------------------------


def test_ladder_markdown_speedups_and_the_seed_column():
    cases = [
        case("numpy", "numpy", [record([1, 1000, 1000])], seed_ms=12500.0),
        case("torch-eager", "torch-eager", [record([1, 500, 500])], seed_ms=10500.0),
        case("cuda rung 0", "cuda", [record([1, 40, 40])]),
        case("triton", "triton", [], status="skipped", reason="engine triton is not built yet"),
    ]
    text = ladder_suite.markdown(suite_result("ladder", cases))
    rows = table_rows(text, "#")
    assert [r[1] for r in rows] == ["numpy", "torch-eager", "cuda rung 0"]
    by_label = {r[1]: r for r in rows}
    assert by_label["numpy"][3] == "**1,000**" and by_label["cuda rung 0"][3] == "**40**"
    assert by_label["numpy"][8] == "-" and by_label["torch-eager"][8] == "2×"  # × prev
    assert by_label["cuda rung 0"][8] == "12.5×" and by_label["cuda rung 0"][9] == "12.5×"  # × torch-eager
    assert by_label["numpy"][9] == "0.5×"
    assert by_label["numpy"][10] == "12,500" and by_label["cuda rung 0"][10] == ""
    assert SEED_NOTE in text and "orientation only" in text and "38, 27, 20.7, 19, 18, 17 ms/epoch" in text
    assert "- not run: triton: engine triton is not built yet" in text
    assert "`fasttrain bench ladder`" in text


def test_sweep_markdown_relative_speed_against_torch_eager():
    def sweep_case(label, engine, h, seconds):
        cfg = {"epochs": None, "steps": 5000, "batch_size": 32, "lr": 0.003, "precision": "fp16"}
        return case(label, engine, [record([seconds * 1000])], suite="sweep", model=f"mlp:{h}x3", config=cfg)

    cases = [sweep_case("torch-eager fp16", "torch-eager", 128, 5.0), sweep_case("jax bf16", "jax", 128, 0.25),
             sweep_case("torch-eager fp16", "torch-eager", 1024, 6.0), sweep_case("jax bf16", "jax", 1024, 0.5)]
    text = sweep_suite.markdown(suite_result("sweep", cases))
    assert "5,000 steps, batch 32, lr 0.003" in text
    times = table_rows(text, "engine")
    assert times[0] == ["torch-eager fp16", "5", "6"] and times[1] == ["jax bf16", "0.25", "0.5"]
    relative = table_rows(text.split("Speed relative to")[1], "engine")
    assert relative[1] == ["jax bf16", "20×", "12×"]


def test_sweep_markdown_compares_each_row_with_jax_in_its_own_precision():
    def sweep_case(label, engine, h, seconds, precision):
        cfg = {"epochs": None, "steps": 5000, "batch_size": 32, "lr": 0.003, "precision": precision}
        return case(label, engine, [record([seconds * 1000])], suite="sweep", model=f"mlp:{h}x3", precision=precision,
                    config=cfg)

    cases = [sweep_case("jax fp16", "jax", 128, 0.2, "fp16"), sweep_case("jax bf16", "jax", 128, 0.3, "bf16"),
             sweep_case("cuda rung 8 fp16", "cuda", 128, 0.05, "fp16"), sweep_case("cuda rung 8 bf16", "cuda", 128, 0.06, "bf16"),
             sweep_case("jax fp16", "jax", 8192, 3.0, "fp16"), sweep_case("cuda rung 7 fp16", "cuda", 8192, 2.0, "fp16"),
             sweep_case("cuda rung 6 fp32", "cuda", 8192, 6.0, "fp32")]
    text = sweep_suite.markdown(suite_result("sweep", cases))
    versus = {r[0]: r[1:] for r in table_rows(text.split("Speed relative to the JAX engine")[1], "engine")}
    # each row against JAX of its own precision; fp32 has no JAX row in the run, so no ratio
    assert versus == {"cuda rung 8 fp16": ["4×", "-"], "cuda rung 8 bf16": ["5×", "-"], "cuda rung 7 fp16": ["-", "1.5×"]}
    # a row from another invocation (a merged folder) is not compared with this one's JAX
    cases[-2].run_id = "an earlier run"
    versus = {r[0]: r[1:] for r in table_rows(sweep_suite.markdown(suite_result("sweep", cases))
                                              .split("Speed relative to the JAX engine")[1], "engine")}
    assert "cuda rung 7 fp16" not in versus and versus["cuda rung 8 fp16"] == ["4×", "-"]


def test_record_table_gives_each_model_its_own_target():
    # "cuda rung 8 fp16" is a row of several models with a different target each: each line shows its model's
    mlp = {"epochs": None, "steps": 5000, "batch_size": 32, "lr": 0.003, "precision": "fp16"}
    cases = [case("cuda rung 8 fp16", "cuda", [record([1.5, 1.5])], suite="record", model=m, precision="fp16",
                  config=None if m == "logreg" else mlp) for m in ("logreg", "mlp:128x3", "mlp:1024x3")]
    text = record_suite.markdown(suite_result("record", cases))
    assert "- Setting: logreg: 20 epochs, batch 128, lr 0.1; mlp:128x3: 5,000 steps, batch 32, lr 0.003; " in text
    lines = {r[0]: r for r in table_rows(text, "model")}
    assert lines["logreg"][5].startswith("<= 0.7 ms") and lines["mlp:128x3"][5].startswith("<= 0.025 s")
    assert lines["mlp:1024x3"][5].startswith("<= 0.06 s")


def test_curves_markdown_escapes_pipes_in_the_table():
    ref = record([3, 3], curve=[{"step": 10, "loss": 1.0}], test_acc=0.92)
    dev = {"curve_max_abs": 3.2e-6, "train_loss_max_rel": 1.5e-6, "test_acc_diff_pp": 0.1}
    result = suite_result("curves", [case("jax", "jax", [record([3, 3], curve=[{"step": 10, "loss": 1.0}])],
                                          suite="curves", deviation=dev)], reference={"logreg": ref})
    text = curves_suite.markdown(result)
    lines = [line for line in text.splitlines() if line.startswith("|")]
    widths = {line.replace("\\|", "").count("|") for line in lines}
    assert len(widths) == 1  # header, rule and every row have the same number of cells
    rows = table_rows(text, "engine / rung")
    assert rows[0][0].startswith("numpy fp64 (reference)")
    assert rows[1][:4] == ["jax", "fp32", "1", "3.20e-06"] and rows[1][-1] == "+0.10"


def test_quick_and_synthetic_runs_say_so():
    result = suite_result("ladder", [case("numpy", "numpy", [record([2, 2])])])
    result.quick = True
    result.dataset = {"name": "synthetic", "n_train": 10000, "n_test": 2000, "synthetic": True, "subset": False}
    text = ladder_suite.markdown(result)
    assert "--quick" in text and "SYNTHETIC" in text


def test_plots_are_written_as_png(tmp_path):
    pytest.importorskip("matplotlib")
    ladder = suite_result("ladder", [case("numpy", "numpy", [record([2, 2])], seed_ms=12500.0),
                                     case("cuda rung 0", "cuda", [record([1, 1]), record([1, 2])])])
    cfg = {"epochs": None, "steps": 100, "batch_size": 32, "lr": 0.003, "precision": "fp16"}
    sweep = suite_result("sweep", [case("torch-eager fp16", "torch-eager", [record([5])], "sweep", f"mlp:{h}x3",
                                        config=cfg) for h in (128, 256)])
    curve = [{"step": s, "loss": 2.0 / s} for s in (5, 10, 15)]
    curves = suite_result("curves", [case("numpy", "numpy", [record([1], curve=curve)], "curves",
                                          deviation={"curve_max_abs": 0.0})], reference={"logreg": record([1], curve=curve)})
    written = [p for r in (ladder, sweep, curves) for p in report.write_plots(r, tmp_path)]
    assert sorted(p.name for p in written) == ["curves.png", "ladder.png", "sweep_relative.png", "sweep_time.png"]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in written)


def test_header_names_every_commit_of_a_merged_result():
    """A folder merged from runs at several commits says which models ran at which; one commit: just it."""
    import copy

    at_b = copy.deepcopy(record([2.0]))
    at_b["environment"]["git_sha"] = "def5678"
    cases = [case("a", "numpy", [record([1.0])], model="logreg"), case("b", "numpy", [at_b], model="mlp:8x1")]
    text = tables.header(suite_result("record", cases))
    assert "git abc1234 (logreg), def5678 (mlp:8x1)" in text
    assert "git abc1234\n" in tables.header(suite_result("record", cases[:1])) + "\n"
