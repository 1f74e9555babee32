"""The scaling sweep's rows and runner on the CPU (``lab/experiments/scaling.py``): every run an experiment row (overrides of
its preset, passed as the lab's flags; the launcher's flags apart), every configuration checked before any
process starts, and the sweep's status written after every run. No process is started but the few that
test the session runner itself: ``run_in_session`` is replaced by one that records the command lines (the GPU
runs are ``fasttrain lab dist sweep`` on the device). A transformers model as the base (``-- --model hf:...``),
several GPU counts, the time limit and ``--skip-done`` too."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fasttrain.errors import FasttrainError
from fasttrain.lab.experiments import scaling
from fasttrain.lab.experiments.experiment import Experiment


def test_every_run_is_an_experiment_whose_overrides_are_its_flags(tmp_path):
    runs = scaling.plan(["tiny"], 2, 3, ["ddp", "fsdp-zero2"], extra=["--device", "cpu"])
    assert [r.name for r in runs] == ["tiny.1gpu", "tiny.ddp", "tiny.fsdp-zero2", "tiny.ddp-weak", "tiny.1gpu-bf16",
                                      "tiny.fsdp-zero3-bf16"]
    assert all(isinstance(r, Experiment) for r in runs)
    assert [r.compared_with for r in runs] == [None, "1gpu", "1gpu", "1gpu", None, "1gpu-bf16"]
    by = {r.label: r for r in runs}
    argv = scaling.command_line(by["fsdp-zero3-bf16"], tmp_path)
    assert argv[1:4] == ["-m", "fasttrain", "lab"] and argv[-2:] == ["--nproc-per-node", "2"]
    line = " ".join(argv[4:])
    for flag in ("--preset tiny", "--max-steps 3", "--dropout 0 ", "--eval-interval 0", "--log-interval 1",
                 "--timing-warmup-steps 5", "--bf16", "--strategy fsdp --global-batch-size 8", "--quiet",
                 "--device cpu", f"--out {tmp_path / 'tiny.fsdp-zero3-bf16.json'}"):
        assert flag in line, flag
    assert "--per-device-train-batch-size" not in line and "--eval-tokens" not in line     # tiny sets them
    one = scaling.command_line(by["1gpu"], tmp_path)
    assert "--per-device-train-batch-size" in one and "--nproc-per-node" not in one and "--bf16" not in one
    assert scaling.run_config(by["1gpu-bf16"]).bf16 and scaling.run_config(by["1gpu"]).dropout == 0.0
    # shakespeare-char validates on its whole split: the sweep's runs score 65536 tokens instead
    assert "--eval-tokens 65536" in " ".join(scaling.command_line(scaling.plan(["shakespeare-char"], 2, 3, ["ddp"])[0],
                                                                  tmp_path))


def test_a_run_that_cannot_run_is_refused_before_any_process(tmp_path, monkeypatch):
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: pytest.fail("a process started"))
    with pytest.raises(FasttrainError, match=r"^tiny\.1gpu, tiny\.ddp.*: --max-steps must be"):
        scaling.plan(["tiny"], 2, 0, ["ddp"])
    bad = scaling.Planned("1gpu", "tiny", 1, overrides={"dropout": 2.0})
    with pytest.raises(FasttrainError, match=r"^tiny\.1gpu: --dropout must be in \[0, 1\)"):
        scaling.sweep([bad], tmp_path / "out", log=lambda line: None)
    assert not (tmp_path / "out").exists()


def test_the_sweep_writes_its_status_after_every_run(tmp_path, monkeypatch):
    """A sweep cut short (a time limit, Ctrl-C) keeps the status of the runs it finished."""
    started = []

    def fake_run(argv, env, timeout_s):
        started.append(argv)
        if len(started) == 3:
            raise KeyboardInterrupt
        return 0 if len(started) == 1 else 1, "", "one line\nlast line\n"

    monkeypatch.setattr(scaling, "run_in_session", fake_run)
    runs = scaling.plan(["tiny"], 2, 3, ["ddp"], bf16=False, extra=["--device", "cpu"])
    lines = []
    with pytest.raises(KeyboardInterrupt):
        scaling.sweep(runs, tmp_path, log=lines.append)
    status = json.loads((tmp_path / "sweep.json").read_text())
    assert [(s["name"], s["exit"], s["error"]) for s in status] == [("tiny.1gpu", 0, None),
                                                                    ("tiny.ddp", 1, "last line")]
    assert status[1]["argv"] == started[1][1:]
    assert lines[0].startswith("[1/3] tiny.1gpu: -m fasttrain lab --preset tiny") and lines[1].startswith("    ok")
    assert lines[3].startswith("    FAILED: last line") and lines[4].startswith("[3/3] tiny.ddp-weak")


def test_lab_dist_is_the_scaling_experiments_command():
    # `fasttrain lab dist` lives with the experiment it runs: the launcher below it (parallel/launch.py) has no
    # command of its own and imports no experiment (tests/test_imports.py keeps the floors)
    from fasttrain.lab.cli import command
    from fasttrain.lab.parallel import launch

    assert set(command.commands["dist"].commands) == {"sweep", "report"}
    assert set(scaling.command.commands) == {"sweep", "report"}
    with pytest.raises(AttributeError):
        launch.command


# --- a transformers model as the base, several GPU counts ----------------------------------------

def _hf_base(tmp_path, batch=4, heads=4, kv_heads=2) -> list[str]:
    """A tiny Llama's config.json (no weights, no transformers needed) and its token files, as lab flags."""
    import numpy as np

    folder = tmp_path / "tiny-llama"
    (folder / "model").mkdir(parents=True, exist_ok=True)
    (folder / "model" / "config.json").write_text(json.dumps(dict(
        model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=256, hidden_size=32, intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=64,
        tie_word_embeddings=False, rms_norm_eps=1e-6)))
    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        rng.integers(0, 256, size=4096).astype(np.uint16).tofile(folder / f"{split}.bin")
    return ["--model", f"hf:{folder / 'model'}", "--train-bin", str(folder / "train.bin"), "--val-bin",
            str(folder / "val.bin"), "--bin-dtype", "uint16", "--context", "32", "--per-device-train-batch-size",
            str(batch), "--learning-rate", "3e-4", "--bf16", "--attn-implementation", "sdpa"]


