"""Bad input to `fasttrain bench` and `fasttrain memory`: one line, non-zero, no result lost."""

from __future__ import annotations

import json
import stat

import pytest

from fasttrain.cli import main
from fasttrain.files import default_file_mode
from tests_support import fasttrain_cli, one_line_error

SMALL = ["--quick", "--engines", "numpy"]  # the ladder: one numpy row on 10,000 examples


def _errors(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.strip().splitlines() if line.startswith("error: ")]


@pytest.fixture(scope="module")
def real_looking_folder(tmp_path_factory):
    """A results folder from a quick synthetic ladder run (stands in for real results)."""
    out = tmp_path_factory.mktemp("bench-real")
    assert main(["bench", "ladder", *SMALL, "--synthetic", "--out", str(out)]) == 0
    return out


# --- data: no silent fallback -----------------------------------------------------------------


def test_mistyped_dataset_is_an_error_not_synthetic(tmp_path):
    one_line_error(fasttrain_cli("bench", "ladder", *SMALL, "--dataset", "mnsit", "--out", tmp_path / "out"),
                   "unknown dataset 'mnsit'")
    assert not (tmp_path / "out").exists()


def test_missing_data_is_an_error_that_names_the_synthetic_option(tmp_path):
    one_line_error(fasttrain_cli("bench", "ladder", *SMALL, "--data-dir", tmp_path / "none", "--out", tmp_path / "out"),
                   r"file not found.*--synthetic")
    assert not (tmp_path / "out").exists()


def test_dataset_synthetic_is_the_explicit_request(tmp_path, capsys):
    assert main(["bench", "ladder", *SMALL, "--dataset", "synthetic", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "ladder.json").read_text())
    assert data["dataset"]["synthetic"] is True


# --- merging never drops results silently -------------------------------------------------------


def test_a_run_of_another_setting_is_refused_before_running(real_looking_folder, capsys):
    before = (real_looking_folder / "ladder.json").read_bytes()
    # the same folder without --quick (another setting): refused, the earlier results untouched
    assert main(["bench", "ladder", "--engines", "numpy", "--synthetic",
                 "--out", str(real_looking_folder)]) == 1
    errors = _errors(capsys)
    assert len(errors) == 1 and "holds results of another setting" in errors[0] and "--fresh" in errors[0]
    assert (real_looking_folder / "ladder.json").read_bytes() == before


def test_an_unreadable_results_file_is_refused_not_replaced(tmp_path, capsys):
    (tmp_path / "ladder.json").write_bytes(b"\x00\xff binary \x89PNG")
    assert main(["bench", "ladder", *SMALL, "--synthetic", "--out", str(tmp_path)]) == 1
    errors = _errors(capsys)
    assert len(errors) == 1 and "binary" in errors[0] and "--fresh" in errors[0]
    assert (tmp_path / "ladder.json").read_bytes() == b"\x00\xff binary \x89PNG"


def test_a_second_writer_is_refused_while_the_first_holds_the_folder(real_looking_folder, capsys):
    from fasttrain.bench.cli import folder_lock

    before = (real_looking_folder / "ladder.json").read_bytes()
    with folder_lock(real_looking_folder):
        assert main(["bench", "ladder", *SMALL, "--synthetic", "--out", str(real_looking_folder)]) == 1
        errors = _errors(capsys)
        assert len(errors) == 1 and "is in use by another fasttrain bench (pid" in errors[0]
        assert main(["bench", "merge", str(real_looking_folder), str(real_looking_folder)]) == 1
        assert main(["bench", "render", str(real_looking_folder)]) == 1
    assert (real_looking_folder / "ladder.json").read_bytes() == before
    # released: the same command runs
    assert main(["bench", "render", str(real_looking_folder)]) == 0


@pytest.mark.parametrize("content, pattern", [
    (b"[1, 2, 3]", "holds a JSON list, not an object"),
    (b"\x89PNG\r\n\x1a\n\x00\x00", "binary, not UTF-8 text"),
    (b'{"schema": 1, "suite": "ladder", "x": NaN}', "holds NaN, which is not JSON"),
    (b'{"schema": 1, "cases": "nope"}', "'cases' is not a list of objects"),
    (b'{"schema": 1, "suite": "ladder"}', "not a fasttrain benchmark results file"),
    (b"{not json", "not a fasttrain benchmark results file"),
    (b'"just a string"', "holds a JSON str"),
])
@pytest.mark.parametrize("command", ["render", "merge"])
def test_merge_and_render_refuse_bad_json(tmp_path, content, pattern, command):
    part = tmp_path / "part"
    part.mkdir()
    (part / "ladder.json").write_bytes(content)
    args = ["bench", "render", part] if command == "render" else ["bench", "merge", tmp_path / "into", part]
    one_line_error(fasttrain_cli(*args), pattern)
    assert (part / "ladder.json").read_bytes() == content
    assert not (tmp_path / "into" / "ladder.json").exists()


