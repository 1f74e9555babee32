"""The Shakespeare speedrun on the CPU, on a tiny budget: the ladder's code path (rungs as config
overrides, fixed-step recipes under the record protocol, warm-up that does not train the measured model,
the verdict over seeds, result files, record.json, the saved model that ``lab eval`` scores exactly as
recorded) and bad input. A tiny model on a learnable toy corpus reaches a loose target in a few steps;
the real target (1.47 on Tiny Shakespeare) is the GPU's job (dev/speedrun/device_record.sh)."""

from __future__ import annotations

import csv
import io
import json
import math
import statistics
import sys
import shutil

import pytest

torch = pytest.importorskip("torch")

from tests_support import run_cli  # noqa: E402
from fasttrain.errors import FasttrainError  # noqa: E402
from fasttrain.lab.experiments import speedrun as sr  # noqa: E402
from fasttrain.lab import optim as lab_optim  # noqa: E402
from fasttrain.lab.experiments import record_protocol as rp  # noqa: E402
from fasttrain.lab.experiments import speedrun_report as report  # noqa: E402
from fasttrain.lab import train as lab  # noqa: E402
from fasttrain.lab import evaluate as lab_evaluate  # noqa: E402
from fasttrain.lab.build import make_trainer  # noqa: E402

TARGET = 2.6           # every seed of the tiny model ends well below it on the toy corpus after 20 steps
SMALL = dict(max_steps=20, device="cpu", torch_compile=False)


# --- the ladder's definition -------------------------------------------------------------------

def test_rungs_add_one_change_each_to_the_preset_as_users_run_it():
    rows = sr.plan(list(range(len(sr.LADDER))), [1, 2, 3])
    base = rows[0].cfg
    assert (base.precision, base.attn_implementation, base.optim, base.preload, base.torch_compile) == \
        ("fp32", "eager", "adamw_torch", False, False)
    # the preset's shape, its schedule cut to the fixed recipe; every row scores the whole split, validates only
    # at the end (a setting, not a rung)
    assert (base.layers, base.width, base.context, base.per_device_train_batch_size, base.dropout, base.max_steps) == \
        (6, 384, 256, 64, 0.2, sr.RECIPE_STEPS)
    assert all(r.cfg.eval_tokens is None and r.cfg.eval_interval == 0 for r in rows)
    assert "eval-every-50" not in sr.rung_names()
    for prev, row, rung in zip(rows, rows[1:], sr.LADDER[1:]):
        changed = {k for k, v in row.cfg.to_dict().items() if prev.cfg.to_dict()[k] != v} - {"name"}
        assert changed == set(rung.overrides), rung.name
    top = rows[-1].cfg
    assert top.bf16 and top.cuda_graph_step and not top.torch_compile and top.optim == "muon"
    assert sr.plan([7], [1], eval_interval=50)[0].cfg.eval_interval == 50


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
    assert not sr.compiles(rows[1].cfg) and sr.compiles(rows[2].cfg)


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
    (lambda: sr.plan([0], [1], sets={"eval_tokens": 512}), "scores the whole validation split"),
    (lambda: sr.plan([0], [1], variants=[("v", {"eval_tokens": 64})]), "scores the whole validation split"),
    (lambda: sr.plan([0], [1], eval_interval=-5), "--eval-interval must be a non-negative"),
])
def test_bad_input_is_a_one_line_error(call, message):
    with pytest.raises(FasttrainError, match=None) as info:
        call()
    assert message in str(info.value) and "\n" not in str(info.value)


# --- warm-up and the timed run ----------------------------------------------------------------

def test_warm_up_then_reset_trains_exactly_like_a_fresh_model(corpus):
    cfg = sr.plan([0], [5], base_preset="tiny", sets=SMALL)[0].cfg.with_(seed=5)
    fresh = make_trainer(cfg, corpus, torch.device("cpu"))
    a = rp.run_fixed_steps(fresh)
    warmed = make_trainer(cfg.with_(seed=9), corpus, torch.device("cpu"))
    warmed.train(3, evaluate=False)                  # warm-up steps train the parameters ...
    params = [p for p in warmed.model.parameters()]
    warmed.reset(5)                                  # ... which go back to seed 5's start, in place
    assert all(p is q for p, q in zip(params, warmed.model.parameters()))
    b = rp.run_fixed_steps(warmed)
    assert a["final_val_loss"] == b["final_val_loss"] and a["steps"] == b["steps"] == 20
    assert a["final_val_tokens"] == len(corpus.val) - 1


def test_speedups_divide_median_training_times_and_mark_a_row_that_does_not_count():
    def row(counts, train_s, ms=10.0):
        return {"summary": {"counts": counts, "train_s_median": train_s, "ms_per_step": {"p50": ms}}}
    assert report.speedup(row(True, 8.0), row(True, 2.0)) == (4.0, False)
    assert report.speedup(row(False, 30.0), row(True, 3.0)) == (10.0, True)
    assert report.speedup(row(True, 8.0), row(False, None)) == (None, False)
    assert report.step_speedup(row(True, 1.0, ms=30.0), row(True, 1.0, ms=10.0)) == 3.0
    assert report._ratio(10.0, True) == "*10×*" and report._ratio(4.0) == "4×"


