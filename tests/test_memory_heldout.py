"""dev/memory/heldout.py: the estimator against every measured peak under results/, the rows its rules were written
against counted apart. Its bookkeeping (what a row is, what is left out, the summaries), its one-line refusals of a
missing or broken source, and the committed table as the script writes it from the committed files."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests_support import one_line_error

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "dev" / "memory" / "heldout.py"


@pytest.fixture(scope="module")
def H():
    spec = importlib.util.spec_from_file_location("heldout", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_script(*args):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True, env=env,
                          timeout=300)


def fake_row(error=None, oom=False, fits=None, in_sample=False, tags=("sdpa",)):
    measured = None if oom else 100.0
    return dict(source="s", model="m", batch="1x1", technique=" + ".join(tags), tags=list(tags),
                measured_mib=measured, measured_reserved_mib=None,
                predicted_mib=None if error is None else 100.0 + error, predicted_then_mib=None, prediction="p",
                error_pct=error, oom=oom, predicted_fits=fits, rules_written_against=in_sample,
                rules=["r"] if in_sample else [], note=None)


def test_percentile_is_the_nearest_rank(H):
    values = list(range(1, 21))                     # 1..20: the 95th percentile is the 19th value
    assert H.percentile(values, 0.95) == 19
    assert H.percentile([3.0], 0.95) == 3.0 and H.percentile([], 0.95) is None
    assert H.percentile(list(range(1, 101)), 0.95) == 95


def test_the_summary_counts_an_oom_predicted_to_fit_and_keeps_in_sample_rows_apart(H):
    rows = [fake_row(1.0), fake_row(-3.0, tags=("eager attention",)), fake_row(6.0),
            fake_row(oom=True, fits=True), fake_row(oom=True, fits=False), fake_row(oom=True, fits=None),
            fake_row(40.0, in_sample=True), fake_row(oom=True, fits=True, in_sample=True)]
    data = H.table(rows, [])
    held = data["summary"]
    assert held["count"] == 3 and held["median_abs_error_pct"] == 3.0 and held["p95_abs_error_pct"] == 6.0
    assert held["worst_error_pct"] == 6.0 and held["within_5pct"] == 2
    # out of memory: three held-out rows, one of them a configuration the fit rule would have run
    assert held["oom"] == 3 and held["predicted_fit_but_oom"] == 1
    seen = data["in_sample"]
    assert seen["count"] == 1 and seen["worst_error_pct"] == 40.0 and seen["predicted_fit_but_oom"] == 1
    assert data["by_technique"]["eager attention"]["count"] == 1
    assert data["by_technique"]["sdpa"]["predicted_fit_but_oom"] == 1
    text = H.markdown(data)
    assert "3 rows: median |error| 3.00%, 95th percentile 6.00%" in text and "1 of them predicted to fit" in text


def test_tunes_fit_rule_is_the_searchs_own(H):
    device = {"total_mib": 1000.0, "context_mib": 100.0, "reserve": 0.25}
    assert H.fits(720.0, device) is True and H.fits(721.0, device) is False       # 720 x 1.25 + 100 = 1000
    assert H.fits(None, device) is None and H.fits(500.0, None) is None


def write_tune_folder(results: Path, grid: dict, ranked: list, confirm: dict | None = None) -> Path:
    """A machine's tune benchmark as bench_tune.py's report writes it, for the CPU test model (tiny-gpt2)."""
    from fasttrain.lab.config import LabConfig

    base = dataclasses.asdict(LabConfig(name="custom").with_(model="hf:/nowhere/tiny-gpt2/model", context=32,
                                                             bf16=True, attn_implementation="sdpa"))
    folder = results / "tune" / "a-gpu"
    (folder / "tiny-gpt2-tune").mkdir(parents=True)
    device = {"name": "a GPU", "total_mib": 1000.0, "context_mib": 10.0, "reserve": 0.25, "cpu": False}
    (folder / "tiny-gpt2-tune" / "tune.json").write_text(json.dumps(
        {"kind": "tune", "base": base, "device": device, "ranked": ranked}))
    state = {"grid": grid, "tune": {"pick": ranked[0]["overrides"]}, "hf": {"peak_mib": 5.0}}
    if confirm:
        state["confirm"] = confirm
    (folder / "tune.json").write_text(json.dumps({"kind": "tune-bench", "states": {"tiny-gpt2": state}}))
    return folder


def test_tune_rows_count_probes_grid_points_and_confirmations_once(H, tmp_path):
    pytest.importorskip("torch")
    small = {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 4}
    big = {"per_device_train_batch_size": 64, "gradient_accumulation_steps": 1, "torch_compile": True,
           "torch_compile_mode": "reduce-overhead"}
    ranked = [{"label": "2x4", "status": "ok", "overrides": small, "peak_mib": 3.0, "reserved_mib": 4.0,
               "predicted_mib": 2.5},
              {"label": "1x8", "status": "stopped after 90 s", "overrides": {**small, "per_device_train_batch_size": 1},
               "peak_mib": None}]
    grid = {"a": {"overrides": small, "peak_mib": 3.0, "from_tune_cache": True},
            "b": {"overrides": big, "peak_mib": None, "error": "out of memory", "oom": True},
            "c": {"overrides": {**small, "optim": "adamw_torch_fused"}, "peak_mib": 2.9, "error": None}}
    folder = write_tune_folder(tmp_path / "results", grid, ranked, {"steps": 200, "oom": False, "peak_mib": 3.1,
                                                                   "predicted_mib": 2.5})
    rows, excluded = H.tune_rows(folder, H.dev_models("dev/tune/bench_tune.py"), str)
    kinds = [r["source"].rsplit(" ", 1)[-1] if " " in r["source"] else "probe" for r in rows]
    assert kinds == ["probe", "grid", "grid", "confirmation"]
    probe, oom, grid, confirm = rows
    assert probe["measured_mib"] == 3.0 and probe["measured_reserved_mib"] == 4.0 and probe["predicted_then_mib"] == 2.5
    assert probe["prediction"] == "today's estimator" and probe["predicted_mib"] > 0 and not probe["rules"]
    # the grid's point out of memory: predicted, not measured; a tiny model fits the recorded device
    assert oom["oom"] and oom["measured_mib"] is None and oom["error_pct"] is None and oom["predicted_fits"] is True
    assert oom["rules"] == ["CUDA-graph pool"] and "CUDA graphs" in oom["technique"]
    assert confirm["measured_mib"] == 3.1 and confirm["batch"] == "2x4"
    reasons = [e["reason"] for e in excluded]
    assert any("tune's probe cache" in r for r in reasons) and any("stopped after 90 s" in r for r in reasons)
    assert any("HF Trainer" in r for r in reasons)
    summary = H.table(rows, excluded)["summary"]
    assert summary["count"] == 3 and summary["oom"] == 0           # the OOM point is under the pool's rule
    assert H.table(rows, excluded)["in_sample"]["predicted_fit_but_oom"] == 1


def test_a_configuration_recorded_before_a_field_existed_reads_as_its_default(H):
    cfg = H.config_of({"name": "custom", "context": 64, "float8": None, "removed_since": 3,
                       "lora_target_modules": ["qkv"]})
    assert cfg.float8 == "none" and cfg.lora_target_modules == ("qkv",)
    dist = H.config_of({"name": "custom"}, {"world_size": 2, "strategy": "fsdp", "label": "fsdp-zero2", "tp": 1})
    assert dist.nproc_per_node == 2 and dist.reshard_after_forward is False and dist.label == "fsdp-zero2"
    assert H.model_name("hf:/tmp/tune-work/llama-1b/model") == "llama-1b" and H.model_name("hf:gpt2") == "gpt2"


def test_a_rule_counts_in_sample_only_the_rows_it_was_written_after(H):
    """D26 was written after GPT-2's rows missed, and for the other families before any GPU row of theirs: the
    same configuration is in sample for GPT-2, held out for Llama."""
    cfg = H.config_of({"name": "custom", "use_liger_kernel": True, "liger_kernels": "fused_linear_cross_entropy",
                       "torch_compile": True, "torch_compile_scope": "model"})
    d26 = H.RULES["GPT-2's fused head beside a whole compiled model (D26)"]
    assert d26(cfg, {"model_type": "gpt2"}) and not d26(cfg, {"model_type": "llama"}) and not d26(cfg, None)
    assert not d26(cfg.with_(torch_compile_scope="blocks"), {"model_type": "gpt2"})


@pytest.mark.parametrize("damage, message", [
    ("missing", r"tune\.json: no such file"),
    ("broken", r"tune\.json: not valid JSON \(line 1"),
    ("no states", r"tune\.json: no 'states'"),
    ("no validation", r"validation\.json: no such file"),
])
def test_a_missing_or_broken_source_is_one_line(tmp_path, damage, message):
    results = tmp_path / "results"
    (results / "memory").mkdir(parents=True)
    folder = results / "tune" / "a-gpu"
    folder.mkdir(parents=True)
    if damage == "broken":
        (folder / "tune.json").write_text('{"states": ')
    elif damage == "no states":
        (folder / "tune.json").write_text('{"kind": "tune-bench"}')
    elif damage == "no validation":
        (folder / "tune.json").write_text('{"states": {}}')
    one_line_error(run_script("--results", results), message)
    assert not (results / "memory" / "heldout.json").exists()


def test_a_missing_output_folder_or_readme_markers_are_one_line(tmp_path):
    one_line_error(run_script("--out", tmp_path / "nowhere"), "nowhere: no such folder")
    readme = tmp_path / "README.md"
    readme.write_text("# no markers\n")
    one_line_error(run_script("--out", tmp_path, "--into", readme), "no <!-- memory-heldout:start --> line")


def test_the_committed_table_is_what_the_script_writes_from_the_committed_results(H):
    """results/memory/heldout.json and .md, written again from the committed files with today's estimator: the
    same (a changed rule or result file asks for the command to run again)."""
    pytest.importorskip("torch")
    data = json.loads(json.dumps(H.table(*H.collect(ROOT / "results"))))
    committed = json.loads((ROOT / "results" / "memory" / "heldout.json").read_text())
    assert data == committed, "results/memory/heldout.json is stale: run python3 dev/memory/heldout.py"
    assert (ROOT / "results" / "memory" / "heldout.md").read_text() == H.markdown(committed)
    # the summary is of the held-out rows alone, the in-sample ones counted apart
    runs = committed["runs"]
    assert committed["summary"]["count"] == sum(r["error_pct"] is not None and not r["rules_written_against"]
                                                for r in runs)
    assert committed["in_sample"]["count"] == sum(r["error_pct"] is not None and r["rules_written_against"]
                                                  for r in runs)


def test_a_capped_point_refuses_bad_input_in_one_line_before_any_work():
    """dev/memory/capped_point.py (a configuration on a larger card, the allocator capped at a smaller card's room):
    the cap's fraction of this card, a cap above the card, a --set that is not a JSON object, an unknown model and a
    machine without CUDA are refused in one line."""
    spec = importlib.util.spec_from_file_location("capped_point", ROOT / "dev" / "memory" / "capped_point.py")
    capped = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(capped)
    assert capped.capped_fraction(80_552, 143_771 * 2**20) == pytest.approx(80_552 / 143_771)
    with pytest.raises(SystemExit, match="give a cap below it"):
        capped.capped_fraction(150_000, 143_771 * 2**20)
    script = ROOT / "dev" / "memory" / "capped_point.py"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    for args, says in ((["--set", "[1]"], "give a JSON object"), (["--set", "{"], "not JSON"),
                       (["--model", "nope", "--set", "{}"], "--model nope: one of"),
                       (["--set", "{}"], "needs a CUDA GPU")):
        argv = [sys.executable, str(script), "/nonexistent", "--cap-mib", "80000"]
        argv += args if "--model" in args else ["--model", "gpt2-124m", *args]
        done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300)
        assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr
        assert says in done.stderr, done.stderr


def test_a_capped_points_snapshot_names_what_is_alive_at_the_peak_by_the_models_shape():
    """capped_point.py --snapshot: the allocator's events of one step, the peak found and what was alive there named
    after the model's shape (Llama 1B at 64 x 2048: N h, N f, N kv in bf16 or fp32), the rest by size; a free of a
    block allocated before the history started lowers the live bytes (the peak is above the step's start)."""
    from types import SimpleNamespace

    spec = importlib.util.spec_from_file_location("capped_point", ROOT / "dev" / "memory" / "capped_point.py")
    capped = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(capped)
    llama = dict(hidden_size=2048, intermediate_size=8192, num_attention_heads=32, num_key_value_heads=8,
                 vocab_size=128256)
    names = capped.shape_names(SimpleNamespace(per_device_train_batch_size=64, context=2048), llama)
    n = 64 * 2048
    assert names[n * 2048 * 2] == ["N h bf16"] and names[n * 8192 * 2] == ["N f bf16"]
    assert names[n * 512 * 4] == ["N kv fp32"] and names[n * 2048 * 4] == ["N h fp32"]
    nh, nf, odd = n * 2048 * 2, n * 8192 * 2, 12_345
    events = [(0, -nh), (1, nf), (2, nh), (3, nf), (4, odd), (5, -nf), (6, -nf), (7, nh)]
    got = capped.alive_by_name(events, names)
    # live: -nh, -nh+nf, nf, 2nf, 2nf+odd (the peak), then frees
    assert got["peak_above_start_mib"] == pytest.approx((2 * nf + odd) / 2**20)
    assert got["alive"] == {"N f bf16": 2, f"{odd:,} B": 1}