def _sweep_cli(args):
    from click.testing import CliRunner

    return CliRunner().invoke(scaling.command, ["sweep", *args])


def test_a_transformers_model_over_several_gpu_counts_plans_both_batches(tmp_path):
    from fasttrain.lab.overrides import settings_from_flags

    base = settings_from_flags(_hf_base(tmp_path, kv_heads=4))
    runs = scaling.plan([], [2, 4], 7, ["ddp", "fsdp-zero3", "tp"], weak=["ddp", "fsdp-zero3"], base=base,
                        name="tiny-llama", warmup=3)
    assert [r.label for r in runs] == [
        "1gpu", "2gpu-ddp", "2gpu-fsdp-zero3", "2gpu-tp", "2gpu-ddp-weak", "2gpu-fsdp-zero3-weak",
        "4gpu-ddp", "4gpu-fsdp-zero3", "4gpu-tp", "4gpu-ddp-weak", "4gpu-fsdp-zero3-weak"]     # bf16 already: no -bf16 rows
    by = {r.label: r for r in runs}
    line = " ".join(scaling.command_line(by["4gpu-fsdp-zero3"], tmp_path))
    assert "--preset" not in line and "--model hf:" in line and "--bin-dtype uint16" in line
    # the global batch sets each rank's micro-batch: the base's own beside it would be refused as a contradiction
    assert "--per-device-train-batch-size" not in line
    for flag in ("--max-steps 7", "--timing-warmup-steps 3", "--dropout 0", "--strategy fsdp --global-batch-size 4",
                 "--nproc-per-node 4", f"--out {tmp_path / 'tiny-llama.4gpu-fsdp-zero3.json'}"):
        assert flag in line, flag
    weak = " ".join(scaling.command_line(by["2gpu-ddp-weak"], tmp_path))
    assert "--per-device-train-batch-size 4" in weak and "--global-batch-size" not in weak
    cfg = scaling.run_config(by["4gpu-ddp"])
    assert cfg.model.startswith("hf:") and cfg.bf16 and cfg.max_steps == 7 and cfg.context == 32


