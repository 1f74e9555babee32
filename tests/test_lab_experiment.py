"""The lab's experiments (``lab/experiments/experiment.py``): rows of overrides of one base configuration, typed by the one
parser of lab settings, every row validated before any row runs, each finished row handed to a callback; and
the experiments that use it (the technique table, the speedrun ladder) taking their overrides through it."""

from __future__ import annotations

import pytest

from fasttrain.errors import FasttrainError
from fasttrain.lab.experiments import experiment
from fasttrain.lab.config import preset
from fasttrain.lab.experiments.experiment import Experiment
from fasttrain.lab.overrides import parse_assignments

BASE = preset("tiny", device="cpu")


# --- the row and its overrides ---------------------------------------------------------------------

def test_overrides_go_through_the_one_parser():
    # the text a flag or --set takes and typed values give the same configuration
    text = Experiment("text", overrides={"learning-rate": "2e-3", "bf16": "true", "eval_tokens": "none",
                                         "lora_target_modules": "qkv,proj", "max_steps": "7", "optim": "sgd"})
    typed = Experiment("typed", overrides={"learning_rate": 2e-3, "bf16": True, "eval_tokens": None,
                                           "lora_target_modules": ("qkv", "proj"), "max_steps": 7, "optim": "sgd"})
    a, b = text.config(BASE), typed.config(BASE)
    assert a == b and a.learning_rate == 2e-3 and a.bf16 is True and a.eval_tokens is None
    assert a.lora_target_modules == ("qkv", "proj") and a.max_steps == 7
    assert text.settings() == {**parse_assignments("learning_rate=2e-3,bf16=true,eval_tokens=none,max_steps=7,"
                                                   "optim=sgd"), "lora_target_modules": ("qkv", "proj")}
    assert Experiment("none").config(BASE) == BASE


@pytest.mark.parametrize("overrides, message", [
    ({"no_such_setting": 1}, "unknown lab setting 'no_such_setting'"),
    ({"bf16": "maybe"}, "--bf16 'maybe': give true or false"),
    ({"max_steps": "ten"}, "--max-steps 'ten': give an integer"),
    ({"optim": "lion"}, "unknown --optim 'lion'"),
    ({"max_steps": 2.5}, "--max-steps 2.5: give an integer"),
])
def test_a_bad_override_is_one_line_naming_the_row(overrides, message):
    with pytest.raises(FasttrainError) as info:
        Experiment("row b", overrides=overrides).config(BASE)
    assert str(info.value).startswith("row b: ") and message in str(info.value) and "\n" not in str(info.value)


def test_seeds_the_row_trains():
    assert Experiment("a", seeds=[5, 9]).seed_list(BASE, repeats=3) == [5, 9]
    assert Experiment("a").seed_list(BASE, repeats=3) == [BASE.seed, BASE.seed + 1, BASE.seed + 2]
    assert Experiment("a").seed_list(BASE) == [BASE.seed]


# --- prepare: every row before any row runs ----------------------------------------------------------

def test_a_bad_override_is_refused_before_any_row_runs():
    rows = [Experiment("good"), Experiment("bad", overrides={"dropout": 1.5}), Experiment("worse", overrides={"x": 1})]
    ran = []
    with pytest.raises(FasttrainError) as info:
        experiment.run(experiment.prepare(rows, BASE), lambda row, cfg: ran.append(row.label))
    assert ran == [] and "\n" not in str(info.value)
    # the parser's refusal comes while building (an unknown setting); validation names its row too
    assert str(info.value).startswith("worse: unknown lab setting 'x'")
    with pytest.raises(FasttrainError, match=r"^bad: --dropout must be in \[0, 1\)"):
        experiment.prepare(rows[:2], BASE)


def test_a_row_that_cannot_run_here_is_refused_naming_every_such_row_or_skipped_with_its_reason():
    rows = [Experiment("cpu"), Experiment("gpu a", gpu_only="needs a CUDA GPU (x)"),
            Experiment("gpu b", gpu_only="needs a CUDA GPU (x)"), Experiment("bad", overrides={"dropout": 1.5})]
    with pytest.raises(FasttrainError, match=r"^gpu a, gpu b: needs a CUDA GPU \(x\)$"):
        experiment.prepare(rows, BASE, cuda=False)
    assert [p.unable for p in experiment.prepare(rows[:3], BASE, cuda=True)] == [None, None, None]
    assert [p.unable for p in experiment.prepare(rows[:3], BASE)] == [None, None, None]     # the device not judged
    prepared = experiment.prepare(rows, BASE, cuda=False, skip=True)
    assert [p.unable is None for p in prepared] == [True, False, False, False]
    assert prepared[3].unable.startswith("--dropout must be in [0, 1)")
    events = []
    results = experiment.run(prepared, lambda row, cfg: f"ran {row.label}",
                             skipped=lambda row, cfg, why: f"skipped {row.label}: {why}",
                             on_row=lambda row, result: events.append(result))
    assert results == events == ["ran cpu", "skipped gpu a: needs a CUDA GPU (x)",
                                 "skipped gpu b: needs a CUDA GPU (x)", "skipped bad: " + prepared[3].unable]
    # without a skipped function, nothing runs
    ran = []
    with pytest.raises(FasttrainError, match="gpu a, gpu b: needs a CUDA GPU"):
        experiment.run(prepared, lambda row, cfg: ran.append(row))
    assert ran == []