# --- the whole code path ----------------------------------------------------------------------

@pytest.mark.slow
def test_ladder_on_a_tiny_budget_writes_results_a_record_and_a_checkpoint_lab_eval_reproduces(corpus, tmp_path):
    pytest.importorskip("safetensors")
    rows = sr.plan([0, 3], [0, 1, 2, 3, 4], base_preset="tiny", baseline_seeds=1, sets=SMALL,
                   variants=[("muon", {"optim": "muon"})], eval_interval=10)
    out, ck = tmp_path / "out", tmp_path / "ck"
    res = sr.run_ladder(rows, target=TARGET, corpus=corpus, out=str(out), save=str(ck))
    s0, s3, sm = (r["summary"] for r in res["rows"])
    # rung 0 ran one seed: measured, but it cannot count; the others count with five
    assert not s0["counts"] and s0["missing"] == "1 seeds; the protocol needs at least 5", s0
    assert s3["counts"] and sm["counts"], (s3, sm)
    for s in (s3, sm):
        assert s["n"] == 5 and s["df"] == 4 and s["mean"] < TARGET and s["p_value"] < 0.05 and s["t"] < 0
        assert s["steps"] == 20 and len(s["final_val_losses"]) == 5
    for row in res["rows"]:
        for run in row["runs"]:
            assert run["steps"] == 20 and [e["step"] for e in run["evals"]] == [10, 20]
            assert run["evals"][-1]["tokens"] == len(corpus.val) - 1 and run["final_val_loss"] == \
                run["evals"][-1]["val_loss"]
        assert row["setup_s"] > 0 and row["warmup_steps"] == 2 and len(row["warmup_ms"]) == 2
    assert [len(r["runs"]) for r in res["rows"]] == [1, 5, 5]

    # result files: one run record per rung and seed, long CSV, the Markdown ladder with the protocol's columns
    runs = sorted(p.name for p in (out / "runs").iterdir())
    assert len(runs) == 11 and "00-baseline-seed0.json" in runs and "v-muon-seed4.json" in runs
    rec = json.loads((out / "runs" / "03-sdpa-seed1.json").read_text())
    assert rec["config"]["seed"] == 1 and rec["config"]["attn_implementation"] == "sdpa" and rec["final_val_loss"]
    table = list(csv.DictReader(io.StringIO((out / "speedrun.csv").read_text())))
    p_rows = [r for r in table if r["metric"] == "p_value"]
    assert [r["rung"] for r in p_rows] == ["sdpa", "muon"] and float(p_rows[0]["p50"]) == s3["p_value"]
    assert {r["metric"] for r in table} >= {"train_s", "ms_per_step", "mean_final_val_loss", "t", "df", "steps",
                                            "final_val_loss_seed4", "first_crossing_s", "setup_s"}
    md = (out / "ladder.md").read_text()
    assert "| 3 | sdpa |" in md and "| muon | muon |" in md and "1/1 †" in md and "**yes**" in md
    assert "no: 1 seeds; the protocol needs at least 5" in md and "one-sided one-sample t-test" in md
    assert "fasttrain lab eval" in md and "final val loss (mean ± sd)" in md
    summary = json.loads((out / "speedrun.json").read_text())
    assert summary["fastest"]["name"] == res["fastest"]["name"] and summary["process_wall_s"] > 0
    # the cold-start profile: the process's age at each milestone, in the order they happen
    ages = [summary["process_phases"][k] for k in ("entered_s", "corpus_loaded_s", "environment_s", "rows_done_s",
                                                   "saved_s")]
    assert ages == sorted(ages) and ages[0] > 0 and ages[-1] == summary["process_wall_s"]

    # the saved model (the fastest counted row's median seed) alone gives back its final loss, exactly
    meta = json.loads((ck / "config.json").read_text())
    assert meta["chars"] == corpus.chars and meta["split"]["val_chars"] == len(corpus.val)
    assert meta["eval"]["eval_tokens"] is None and meta["speedrun"]["steps"] == 20
    assert meta["speedrun"]["rung"] == res["fastest"]["name"] == res["saved"]["rung"]
    again = lab_evaluate.evaluate_checkpoint(ck, device="cpu", corpus=corpus)
    assert again["val_loss"] == meta["val_loss"] == res["saved"]["val_loss"] and again["val_loss"] <= TARGET

    # several rows judged on the same seeds: keeping the fastest is a choice made on them, so no record
    with pytest.raises(FasttrainError, match="not chosen apart from its judging seeds"):
        report.record_of(res, machine="cpu")