def test_bad_sweep_inputs_are_one_line_before_any_run(tmp_path, monkeypatch):
    monkeypatch.setattr(scaling, "run_in_session", lambda *a, **k: pytest.fail("a run started"))
    out = tmp_path / "out"
    # a batch that does not split over N: the run named, before any starts (a dry run too)
    result = _sweep_cli(["--out", str(out), "--device", "cpu", "--dry-run", "--nproc-per-node", "2,4",
                         "--strategies", "ddp", "--", *_hf_base(tmp_path, batch=2)])
    assert result.exit_code != 0 and isinstance(result.exception, FasttrainError)
    assert str(result.exception).startswith("tiny-llama.4gpu-ddp: --global-batch-size 2 does not split over 4")
    # heads that do not split over a tensor-parallel group of 4 (4 key/value heads of ... 2)
    result = _sweep_cli(["--out", str(out), "--device", "cpu", "--dry-run", "--nproc-per-node", "4",
                         "--strategies", "tp", "--", *_hf_base(tmp_path)])
    assert str(result.exception).startswith("tiny-llama.tp: ") and "4" in str(result.exception), result.output
    # more GPUs than the machine has (none here)
    monkeypatch.setattr("fasttrain.lab.parallel.launch.gpu_count", lambda: 2)
    result = _sweep_cli(["--out", str(out), "--nproc-per-node", "2,4", "--strategies", "ddp", "--",
                         *_hf_base(tmp_path)])
    assert "needs 4 GPUs; this machine has 2" in str(result.exception), result.output
    for args, message in (
            (["--nproc-per-node", "2,x"], "--nproc-per-node must be a count"),
            (["--nproc-per-node", "2,1"], "--nproc-per-node must be at least 2"),
            (["--nproc-per-node", "2,2"], "a count is named twice"),
            (["--weak", "zero1"], "--weak: 'zero1' is not among --strategies"),
            (["--presets", "tiny"], "--presets and --model hf:... name the sweep's base twice"),
            (["--time-limit", "0"], "--time-limit must be a positive number"),
            (["--name", "a.b"], "--name 'a.b': letters, digits"),
            (["--", "--max-steps", "3"], "--max-steps is the sweep's own option"),
            (["--", "--out", "x.json"], "unknown lab setting 'out'")):
        lab = [] if "--" in args else ["--"]
        result = _sweep_cli(["--out", str(out), "--device", "cpu", "--dry-run", "--strategies", "ddp", *args, *lab,
                             *_hf_base(tmp_path)])
        assert result.exit_code != 0 and message in str(result.exception), (args, result.output, result.exception)
    assert not out.exists()


def test_a_dry_run_of_a_transformers_model_names_it_by_its_folder(tmp_path):
    result = _sweep_cli(["--out", str(tmp_path / "o"), "--device", "cpu", "--dry-run", "--nproc-per-node", "2",
                         "--strategies", "ddp,zero1", "--weak", "all", "--no-strong", "--max-steps", "4", "--",
                         *_hf_base(tmp_path)])
    assert result.exit_code == 0, result.output
    lines = result.output.strip().splitlines()
    assert "dry run: 3 runs planned, none started" in lines[-1]
    assert [line.rsplit("--out ", 1)[1].split()[0].rsplit("/", 1)[1] for line in lines[:-1]] == [
        "tiny-llama.1gpu.json", "tiny-llama.ddp-weak.json", "tiny-llama.zero1-weak.json"]


def test_the_time_limit_starts_no_run_the_time_left_cannot_hold(tmp_path, monkeypatch):
    """The longest run so far of a process count is the estimate of the next; runs not started are recorded."""
    clock = [0.0]
    monkeypatch.setattr(scaling.time, "monotonic", lambda: clock[0])
    took = {1: 20.0, 2: 50.0}

    def fake_run(argv, env, timeout_s):
        n = int(argv[argv.index("--nproc-per-node") + 1]) if "--nproc-per-node" in argv else 1
        assert timeout_s <= 100 - clock[0]          # no run outlives the limit
        clock[0] += took[n]
        return 0, "", ""

    monkeypatch.setattr(scaling, "run_in_session", fake_run)
    runs = scaling.plan(["tiny"], 2, 3, ["ddp", "zero1", "fsdp-zero3"], bf16=False, weak=(),
                        extra=["--device", "cpu"])
    status = scaling.sweep(runs, tmp_path, log=lambda line: None, time_limit_s=100)
    # 1gpu (20 s), ddp (50 s): 30 s left < 50 s, the longest 2-process run
    assert [(s["label"], s["exit"]) for s in status] == [("1gpu", 0), ("ddp", 0), ("zero1", None),
                                                         ("fsdp-zero3", None)]
    assert "30 s left" in status[2]["skipped"]
    assert json.loads((tmp_path / "sweep.json").read_text())[3]["exit"] is None


