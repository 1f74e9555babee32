"""`fasttrain bench`: the quick suites end to end on the NumPy engine, and the README generator."""

from __future__ import annotations

import csv
import json
import stat

import pytest

from fasttrain.cli import main
from fasttrain.files import default_file_mode
from tests_support import fasttrain_cli, fasttrain_in_process, one_line_error


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    rc = main(["bench", "all", "--quick", "--synthetic", "--engines", "numpy", "--hidden", "32,64", "--out", str(out)])
    return rc, out


def test_bench_all_quick_writes_every_output(quick_run):
    rc, out = quick_run
    assert rc == 0
    for suite in ("ladder", "sweep", "curves"):
        for suffix in ("json", "csv", "md"):
            assert (out / f"{suite}.{suffix}").stat().st_size > 0
    assert (out / "results.csv").is_file() and (out / "README.md").is_file()
    rows = list(csv.DictReader((out / "results.csv").open()))
    assert {r["suite"] for r in rows} == {"ladder", "sweep", "curves"}
    assert {r["model"] for r in rows if r["suite"] == "sweep"} == {"mlp:32x3", "mlp:64x3"}
    ladder = (out / "ladder.md").read_text()
    assert "SYNTHETIC" in ladder and "--quick" in ladder
    assert "`fasttrain bench all --quick --engines numpy --out" in ladder


def test_bench_all_quick_writes_pngs(quick_run):
    pytest.importorskip("matplotlib")
    _rc, out = quick_run
    for name in ("ladder.png", "sweep_time.png", "curves.png"):
        assert (out / name).read_bytes()[:4] == b"\x89PNG"


def test_bench_readme_prints_the_results_section(quick_run, capsys, monkeypatch):
    _rc, out = quick_run
    monkeypatch.chdir(out.parent)
    capsys.readouterr()
    assert main(["bench", "readme", out.name]) == 0
    text = capsys.readouterr().out
    assert text.startswith("## Results")
    assert f"`fasttrain bench readme {out.name}`" in text
    assert "| # | engine / rung |" in text and "numpy fp64 (reference)" in text
    pytest.importorskip("matplotlib")
    assert f"]({out.name}/ladder.png)" in text and f"]({out.name}/sweep_time.png)" in text


def test_bench_readme_into_replaces_only_the_marked_section(quick_run, tmp_path, capsys):
    _rc, out = quick_run
    readme = tmp_path / "README.md"
    readme.write_text("# fasttrain\n\nintro\n\n<!-- bench-results:start -->\nold numbers\n<!-- bench-results:end -->\n\ntail\n")
    assert main(["bench", "readme", str(out), "--into", str(readme)]) == 0
    text = readme.read_text()
    assert text.startswith("# fasttrain\n\nintro\n\n<!-- bench-results:start -->\n## Results")
    assert "old numbers" not in text and text.endswith("<!-- bench-results:end -->\n\ntail\n")
    readme.write_text("no markers\n")
    assert main(["bench", "readme", str(out), "--into", str(readme)]) == 1
    assert "needs exactly one line <!-- bench-results:start -->" in capsys.readouterr().err


def test_bench_readme_marker_fills_a_second_section_and_leaves_the_first(quick_run, tmp_path, capsys):
    _rc, out = quick_run
    readme = tmp_path / "README.md"
    first = "<!-- bench-results:start -->\nmain numbers\n<!-- bench-results:end -->\n"
    readme.write_text(first + "## Lab\n<!-- lab-results:start -->\nstale figures\n<!-- lab-results:end -->\n")
    assert main(["bench", "readme", str(out), "--marker", "lab-results", "--into", str(readme)]) == 0
    text = readme.read_text()
    assert text.startswith(first) and "<!-- lab-results:start -->\n### Results" in text and "stale figures" not in text
    assert main(["bench", "readme", str(out), "--marker", "lab results!", "--into", str(readme)]) == 1
    assert "--marker" in capsys.readouterr().err


def test_rerun_of_one_size_keeps_the_others(quick_run):
    _rc, out = quick_run
    assert main(["bench", "sweep", "--quick", "--synthetic", "--engines", "numpy", "--hidden", "16", "--out", str(out)]) == 0
    rows = list(csv.DictReader((out / "sweep.csv").open()))
    assert {r["model"] for r in rows} == {"mlp:16x3", "mlp:32x3", "mlp:64x3"}