@pytest.mark.slow
def test_cli_speedrun_then_lab_eval_then_record(fake_corpus, tmp_path, capsys):
    pytest.importorskip("safetensors")
    out, ck = tmp_path / "out", tmp_path / "ck"
    code, stdout, stderr = run_cli(["lab", "speedrun", "--preset", "tiny", "--rungs", "0,bf16", "--seeds", "5",
                                    "--target", str(TARGET), "--set", "max_steps=20", "--device", "cpu",
                                    "--variant", "hot:learning_rate=2e-2", "--quiet", "--out", str(out),
                                    "--save", str(ck)], capsys)
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
    # the record comes from a search: chosen on seeds 100-101, judged on 0-4, then the process times added
    machine = tmp_path / "results" / "cpu"
    machine.parent.mkdir()
    code, stdout, stderr = run_cli(["lab", "speedrun", "search", "--preset", "tiny", "--recipes", "softcap-zero",
                                    "--steps", "10,20", "--choosing-seeds", "100-101", "--judging-seeds", "0-4",
                                    "--target", "3.5", "--device", "cpu", "--set", "cuda_graph_step=False",
                                    "--quiet", "--out", str(machine), "--save", str(tmp_path / "ck2")], capsys)
    assert code == 0, stderr
    assert "chosen: softcap-zero at 10 steps" in stdout and "counts" in stdout
    name = "softcap-zero"
    times = tmp_path / "process_times.jsonl"
    times.write_text(json.dumps({"rung": name, "cache": "cold", "process_s": 21.5, "rc": 0}) + "\n")
    code, stdout, stderr = run_cli(["lab", "speedrun", "record", str(machine), "--out", str(machine),
                                    "--process-times", str(times)], capsys)
    assert code == 0, stderr
    record = rp.read_record(machine / "record.json")
    assert record["process_cold_s"] == 21.5 and record["process_warm_s"] is None and record["steps"] == 10
    assert record["choosing_seeds"] == [100, 101] and record["judging_seeds"] == [0, 1, 2, 3, 4]
    assert record["command"].startswith("fasttrain lab speedrun")      # (in-process: sys.argv is pytest's)
    # the README section reads the record against the goals, the process times and a step profile beside them
    (machine / "cold").mkdir()
    (machine / "cold" / "process_times.jsonl").write_text(
        json.dumps({"rung": name, "cache": "cold", "process_s": 21.5, "setup_s": 10.0, "train_s": 4.0, "rc": 0}) + "\n")
    (machine / "profile-x.json").write_text(json.dumps({
        "rung": name, "steps": 10, "wall_ms_per_step": 4.0, "gpu_busy_ms_per_step": 3.0, "kernel_launches_per_step": 7,
        "by_family_ms_per_step": {"gemm": 2.0, "attention": 1.0},
        "top_kernels": [{"name": "k1", "ms_per_step": 2.0, "calls_per_step": 3}]}))
    code, section, stderr = run_cli(["lab", "speedrun", "readme", str(machine), "--also", str(out)], capsys)
    assert code == 0, stderr
    train_s = record["train_s"]
    verdict = "met" if train_s <= 5 else f"missed ({train_s / 5:.2f}x the goal)"
    assert f"| training time of the fixed steps (median over seeds) | 5 | {train_s:.2f} | {verdict} |" in section
    assert "| whole process, cold compiler caches | 20 | 21.50 | missed (1.07x the goal) |" in section
    assert "| whole process, warm compiler caches | 12 | - | not measured |" in section
    assert f"| {name} | cold | 21.5 | 10 | 4 | 7.5 |" in section          # rest = process - setup - train
    assert "### Variants measured apart" in section and "| gemm | 2.000 | 67% |" in section
    # each heading once: the variants' ladder sits under "Variants measured apart" without a title of its own
    headings = [line for line in section.splitlines() if line.startswith("#")]
    assert len(headings) == len(set(headings)) and all(h.startswith("### ") for h in headings)
    # written into the results index, its links lead from there into the folders
    index = tmp_path / "results" / "README.md"
    index.write_text(f"# Results\n\n## The Shakespeare speedrun\n\n{report.README_START}\n{report.README_END}\n")
    code, _, stderr = run_cli(["lab", "speedrun", "readme", str(machine), "--also", str(out), "--into", str(index)],
                              capsys)
    assert code == 0, stderr
    text = index.read_text()
    assert "](cpu/record.json)" in text and "](cpu/cold/process_times.jsonl)" in text and "](../out/speedrun.json)" in text
    # two folders of variants: each under a heading that names it
    shutil.copytree(out, tmp_path / "out2")
    code, section, stderr = run_cli(["lab", "speedrun", "readme", str(machine), "--also", str(out), "--also",
                                     str(tmp_path / "out2")], capsys)
    assert code == 0, stderr
    headings = [line for line in section.splitlines() if line.startswith("#")]
    assert len(headings) == len(set(headings)) and f"### Variants measured apart (`{tmp_path / 'out2'}`)" in headings
    assert "the GPU busy 3.00 ms of it (75%)" in section
    times.write_text("not json\n")
    code, _, stderr = run_cli(["lab", "speedrun", "record", str(machine), "--out", str(machine),
                               "--process-times", str(times)], capsys)
    assert code == 1 and "line 1: not JSON" in stderr and stderr.count("\n") == 1


