"""`fasttrain bench`: the quick suites end to end on the NumPy engine, and the README generator."""

from __future__ import annotations

import csv
import json

import pytest

from fasttrain.cli import main


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
