"""The Shakespeare speedrun on the CPU, on a tiny budget: the ladder's code path (rungs as config
overrides, fixed-step recipes under the record protocol, warm-up that does not train the measured model,
the verdict over seeds, result files, record.json, the saved model that ``lab eval`` scores exactly as
recorded) and bad input. A tiny model on a learnable toy corpus reaches a loose target in a few steps;
the real target (1.47 on Tiny Shakespeare) is the GPU's job (dev/speedrun/device_record.sh)."""

from __future__ import annotations

import csv
import io
import json
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

    # the saved model (the fastest counted row's median seed) alone gives back its final loss, exactly
    meta = json.loads((ck / "config.json").read_text())
    assert meta["chars"] == corpus.chars and meta["split"]["val_chars"] == len(corpus.val)
    assert meta["eval"]["eval_tokens"] is None and meta["speedrun"]["steps"] == 20
    assert meta["speedrun"]["rung"] == res["fastest"]["name"] == res["saved"]["rung"]
    again = lab_evaluate.evaluate_checkpoint(ck, device="cpu", corpus=corpus)
    assert again["val_loss"] == meta["val_loss"] == res["saved"]["val_loss"] and again["val_loss"] <= TARGET

    # record.json of the fastest counted row, with the whole-process times measured from the shell
    times = [{"rung": res["fastest"]["name"], "cache": "cold", "process_s": 30.0, "rc": 0},
             {"rung": res["fastest"]["name"], "cache": "warm", "process_s": 12.0, "rc": 0},
             {"rung": res["fastest"]["name"], "cache": "warm", "process_s": 99.0, "rc": 1}]
    record = report.record_of(res, times, machine="cpu")
    fastest = next(r for r in res["rows"] if r["name"] == res["fastest"]["name"])["summary"]
    assert record["final_val_losses"] == fastest["final_val_losses"] and record["seeds"] == [0, 1, 2, 3, 4]
    assert (record["process_cold_s"], record["process_warm_s"]) == (30.0, 12.0)
    assert record["train_s"] == fastest["train_s_median"] == res["fastest"]["train_s"]
    assert record["checkpoint"]["path"] == str(ck)
    rp.check_record(record)


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
    times = tmp_path / "process_times.jsonl"
    name = report.load_result(out)["fastest"]["name"]
    times.write_text(json.dumps({"rung": name, "cache": "cold", "process_s": 21.5, "rc": 0}) + "\n")
    machine = tmp_path / "results" / "cpu"
    code, stdout, stderr = run_cli(["lab", "speedrun", "record", str(out), "--out", str(machine),
                                    "--process-times", str(times)], capsys)
    assert code == 0, stderr
    record = rp.read_record(machine / "record.json")
    assert record["process_cold_s"] == 21.5 and record["process_warm_s"] is None and record["steps"] == 20
    assert record["command"].startswith("fasttrain lab speedrun")      # (in-process: sys.argv is pytest's)
    # the README section reads the record against the goals, the process times and a step profile beside them
    (machine / "speedrun.json").write_text((out / "speedrun.json").read_text())
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
    code, _, stderr = run_cli(["lab", "speedrun", "record", str(out), "--out", str(machine),
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