def test_the_experiments_config_function_builds_each_row():
    rows = [Experiment("a", overrides={"max_steps": 3}), Experiment("b", overrides={"max_steps": 4})]
    def config(row):
        return row.config(BASE).with_(warmup_steps=row.settings()["max_steps"])

    prepared = experiment.prepare(rows, config=config)
    assert [(p.config.max_steps, p.config.warmup_steps) for p in prepared] == [(3, 3), (4, 4)]
    with pytest.raises(TypeError):
        experiment.prepare(rows)


# --- run: the callback after every row ---------------------------------------------------------------

def test_each_finished_row_reaches_the_callback_before_the_next_runs_and_a_cut_short_run_keeps_them():
    events = []

    def run_one(row, cfg):
        if row.label == "c":
            raise KeyboardInterrupt          # a run cut short
        events.append(("run", row.label, cfg.max_steps))
        return row.label

    rows = [Experiment(label, overrides={"max_steps": n}) for label, n in (("a", 2), ("b", 3), ("c", 4))]
    with pytest.raises(KeyboardInterrupt):
        experiment.run(experiment.prepare(rows, BASE), run_one,
                       on_row=lambda row, result: events.append(("done", result)))
    assert events == [("run", "a", 2), ("done", "a"), ("run", "b", 3), ("done", "b")]


def test_rows_train_through_the_labs_one_trainer(corpus):
    pytest.importorskip("torch")
    from fasttrain.lab import train as lab_train

    rows = [Experiment("base", overrides={"max_steps": "2"}),
            Experiment("sgd", overrides={"max_steps": "2", "optim": "sgd"}, compared_with="base")]
    kept = {}
    records = experiment.run(experiment.prepare(rows, BASE.with_(eval_interval=0, timing_warmup_steps=1), cuda=False),
                             lambda row, cfg: lab_train.run(cfg, corpus=corpus),
                             on_row=lambda row, record: kept.update({row.label: record}))
    assert [r["config"]["optim"] for r in records] == ["adamw_torch", "sgd"]
    assert all(r["config"]["max_steps"] == 2 for r in records) and list(kept) == ["base", "sgd"]


# --- the experiments that use it ------------------------------------------------------------------------

def test_the_technique_tables_rows_are_experiments_typed_by_the_parser():
    from fasttrain.bench import lab as bench_lab

    rows = bench_lab.lab_rows(8)
    assert all(isinstance(r, Experiment) for r in rows)
    assert {r.compared_with for r in rows} == {"baseline", "full fine-tune"}
    base = preset("tiny", **bench_lab.BASELINE)
    text = bench_lab.LabRow("text", "mixed precision", overrides={"bf16": "true", "per_device_train_batch_size": "2"})
    cfg = bench_lab.row_config(base, text, steps=4, warmup=1)
    assert cfg.bf16 is True and cfg.per_device_train_batch_size == 2 and cfg.max_steps == 4 * 5


def test_the_technique_table_refuses_a_bad_override_before_any_row_runs(corpus):
    pytest.importorskip("torch")
    from fasttrain.bench import lab as bench_lab

    ran, saved = [], []
    rows = [bench_lab.LabRow("baseline", "baseline"),
            bench_lab.LabRow("typo", "optimizers", overrides={"optimm": "sgd"})]
    plan = bench_lab.LabPlan("tiny", 2, 1, 1, rows, False, 2, device="cpu")
    with pytest.raises(FasttrainError, match=r"^typo: unknown lab setting 'optimm'"):
        bench_lab.run_lab(plan, corpus=corpus, runner=lambda cfg, **kw: ran.append(cfg), on_case=saved.append)
    assert ran == [] and saved == []


def test_the_ladders_rows_are_experiments_built_through_the_parser():
    from fasttrain.lab.experiments import speedrun as sr

    rows = sr.plan([0, 9], [1, 2], base_preset="tiny", sets={"bf16": "true", "max_steps": "20"},
                   variants=[("lr", {"learning_rate": "2e-3"})])
    assert all(isinstance(r, Experiment) for r in rows)
    assert [r.cfg.bf16 for r in rows] == [True, True, True] and rows[2].cfg.learning_rate == 2e-3
    assert [r.cfg.name for r in rows] == ["baseline", "graph-step", "lr"]
    assert [r.compared_with for r in rows] == [None, "0", "0"]
    assert rows[0].cannot_run(False) is None and "graph-step needs a CUDA GPU" in rows[1].cannot_run(False)
    with pytest.raises(FasttrainError, match=r"^lr: --max-steps 'many': give an integer"):
        sr.plan([0], [1], base_preset="tiny", variants=[("lr", {"max_steps": "many"})])
