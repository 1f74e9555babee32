"""The lab's loggers (fasttrain.lab.loggers): every logged step as a line off a terminal, metrics.jsonl and
metrics.csv written as the run goes (a crash keeps them), TensorBoard's event file, a W&B offline run,
the run record rewritten at each checkpoint, and --report-to's refusals before any work."""

from __future__ import annotations

import csv
import json

import pytest

from fasttrain.errors import FasttrainError
from fasttrain.lab import loggers as L
from fasttrain.lab.config import preset

torch = pytest.importorskip("torch")


class Crash(Exception):
    pass


def _cfg(**changes):
    return preset("tiny", **{"device": "cpu", "max_steps": 8, "eval_interval": 4, "log_interval": 2,
                             "timing_warmup_steps": 1, **changes})


def test_a_crash_keeps_the_metrics_files_and_the_record_of_the_last_checkpoint(tmp_path, corpus, monkeypatch):
    from fasttrain.lab.train import run

    monkeypatch.setattr(L, "is_terminal", lambda: False)        # a batch job's log: every logged step a line
    cfg = _cfg(logging_dir=str(tmp_path / "logs"), save_steps=4, output_dir=str(tmp_path / "ck"))
    record_path = tmp_path / "run.json"
    lines, seen_mid_run = [], {}

    def progress(step, total):
        if step == 6:               # the files hold the steps so far while the run goes (flushed each step)
            seen_mid_run["jsonl"] = (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()
        if step == 7:
            raise Crash()
    with pytest.raises(Crash):
        run(cfg, corpus=corpus, log=lines.append, progress=progress, record_path=record_path)

    rows = [json.loads(line) for line in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "loss" in r]
    assert [r["step"] for r in train] == [2, 4, 6]
    assert [json.loads(x)["step"] for x in seen_mid_run["jsonl"]] == [2, 4, 4, 6]   # step 4: its row and its validation
    tokens_per_step = cfg.per_device_train_batch_size * cfg.context
    for r in train:
        assert r["loss"] > 0 and r["lr"] > 0 and r["grad_norm"] > 0 and r["tokens_per_s"] > 0
        assert r["memory_gb"] > 0 and r["tokens_seen"] == r["step"] * tokens_per_step
    assert [(r["step"], r["tokens_seen"]) for r in rows if "val_loss" in r] == [(4, 4 * tokens_per_step)]
    with open(tmp_path / "logs" / "metrics.csv", newline="") as f:
        table = list(csv.DictReader(f))
    assert tuple(table[0]) == L.COLUMNS
    assert [float(r["loss"]) for r in table if r["loss"]] == [r["loss"] for r in train]
    assert [r["val_loss"] != "" for r in table] == [False, False, True, False]
    # the lines a log file gets: one per logged step, with the grad-norm and the throughput
    step_lines = [line for line in lines if line.startswith("step ") and "grad-norm" in line]
    assert len(step_lines) == 3 and step_lines[0].startswith("step 2/8  loss ") and "tok/s" in step_lines[0]
    # the run record as of the checkpoint of step 4, written whole
    record = json.loads(record_path.read_text())
    assert record["partial"] == {"step": 4, "of": 8}
    assert [p["step"] for p in record["loss_curve"]] == [2, 4] and record["eval"][0]["step"] == 4


def test_no_lines_on_a_terminal_and_no_grad_norm_without_clipping(tmp_path, corpus, monkeypatch):
    from fasttrain.lab.train import run

    monkeypatch.setattr(L, "is_terminal", lambda: True)         # the bar shows the steps
    lines = []
    rec = run(_cfg(max_steps=4, max_grad_norm=0.0, report_to="jsonl"), corpus=corpus, log=lines.append,
              record_path=tmp_path / "r.json")
    assert not any("grad-norm" in line or "tok/s" in line for line in lines)
    rows = [json.loads(x) for x in (tmp_path / "r.metrics.jsonl").read_text().splitlines()]   # beside --out
    assert [r["grad_norm"] for r in rows if "loss" in r] == [None, None]
    assert rec["logs"] == {"jsonl": str(tmp_path / "r.metrics.jsonl")}
    assert not (tmp_path / "r.metrics.csv").exists()


def test_tensorboard_event_file_reads_back(tmp_path, corpus):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from fasttrain.lab.train import run

    rec = run(_cfg(report_to="tensorboard", logging_dir=str(tmp_path / "tb")), corpus=corpus)
    events = EventAccumulator(str(tmp_path / "tb" / "tensorboard"))
    events.Reload()
    loss = events.Scalars("train/loss")
    assert [e.step for e in loss] == [2, 4, 6, 8]
    assert [e.value for e in loss] == pytest.approx([p["loss"] for p in rec["loss_curve"]], rel=1e-6)
    assert [e.step for e in events.Scalars("eval/loss")] == [4, 8]
    assert {"train/lr", "train/grad_norm", "train/tokens_seen"} <= set(events.Tags()["scalars"])


def test_wandb_offline_run_directory(tmp_path, corpus, monkeypatch):
    pytest.importorskip("wandb")
    from fasttrain.lab.train import run

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run(_cfg(max_steps=4, report_to="wandb", logging_dir=str(tmp_path / "logs")), corpus=corpus)
    runs = list((tmp_path / "logs" / "wandb" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    data = list(runs[0].glob("*.wandb"))            # the run's records, which wandb sync uploads
    assert len(data) == 1
    raw = data[0].read_bytes()                      # protobuf records: the keys appear as written
    assert b"train/loss" in raw and b"train/grad_norm" in raw and b"eval/loss" in raw and b"report_to" in raw


def test_report_to_is_checked_before_any_work(tmp_path, monkeypatch):
    with pytest.raises(FasttrainError, match=r"--report-to 'jsonl,mlflow': name none, all or any of"):
        L.reporters("jsonl,mlflow")
    assert L.reporters("all") == L.REPORTERS and L.reporters("none") == ()
    assert L.reporters("csv,jsonl") == ("jsonl", "csv")
    cfg = preset("tiny", report_to="tensorboard")
    with pytest.raises(FasttrainError, match=r"--report-to tensorboard: give --logging-dir DIR \(or --out"):
        L.check_loggers(cfg)
    assert L.check_loggers(preset("tiny")) == ()            # the default files need a place; none: nothing written
    monkeypatch.setitem(__import__("sys").modules, "tensorboard", None)
    with pytest.raises(FasttrainError, match="needs the tensorboard package: pip install tensorboard"):
        L.check_loggers(cfg, tmp_path / "run.json")
    pytest.importorskip("wandb")
    for name in ("WANDB_MODE", "WANDB_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    with pytest.raises(FasttrainError, match="no W&B account here .* WANDB_MODE=offline"):
        L.check_loggers(preset("tiny", report_to="wandb"), tmp_path / "run.json")
    (tmp_path / "file").write_text("x")
    with pytest.raises(FasttrainError, match="--logging-dir .*file: that is a file"):
        L.check_loggers(preset("tiny", logging_dir=str(tmp_path / "file")))


def test_the_cli_refuses_a_bad_report_to_in_one_line(tmp_path, capsys, fake_corpus):
    from tests_support import run_cli

    code, _, text = run_cli(["lab", "--preset", "tiny", "--device", "cpu", "--max-steps", "2", "--report-to",
                             "tensorboard"], capsys)
    lines = text.strip().splitlines()
    assert code != 0 and len(lines) == 1 and "--report-to tensorboard: give --logging-dir" in lines[0]


def test_step_line_formats_what_it_has():
    row = {"step": 20, "loss": 3.21044, "lr": 1e-3, "grad_norm": 0.8712, "tokens_per_s": 12345.6, "memory_gb": 0.41,
           "tokens_seen": 40960}
    assert L.step_line(row, 200) == ("step  20/200  loss 3.2104  lr 1.00e-03  grad-norm 0.871  12,346 tok/s  "
                                     "mem 0.41 GB  40,960 tokens")
    assert L.step_line({"step": 3, "loss": 1.0}) == "step      3  loss 1.0000"


def test_a_resumed_run_writes_the_saved_curve_first(tmp_path):
    from fasttrain.lab.trainer import Metrics

    cfg = _cfg(logging_dir=str(tmp_path / "logs"), report_to="jsonl")
    loggers = L.open_loggers(cfg, lines=False)
    metrics = Metrics(cfg, torch.device("cpu"), loggers=loggers)
    metrics.restore({"loss_curve": [{"step": 2, "loss": 3.5, "lr": 0.01, "ms": 5.0},
                                    {"step": 4, "loss": 3.1, "lr": 0.009, "ms": 5.0}],
                     "evals": [{"step": 4, "val_loss": 3.2, "tokens": 100, "ms": 1.0}], "train_s": 1.0})
    loggers.close()
    rows = [json.loads(x) for x in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert rows == [{"step": 2, "loss": 3.5, "lr": 0.01}, {"step": 4, "loss": 3.1, "lr": 0.009},
                    {"step": 4, "val_loss": 3.2}]
