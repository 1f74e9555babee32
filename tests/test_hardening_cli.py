"""Bad input at the command line: one line saying what is wrong and how to fix it, a non-zero exit,
no traceback, and no file written or lost. Training runs here are tiny (synthetic-sized data)."""

from __future__ import annotations

import errno
import json
import os
import stat
from pathlib import Path

import numpy as np
import pytest
from rich.console import Console

from tests_support import fasttrain_cli, one_line_error


def tiny_data():
    from fasttrain.data.synthetic import synthetic_dataset

    return synthetic_dataset(256, 64)


# --- help and the engines list --------------------------------------------------------------


def test_bare_fasttrain_prints_the_help():
    result = fasttrain_cli()
    assert result.returncode == 0
    assert "error" not in result.stderr
    assert result.stdout.startswith("Usage: fasttrain") and "\nCommands:\n" in result.stdout


@pytest.mark.parametrize("group", ["data", "bench"])
def test_bare_subgroup_prints_its_help(group):
    result = fasttrain_cli(group)
    assert result.returncode == 0 and f"Usage: fasttrain {group}" in result.stdout and "error" not in result.stderr


def test_engines_in_80_columns_keeps_every_word_of_the_hints():
    from fasttrain.cli import print_engines
    from fasttrain.engines import registry

    console = Console(width=80, record=True, color_system=None)
    print_engines(console)
    text = console.export_text()
    assert max(len(line.rstrip()) for line in text.splitlines()) <= 80
    flat = " ".join(text.split())  # lines wrapped at spaces join back into the full sentences
    for name, engine_cls in registry().items():
        assert name in flat
        reason = engine_cls.available()
        if reason:
            assert " ".join(reason.split()) in flat, reason
        assert "…" not in text  # nothing cut with an ellipsis


# --- output paths: refused before training --------------------------------------------------


@pytest.mark.parametrize("args, pattern", [
    (["--out", ""], r"--out is empty; give a file name"),
    (["--out", "{tmp}/newdir/"], r"--out .*newdir/: that is a folder; give a file name"),
    (["--out", "{tmp}/results/"], r"results/' is a directory"),
    (["--out", "{tmp}"], r"is a directory"),
    (["--out", "{tmp}/no/such/run.json"], r"folder .* does not exist; create it first"),
    (["--save-weights", ""], r"--save-weights is empty"),
    (["--out", "{tmp}/same", "--save-weights", "{tmp}/same"], r"--out and --save-weights name the same file"),
])
def test_output_paths_refused_before_training(tmp_path, args, pattern):
    (tmp_path / "results").mkdir()
    # no data anywhere: a check that ran after loading would fail on the data instead
    empty = tmp_path / "empty"
    empty.mkdir()
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    one_line_error(fasttrain_cli("train", *args, "--data-dir", empty), pattern)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "results"]


def test_output_path_checks_in_the_python_api(tmp_path):
    import fasttrain

    with pytest.raises(fasttrain.FasttrainError, match="name the same file"):
        fasttrain.train("numpy", "logreg", data=tiny_data(), epochs=1, out=tmp_path / "x", save_weights_to=tmp_path / "x")
    with pytest.raises(fasttrain.FasttrainError, match="that is a folder"):
        fasttrain.train("numpy", "logreg", data=tiny_data(), epochs=1, out=tmp_path)
    with pytest.raises(fasttrain.FasttrainError, match="is a folder, not a weights file"):
        fasttrain.load_weights(tmp_path)


