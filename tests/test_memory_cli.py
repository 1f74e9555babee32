"""`fasttrain memory`: breakdown tables, JSON, the page, the cost table, and one clear line for
each bad input (the CLI's contract: ``error: ...``, exit 1, no traceback)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from fasttrain.memory import cost as C
from fasttrain.memory import estimate, format_gib, preset
from fasttrain.memory.playbook import format_bytes


def run(*args):
    # ``fasttrain memory ARGS`` in this process (the entry point itself: the ``fasttrain cost`` test below)
    from tests_support import fasttrain_in_process

    return fasttrain_in_process("memory", *args)


def one_line_error(result, pattern):
    assert result.returncode in (1, 2), result     # 1: FasttrainError, 2: click usage error
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.stderr
    assert re.search(pattern, lines[0]), lines[0]


@pytest.mark.parametrize("mode, fmt", [("precise", format_gib), ("playbook", format_bytes)])
def test_llama3_8b_breakdown_in_both_modes(mode, fmt):
    r = run("--preset", "llama3-8b", "--mode", mode)
    assert r.returncode == 0, r.stderr
    b = estimate(preset("llama3-8b"), mode)
    for name in ("parameters", "gradients", "optimizer", "activations", "total"):
        assert name in r.stdout
    assert fmt(b.total) in r.stdout
    assert f"{b.params:,.0f} parameters" in r.stdout


def test_json_output_and_flags_reach_the_setup():
    r = run("--preset", "llama3-70b", "--tp", 8, "--dp", 16, "--zero", 1, "--seq-parallel", "--recompute", "selective",
            "--micro-batch", 2, "--seq", 4096, "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    s = preset("llama3-70b", tp=8, dp=16, zero=1, seq_parallel=True, recompute="selective", micro_batch=2, seq=4096)
    assert d["total"] == pytest.approx(estimate(s).total)
    assert d["setup"]["tp"] == 8 and d["mode"] == "precise"


def test_every_widget_flag_is_accepted():
    r = run("--heads", 16, "--micro-batch", 4, "--hidden", 1024, "--ffn", 4096, "--layers", 4, "--seq", 512, "--vocab",
            32000, "--tp", 2, "--dp", 4, "--opt-bytes", 8, "--mixed", "--seq-parallel", "--recompute", "full", "--zero",
            2, "--ffn-act", "gelu", "--mode", "playbook", "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    s = preset("llama3-8b").with_(heads=16, micro_batch=4, hidden=1024, ffn=4096, layers=4, seq=512, vocab=32000, tp=2,
                                  dp=4, opt_bytes=8, precision="mixed", seq_parallel=True, recompute="full", zero=2,
                                  ffn_act="gelu")
    assert d["total"] == estimate(s, "playbook").total


@pytest.mark.parametrize("args, pattern", [
    (["--layers", 0], "--layers must be a positive integer, got 0"),
    (["--hidden", -4096], "--hidden must be a positive integer, got -4096"),
    (["--micro-batch", 0], "--micro-batch must be a positive integer"),
    (["--seq", -1], "--seq must be a positive integer"),
    (["--vocab", 0], "--vocab must be a positive integer"),
    (["--opt-bytes", -2], "--opt-bytes must be a non-negative integer"),
    (["--heads", 7], r"heads \(7\) must divide the hidden size \(4096\)"),
    (["--tp", 3], r"tensor parallelism t=3 must divide the heads \(32\)"),
    (["--preset", "llama9"], "unknown preset 'llama9'; use one of llama3-8b"),
    (["--mode", "playbook", "--precision", "amp"], "only in --mode precise"),
    (["--mixed", "--precision", "fp32"], "contradict"),
    (["--zero", 4], "not in the range"),
])
def test_bad_input_gives_one_line(args, pattern):
    one_line_error(run(*args), pattern)


def test_html_writes_a_self_contained_page(tmp_path):
    out = tmp_path / "mem.html"
    r = run("--preset", "llama3-405b", "--html", out)
    assert r.returncode == 0, r.stderr
    text = out.read_text()
    assert "FTMemory" in text and "llama3-405b" in text and "<script src" not in text


def test_cost_table_prints_the_implied_mfu():
    r = run("cost")
    assert r.returncode == 0, r.stderr
    for row in C.published():
        assert f"{100 * row.implied_mfu:.1f}%" in r.stdout
        assert f"{row.published_gpu_hours / 1e6:.2f}M" in r.stdout


def test_cost_for_a_preset_and_bad_cost_input():
    r = run("cost", "--preset", "llama3.1-8b", "--tflops", 400, "--price", 2, "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)[0]
    assert d["gpu_hours"] == pytest.approx(d["flops"] / 400e12 / 3600)
    one_line_error(run("cost", "--mfu", 150), r"--mfu is a percentage in \(0, 100\]")
    one_line_error(run("cost", "--mfu", 40, "--tflops", 300), "not both")
    one_line_error(run("cost", "--preset", "val-gpt"), "no published token count")


def test_list_presets():
    r = run("--list-presets")
    assert r.returncode == 0 and "llama3-405b" in r.stdout and "playbook-8b" in r.stdout


# --- ranges, the cost presets, the page's file ------------------------------------------------


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
    one_line_error(run(*args), pattern)


def test_mfu_is_a_percentage_like_the_page(capsys):
    from fasttrain.cli import main
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
    from fasttrain.cli import main

    assert main(["memory", "cost", "--preset", name, "--json"]) == 0
    row = json.loads(capsys.readouterr().out)[0]
    assert row["published_gpu_hours"] is not None and row["tokens"] >= 15e12


def test_cost_of_a_listed_preset_without_published_figures_asks_for_tokens():
    one_line_error(run("cost", "--preset", "gpt2-124m"), "no published token count; give --tokens")


def test_memory_html_never_creates_folders(tmp_path):
    target = tmp_path / "a" / "b" / "page.html"
    one_line_error(run("--html", target), r"folder .*a/b does not exist; create it first")
    assert list(tmp_path.iterdir()) == []
    one_line_error(run("--html", f"{tmp_path}/newdir/"), "that is a folder")
    one_line_error(run("--html", ""), "--html is empty")
    assert list(tmp_path.iterdir()) == []


def test_memory_html_is_atomic_with_the_usual_mode(tmp_path, monkeypatch):
    import stat

    from fasttrain.files import default_file_mode
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
def test_html_and_json_together_do_both(tmp_path):
    out = tmp_path / "mem.html"
    r = run("--preset", "llama3-8b", "--html", out, "--json")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)                     # stdout is the JSON alone
    assert data["total"] > 0 and out.read_text().lstrip().lower().startswith("<!doctype html")
    assert f"page: {out}" in r.stderr


@pytest.mark.parametrize("tokens", ["1e30", "3e21"])
def test_cost_with_absurd_token_counts_cuts_no_cell(tokens):
    r = run("cost", "--preset", "llama3-8b", "--tokens", tokens)
    assert r.returncode == 0, r.stderr
    assert "…" not in r.stdout and "..." not in r.stdout, r.stdout
    assert f"{float(tokens):.3g}" in r.stdout


@pytest.mark.parametrize("args,pattern", [
    (["--tokens", "-5"], r"--tokens must be positive and finite"),
    (["--tokens", "nan"], r"--tokens must be positive and finite"),
    (["--params", "inf"], r"--params must be positive and finite"),
])
def test_cost_counts_must_be_positive_and_finite(args, pattern):
    one_line_error(run("cost", "--preset", "llama3-8b", *args), pattern)


def test_fasttrain_cost_is_memory_cost():
    alias = subprocess.run([sys.executable, "-m", "fasttrain", "cost", "--json"], capture_output=True, text=True,
                           timeout=120)
    assert alias.returncode == 0, alias.stderr
    assert json.loads(alias.stdout) == json.loads(run("cost", "--json").stdout)


def test_the_labs_names_and_the_hf_configs_defaults_are_said(tmp_path):
    """One name per setting across lab, tune and memory: --per-device-train-batch-size and --context, with
    --micro-batch and --seq read as them (a line says so); --hf-config assumes bf16 autocast, sdpa and the
    model's positions, and says so."""
    (tmp_path / "config.json").write_text(json.dumps(dict(
        model_type="llama", hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=120, max_position_embeddings=96)))
    new = run("--preset", "llama3-8b", "--per-device-train-batch-size", 2, "--context", 1024, "--json")
    old = run("--preset", "llama3-8b", "--micro-batch", 2, "--seq", 1024, "--json")
    assert new.returncode == old.returncode == 0, old.stderr
    assert json.loads(new.stdout)["total"] == json.loads(old.stdout)["total"]
    assert "--micro-batch is another name of --per-device-train-batch-size" in old.stderr
    assert "--seq is another name of --context" in old.stderr and new.stderr == ""
    hf = run("--hf-config", tmp_path, "--json")
    assert hf.returncode == 0, hf.stderr
    setup = json.loads(hf.stdout)["setup"]
    assert setup["precision"] == "amp" and setup["attention"] == "flash" and setup["seq"] == 96
    assert "bf16 autocast (default" in hf.stderr and "context 96 (the model's positions" in hf.stderr
    one_line_error(run("--micro-batch", 2, "--per-device-train-batch-size", 4), "name the same setting")