def test_skip_done_keeps_the_runs_whose_records_are_there(tmp_path, monkeypatch):
    started = []
    monkeypatch.setattr(scaling, "run_in_session", lambda argv, env, t: (started.append(argv), (0, "", ""))[1])
    (tmp_path / "tiny.1gpu.json").write_text(json.dumps({"kind": "lab-run", "tokens_per_s": 10.0}))
    (tmp_path / "tiny.ddp.json").write_text(json.dumps({"kind": "lab-run", "tokens_per_s": None}))   # failed
    runs = scaling.plan(["tiny"], 2, 3, ["ddp"], bf16=False, weak=(), extra=["--device", "cpu"])
    status = scaling.sweep(runs, tmp_path, log=lambda line: None, skip_done=True)
    assert [s.get("kept", False) for s in status] == [True, False] and len(started) == 1


def test_a_run_past_its_time_is_stopped_with_its_whole_session(tmp_path):
    """The session runner: a child that started a grandchild (as torchrun starts workers) loses both."""
    pid_file = tmp_path / "grandchild.pid"
    script = (f"import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; "
              f"time.sleep(60)']); open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(60)")
    t0 = time.perf_counter()
    with pytest.raises(subprocess.TimeoutExpired):
        scaling.run_in_session([sys.executable, "-c", script], None, 2.0)
    assert time.perf_counter() - t0 < 20
    pid = int(pid_file.read_text())
    for _ in range(50):
        if not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]:
            break
        time.sleep(0.1)
    else:
        pytest.fail("the grandchild outlived its run")
    assert scaling.run_in_session([sys.executable, "-c", "print('ok')"], None, 30) == (0, "ok\n", "")


def test_the_report_sorts_several_counts_by_count():
    from fasttrain.lab.experiments.scaling_report import _order

    labels = ["4gpu-ddp-weak", "2gpu-fsdp-zero3", "1gpu", "4gpu-ddp", "2gpu-ddp", "ddp"]
    assert sorted(labels, key=_order) == ["1gpu", "ddp", "2gpu-ddp", "2gpu-fsdp-zero3", "4gpu-ddp", "4gpu-ddp-weak"]


def test_ddp_reducing_in_bf16_is_a_strategy_of_the_sweep_with_its_setting_in_the_runs_config():
    runs = scaling.plan(["tiny"], 2, 3, ["ddp", "ddp-reduce-bf16"], bf16=False, weak=("ddp-reduce-bf16",))
    by = {r.label: r for r in runs}
    assert by["ddp-reduce-bf16"].overrides["reduce_dtype"] == "bf16"
    assert by["ddp-reduce-bf16-weak"].overrides["reduce_dtype"] == "bf16"
    assert "reduce_dtype" not in by["ddp"].overrides
    assert by["ddp-reduce-bf16"].launch[:2] == ("--strategy", "ddp")
    line = scaling.command_line(by["ddp-reduce-bf16"], Path("out"))
    assert line[line.index("--reduce-dtype") + 1] == "bf16"


def test_hsdp_and_the_2d_mesh_are_strategies_of_the_sweep_checked_before_any_run():
    runs = scaling.plan(["tiny"], 4, 3, ["hsdp-r2", "fsdp-tp2"], bf16=False, weak=())
    by = {r.label: r for r in runs}
    assert by["hsdp-r2"].launch[:4] == ("--strategy", "hsdp", "--dp-replicate", "2")
    assert by["fsdp-tp2"].launch[:4] == ("--strategy", "fsdp", "--tp", "2")
    assert by["fsdp-tp2"].parallel().tp == 2 and by["hsdp-r2"].parallel().dp_replicate == 2
    # a 2-D mesh over 2 GPUs leaves one data-parallel rank for hsdp's two replicas: one line, before any run
    with pytest.raises(FasttrainError, match="hsdp-r2"):
        scaling.plan(["tiny"], 3, 3, ["hsdp-r2"], bf16=False, weak=())