def test_result_files_get_the_usual_mode(tmp_path):
    import fasttrain
    from fasttrain.files import default_file_mode

    fasttrain.train("numpy", "logreg", data=tiny_data(), epochs=1, out=tmp_path / "run.json",
                    save_weights_to=tmp_path / "w.npz")
    for name in ("run.json", "w.npz"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == default_file_mode(), name
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.json", "w.npz"]  # no temporary file left


def test_a_failed_write_keeps_the_earlier_file(tmp_path, monkeypatch):
    from fasttrain.files import atomic_write_text

    target = tmp_path / "run.json"
    target.write_text("earlier\n")

    def full_disk(self, text, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(self))

    monkeypatch.setattr(Path, "write_text", full_disk)
    with pytest.raises(OSError):
        atomic_write_text(target, "new\n")
    monkeypatch.undo()
    assert target.read_text() == "earlier\n"
    assert [p.name for p in tmp_path.iterdir()] == ["run.json"]


def test_any_oserror_in_the_cli_is_one_line(tmp_path, monkeypatch, capsys):
    from fasttrain import cli

    def broken(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system", str(tmp_path / "x.html"))

    monkeypatch.setattr("fasttrain.memory.page.write_page", broken)
    assert cli.main(["memory", "--html", str(tmp_path / "x.html")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "Read-only file system" in err[0]
    assert "write somewhere else" in err[0]


# --- numbers --------------------------------------------------------------------------------


@pytest.mark.parametrize("args, pattern", [
    (["--seed", "-1"], r"seed must be an integer from 0 at most"),
    (["--seed", str(2**40)], r"seed must be"),
    (["--epochs", "1000000000000"], r"epochs must be a positive integer at most 100,000"),
    (["--epochs", "1e12"], r"'1e12' is not a valid integer"),
    (["--steps", "0"], r"steps must be a positive integer"),
    (["--model", "mlp:10000000x1"], r"width must be 1..65536"),
    (["--model", "mlp:30000x3"], r"parameters, more than the 1,000,000,000"),
    (["--model", "mlp:128x100"], r"depth 1..64"),
    (["--batch-size", "0"], r"batch_size must be a positive integer"),
    (["--batch-size", "99999999"], r"batch_size must be a positive integer at most"),
    (["--lr", "inf"], r"lr must be a positive number \(finite\)"),
    (["--threads", "-2"], r"--threads must be between 0 and 1024"),
    (["--threads", "100000"], r"--threads must be between 0 and 1024"),
    (["--threads", "two"], r"--threads expects int"),
    (["--log-every", "0"], r"log_every must be a positive integer"),
])
def test_ranges_checked_before_any_work(tmp_path, args, pattern):
    one_line_error(fasttrain_cli("train", *args, "--data-dir", tmp_path), pattern)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("kwargs, pattern", [
    (dict(seed=-1), "seed must be"), (dict(epochs=10**12), "epochs must be"), (dict(batch_size=True), "batch_size"),
    (dict(lr=float("nan")), "lr must be"), (dict(steps=2.5), "steps must be"),
])
def test_ranges_in_the_python_api(kwargs, pattern):
    import fasttrain

    with pytest.raises(fasttrain.FasttrainError, match=pattern):
        fasttrain.default_config("logreg", **kwargs)
    with pytest.raises(fasttrain.FasttrainError, match=pattern):
        fasttrain.train("numpy", "logreg", data=tiny_data(), **kwargs)


def test_engine_option_ranges_in_the_python_api():
    import fasttrain

    with pytest.raises(fasttrain.FasttrainError, match="--threads must be between 0 and 1024"):
        fasttrain.train("numpy", "logreg", data=tiny_data(), epochs=1, engine_options={"threads": -1})


def test_batch_larger_than_the_dataset_is_refused():
    import fasttrain

    with pytest.raises(fasttrain.FasttrainError, match="batch size 1000 is larger than the 256 training examples; "
                                                       "give --batch-size at most 256"):
        fasttrain.train("numpy", "logreg", data=tiny_data(), epochs=1, batch_size=1000)


def test_divergence_is_detected_said_and_recorded_as_strict_json(tmp_path):
    import fasttrain

    out = tmp_path / "run.json"
    record = fasttrain.train("numpy", "logreg", data=tiny_data(), epochs=5, lr=1e38, out=out)
    assert record.diverged is not None and record.diverged["epoch"] == 1
    assert len(record.epochs) == 1  # stopped: later epochs would only train NaN weights
    text = out.read_text()
    data = json.loads(text, parse_constant=lambda name: pytest.fail(f"bare {name} in the run record"))
    assert data["diverged"]["what"] == "train loss" and data["final"]["test_loss"] is None


def test_divergence_in_the_cli_is_one_line_and_keeps_the_record():
    # the real data is needed for the CLI (tiny files fail their checksums)
    data_dir = os.environ.get("FASTTRAIN_DATA_DIR")
    if not data_dir:
        pytest.skip("needs FASTTRAIN_DATA_DIR (the real MNIST)")
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run.json"
        line = one_line_error(fasttrain_cli("train", "--lr", "1e38", "--epochs", "3", "--out", out, "--quiet"),
                              r"training diverged at epoch 1 \(train loss nan\); lower --lr")
        assert str(out) in line
        assert json.loads(out.read_text())["diverged"]["epoch"] == 1


# --- evaluate -------------------------------------------------------------------------------


def _weights_files(folder: Path) -> dict[str, str]:
    rng = np.random.default_rng(0)
    np.savez(folder / "shape.npz", W1=rng.normal(size=(100, 10)), b1=np.zeros(10))
    np.savez(folder / "bias.npz", W1=rng.normal(size=(784, 10)), b1=np.zeros(7))
    np.savez(folder / "chain.npz", W1=rng.normal(size=(784, 32)), b1=np.zeros(32), W2=rng.normal(size=(31, 10)),
             b2=np.zeros(10))
    np.savez(folder / "empty.npz", x=np.zeros(3))
    np.savez(folder / "nobias.npz", W1=rng.normal(size=(784, 10)))
    np.savez(folder / "nan.npz", W1=np.full((784, 10), np.nan), b1=np.zeros(10))
    np.savez(folder / "classes20.npz", W1=rng.normal(size=(784, 20)), b1=np.zeros(20))
    np.savez(folder / "ints.npz", W1=np.zeros((784, 10), np.int64), b1=np.zeros(10, np.int64))
    np.savez(folder / "good.npz", W1=rng.normal(size=(784, 10)), b1=np.zeros(10))
    (folder / "truncated.npz").write_bytes((folder / "good.npz").read_bytes()[:2000])
    (folder / "renamed.npz").write_text('{"schema": 1}')
    np.save(folder / "single.npy", np.zeros(3))
    (folder / "single.npy").rename(folder / "single.npz")
    (folder / "dir.npz").mkdir()
    return {
        "shape": r"W1 has shape \(100, 10\), expected \(784, width\)",
        "bias": r"b1 has shape \(7,\), expected \(10,\)",
        "chain": r"W2 has shape \(31, 10\), expected \(32, width\)",
        "empty": r"holds no weights",
        "nobias": r"b1 is missing",
        "nan": r"NaN or inf",
        "classes20": r"the last layer has 20 outputs, but the datasets have 10 classes",
        "ints": r"holds int64 values, not floats",
        "truncated": r"not a readable fasttrain weights file, truncated",
        "renamed": r"not a readable fasttrain weights file",
        "single": r"a single array, not an .npz archive",
        "dir": r"dir.npz' is a directory",
        "missing": r"weights file not found",
    }


def test_evaluate_refuses_bad_weights_before_loading_data(tmp_path):
    cases = _weights_files(tmp_path)
    empty = tmp_path / "nodata"
    empty.mkdir()
    for name, pattern in cases.items():
        one_line_error(fasttrain_cli("evaluate", "--weights", tmp_path / f"{name}.npz", "--data-dir", empty), pattern)


def test_evaluate_weights_api_checks_too(tmp_path):
    import fasttrain

    with pytest.raises(fasttrain.FasttrainError, match="NaN or inf"):
        fasttrain.evaluate_weights([(np.full((784, 10), np.nan), np.zeros(10))], tiny_data())
    with pytest.raises(fasttrain.FasttrainError, match="expected \\(784, width\\)"):
        fasttrain.evaluate_weights([(np.zeros((10, 784)), np.zeros(784))], tiny_data())