def test_budget_skips_what_would_start_too_late_and_the_table_says_so(corpus, tmp_path):
    rows = sr.plan([0, 2], [0, 1], base_preset="tiny", sets=SMALL)
    res = sr.run_ladder(rows, target=TARGET, corpus=corpus, budget_s=1e-9, out=str(tmp_path))
    assert [r.get("skipped") for r in res["rows"]] == ["budget", "budget"]
    assert not any(r["summary"]["counts"] for r in res["rows"])
    assert "not run (out of --budget-s)" in (tmp_path / "ladder.md").read_text()


def test_a_graph_step_row_on_the_cpu_is_refused_before_any_work(corpus, tmp_path):
    rows = sr.plan([0, 9], [0], base_preset="tiny", sets=SMALL)
    with pytest.raises(FasttrainError, match="graph-step needs a CUDA GPU"):
        sr.run_ladder(rows, target=TARGET, corpus=corpus, out=str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


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
    (["--eval-interval", "-1"], "--eval-interval must be a non-negative"),
    (["--set", "eval_tokens=512"], "scores the whole validation split"),
    (["--compile-cache", "/no/such/folder/cache.bin"], "does not exist; create it first"),
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
    code, stdout, stderr = run_cli(["lab", "speedrun", "--preset", "tiny", "--rungs", "0", "--seeds", "5",
                                    "--target", "0.01", "--set", "max_steps=5", "--device", "cpu", "--quiet",
                                    "--out", str(out), "--save", str(ck)], capsys)
    assert code == 1 and stderr.startswith("error: no row counts") and stderr.count("\n") == 1
    assert "no: mean final validation loss" in stdout and "> 0.01" in stdout
    assert (out / "ladder.md").exists() and not ck.exists()


def test_readme_of_a_folder_without_results_is_one_line(tmp_path, capsys):
    code, _, stderr = run_cli(["lab", "speedrun", "readme", str(tmp_path)], capsys)
    assert code == 1 and stderr.startswith("error:") and "speedrun.json: no such file" in stderr


# --- the GPU path: compile, CUDA graphs, reset across seeds, exact re-evaluation ------------------

@pytest.mark.gpu
def test_gpu_compiled_and_graphed_rows_count_and_the_checkpoint_reevaluates_exactly(corpus, tmp_path):
    """The GPU paths of the ladder on the tiny model: compile with CUDA graphs (reduce-overhead), per-block
    compilation, the whole step as one CUDA graph (AdamW, then Muon), five seeds each on one setup (reset in
    place), the compile cache written, and the saved model re-scored exactly."""
    pytest.importorskip("safetensors")
    rows = sr.plan([7, 8, 9, 10], [0, 1, 2, 3, 4], base_preset="tiny",
                   sets=dict(max_steps=40, device="cuda", timing_warmup_steps=3), eval_interval=10)
    assert rows[0].cfg.torch_compile_mode == "reduce-overhead" and rows[0].cfg.bf16 and rows[2].cfg.cuda_graph_step
    cache = tmp_path / "compile.cache"
    res = sr.run_ladder(rows, target=TARGET, corpus=corpus, out=str(tmp_path / "out"), save=str(tmp_path / "ck"),
                        compile_cache=str(cache))
    assert all(r["summary"]["counts"] for r in res["rows"]), [r.get("error") or r["summary"] for r in res["rows"]]
    assert cache.stat().st_size > 0 and res["rows"][0]["compile_cache"]["saved"]
    for row in res["rows"]:
        finals = row["summary"]["final_val_losses"]
        assert len(set(finals)) == 5, finals                        # five seeds, five different runs
        assert row["summary"]["compile_s"] is not None
    meta = json.loads((tmp_path / "ck" / "config.json").read_text())
    assert meta["eval"]["device_type"] == "cuda" and meta["eval"]["bf16"] and meta["eval"]["tf32"]
    again = lab_evaluate.evaluate_checkpoint(tmp_path / "ck", device="cuda", corpus=corpus)
    assert again["val_loss"] == meta["val_loss"]


@pytest.mark.gpu
def test_gpu_the_graph_step_trains_like_the_eager_step(corpus):
    """One seed, the same recipe, the same initial weights and batches: the captured step's final loss
    equals the eager step's up to the optimizers' rounding (capturable fused AdamW computes its bias
    correction on the device; the tiny preset has no dropout, whose numbers differ under a graph)."""
    from fasttrain.lab.build import make_trainer

    base = sr.plan([5], [0], base_preset="tiny", sets=dict(max_steps=30, device="cuda"))[0].cfg
    graphed = sr.build_trainer(base.with_(cuda_graph_step=True), corpus, torch.device("cuda"))
    graphed.reset()                     # the recipe's own seed: the eager trainer's weights and batches
    eager = make_trainer(base, corpus, torch.device("cuda"))
    a, b = rp.run_fixed_steps(graphed), rp.run_fixed_steps(eager)
    assert abs(a["final_val_loss"] - b["final_val_loss"]) < 0.02, (a["final_val_loss"], b["final_val_loss"])


def test_muon_takes_the_blocks_matrices_and_adamw_the_rest(corpus):
    cfg = sr.plan([10], [0], base_preset="tiny", sets=dict(SMALL, cuda_graph_step=False))[0].cfg
    trainer = make_trainer(cfg, corpus, torch.device("cpu"))
    muon, adamw = trainer.optimizer.optimizers
    named = dict(trainer.model.named_parameters())
    in_muon = {n for n, p in named.items() if any(p is q for g in muon.param_groups for q in g["params"])}
    assert in_muon == {n for n, p in named.items() if n.startswith("blocks.") and p.dim() == 2}
    assert len(trainer.optimizer.param_groups) == len(muon.param_groups) + len(adamw.param_groups)
    trainer.train_step(next(trainer.batches(1)))
    assert all(g["lr"] == lab_optim.lr_at(cfg, 0) for g in trainer.optimizer.param_groups)
    rec = lab.run(cfg.with_(max_steps=2, eval_interval=0), corpus=corpus)      # the lab's own loop takes it too
    hidden = sum(p.numel() for n, p in named.items() if n in in_muon)
    rest = sum(p.numel() for n, p in named.items() if n not in in_muon)
    assert rec["memory"]["by_kind"]["optimizer_state"] == 4 * hidden + 8 * rest + 4 * (len(named) - len(in_muon))


@pytest.mark.slow
def test_merge_joins_invocations_of_different_rungs_into_one_ladder(fake_corpus, tmp_path, capsys):
    """A ladder longer than one device call runs as several invocations; merge orders the rungs, keeps every
    run record, and refuses a rung measured twice or results of another GPU."""
    common = ["--preset", "tiny", "--seeds", "1", "--target", str(TARGET), "--set", "max_steps=12", "--eval-interval",
              "4", "--device", "cpu", "--quiet"]
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


@pytest.mark.parametrize("same", [False, True])
def test_cli_save_into_a_folder_of_other_files_is_refused_before_any_rung(fake_corpus, tmp_path, capsys, monkeypatch,
                                                                          same):
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "notes.txt").write_text("precious")
    monkeypatch.setattr(sr, "run_row", lambda *a, **k: pytest.fail("a rung ran"))
    out = victim if same else tmp_path / "out"
    code, _, stderr = run_cli(["lab", "speedrun", "--preset", "tiny", "--rungs", "0", "--seeds", "1", "--device", "cpu",
                               "--quiet", "--out", str(out), "--save", str(victim)], capsys)
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert code == 1 and len(lines) == 1 and "the folder holds other files (notes.txt)" in lines[0], stderr
    assert [p.name for p in victim.iterdir()] == ["notes.txt"] and (victim / "notes.txt").read_text() == "precious"