def test_hf_config_micro_batch_zero_is_refused_not_read_as_one(tmp_path):
    """``--micro-batch 0`` with ``--hf-config`` was read as "not given" and estimated batch 1."""
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 120, "max_position_embeddings": 64}))
    one_line_error(run("--hf-config", tmp_path, "--micro-batch", 0), "--micro-batch must be a positive integer, got 0")


@pytest.mark.parametrize("change, pattern", [
    ({"num_key_value_heads": 3}, r"num_key_value_heads \(3\) must divide num_attention_heads \(4\)"),
    ({"num_attention_heads": None}, "num_attention_heads must be a positive integer, got null"),
    ({"hidden_size": "32"}, 'hidden_size must be a positive integer, got "32"'),
])
def test_hf_config_fields_are_checked_as_the_lab_checks_them(tmp_path, change, pattern):
    """The estimator and the lab read config.json through one reader with one set of field checks."""
    config = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 120, "max_position_embeddings": 64}
    (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
    one_line_error(run("--hf-config", tmp_path), pattern)


def test_recompute_layers_from_the_command_line(capsys):
    """--recompute-layers k: the first k layers recompute (D22), between none and full; alone or out of range it
    is one line."""
    from tests_support import run_cli

    totals = {}
    for args in ([], ["--recompute", "full"], ["--recompute", "full", "--recompute-layers", "16"]):
        code, out, err = run_cli(["memory", "--preset", "llama3-8b", "--micro-batch", "1", "--seq", "8192", "--json",
                                  *args], capsys)
        assert code == 0, err
        totals[len(args)] = json.loads(out)["total"]
    assert totals[2] < totals[4] < totals[0]
    for args, message in ((["--recompute-layers", "16"], "goes with --recompute full"),
                          (["--recompute", "full", "--recompute-layers", "40"], "between 0 .* and the 32 layers")):
        code, _, err = run_cli(["memory", "--preset", "llama3-8b", *args], capsys)
        assert code != 0 and len(err.strip().splitlines()) == 1 and re.search(message, err), err


def test_float8_flag_estimates_a_transformers_model_s_float8_layers(tmp_path):
    """--float8 with --hf-config: the setup says it and the layers keep less (D24); beside a preset (the lab's
    GPT), one line that says to give --hf-config."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(dict(model_type="llama", vocab_size=512, hidden_size=256, intermediate_size=1024,
                                    num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                                    max_position_embeddings=256)))
    base = ("--hf-config", str(path), "--micro-batch", "2", "--seq", "256", "--compiled", "blocks", "--json")
    plain, f8 = run(*base), run(*base, "--float8", "tensorwise")
    assert plain.returncode == 0 and f8.returncode == 0, f8.stderr
    plain, f8 = json.loads(plain.stdout), json.loads(f8.stdout)
    assert f8["setup"]["float8"] == "tensorwise" and plain["setup"]["float8"] == "none"
    assert f8["total"] < plain["total"]
    one_line_error(run("--preset", "val-gpt", "--float8", "rowwise"), "--hf-config")
