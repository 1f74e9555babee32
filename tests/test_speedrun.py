"""The Shakespeare speedrun on the CPU, on a tiny budget: the ladder's code path (rungs as config
overrides, warm-up that does not train the measured model, stopping rules, statistics over seeds,
result files, the saved model that ``lab eval`` scores exactly as recorded) and bad input. A tiny
model on a learnable synthetic corpus reaches a loose target in a few steps; the real target
(1.47 on Tiny Shakespeare) is the GPU's job (dev/device/device_speedrun.sh)."""

from __future__ import annotations

import csv
import io
import json

import pytest

torch = pytest.importorskip("torch")

from tests_support import run_cli  # noqa: E402
from fasttrain.errors import FasttrainError  # noqa: E402
from fasttrain.lab import speedrun as sr  # noqa: E402
from fasttrain.lab import checkpoint as lab_checkpoint  # noqa: E402
from fasttrain.lab import optim as lab_optim  # noqa: E402
from fasttrain.lab import speedrun_report as report  # noqa: E402
from fasttrain.lab import train as lab  # noqa: E402
from fasttrain.lab import evaluate as lab_evaluate  # noqa: E402
from fasttrain.lab.build import make_trainer  # noqa: E402

TARGET = 2.2           # the tiny model reaches it on the synthetic corpus after ~10 steps
SMALL = dict(max_steps=20, eval_interval=5, eval_tokens=512, device="cpu", torch_compile=False)


# --- the ladder's definition -------------------------------------------------------------------

def test_rungs_add_one_change_each_to_the_preset_as_users_run_it():
    rows = sr.plan(list(range(len(sr.LADDER))), [1, 2, 3])
    base = rows[0].cfg
    assert (base.precision, base.attn_implementation, base.optim, base.preload, base.torch_compile) == \
        ("fp32", "eager", "adamw_torch", False, False)
    assert (base.layers, base.width, base.context, base.per_device_train_batch_size, base.dropout, base.max_steps) == \
        (6, 384, 256, 64, 0.2, 5000)
    for prev, row, rung in zip(rows, rows[1:], sr.LADDER[1:]):
        changed = {k for k, v in row.cfg.to_dict().items() if prev.cfg.to_dict()[k] != v} - {"name"}
        assert changed == set(rung.overrides), rung.name
    top = rows[-1].cfg
    assert top.bf16 and top.torch_compile_mode == "reduce-overhead" and top.max_steps == 2000 and top.optim == "muon"


def test_a_gap_in_the_rungs_names_every_change_it_skips():
    rows = sr.plan([0, 3], [1])
    assert rows[1].change.count(" + ") == 2 and "TF32" in rows[1].change and "flash" in rows[1].change


def test_rung_and_seed_parsing():
    assert sr.parse_rungs("0,cuda-graphs,2-3") == [0, 2, 3, 7]
    assert sr.parse_rungs(None) == list(range(len(sr.LADDER)))
    assert sr.parse_seeds("3", 1337) == [1337, 1338, 1339]
    assert sr.parse_seeds("7,", 0) == [7] and sr.parse_seeds("5,1", 0) == [5, 1]
    assert sr.parse_rung_seeds("0=1,4-5=2") == {0: 1, 4: 2, 5: 2}
    rows = sr.plan([0, 4, 7], [1, 2, 3], rung_seeds={4: 2}, baseline_seeds=1)
    assert [r.seeds for r in rows] == [[1], [1, 2], [1, 2, 3]]
    assert sr.parse_assignments("learning_rate=2e-3,bf16=false,eval_tokens=none,max_steps=10") == \
        {"learning_rate": 2e-3, "bf16": False, "eval_tokens": None, "max_steps": 10}