def test_progress_hears_the_start_and_every_seed_after_its_run(fake_corpus):
    """The bar moves between runs only (a call inside the timed steps would add host work to them)."""
    rows = sr.plan([0], [0, 1], base_preset="tiny", sets=dict(SMALL))
    calls = []

    class Recorder:
        takes_loss = True

        def __call__(self, step, total, loss=None):
            calls.append((step, total, loss))
    result = sr.run_ladder(rows, progress=Recorder())
    finals = [r["final_val_loss"] for r in result["rows"][0]["runs"]]
    assert calls == [(0, 2, None), (1, 2, finals[0]), (2, 2, finals[1])]


# --- round three: choose on some seeds, judge on others, confirm on fresh ones --------------------------

from fasttrain.lab.experiments import speedrun_search as choosing  # noqa: E402

ENDS = {800: 1.475, 950: 1.466, 1100: 1.461, 1250: 1.458, 1400: 1.455}     # a recipe's mean final loss by steps


def _fake_probe(ends, calls, spread=0.002, ms=7.0):
    def probe(steps):
        calls.append(steps)
        m = ends[steps]
        return {"final_val_losses": [m - spread, m, m + spread], "train_s": steps * ms / 1e3}
    return probe


def test_the_step_search_bisects_to_the_shortest_count_that_ends_below_the_target_with_margin():
    calls = []
    found = choosing.search_steps(_fake_probe(ENDS, calls), list(ENDS), target=1.47, margin=0.008)
    # 1.461 <= 1.47 - 0.008 = 1.462 first at 1,100; 950's 1.466 is below the target but inside the margin
    assert found["steps"] == 1100 and found["train_s"] == pytest.approx(7.7)
    assert calls == [1100, 800, 950] and [p["passes"] for p in found["probes"]] == [True, False, False]
    assert found["probes"][0]["mean"] == pytest.approx(1.461) and found["margin"] == 0.008
    # no margin: 950 counts; a margin nothing meets: no steps, every probe recorded
    assert choosing.search_steps(_fake_probe(ENDS, []), list(ENDS), target=1.47, margin=0.0)["steps"] == 950
    calls = []
    none = choosing.search_steps(_fake_probe(ENDS, calls), list(ENDS), target=1.47, margin=0.02)
    assert none["steps"] is None and none["train_s"] is None and calls == [1100, 1250, 1400]
    assert found["monotone"] and none["monotone"]