def test_bench_outputs_get_the_usual_mode(real_looking_folder):
    for name in ("ladder.json", "ladder.csv", "ladder.md", "results.csv", "README.md"):
        assert stat.S_IMODE((real_looking_folder / name).stat().st_mode) == default_file_mode(), name
    assert not [p.name for p in real_looking_folder.iterdir() if p.name.endswith(".tmp")]


def test_bench_out_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "file").write_text("x")
    one_line_error(fasttrain_cli("bench", "ladder", *SMALL, "--synthetic", "--out", tmp_path / "file"),
                   "is a file|that is a file, not a folder")


# --- memory ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("args, pattern", [
    (["--workspace-mib", "inf"], r"--workspace-mib must be a number from 0 to"),
    (["--workspace-mib", "nan"], r"--workspace-mib must be a number from 0 to"),
    (["--vocab", str(10**40)], r"--vocab must be at most 16,777,216"),
    (["--layers", str(10**12)], r"--layers must be at most"),
    (["--seq", str(2**40)], r"--seq must be at most"),
    (["--opt-bytes", "1000"], r"--opt-bytes must be at most 64"),
    (["cost", "--mfu", "0.4"], r"--mfu is a percentage: 0.4 would be 0.4% \(give --mfu 40 for 40%"),
    (["cost", "--mfu", "0"], r"--mfu is a percentage in \(0, 100\]"),
    (["cost", "--mfu", "forty"], r"--mfu expects a percentage like 40 or 40%"),
    (["cost", "--preset", "gpt2-124m", "--tokens", "inf"], r"tokens must be positive and finite"),
    (["cost", "--price", "nan"], r"--price must be >= 0 and finite"),
    (["cost", "--preset", "llama9"], r"unknown preset 'llama9'"),
])
def test_memory_ranges(args, pattern):
    one_line_error(fasttrain_cli("memory", *args), pattern)


def test_mfu_is_a_percentage_like_the_page(capsys):
    from fasttrain.memory import cost as C
    from fasttrain.memory.cli import parse_mfu_percent
    from fasttrain.memory.page import render

    assert parse_mfu_percent("40") == parse_mfu_percent("40%") == pytest.approx(0.4)
    assert parse_mfu_percent("0.5%") == pytest.approx(0.005)
    assert 'MFU % <input type="number" id="mfu"' in render()
    assert main(["memory", "cost", "--preset", "llama3-8b", "--mfu", "40", "--json"]) == 0
    by_percent = json.loads(capsys.readouterr().out)[0]
    assert by_percent["tflops_sustained"] == pytest.approx(0.4 * C.H100_BF16_TFLOPS)


@pytest.mark.parametrize("name", ["llama3-8b", "llama3.1-8b", "llama3-70b", "llama3.1-405b"])
def test_cost_takes_the_listed_preset_names_and_the_aliases(name, capsys):
    assert main(["memory", "cost", "--preset", name, "--json"]) == 0
    row = json.loads(capsys.readouterr().out)[0]
    assert row["published_gpu_hours"] is not None and row["tokens"] >= 15e12


def test_cost_of_a_listed_preset_without_published_figures_asks_for_tokens():
    one_line_error(fasttrain_cli("memory", "cost", "--preset", "gpt2-124m"), "no published token count; give --tokens")


def test_memory_html_never_creates_folders(tmp_path):
    target = tmp_path / "a" / "b" / "page.html"
    one_line_error(fasttrain_cli("memory", "--html", target), r"folder .*a/b does not exist; create it first")
    assert list(tmp_path.iterdir()) == []
    one_line_error(fasttrain_cli("memory", "--html", f"{tmp_path}/newdir/"), "that is a folder")
    one_line_error(fasttrain_cli("memory", "--html", ""), "--html is empty")
    assert list(tmp_path.iterdir()) == []


def test_memory_html_is_atomic_with_the_usual_mode(tmp_path, monkeypatch):
    from fasttrain.memory import page

    target = tmp_path / "page.html"
    target.write_text("earlier page\n")

    def broken_render(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(page, "render", broken_render)
    with pytest.raises(OSError):
        page.write_page(target)
    assert target.read_text() == "earlier page\n" and [p.name for p in tmp_path.iterdir()] == ["page.html"]
    monkeypatch.undo()
    page.write_page(target)
    assert target.read_text().startswith("<!DOCTYPE html>") or "<html" in target.read_text()[:200]
    assert stat.S_IMODE(target.stat().st_mode) == default_file_mode()