def test_render_rewrites_reports_from_the_json(quick_run):
    _rc, out = quick_run
    before = (out / "ladder.md").read_text()
    for path in [out / "ladder.md", out / "curves.csv", out / "results.csv", out / "README.md"]:
        path.unlink()
    assert main(["bench", "render", str(out)]) == 0
    assert (out / "ladder.md").read_text() == before
    assert (out / "curves.csv").is_file() and (out / "results.csv").is_file() and (out / "README.md").is_file()


def test_merge_folds_runs_split_over_several_calls(tmp_path, capsys):
    common = ["--quick", "--synthetic", "--engines", "numpy"]
    assert main(["bench", "sweep", *common, "--hidden", "16", "--out", str(tmp_path / "a")]) == 0
    assert main(["bench", "sweep", *common, "--hidden", "24", "--out", str(tmp_path / "b")]) == 0
    assert main(["bench", "merge", str(tmp_path / "all"), str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    rows = list(csv.DictReader((tmp_path / "all" / "sweep.csv").open()))
    assert {r["model"] for r in rows} == {"mlp:16x3", "mlp:24x3"}
    assert (tmp_path / "all" / "README.md").is_file()
    saved = json.loads((tmp_path / "all" / "sweep.json").read_text())
    assert len(saved["commands"]) == 2
    # a part from another GPU is refused, not mixed in
    other = json.loads((tmp_path / "b" / "sweep.json").read_text())
    other["environment"]["gpu"] = {"name": "NVIDIA H200"}
    (tmp_path / "b" / "sweep.json").write_text(json.dumps(other))
    capsys.readouterr()
    assert main(["bench", "merge", str(tmp_path / "mixed"), str(tmp_path / "a"), str(tmp_path / "b")]) == 1
    assert "different GPUs" in capsys.readouterr().err


def test_a_crashing_engine_is_recorded_and_fails_the_command(tmp_path, capsys, monkeypatch):
    import fasttrain.training

    def crash(*args, **kwargs):
        raise RuntimeError("illegal memory access")

    monkeypatch.setattr(fasttrain.training, "run", crash)
    assert main(["bench", "ladder", "--quick", "--synthetic", "--engines", "numpy", "--out", str(tmp_path)]) == 1
    assert "1 row(s) failed: ladder numpy logreg" in capsys.readouterr().err
    saved = json.loads((tmp_path / "ladder.json").read_text())
    numpy_case = next(c for c in saved["cases"] if c["label"] == "numpy")
    assert numpy_case["status"] == "failed" and "illegal memory access" in numpy_case["traceback"]
    assert "FAILED: numpy: RuntimeError: illegal memory access" in (tmp_path / "ladder.md").read_text()


def test_bench_errors_are_one_line(tmp_path, capsys):
    assert main(["bench", "ladder", "--engines", "nunpy", "--out", str(tmp_path)]) == 1
    assert "unknown engine 'nunpy'" in capsys.readouterr().err
    assert main(["bench", "sweep", "--hidden", "12x", "--out", str(tmp_path)]) == 1
    assert "--hidden: expected a comma-separated list" in capsys.readouterr().err
    assert main(["bench", "readme", str(tmp_path / "none")]) == 1
    assert "no such folder" in capsys.readouterr().err


def test_bench_list_runs_nothing(tmp_path, capsys):
    assert main(["bench", "ladder", "--list", "--out", str(tmp_path / "x")]) == 0
    text = capsys.readouterr().out
    assert "cuda rung 8" in text and "numpy" in text
    assert not (tmp_path / "x").exists()


def test_models_option_narrows_a_suite_and_refuses_a_model_it_lacks(capsys):
    assert main(["bench", "many", "--models", "mlp:1024x3", "--list"]) == 0
    listed = capsys.readouterr().out
    assert "mlp:1024x3" in listed and "logreg" not in listed and "mlp:128x3 " not in listed
    assert main(["bench", "many", "--models", "mlp:9x3", "--list"]) == 1
    err = capsys.readouterr().err
    assert "--models: mlp:9x3 is not a model of many" in err and err.count("\n") == 1


# --- bad input: one line, non-zero, no result lost ----------------------------------------------


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
    # the lock leaves nothing in the results folder
    assert not [f for f in real_looking_folder.iterdir() if "lock" in f.name]


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
    one_line_error(fasttrain_in_process(*args), pattern)
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