def test_a_loss_that_rises_with_the_steps_is_said():
    """The H100's dropout-0.1 recipe on seeds 2000-2004: 1.4587 at 1,400 steps, 1.4628 at 1,550."""
    ends, calls, lines = {1250: 1.4600, 1400: 1.4587, 1550: 1.4628}, [], []
    recipe = choosing.Recipe("drop-0.1", "", {}, tuple(ends))
    result = choosing.choose([recipe], lambda r, steps: _fake_probe(ends, calls)(steps), target=1.47,
                             margin=0.012, log=lines.append)
    (searched,) = result["recipes"]
    assert calls == [1400, 1550] and searched["steps"] is None and searched["monotone"] is False
    assert "a longer probe ended higher than a shorter one (1400: 1.4587, 1550: 1.4628)" in lines[-1]


def test_a_probe_with_a_seed_that_did_not_finish_does_not_pass():
    assert choosing.passes([1.40, 1.41], target=1.47, margin=0.008) == (True, 0.008)
    assert choosing.passes([1.40, None], target=1.47, margin=0.008) == (False, None)
    assert choosing.passes([1.40, float("nan")], target=1.47, margin=0.008) == (False, None)
    with pytest.raises(FasttrainError, match="positive step counts"):
        choosing.search_steps(lambda s: {}, [0, 10])


def test_a_timed_process_is_cut_at_its_milestones_into_parts_that_add_up():
    # the H100's warm wd-0.5 process (cold_start.sh's line)
    t = {"rung": "wd-0.5", "cache": "warm", "process_s": 24.195, "rc": 0, "setup_s": 5.97, "train_s": 9.504,
         "phases": {"entered_s": 0.63, "corpus_loaded_s": 4.15, "environment_s": 4.2, "rows_done_s": 22.9,
                    "saved_s": 22.9, "build_s": 5.677, "warmup_steps_s": 0.0244, "warmup_eval_s": 0.2583,
                    "train_s": 9.5039, "final_eval_s": 0.025}}
    parts = report.process_parts(t)
    assert list(parts) == list(report.PROCESS_PARTS) and sum(parts.values()) == pytest.approx(24.195)
    assert parts["imports_data"] == pytest.approx(3.52) and parts["exit"] == pytest.approx(1.295)
    assert parts["rest_of_row"] == pytest.approx(22.9 - 4.15 - 5.677 - 0.2827 - 9.5039)
    md = report.process_markdown([t, {"rung": "startup", "cache": "import-torch", "process_s": 4.6, "rc": 0,
                                      "setup_s": None, "train_s": None, "phases": None}])
    assert "| wd-0.5 | warm | 0.63 | 3.52 | 5.68 | 0.283 | 9.5 |" in md and md.count("| startup |") == 1


def test_the_auto_margin_is_the_verdicts_line_plus_two_standard_errors_of_the_choosing_mean():
    from scipy import stats

    # like the H100's wd-0.5 at 1,250 steps on choosing seeds 2000-2004 (mean 1.4587, sd 0.0055)
    losses = [1.4515, 1.4605, 1.4665, 1.4555, 1.4595]
    sd = statistics.stdev(losses)
    for n_j in (5, 10):
        want = stats.t.ppf(0.99, n_j - 1) * sd / math.sqrt(n_j) + 2 * sd / math.sqrt(5)
        assert choosing.auto_margin(losses, n_j) == pytest.approx(want)
    # with 5 judging seeds this spread needs a mean <= 1.4555; with 10, <= 1.4599: the mean 1.4587 passes then only
    assert choosing.passes(losses, target=1.47, margin="auto", judging_n=5)[0] is False
    ok, used = choosing.passes(losses, target=1.47, margin="auto", judging_n=10)
    assert ok and used == pytest.approx(choosing.auto_margin(losses, 10))
    # a wider spread asks more of the same mean
    wide = [1.4500, 1.4620, 1.4700, 1.4520, 1.4595]     # sd 0.0081
    assert statistics.fmean(wide) == pytest.approx(statistics.fmean(losses))
    assert choosing.passes(wide, target=1.47, margin="auto", judging_n=10)[0] is False
    assert choosing.parse_margin("auto") == "auto" and choosing.parse_margin("0.01") == 0.01
    # without scipy the auto margin is one line naming the extra, as the t-test's is
    with pytest.MonkeyPatch.context() as patched:
        patched.setitem(sys.modules, "scipy", None)
        with pytest.raises(FasttrainError, match="scipy .* is not installed"):
            choosing.auto_margin(losses, 10)
    for bad in ("-0.1", "nan", "lots", None):
        with pytest.raises(FasttrainError, match="--margin must be auto or a non-negative number"):
            choosing.parse_margin(bad)