@pytest.mark.parametrize("call,message", [
    (lambda: sr.parse_rungs("0,turbo"), "unknown rung 'turbo'"),
    (lambda: sr.parse_rungs("99"), "unknown rung '99'"),
    (lambda: sr.parse_rungs("3-1"), "unknown rung '3-1'"),
    (lambda: sr.parse_seeds("0", 0), "--seeds '0'"),
    (lambda: sr.parse_seeds("1,1", 0), "distinct"),
    (lambda: sr.parse_seeds("a,b", 0), "--seeds 'a,b'"),
    (lambda: sr.parse_seeds("-1,", 0), "non-negative"),
    (lambda: sr.parse_assignments("no_such_field=1"), "unknown lab setting 'no_such_field'"),
    (lambda: sr.parse_variant("nocolon"), "NAME:FIELD=VALUE"),
    (lambda: sr.plan([0], [1, 2], baseline_seeds=3), "--baseline-seeds must be between 1 and"),
    (lambda: sr.parse_rung_seeds("0=x"), "RUNG=COUNT"),
    (lambda: sr.plan([0, 3], [1, 2], rung_seeds={3: 0}), "--rung-seeds for rung 3 must be between"),
    (lambda: sr.plan([0], [1], sets={"dropout": 1.5}), "--dropout must be in [0, 1)"),
])
def test_bad_input_is_a_one_line_error(call, message):
    with pytest.raises(FasttrainError, match=None) as info:
        call()
    assert message in str(info.value) and "\n" not in str(info.value)


# --- warm-up and the timed run ----------------------------------------------------------------

def test_warm_up_then_reset_trains_exactly_like_a_fresh_model(corpus):
    cfg = sr.plan([0], [5], base_preset="tiny", sets=SMALL)[0].cfg.with_(seed=5)
    fresh = make_trainer(cfg, corpus, torch.device("cpu"))
    a = sr.train_to_target(fresh, target=0.01, max_train_s=0, patience_steps=0)
    warmed = make_trainer(cfg.with_(seed=9), corpus, torch.device("cpu"))
    for x, y in warmed.batches(3):                   # warm-up steps train the parameters ...
        warmed.train_step(x, y)
    params = [p for p in warmed.model.parameters()]
    warmed.reset(5)                                  # ... which go back to seed 5's start, in place
    assert all(p is q for p, q in zip(params, warmed.model.parameters()))
    b = sr.train_to_target(warmed, target=0.01, max_train_s=0, patience_steps=0)
    assert [e["val_loss"] for e in a["evals"]] == [e["val_loss"] for e in b["evals"]]
    assert a["stop"] == "max_steps" and a["steps"] == 20 and not a["reached"]


def test_patience_stops_a_run_that_no_longer_improves(corpus):
    cfg = sr.plan([0], [0], base_preset="tiny", sets=dict(SMALL, learning_rate=1e-3, min_lr=1e-3, warmup_steps=0,
                                                           dropout=0.0))[0].cfg
    trainer = make_trainer(cfg, corpus, torch.device("cpu"))
    rec = sr.train_to_target(trainer, target=0.01, max_train_s=0, patience_steps=5)
    # a new best at every validation: never stopped for patience; the target is out of reach
    assert rec["stop"] == "max_steps" and rec["best_step"] == 20
    losses = iter([3.0, 2.0, 2.5, 2.6, 2.7])
    trainer.reset(0)
    trainer.evaluate = lambda: (next(losses), 512)   # the loss rises after step 10
    rec = sr.train_to_target(trainer, target=0.01, max_train_s=0, patience_steps=10)
    assert rec["stop"] == "over-fitting" and rec["steps"] == 20 and rec["best_step"] == 10


def test_speedups_divide_medians_and_bound_a_row_that_missed():
    def row(counts, p50=None, bound=None, ms=10.0):
        return {"summary": {"counts": counts, "time_to_target_s": {"p50": p50} if counts else None,
                            "missed_train_s": bound, "ms_per_step": {"p50": ms}}}
    assert report.speedup(row(True, 8.0), row(True, 2.0)) == (4.0, False)
    assert report.speedup(row(False, bound=30.0), row(True, 3.0)) == (10.0, True)
    assert report.speedup(row(True, 8.0), row(False)) == (None, False)
    assert report.step_speedup(row(True, 1.0, ms=30.0), row(True, 1.0, ms=10.0)) == 3.0


# --- the whole code path ----------------------------------------------------------------------

