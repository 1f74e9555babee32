"""Run records a person can rerun: what a record holds (command line, libraries, model source and
config, the corpus' hashes), ``fasttrain lab --from-record`` reproducing a CPU run's loss curve
exactly, ``fasttrain lab plot`` drawing a run's loss curve, and bad records refused in one line."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from tests_support import run_cli  # noqa: E402


def test_from_record_reruns_a_cpu_run_exactly(fake_corpus, tmp_path, capsys):
    first = tmp_path / "run.json"
    code, _, err = run_cli(["lab", "--preset", "tiny", "--device", "cpu", "--quiet", "--max-steps", "5",
                            "--dropout", "0.1", "--learning-rate", "0.02", "--eval-interval", "2", "--out", str(first)],
                           capsys)
    assert code == 0, err
    rec = json.loads(first.read_text())
    assert rec["command"].startswith("fasttrain lab --preset tiny") and "--dropout 0.1" in rec["command"]
    assert set(rec["libraries"]) >= {"torch", "transformers", "peft", "torchao", "liger-kernel", "tokenizers"}
    assert rec["libraries"]["torch"] == torch.__version__
    assert rec["model_source"]["name"] == "gpt" and rec["model"]["layers"] == 2
    assert len(rec["corpus"]["tokens_sha256"]) == 64 and "sha256" in rec["corpus"]
    again = tmp_path / "again.json"
    code, _, err = run_cli(["lab", "--from-record", str(first), "--quiet", "--out", str(again)], capsys)
    assert code == 0, err
    rerun = json.loads(again.read_text())
    assert rerun["config"] == rec["config"]
    assert [(p["step"], p["loss"]) for p in rerun["loss_curve"]] == [(p["step"], p["loss"]) for p in rec["loss_curve"]]
    assert [e["val_loss"] for e in rerun["eval"]] == [e["val_loss"] for e in rec["eval"]]
    # flags beside --from-record change the rerun
    third = tmp_path / "third.json"
    code, _, err = run_cli(["lab", "--from-record", str(first), "--max-steps", "3", "--quiet", "--out", str(third)],
                           capsys)
    assert code == 0, err
    assert json.loads(third.read_text())["config"]["max_steps"] == 3


@pytest.mark.parametrize("content, message", [
    (None, "no such run record"), ("{not json", "unreadable JSON"), ('{"kind": "bench"}', "not a lab run record"),
    ('{"kind": "lab-run", "config": {"max_steps": "many"}}', "--max-steps 'many': give an integer"),
])
def test_a_bad_record_is_one_line(fake_corpus, tmp_path, capsys, content, message):
    path = tmp_path / "r.json"
    if content is not None:
        path.write_text(content)
    code, _, err = run_cli(["lab", "--from-record", str(path), "--quiet"], capsys)
    assert code == 1 and message in err and "Traceback" not in err


def test_plot_draws_a_runs_loss_curve(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    record = {"kind": "lab-run", "config": {"name": "tiny"}, "device": "cpu", "precision": "fp32",
              "loss_curve": [{"step": s, "loss": 4.0 / s} for s in range(1, 6)],
              "eval": [{"step": 5, "val_loss": 1.0}]}
    path = tmp_path / "run.json"
    path.write_text(json.dumps(record))
    code, out, err = run_cli(["lab", "plot", str(path), "--out", str(tmp_path / "curve.png")], capsys)
    assert code == 0, err
    assert (tmp_path / "curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({**record, "loss_curve": [], "eval": []}))
    code, _, err = run_cli(["lab", "plot", str(empty), "--out", str(tmp_path / "e.png")], capsys)
    assert code == 1 and "no loss curve" in err and not (tmp_path / "e.png").exists()


def test_run_record_object_carries_the_trained_model(corpus):
    import fasttrain.lab
    from fasttrain.lab.record import RunRecord

    rec = fasttrain.lab.run("tiny", data=corpus, device="cpu", max_steps=4, eval_interval=0)
    assert isinstance(rec, RunRecord) and isinstance(rec.model, torch.nn.Module)
    assert rec.to_dict()["kind"] == "lab-run" and rec.losses == [p["loss"] for p in rec.to_dict()["loss_curve"]]
    assert rec.timings["step_ms"]["p50"] > 0 and rec.timings["setup_ms"] > 0 and rec.memory["by_kind"]["parameters"] > 0


def test_plot_draws_several_runs_on_one_figure(tmp_path, capsys, monkeypatch):
    pytest.importorskip("matplotlib")
    import matplotlib.axes

    from fasttrain.lab.record import run_labels

    drawn = []
    plot = matplotlib.axes.Axes.plot

    def spy(self, *args, **kwargs):             # what each line is: its label and its points
        drawn.append((kwargs.get("label"), list(args[0]), list(args[1])))
        return plot(self, *args, **kwargs)
    monkeypatch.setattr(matplotlib.axes.Axes, "plot", spy)
    paths = []
    for name, scale in (("bf16", 4.0), ("fp32", 3.0)):
        record = {"kind": "lab-run", "config": {"name": "tiny"}, "device": "cpu", "precision": name,
                  "loss_curve": [{"step": s, "loss": scale / s} for s in range(1, 6)],
                  "eval": [{"step": 5, "val_loss": scale / 6}]}
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(record))
    code, out, err = run_cli(["lab", "plot", *map(str, paths), "--out", str(tmp_path / "runs.png")], capsys)
    assert code == 0, err
    assert (tmp_path / "runs.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and "loss curves:" in out
    assert [d[0] for d in drawn] == ["bf16: train loss", "bf16: validation loss", "fp32: train loss",
                                     "fp32: validation loss"]
    assert drawn[2][1:] == ([1, 2, 3, 4, 5], [3.0 / s for s in range(1, 6)])
    assert run_labels(["a/run.json", "b/run.json"]) == ["a/run.json", "b/run.json"]    # alike names: whole paths
    # a bad record among them: one line naming it, nothing written
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"kind": "lab-run", "config": {}, "loss_curve": [], "eval": []}))
    code, _, err = run_cli(["lab", "plot", str(paths[0]), str(bad), "--out", str(tmp_path / "x.png")], capsys)
    assert code == 1 and f"{bad}: the record has no loss curve" in err and not (tmp_path / "x.png").exists()
    bad.write_text("{not json")
    code, _, err = run_cli(["lab", "plot", str(paths[0]), str(bad), "--out", str(tmp_path / "x.png")], capsys)
    assert code == 1 and str(bad) in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("name, message", [
    ("curve", "the extension (none) names no image format"),
    ("curve.txt", "the extension ('.txt') names no image format"),
    ("run.json", "is the run record this run reads"),
])
def test_plot_out_without_an_image_extension_or_naming_the_record_is_one_line(tmp_path, capsys, name, message):
    """``lab plot --out curve`` ended in matplotlib's traceback; ``--out run.json`` replaced the record."""
    pytest.importorskip("matplotlib")
    record = {"kind": "lab-run", "config": {"name": "tiny"}, "loss_curve": [{"step": 1, "loss": 2.0}], "eval": []}
    path = tmp_path / "run.json"
    path.write_text(json.dumps(record))
    code, _, err = run_cli(["lab", "plot", str(path), "--out", str(tmp_path / name)], capsys)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 1 and len(lines) == 1 and message in lines[0] and "Traceback" not in err, err
    assert json.loads(path.read_text()) == record
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.json"]


