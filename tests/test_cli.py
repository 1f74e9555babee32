"""The command line: smoke runs, and every bad input gives one line, a non-zero exit and no file.

The smoke runs start ``python -m fasttrain`` (the real entry point, exit code and all); the bad inputs call the
same ``main`` in this process (``fasttrain_in_process``: what it prints and returns is what the process would), so that
dozens of cases do not each pay an interpreter's start."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import numpy as np
import pytest
from rich.console import Console

from fasttrain.data.idx import write_idx
from tests_support import fasttrain_cli, fasttrain_in_process, one_line_error


def test_help_and_engines():
    assert fasttrain_cli("--help").returncode == 0
    result = fasttrain_cli("engines")
    assert result.returncode == 0 and "numpy" in result.stdout and "yes" in result.stdout


@pytest.mark.parametrize("args, pattern", [
    (["train", "--engine", "nope"], "unknown engine 'nope'"),
    (["train", "--model", "mlp:12"], "unknown model 'mlp:12'"),
    (["train", "--batch-size", "abc"], "'abc' is not a valid integer"),
    (["train", "--precision", "fp8"], "'fp8' is not one of"),
    (["train", "--turbo"], "no such option --turbo for engine numpy"),
    (["train", "--lr", "-1"], "lr must be a positive number"),
    (["train", "--epochs", "2", "--steps", "5"], "not both"),
    (["train", "--precision", "fp16"], "does not support precision fp16"),
    (["data", "download", "--dataset", "cifar"], "unknown dataset 'cifar'"),
    (["frobnicate"], "No such command"),
])
def test_bad_flags(args, pattern, tmp_path):
    one_line_error(fasttrain_in_process(*args, "--data-dir", tmp_path) if args[0] == "data" else fasttrain_in_process(*args, env={"FASTTRAIN_DATA_DIR": str(tmp_path)}), pattern)


def _bad_dataset(root: Path, corrupt) -> None:
    d = root / "mnist"
    d.mkdir(parents=True)
    rng = np.random.default_rng(0)
    write_idx(d / "train-images-idx3-ubyte.gz", rng.integers(0, 256, (20, 28, 28), dtype=np.uint8))
    write_idx(d / "train-labels-idx1-ubyte.gz", rng.integers(0, 10, 20, dtype=np.uint8))
    write_idx(d / "t10k-images-idx3-ubyte.gz", rng.integers(0, 256, (10, 28, 28), dtype=np.uint8))
    write_idx(d / "t10k-labels-idx1-ubyte.gz", rng.integers(0, 10, 10, dtype=np.uint8))
    corrupt(d)


@pytest.mark.parametrize("corrupt, pattern", [
    (lambda d: (d / "t10k-labels-idx1-ubyte.gz").unlink(), r"not found: .*t10k-labels.*fasttrain data download --dataset mnist"),
    (lambda d: (d / "train-images-idx3-ubyte.gz").write_bytes(b"\x1f\x8b\x08garbage"), "truncated or corrupt gzip"),
    (lambda d: write_idx(d / "train-labels-idx1-ubyte.gz", np.full(20, 12, np.uint8)), "label 12 is outside 0..9"),
    (lambda d: write_idx(d / "t10k-images-idx3-ubyte.gz", np.zeros((10, 32, 32), np.uint8)), "must be 28x28"),
    (lambda d: (d / "t10k-labels-idx1-ubyte.gz").write_bytes(__import__("gzip").compress(b"\x00\x00\x08\x05")), "wrong magic"),
    (lambda d: None, "checksum mismatch"),
])
def test_bad_data_files(tmp_path, corrupt, pattern):
    _bad_dataset(tmp_path, corrupt)
    out = tmp_path / "r.json"
    result = fasttrain_in_process("train", "--data-dir", tmp_path, "--epochs", "1", "--out", out, "--quiet")
    one_line_error(result, pattern)
    assert not out.exists()
    one_line_error(fasttrain_in_process("data", "verify", "--data-dir", tmp_path), pattern)


def test_unwritable_output_fails_before_training(tmp_path):
    result = fasttrain_in_process("train", "--epochs", "1", "--out", tmp_path / "no" / "such" / "r.json",
                                  env={"FASTTRAIN_DATA_DIR": str(tmp_path)})
    one_line_error(result, "folder .* does not exist")


@pytest.mark.mnist
def test_train_smoke_on_mnist(mnist_dir, tmp_path):
    out, weights = tmp_path / "r.json", tmp_path / "w.npz"
    result = fasttrain_cli("train", "--engine", "numpy", "--model", "mlp:32x2", "--steps", "300", "--out", out,
                           "--save-weights", weights, "--data-dir", mnist_dir)
    assert result.returncode == 0, result.stderr
    assert "test acc" in result.stdout
    record = json.loads(out.read_text())
    assert record["config"]["steps"] == 300 and record["curve"][-1]["step"] == 300
    scored = fasttrain_cli("evaluate", "--weights", weights, "--data-dir", mnist_dir)
    assert scored.returncode == 0 and f"{record['final']['test_acc']:.4f}" in scored.stdout
    verify = fasttrain_cli("data", "verify", "--data-dir", mnist_dir)
    assert verify.returncode == 0 and "all files verified" in verify.stdout


# --- help and the engines list ----------------------------------------------------------------


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
    one_line_error(fasttrain_in_process("train", *args, "--data-dir", empty), pattern)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "results"]


def test_any_oserror_in_the_cli_is_one_line(tmp_path, monkeypatch, capsys):
    from fasttrain import cli

    def broken(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system", str(tmp_path / "x.html"))

    monkeypatch.setattr("fasttrain.memory.page.write_page", broken)
    assert cli.main(["memory", "--html", str(tmp_path / "x.html")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "Read-only file system" in err[0]
    assert "write somewhere else" in err[0]


# --- numbers ----------------------------------------------------------------------------------


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
    one_line_error(fasttrain_in_process("train", *args, "--data-dir", tmp_path), pattern)
    assert list(tmp_path.iterdir()) == []


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


# --- evaluate ---------------------------------------------------------------------------------


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
        one_line_error(fasttrain_in_process("evaluate", "--weights", tmp_path / f"{name}.npz", "--data-dir", empty),
                       pattern)