def test_ladder_on_a_tiny_budget_writes_results_and_a_checkpoint_lab_eval_reproduces(corpus, tmp_path):
    pytest.importorskip("safetensors")
    rows = sr.plan([0, 3, 10], [0, 1], base_preset="tiny", baseline_seeds=1, sets=SMALL)
    out, ck = tmp_path / "out", tmp_path / "ck"
    res = sr.run_ladder(rows, target=TARGET, corpus=corpus, out=str(out), save=str(ck), max_train_s=60,
                        patience_steps=0)
    assert [r["summary"]["counts"] for r in res["rows"]] == [True, True, True], [r["summary"] for r in res["rows"]]
    for row in res["rows"]:
        for run in row["runs"]:
            assert run["reached"] and run["final_val_loss"] <= TARGET and run["stop"] == "target"
            assert run["time_to_target_s"] == run["evals"][-1]["train_s"] and run["steps_to_target"] % 5 == 0
            assert run["evals"][-1]["tokens"] == 512
        assert row["setup_s"] > 0 and row["warmup_steps"] == 2
    assert len(res["rows"][0]["runs"]) == 1 and len(res["rows"][1]["runs"]) == 2

    # result files: one run record per rung and seed, long CSV with p20/p50/p80, the Markdown ladder
    runs = sorted(p.name for p in (out / "runs").iterdir())
    assert runs == ["00-baseline-seed0.json", "03-sdpa-seed0.json", "03-sdpa-seed1.json", "10-muon-seed0.json",
                    "10-muon-seed1.json"]
    rec = json.loads((out / "runs" / "03-sdpa-seed1.json").read_text())
    assert rec["config"]["seed"] == 1 and rec["config"]["attn_implementation"] == "sdpa" and rec["reached"]
    table = list(csv.DictReader(io.StringIO((out / "speedrun.csv").read_text())))
    tt = [r for r in table if r["metric"] == "time_to_target_s"]
    assert [r["rung"] for r in tt] == ["baseline", "sdpa", "muon"] and tt[1]["n"] == "2"
    assert float(tt[1]["p20"]) <= float(tt[1]["p50"]) <= float(tt[1]["p80"])
    assert {r["metric"] for r in table} >= {"ms_per_step", "steps_to_target", "setup_s", "eval_s", "best_val_loss",
                                            "speedup_vs_baseline"}
    md = (out / "ladder.md").read_text()
    assert f"time to ≤ {TARGET}" in md and "| 3 | sdpa |" in md and "| 10 | muon |" in md and "1/1 †" in md
    assert "fewer seeds" in md and "× baseline" in md and "fasttrain lab eval" in md
    summary = json.loads((out / "speedrun.json").read_text())
    assert summary["fastest"]["name"] == res["fastest"]["name"] and summary["process_wall_s"] > 0

    # the saved model alone gives back the recorded validation loss, exactly
    meta = json.loads((ck / "config.json").read_text())
    assert meta["chars"] == corpus.chars and meta["split"]["val_chars"] == len(corpus.val)
    assert meta["eval"]["eval_batch_size"] == 8 and meta["eval"]["eval_tokens"] == 512
    assert meta["speedrun"]["rung"] == res["fastest"]["name"] == res["saved"]["rung"]
    again = lab_evaluate.evaluate_checkpoint(ck, device="cpu", corpus=corpus)
    assert again["val_loss"] == meta["val_loss"] == res["saved"]["val_loss"] and again["val_loss"] <= TARGET


def test_cli_speedrun_then_lab_eval(fake_corpus, tmp_path, capsys):
    pytest.importorskip("safetensors")
    out, ck = tmp_path / "out", tmp_path / "ck"
    code, stdout, stderr = run_cli(["lab", "speedrun", "--preset", "tiny", "--rungs", "0,bf16", "--seeds", "1",
                                 "--target", str(TARGET), "--set", "max_steps=20,eval_interval=5,eval_tokens=512",
                                 "--device", "cpu", "--variant", "hot:learning_rate=2e-2", "--quiet",
                                 "--out", str(out), "--save", str(ck)], capsys)
    assert code == 0, stderr
    assert "| 2 | bf16 |" in stdout and "| hot | hot |" in stdout and "rung 2 (bf16) with learning_rate=0.02" in stdout
    recorded = json.loads((ck / "config.json").read_text())["val_loss"]
    code, stdout, stderr = run_cli(["lab", "eval", str(ck), "--device", "cpu"], capsys)
    assert code == 0, stderr
    assert f"val loss {recorded:.6f}" in stdout and "(identical)" in stdout
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\n{report.README_START}\nold\n{report.README_END}\n")
    code, _, stderr = run_cli(["lab", "speedrun", "readme", str(out), "--into", str(readme)], capsys)
    assert code == 0, stderr
    text = readme.read_text()
    assert "old" not in text and "fasttrain lab speedrun readme" in text and "| 2 | bf16 |" in text


