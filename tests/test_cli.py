"""The command line: smoke runs, and every bad input gives one line, a non-zero exit and no file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fasttrain.data.idx import write_idx


def fasttrain_cli(*args, env=None, cwd=None):
    environ = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "fasttrain", *map(str, args)], capture_output=True, text=True,
                          env=environ, cwd=cwd, timeout=300)


def assert_one_line_error(result, pattern):
    assert result.returncode != 0, result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.stderr
    import re
    assert re.search(pattern, lines[0]), lines[0]


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
    assert_one_line_error(fasttrain_cli(*args, "--data-dir", tmp_path) if args[0] == "data" else fasttrain_cli(*args, env={"FASTTRAIN_DATA_DIR": str(tmp_path)}), pattern)


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
    result = fasttrain_cli("train", "--data-dir", tmp_path, "--epochs", "1", "--out", out, "--quiet")
    assert_one_line_error(result, pattern)
    assert not out.exists()
    assert_one_line_error(fasttrain_cli("data", "verify", "--data-dir", tmp_path), pattern)


def test_unwritable_output_fails_before_training(tmp_path):
    result = fasttrain_cli("train", "--epochs", "1", "--out", tmp_path / "no" / "such" / "r.json",
                           env={"FASTTRAIN_DATA_DIR": str(tmp_path)})
    assert_one_line_error(result, "folder .* does not exist")


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