def test_choosing_keeps_the_recipe_whose_chosen_steps_train_fastest():
    slow_step = choosing.Recipe("slow-step", "", {}, (800, 950, 1100))          # 1,100 steps at 7 ms: 7.7 s
    fast_step = choosing.Recipe("fast-step", "", {}, (1100, 1250, 1400))        # 1,100 steps at 5 ms: 5.5 s
    hopeless = choosing.Recipe("hopeless", "", {}, (800, 950))
    ms = {"slow-step": 7.0, "fast-step": 5.0, "hopeless": 1.0}
    calls = []

    def probe(recipe, steps):
        if recipe.name == "hopeless":
            return {"final_val_losses": [1.5, 1.51], "train_s": 0.1}
        return _fake_probe(ENDS, calls, ms=ms[recipe.name])(steps)

    picked = choosing.choose([slow_step, fast_step, hopeless], probe, target=1.47, margin=0.008)
    assert picked["chosen"] == "fast-step" and picked["steps"] == 1100
    assert [r["steps"] for r in picked["recipes"]] == [1100, 1100, None]


def test_choosing_and_judging_seeds_are_disjoint_and_enough_before_any_work():
    assert choosing.parse_seed_list("2000-2002,7", "--choosing-seeds") == [2000, 2001, 2002, 7]
    for text in ("", "1,1", "a-b", "-3"):
        with pytest.raises(FasttrainError, match="distinct non-negative"):
            choosing.parse_seed_list(text, "--judging-seeds")
    with pytest.raises(FasttrainError, match=r"seeds \[3\] are both choosing and judging"):
        choosing.check_seeds([3, 9], [1, 2, 3, 4, 5])
    with pytest.raises(FasttrainError, match="at least 5"):
        choosing.check_seeds([8, 9], [1, 2, 3, 4])
    with pytest.raises(FasttrainError, match="at least 2"):
        choosing.check_seeds([9], [1, 2, 3, 4, 5])
    with pytest.raises(FasttrainError, match="use names from"):
        choosing.parse_recipes("softcap-zero,nope")


def test_every_recipe_is_the_graph_step_rung_with_the_task_kept():
    for recipe in choosing.RECIPES:
        cfg = sr.recipe_row(recipe, recipe.steps[0], [1, 2]).cfg
        assert cfg.cuda_graph_step and not cfg.torch_compile and cfg.max_steps == recipe.steps[0]
        assert cfg.eval_tokens is None and cfg.context == 256 and cfg.train_file is None and cfg.tokenizer is None
        assert list(recipe.steps) == sorted(set(recipe.steps))
        assert sr.user_command(cfg).startswith("fasttrain lab speedrun --rungs graph-step --seeds 1")
        assert f"max_steps={recipe.steps[0]}" in sr.user_sets(cfg)


SEARCH_SETS = dict(cuda_graph_step=False)


