"""The scaling sweep's rows and runner on the CPU (``lab/experiments/scaling.py``): every run an experiment row (overrides of
its preset, passed as the lab's flags; the launcher's flags apart), every configuration checked before any
process starts, and the sweep's status written after every run. No process is started: ``subprocess.run`` is
replaced by one that records the command lines (the GPU runs are ``fasttrain lab dist sweep`` on the device)."""

from __future__ import annotations

import json
import subprocess

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
    monkeypatch.setattr(scaling.subprocess, "run", lambda *a, **k: pytest.fail("a process started"))
    with pytest.raises(FasttrainError, match=r"^tiny\.1gpu, tiny\.ddp.*: --max-steps must be"):
        scaling.plan(["tiny"], 2, 0, ["ddp"])
    bad = scaling.Planned("1gpu", "tiny", 1, overrides={"dropout": 2.0})
    with pytest.raises(FasttrainError, match=r"^tiny\.1gpu: --dropout must be in \[0, 1\)"):
        scaling.sweep([bad], tmp_path / "out", log=lambda line: None)
    assert not (tmp_path / "out").exists()


def test_the_sweep_writes_its_status_after_every_run(tmp_path, monkeypatch):
    """A sweep cut short (a time limit, Ctrl-C) keeps the status of the runs it finished."""
    started = []

    def fake_run(argv, **kw):
        started.append(argv)
        if len(started) == 3:
            raise KeyboardInterrupt
        return subprocess.CompletedProcess(argv, 0 if len(started) == 1 else 1, "", "one line\nlast line\n")

    monkeypatch.setattr(scaling.subprocess, "run", fake_run)
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