def test_from_record_refuses_a_save_of_the_original_run(fake_corpus, tmp_path, capsys):
    """``--from-record`` kept the record's --output-dir and rewrote the original run's checkpoints."""
    first = tmp_path / "run.json"
    states = tmp_path / "states"
    code, _, err = run_cli(["lab", "--preset", "tiny", "--device", "cpu", "--quiet", "--max-steps", "3",
                            "--save-steps", "2", "--output-dir", str(states), "--out", str(first)], capsys)
    assert code == 0, err
    before = (states / "checkpoint-2" / "state.pt").read_bytes()
    code, _, err = run_cli(["lab", "--from-record", str(first), "--quiet"], capsys)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 1 and len(lines) == 1 and "holds another run's checkpoints" in lines[0], err
    assert (states / "checkpoint-2" / "state.pt").read_bytes() == before
    code, _, err = run_cli(["lab", "--from-record", str(first), "--quiet", "--overwrite-output-dir"], capsys)
    assert code == 0, err


def test_from_record_refuses_changed_text_naming_the_file(tmp_path, capsys):
    """``--from-record`` never compared the data's SHA-256: changed text reran at exit 0."""
    from tests_support import toy_text

    text = tmp_path / "t.txt"
    text.write_text(toy_text(6000))
    first = tmp_path / "run.json"
    code, _, err = run_cli(["lab", "--preset", "tiny", "--device", "cpu", "--quiet", "--max-steps", "2",
                            "--train-file", str(text), "--out", str(first)], capsys)
    assert code == 0, err
    text.write_text(toy_text(6000, seed=4))
    code, _, err = run_cli(["lab", "--from-record", str(first), "--quiet"], capsys)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 1 and len(lines) == 1 and f"--train-file {text} changed since the run" in lines[0], err
    text.write_text(toy_text(6000))
    code, _, err = run_cli(["lab", "--from-record", str(first), "--quiet"], capsys)
    assert code == 0, err
