"""Suites as data, option resolution, skipping, running over seeds, merging results."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from fasttrain.bench import runner, suites
from fasttrain.bench.suite import Suite
from fasttrain.engines.rows import OFF, Row
from fasttrain.engines.base import Engine, option
from fasttrain.errors import FasttrainError

TINY = dict(epochs=2, steps=None, batch_size=50, lr=0.1, log_every=3)


@dataclass(frozen=True)
class FakeOptions:
    graphs: bool = option(True, "a boolean flag")
    mode: str = option("auto", "a flag with choices", choices=("auto", "off", "fast"))
    level: str = option(None, "a flag whose default None is off")
    size: int = option(3, "a number")


class FakeEngine(Engine):
    name = "fake"
    description = "test double"
    Options = FakeOptions

    def prepare(self, job):  # pragma: no cover - never run
        raise NotImplementedError


# --- suites as data ------------------------------------------------------------------------


def test_suite_rows_are_consistent():
    """The rows come from the engines; every ladder label is unique, the seed figures sit on rows, each suite
    with speed-up columns has its baseline, and every row names a registered engine."""
    from fasttrain.engines import registry

    ladder, sweep, record = suites.build("ladder").rows, suites.build("sweep").rows, suites.build("record").rows
    labels = [row.label for row in ladder]
    assert len(labels) == len(set(labels))
    assert [row.label for row in ladder if row.seed_ms is not None] == ["numpy", "torch-eager", "torch-fast +compile"]
    assert {row.engine for row in ladder + sweep + record} <= set(registry())
    assert len(suites.build("sweep").baselines()) == 1 and len(suites.build("ladder").baselines()) == 1
    assert [f"cuda rung {n}" for n in range(7)] + ["cuda rung 7 fp16", "cuda rung 8 fp16"] == \
        [label for label in labels if label.startswith("cuda")]
    keys = [c.key for c in suites.build("record").cases()]
    assert len(keys) == len(set(keys))   # a row label once per model


def test_record_suite_holds_the_fused_rungs_to_their_targets():
    record = suites.build("record")
    assert record.models == ("logreg", "mlp:128x3", "mlp:1024x3", "mlp:8192x3") and record.reference
    assert record.reference_models == ("logreg", "mlp:128x3", "mlp:1024x3")
    targets = {(c.row.label, c.model): c.row.target_ms for c in record.cases() if c.row.target_ms}
    assert targets == {("cuda rung 8 fp16", "logreg"): 0.7, ("cuda rung 8 fp16", "mlp:128x3"): 25.0,
                       ("cuda rung 8 fp16", "mlp:1024x3"): 60.0, ("cuda rung 7 fp16", "mlp:8192x3"): 3000.0}
    assert {c.model for c in record.cases() if c.row.baseline} == set(record.models)   # a JAX row beside each
    assert record.config_for("logreg")["epochs"] == 20 and record.config_for("mlp:128x3")["steps"] == 5000
    assert record.metric_for("logreg") == "epoch_ms" and record.metric_for("mlp:8192x3") == "train_ms"
    quick = suites.build("record", quick=True)
    assert "mlp:8192x3" not in quick.models and quick.config_for("mlp:128x3")["steps"] == 100


def test_suites_are_registered_and_engines_bring_their_own():
    names = suites.all_suites()
    assert {"ladder", "sweep", "curves", "record", "peers", "triton"} <= set(names)
    triton = suites.build("triton")
    assert triton.rows and {row.engine for row in triton.rows} == {"triton"}


def test_suite_settings_follow_the_issue():
    ladder = suites.build("ladder")
    assert (ladder.config["epochs"], ladder.config["batch_size"], ladder.config["lr"], ladder.repeats) == (20, 128, 0.1, 3)
    sweep = suites.build("sweep")
    assert sweep.models == tuple(f"mlp:{h}x3" for h in (128, 256, 512, 1024, 2048, 4096, 8192))
    assert (sweep.config["steps"], sweep.config["batch_size"], sweep.config["lr"], sweep.repeats) == (5000, 32, 0.003, 3)
    cases = sweep.cases()
    assert not any(c.row.engine == "numpy" and c.model == "mlp:2048x3" for c in cases)  # max_hidden
    assert all(c.config["precision"] == "fp16" for c in cases if c.row.engine in ("torch-eager", "triton"))
    quick = suites.build("sweep", quick=True, hidden=(64,))
    assert quick.models == ("mlp:64x3",) and quick.repeats == 1 and quick.config["steps"] < 5000
    assert suites.build("ladder", repeats=5).repeats == 5


# --- options -------------------------------------------------------------------------------


def test_off_resolves_to_each_flags_off_value():
    resolved = runner.resolve_options(FakeEngine, {"graphs": OFF, "mode": OFF, "level": OFF, "size": 4})
    assert resolved == {"graphs": False, "mode": "off", "size": 4}  # level: its default None already is off


def test_unknown_option_and_flag_without_off_are_reported():
    with pytest.raises(FasttrainError, match="has no option --turbo"):
        runner.resolve_options(FakeEngine, {"turbo": True})
    with pytest.raises(FasttrainError, match="no 'off' value"):
        runner.resolve_options(FakeEngine, {"size": OFF})
    with pytest.raises(FasttrainError, match="must be one of"):
        runner.resolve_options(FakeEngine, {"mode": "warp"})


def test_plan_gives_a_reason_for_every_skipped_row():
    rows = (Row("numpy", "numpy"), Row("numpy fp16", "numpy", overrides={"precision": "fp16"}),
            Row("ghost", "no-such-engine"), Row("slow", "numpy", quick=False, quick_note="too slow for --quick"),
            Row("numpy bad flag", "numpy", options={"rung": 3}))
    suite = Suite("ladder", "t", rows, ("logreg",), TINY, 1, quick=True)
    reasons = {case.row.label: reason for case, reason in runner.plan(suite)}
    assert reasons["numpy"] is None
    assert "does not support precision fp16" in reasons["numpy fp16"]
    assert "not registered" in reasons["ghost"]
    assert reasons["slow"] == "too slow for --quick"
    assert "has no option --rung" in reasons["numpy bad flag"]
    only = {case.row.label: reason for case, reason in runner.plan(suite, {"jax"})}
    assert only["numpy"] == runner.NOT_SELECTED


def test_engines_filter_rejects_unknown_names():
    runner.check_engines_filter({"numpy", "cuda", "triton"})
    with pytest.raises(FasttrainError, match="unknown engine 'nunpy'"):
        runner.check_engines_filter({"nunpy"})


# --- running -------------------------------------------------------------------------------


def test_run_suite_repeats_over_seeds_and_keeps_skips(tiny_data):
    rows = (Row("numpy", "numpy"), Row("ghost", "no-such-engine"))
    suite = Suite("ladder", "t", rows, ("logreg",), TINY, 2)
    result = runner.run_suite(suite, tiny_data, command="fasttrain bench ladder")
    ok, ghost = result.cases
    assert ok.status == "ok" and ok.seeds == [0, 1] and len(ok.records) == 2
    assert [r["config"]["seed"] for r in ok.records] == [0, 1]
    assert ok.metrics["epoch_ms"]["n"] == 2 and ok.metrics["test_acc"]["mean"] > 0.5
    assert ok.records[0]["final"] != ok.records[1]["final"] or ok.records[0]["epochs"] != ok.records[1]["epochs"]
    assert ghost.status == "skipped" and "not registered" in ghost.reason and not ghost.records
    assert result.commands == ["fasttrain bench ladder"] and result.dataset["n_train"] == 600


def test_curves_suite_measures_deviation_from_the_fp64_reference(tiny_data):
    suite = Suite("curves", "t", (Row("numpy", "numpy"),), ("logreg",), TINY, 1, reference=True)
    result = runner.run_suite(suite, tiny_data)
    ref = result.reference["logreg"]
    assert ref["config"]["precision"] == "fp64" and ref["curve"]
    dev = result.cases[0].deviation
    # numpy fp32 follows the fp64 reference on the same batches: only rounding apart
    assert 0 < dev["curve_max_abs"] < 1e-4 and dev["train_loss_max_rel"] < 1e-4 and abs(dev["test_acc_diff_pp"]) <= 0.5


def test_engine_errors_skip_and_crashes_fail_without_stopping_the_suite(tiny_data):
    calls = []

    def flaky(engine, spec, config, data, options):
        calls.append(config.seed)
        if options.get("threads") == 1:
            raise FasttrainError("needs a GPU")
        raise RuntimeError("kernel exploded\nsecond line")

    rows = (Row("refuses", "numpy", options={"threads": 1}), Row("crashes", "numpy", options={"threads": 2}))
    result = runner.run_suite(Suite("ladder", "t", rows, ("logreg",), TINY, 3), tiny_data, runner=flaky)
    refuses, crashes = result.cases
    assert (refuses.status, refuses.reason) == ("skipped", "needs a GPU")
    assert (crashes.status, crashes.reason) == ("failed", "RuntimeError: kernel exploded")
    assert "Traceback" in crashes.traceback
    assert calls == [0, 0]  # the first seed's error ends the row


def test_results_so_far_are_handed_out_after_every_row(tiny_data):
    seen = []
    rows = (Row("a", "numpy"), Row("ghost", "no-such-engine"), Row("b", "numpy", options={"threads": 1}))
    runner.run_suite(Suite("ladder", "t", rows, ("logreg",), TINY, 1), tiny_data,
                     on_case=lambda partial: seen.append([c.label for c in partial.cases]))
    assert seen == [["a"], ["a", "ghost", "b"]]  # after each row that ran


# --- merging -------------------------------------------------------------------------------


def _result(cases, quick=False, dataset="mnist"):
    return runner.SuiteResult("sweep", "t", quick, "cmd", "now", {"name": dataset}, {}, 1, cases, {}, ["cmd"])


def _case(label, model, status="ok", reason=None):
    return runner.CaseResult("sweep", label, "x", "-", model, "fp32", {}, {}, None, status, reason)


def test_merge_keeps_earlier_results_for_cases_not_run_now():
    old = _result([_case("jax", "mlp:128x3"), _case("cuda", "mlp:128x3"), _case("jax", "mlp:256x3", "failed")])
    new = _result([_case("jax", "mlp:512x3"), _case("cuda", "mlp:128x3", "skipped", runner.NOT_SELECTED),
                   _case("jax", "mlp:256x3")])
    new.commands = ["cmd2"]
    merged, kept = runner.merge(new, old)
    got = {(c.label, c.model): c.status for c in merged.cases}
    assert got == {("jax", "mlp:128x3"): "ok", ("cuda", "mlp:128x3"): "ok", ("jax", "mlp:256x3"): "ok",
                   ("jax", "mlp:512x3"): "ok"}
    assert kept == 2 and merged.commands == ["cmd", "cmd2"]
    assert [c.model for c in merged.cases] == ["mlp:128x3", "mlp:128x3", "mlp:256x3", "mlp:512x3"]


def test_merge_keeps_the_suites_row_order_when_a_part_ran_only_some_rows():
    """A part run with --rows/--engines (here only the sweep's cuda rung 8 row) must not move its rows first."""
    labels = [row.label for row in suites.build("sweep").rows]
    first, last = labels[0], "cuda rung 8 fp16"
    assert labels.index(first) < labels.index(last)
    old = _result([_case(first, "mlp:128x3"), _case(last, "mlp:128x3")])
    new = _result([_case(last, "mlp:128x3")])
    merged, _ = runner.merge(new, old)
    assert [c.label for c in merged.cases] == [first, last]


def test_merge_drops_results_of_another_dataset_or_quick_setting():
    old = _result([_case("jax", "mlp:128x3")])
    assert runner.merge(_result([], dataset="synthetic"), old)[1] == 0
    merged, kept = runner.merge(_result([], quick=True), old)
    assert kept == 0 and merged.cases == []