def test_budget_skips_what_would_start_too_late_and_the_table_says_so(corpus, tmp_path):
    rows = sr.plan([0, 2], [0, 1], base_preset="tiny", sets=SMALL)
    res = sr.run_ladder(rows, target=TARGET, corpus=corpus, budget_s=1e-9, out=str(tmp_path))
    assert [r.get("skipped") for r in res["rows"]] == ["budget", "budget"]
    assert not any(r["summary"]["counts"] for r in res["rows"])
    assert "not run (out of --budget-s)" in (tmp_path / "ladder.md").read_text()


def test_cli_list_shows_every_rung(capsys):
    code, stdout, _ = run_cli(["lab", "speedrun", "--list"], capsys)
    assert code == 0 and all(r.name in stdout for r in sr.LADDER)


@pytest.mark.parametrize("args,message", [
    (["--rungs", "0,warp"], "unknown rung 'warp'"),
    (["--target", "0"], "--target must be a positive number"),
    (["--target", "-1.5"], "--target must be a positive number"),
    (["--seeds", "1,x"], "--seeds '1,x'"),
    (["--seeds", "0"], "--seeds '0'"),
    (["--seeds", "2", "--baseline-seeds", "5"], "--baseline-seeds must be between"),
    (["--set", "warp=9"], "unknown lab setting 'warp'"),
    (["--variant", "v"], "NAME:FIELD=VALUE"),
    (["--patience-steps", "-1"], "--patience-steps must be >= 0"),
])
def test_cli_bad_input_is_one_line_and_writes_nothing(fake_corpus, tmp_path, capsys, args, message):
    out = tmp_path / "out"
    code, _, stderr = run_cli(["lab", "speedrun", "--preset", "tiny", "--device", "cpu", "--quiet", "--out", str(out),
                            *args], capsys)
    assert code == 1
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0], stderr
    assert not out.exists()


def test_cli_save_without_a_counted_rung_says_so_after_the_table(fake_corpus, tmp_path, capsys):
    out, ck = tmp_path / "out", tmp_path / "ck"
    code, stdout, stderr = run_cli(["lab", "speedrun", "--preset", "tiny", "--rungs", "0", "--seeds", "1",
                                 "--target", "0.01", "--set", "max_steps=5,eval_interval=5,eval_tokens=256",
                                 "--device", "cpu", "--quiet", "--out", str(out), "--save", str(ck)], capsys)
    assert code == 1 and stderr.startswith("error: no rung reached 0.01") and stderr.count("\n") == 1
    assert "not reached (max_steps)" in stdout and (out / "ladder.md").exists() and not ck.exists()


def test_readme_of_a_folder_without_results_is_one_line(tmp_path, capsys):
    code, _, stderr = run_cli(["lab", "speedrun", "readme", str(tmp_path)], capsys)
    assert code == 1 and stderr.startswith("error:") and "speedrun.json: no such file" in stderr


# --- the GPU path: compile, CUDA graphs, reset across seeds, exact re-evaluation ------------------

@pytest.mark.gpu
def test_gpu_cuda_graph_rung_reaches_a_loose_target_and_the_checkpoint_reevaluates_exactly(corpus, tmp_path):
    pytest.importorskip("safetensors")
    rows = sr.plan([7, 10], [0, 1], base_preset="tiny",
                   sets=dict(max_steps=40, eval_interval=5, device="cuda", timing_warmup_steps=3))
    assert rows[0].cfg.torch_compile_mode == "reduce-overhead" and rows[0].cfg.bf16
    res = sr.run_ladder(rows, target=TARGET, corpus=corpus, out=str(tmp_path / "out"), save=str(tmp_path / "ck"),
                        max_train_s=60, patience_steps=0)
    assert all(r["summary"]["counts"] for r in res["rows"]), [r.get("error") or r["summary"] for r in res["rows"]]
    meta = json.loads((tmp_path / "ck" / "config.json").read_text())
    assert meta["eval"]["device_type"] == "cuda" and meta["eval"]["bf16"] and meta["eval"]["tf32"]
    again = lab_evaluate.evaluate_checkpoint(tmp_path / "ck", device="cuda", corpus=corpus)
    assert again["val_loss"] == meta["val_loss"]


