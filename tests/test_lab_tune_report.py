"""tune's answer (fasttrain.lab.tune.report): the table ranks by the measure the pick was chosen by and
says what each row was measured on (steps, seconds); a row faster than the pick on a shorter probe says
so; the TrainingArguments hold what tune decided and what the user gave, not the preset's schedule."""

from __future__ import annotations

import io
import json

import pytest

pytest.importorskip("torch")

from fasttrain.lab.config import preset  # noqa: E402
from fasttrain.lab.tune import Candidate, DeviceMemory, Entry, Probe, TuneResult, rank  # noqa: E402
from fasttrain.lab.tune import report as R  # noqa: E402

MIB = 2 ** 20


def entry(label, micro_batch, accumulation, probes, **overrides):
    overrides = {"per_device_train_batch_size": micro_batch, "gradient_accumulation_steps": accumulation, **overrides}
    candidate = Candidate((("precision", "bf16"), ("attention", label)), micro_batch, accumulation,
                          tuple(sorted(overrides.items())))
    return Entry(candidate, 100 * MIB, probes=[Probe(steps=s, tokens_per_s=t, peak_bytes=90 * MIB, wall_s=w,
                                                     losses=[3.0] * s) for s, t, w in probes])


def result(fixed=()):
    """The pick went the whole way (2 then 8 steps, 1,000 tokens/s); a rival stopped at the 2-step rung with
    1,500 tokens/s (a short probe flatters it: its compile had not settled); the baseline ran 8 steps."""
    pick = entry("sdpa", 8, 2, [(2, 900.0, 1.5), (8, 1000.0, 4.0)], bf16=True, attn_implementation="sdpa",
                 optim="adamw_torch_fused")
    rival = entry("eager", 16, 1, [(2, 1500.0, 1.25)], bf16=True)
    baseline = entry("eager", 4, 4, [(8, 600.0, 5.0)], bf16=True)
    base = preset("shakespeare-char", device="cpu", context=32, learning_rate=3e-4)
    memory = DeviceMemory("fake GPU", 1000 * MIB)
    return TuneResult(entries=rank([rival, baseline, pick]), pick=pick, baseline=baseline, memory=memory, dropped=[],
                      notes=[], pruned=0, space_size=3, tune_s=12.0, budget_s=None, budget_hit=False, seq=32,
                      global_batch_tokens=512, base=base, probes_measured=4, probes_cached=0, fixed=tuple(fixed))


def test_the_table_ranks_by_the_picks_measure_and_says_what_each_row_was_measured_on():
    res = result()
    rows = R.ranked_rows(res)
    assert [(r["rank"], r["label"], r["pick"]) for r in rows] == [
        (1, "8x2 bf16 sdpa", True), (2, "4x4 bf16", False), (3, "16x1 bf16", False)]
    assert [(r["ranked_on_steps"], r["steps_measured"], r["seconds_measured"]) for r in rows] == [
        (8, 10, 5.5), (8, 8, 5.0), (2, 2, 1.25)]
    assert [r["status"] for r in rows] == ["ok"] * 3
    assert rows[2]["note"] == "faster than the pick on a 2-step probe, not measured at the pick's 8"
    assert rows[0]["note"] == rows[1]["note"] == ""
    from rich.console import Console

    console = Console(file=io.StringIO(), width=250)
    R.print_report(res, console)
    text = console.file.getvalue()
    assert "ranked on" in text and "measured" in text and "8x2 bf16 sdpa (pick)" in text
    assert "10 steps, 5.5 s" in text and "2 steps, 1.2 s" in text and "ok; faster than the pick on a 2-step" in text
    assert "ranked as the pick was chosen: by the longest probe each configuration reached" in text.replace("\n", " ")


def test_training_arguments_hold_what_tune_decided_and_what_the_user_gave(tmp_path):
    res = result(fixed={"learning_rate", "device"})
    summary = R.summary(res)
    args = summary["pick"]["training_arguments"]
    # decided: the batch's shape and the pick's axes; given: the learning rate
    assert args == {"per_device_train_batch_size": 8, "gradient_accumulation_steps": 2, "bf16": True,
                    "optim": "adamw_torch_fused", "learning_rate": 3e-4}
    assert summary["pick"]["model_kwargs"] == {"attn_implementation": "sdpa"}
    assert summary["ranking"] == R.RANKING
    # nothing given: no learning rate, warm-up, schedule, steps or use_cpu of the preset's
    args = R.summary(result())["pick"]["training_arguments"]
    assert not {"learning_rate", "warmup_steps", "max_steps", "lr_scheduler_type", "use_cpu", "seed"} & set(args)
    R.write_results(result(), tmp_path / "run")
    assert json.loads((tmp_path / "run" / "training_arguments.json").read_text()) == args
    # the full mapping still exists for a runner (on a CPU: use_cpu)
    full, _, _ = R.training_arguments(R.pick_config(res), cpu=True)
    assert full["use_cpu"] is True and full["max_steps"] == 5000
