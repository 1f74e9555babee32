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
    return subprocess.run([sys.executable, "-m", "fasttrain", "memory", *map(str, args)], capture_output=True,
                          text=True, timeout=120)


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