def test_muon_takes_the_blocks_matrices_and_adamw_the_rest(corpus):
    cfg = sr.plan([10], [0], base_preset="tiny", sets=SMALL)[0].cfg
    trainer = make_trainer(cfg, corpus, torch.device("cpu"))
    muon, adamw = trainer.optimizer.optimizers
    named = dict(trainer.model.named_parameters())
    in_muon = {n for n, p in named.items() if any(p is q for g in muon.param_groups for q in g["params"])}
    assert in_muon == {n for n, p in named.items() if n.startswith("blocks.") and p.dim() == 2}
    assert len(trainer.optimizer.param_groups) == len(muon.param_groups) + len(adamw.param_groups)
    trainer.train_step(*next(trainer.batches(1)))
    assert all(g["lr"] == lab_optim.lr_at(cfg, 0) for g in trainer.optimizer.param_groups)
    rec = lab.run(cfg.with_(max_steps=2, eval_interval=0), corpus=corpus)      # the lab's own loop takes it too
    hidden = sum(p.numel() for n, p in named.items() if n in in_muon)
    rest = sum(p.numel() for n, p in named.items() if n not in in_muon)
    assert rec["memory"]["by_kind"]["optimizer_state"] == 4 * hidden + 8 * rest + 4 * (len(named) - len(in_muon))


def test_merge_joins_invocations_of_different_rungs_into_one_ladder(fake_corpus, tmp_path, capsys):
    """A ladder longer than one device call runs as several invocations; merge orders the rungs, keeps every
    run record, and refuses a rung measured twice or results of another GPU."""
    common = ["--preset", "tiny", "--seeds", "1", "--target", str(TARGET), "--set",
              "max_steps=12,eval_interval=4,eval_tokens=256", "--device", "cpu", "--quiet"]
    for rungs, name in (("2", "b"), ("0", "a")):
        code, _, stderr = run_cli(["lab", "speedrun", "--rungs", rungs, *common, "--out", str(tmp_path / name)], capsys)
        assert code == 0, stderr
    merged = tmp_path / "merged"
    code, stdout, stderr = run_cli(["lab", "speedrun", "merge", str(tmp_path / "b"), str(tmp_path / "a"),
                                    "--out", str(merged)], capsys)
    assert code == 0, stderr
    result = report.load_result(merged)
    assert [r["label"] for r in result["rows"]] == ["0", "2"] and len(result["parts"]) == 2
    assert sorted(p.name for p in (merged / "runs").iterdir()) == sorted(
        [p.name for p in (tmp_path / "a" / "runs").iterdir()] + [p.name for p in (tmp_path / "b" / "runs").iterdir()])
    assert "merged by `fasttrain lab speedrun merge`" in (merged / "ladder.md").read_text()
    code, _, stderr = run_cli(["lab", "speedrun", "merge", str(tmp_path / "a"), str(tmp_path / "a"),
                               "--out", str(tmp_path / "twice")], capsys)
    assert code == 1 and "rung 0 (baseline) is in two of the results" in stderr and not (tmp_path / "twice").exists()
    other = json.loads((tmp_path / "b" / "speedrun.json").read_text())
    other["device"] = "another GPU"
    other["environment"]["gpu"] = {"name": "another GPU"}
    (tmp_path / "b" / "speedrun.json").write_text(json.dumps(other))
    code, _, stderr = run_cli(["lab", "speedrun", "merge", str(tmp_path / "a"), str(tmp_path / "b"),
                               "--out", str(tmp_path / "gpus")], capsys)
    assert code == 1 and "different GPU" in stderr and stderr.count("\n") == 1
    merged_rows = report.load_result(merged)["rows"]
    assert merged_rows[1]["change"] == sr.LADDER[1].change + " + " + sr.LADDER[2].change   # since rung 0, not the preset
    # a rung that --budget-s cut short in one part is completed by the same rung run whole in another
    import shutil

    shutil.copytree(tmp_path / "a", tmp_path / "cut")
    cut = json.loads((tmp_path / "cut" / "speedrun.json").read_text())
    cut["rows"][0]["skipped"] = "budget"
    (tmp_path / "cut" / "speedrun.json").write_text(json.dumps(cut))
    whole = report.merge_results([report.load_result(tmp_path / "cut"), report.load_result(tmp_path / "a")])
    assert [r.get("skipped") for r in whole["rows"]] == [None] and whole["parts"][0]["rungs"] == []