@pytest.mark.slow
def test_search_judges_the_chosen_recipe_on_its_own_seeds_and_confirm_reruns_it_on_fresh_ones(fake_corpus, tmp_path,
                                                                                              monkeypatch):
    pytest.importorskip("safetensors")
    from fasttrain.lab.data import corpus_from_text

    recipes = [choosing.Recipe("a", "first", dict(learning_rate=3e-3), (10, 20)),
               choosing.Recipe("b", "second", {}, (10, 20))]
    out = tmp_path / "cpu"
    # a loose target: either recipe (the faster one is chosen, by measured time) ends far below it at 10 steps
    res = sr.run_search(recipes, [100, 101], [0, 1, 2, 3, 4], target=3.5, out=str(out),
                            save=str(tmp_path / "ck"), base_preset="tiny", sets=SEARCH_SETS, device="cpu",
                            command="fasttrain lab speedrun search ...", machine="cpu")
    s = res["search"]
    assert s["choosing_seeds"] == [100, 101] and s["judging_seeds"] == [0, 1, 2, 3, 4]
    assert s["chosen"] in ("a", "b") and s["steps"] == 10
    # the probes ran the choosing seeds only; the one judged row ran the judging seeds only
    judged = res["rows"]
    assert len(judged) == 1 and [r["seed"] for r in judged[0]["runs"]] == [0, 1, 2, 3, 4]
    assert judged[0]["config"]["max_steps"] == s["steps"] and judged[0]["name"] == s["chosen"]
    rec = rp.read_record(out / "record.json")
    assert rec["choosing_seeds"] == [100, 101] and rec["seeds"] == rec["judging_seeds"] == [0, 1, 2, 3, 4]
    assert rec["confirmation"] is None and rec["config"]["max_steps"] == rec["steps"] == s["steps"]
    assert rec["search"][0]["probes"] and rec["margin"] == choosing.MARGIN
    assert json.loads((out / "search.json").read_text())["chosen"] == s["chosen"]
    assert (out / "speedrun.json").is_file() and (tmp_path / "ck" / "config.json").is_file()

    # a seed that judged it is refused before any training
    import fasttrain.lab.experiments.speedrun as speedrun_module

    with monkeypatch.context() as patched:
        patched.setattr(speedrun_module, "run_row", lambda *a, **k: pytest.fail("trained"))
        with pytest.raises(FasttrainError, match=r"seeds \[4\] already chose, judged or confirmed"):
            sr.confirm_record(out / "record.json", seeds=[4, 5, 6, 7, 8], device="cpu")
        # another corpus than the one the record was judged on is refused too
        with pytest.raises(FasttrainError, match="not the corpus the record was judged on"):
            sr.confirm_record(out / "record.json", device="cpu", corpus=corpus_from_text("abc " * 5000))
    before = (out / "record.json").read_text()

    # confirm: the next unused seeds (after 101), the verdict over them written into the record
    conf = sr.confirm_record(out / "record.json", device="cpu", command="fasttrain lab speedrun confirm x")
    assert conf["seeds"] == [102, 103, 104, 105, 106] and conf["holds"] and conf["p_value"] < 0.01, conf
    again = rp.read_record(out / "record.json")
    assert again["confirmation"]["seeds"] == conf["seeds"] and again["confirmation"]["train_s"] > 0
    assert {k: v for k, v in again.items() if k != "confirmation"} == \
        {k: v for k, v in json.loads(before).items() if k != "confirmation"}
    assert "the record holds" in sr.confirmation_line(conf)



def test_cli_confirm_bad_input_is_one_line(fake_corpus, tmp_path, capsys):
    code, _, stderr = run_cli(["lab", "speedrun", "confirm", str(tmp_path / "none.json")], capsys)
    assert code == 1 and stderr.count("\n") == 1 and "none.json" in stderr
    old = tmp_path / "record.json"
    old.write_text(json.dumps({"steps": 1550, "seeds": [1, 2, 3, 4, 5]}))
    code, _, stderr = run_cli(["lab", "speedrun", "confirm", str(old)], capsys)
    assert code == 1 and "lacks" in stderr and "earlier protocol" in stderr and stderr.count("\n") == 1
    code, _, stderr = run_cli(["lab", "speedrun", "search", "--choosing-seeds", "1-2", "--judging-seeds", "2-6",
                               "--out", str(tmp_path / "o")], capsys)
    assert code == 1 and "both choosing and judging" in stderr and not (tmp_path / "o").exists()


@pytest.mark.gpu
def test_gpu_a_graph_step_recipe_is_searched_judged_and_confirmed_in_a_second_call(corpus, tmp_path):
    """The device's path on the tiny model: the recipes' own rung (the whole step as one CUDA graph), chosen on
    two seeds, judged on five others, then confirmed on five fresh ones from the written record."""
    pytest.importorskip("safetensors")
    recipe = choosing.Recipe("tiny-graph", "the tiny model, graph step", dict(logit_softcap=30.0), (20, 40))
    out = tmp_path / "gpu"
    res = sr.run_search([recipe], [100, 101], [0, 1, 2, 3, 4], target=TARGET, out=str(out), corpus=corpus,
                        save=str(tmp_path / "ck"), base_preset="tiny", device="cuda")
    assert res["rows"][0]["config"]["cuda_graph_step"] and res["record"] is not None, res["search"]
    conf = sr.confirm_record(out / "record.json", corpus=corpus)
    assert conf["holds"] and conf["seeds"] == [102, 103, 104, 105, 106]
    assert rp.read_record(out / "record.json")["confirmation"]["seeds"] == conf["seeds"]


def test_writing_the_record_again_keeps_the_confirmation_of_the_same_recipe_only(tmp_path):
    base = {"steps": 10, "config": {"max_steps": 10}, "judging_seeds": [0, 1, 2, 3, 4], "choosing_seeds": [7, 8]}
    (tmp_path / "record.json").write_text(json.dumps(dict(base, confirmation={"seeds": [9], "holds": True})))
    assert report.kept_confirmation(tmp_path / "record.json", dict(base)) == {"seeds": [9], "holds": True}
    assert report.kept_confirmation(tmp_path / "record.json", dict(base, steps=20)) is None
    assert report.kept_confirmation(tmp_path / "record.json", dict(base, judging_seeds=[0, 1, 2, 3, 5])) is None
    assert report.kept_confirmation(tmp_path / "none.json", dict(base)) is None
