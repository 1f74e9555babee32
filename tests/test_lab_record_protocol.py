"""The speedrun's record protocol on the CPU: the t-test against an answer worked by hand, recipes that miss
reported as missing (and why), fixed-step runs timed apart from validation, the record file's keys and shape."""

from __future__ import annotations

import json
import math

import pytest

from fasttrain.errors import FasttrainError
from fasttrain.lab.experiments import record_protocol as rp


def _student_t4_cdf(t: float) -> float:
    # Student's t with 4 degrees of freedom has a closed-form CDF:
    # F(t) = 1/2 + (3/8) u (1 - t^2 / (12 (1 + t^2/4))),  u = t / sqrt(1 + t^2/4)
    q = 1.0 + t * t / 4.0
    return 0.5 + 0.375 * (t / math.sqrt(q)) * (1.0 - t * t / (12.0 * q))


def test_t_test_matches_the_answer_worked_by_hand():
    losses = [1.460, 1.465, 1.455, 1.462, 1.458]
    # by hand: mean = 7.300 / 5 = 1.460; deviations 0, .005, -.005, .002, -.002;
    # s^2 = (0 + 25 + 25 + 4 + 4) e-6 / 4 = 14.5e-6; t = (1.460 - 1.47) / (sqrt(14.5e-6) / sqrt(5))
    mean, s = 1.460, math.sqrt(14.5e-6)
    t = (mean - 1.47) / (s / math.sqrt(5))
    assert t == pytest.approx(-5.872202195147035, rel=1e-9)
    res = rp.t_test_below(losses, 1.47)
    assert (res["n"], res["df"]) == (5, 4)
    assert res["mean"] == pytest.approx(mean, abs=1e-12) and res["std"] == pytest.approx(s, rel=1e-9)
    assert res["t"] == pytest.approx(t, rel=1e-9)
    assert res["p_value"] == pytest.approx(_student_t4_cdf(t), rel=1e-9)     # lower tail: ~0.0021
    assert 0.002 < res["p_value"] < 0.0022


def test_a_mean_just_below_the_target_with_noisy_seeds_is_not_sure_enough():
    losses = [1.4699 + d for d in (-0.004, 0.004, -0.003, 0.003, 0.0)]
    v = rp.verdict(losses, 1.47)
    # mean 1.4699, s = sqrt(5e-5 / 4); t = -0.0001 / (s / sqrt 5) = -0.0632...
    s = math.sqrt((16 + 16 + 9 + 9) * 1e-6 / 4)
    t = -0.0001 / (s / math.sqrt(5))
    assert v["t"] == pytest.approx(t, rel=1e-6) and v["p_value"] == pytest.approx(_student_t4_cdf(t), rel=1e-6)
    assert not v["counts"] and v["missing"].startswith("p = 0.47") and ">= 0.01" in v["missing"]


@pytest.mark.parametrize("losses,planned,reason", [
    ([1.46, 1.45, 1.46, 1.45, 1.49], 5, "p = 0.169 >= 0.01"),      # mean 1.462 < 1.47, but one seed at 1.49
    ([1.50, 1.48, 1.49, 1.47, 1.48], 5, "mean final validation loss 1.4840 > 1.47"),
    ([1.40, 1.41, 1.40], 3, "3 seeds; the protocol needs at least 5"),
    ([1.40, 1.41, 1.40, 1.41, None], 5, "only 4 of 5 seeds finished"),
    ([1.40, 1.41, 1.40, 1.41, float("nan")], 5, "a seed diverged"),
])
def test_recipes_that_miss_are_reported_as_missing(losses, planned, reason):
    v = rp.verdict(losses, 1.47, planned_seeds=planned)
    assert not v["counts"] and v["missing"].startswith(reason), v["missing"]
    assert v["final_val_losses"] == losses


def test_five_tight_seeds_below_the_target_count():
    v = rp.verdict([1.455, 1.458, 1.457, 1.456, 1.459], 1.47)
    assert v["counts"] and v["missing"] is None and v["p_value"] < 1e-4 and v["df"] == 4


def test_equal_losses_have_no_spread():
    assert rp.t_test_below([1.4] * 5, 1.47)["p_value"] == 0.0
    assert rp.t_test_below([1.5] * 5, 1.47)["p_value"] == 1.0
    with pytest.raises(FasttrainError, match="at least 2"):
        rp.t_test_below([1.4])


def test_breakeven_is_compile_time_over_the_step_time_saved():
    assert rp.breakeven_steps(29.0, 0.014, 0.0057) == pytest.approx(29.0 / 0.0083)
    assert rp.breakeven_steps(10.0, 0.005, 0.006) == math.inf
    assert rp.breakeven_steps(None, 0.01, 0.005) is None


def test_compile_seconds_are_the_time_spent_less_the_steps_at_the_steady_step_time():
    # 3 warm-up steps took 12.5 s; at 20 ms a step they would have taken 0.06 s: 12.44 s were compilation
    assert rp.compile_seconds_of(12.5, 3, 20.0) == pytest.approx(12.44)
    assert rp.compile_seconds_of(0.05, 3, 20.0) == 0.0          # faster than steady: noise, nothing compiled
    assert rp.compile_seconds_of(None, 3, 20.0) is None
    assert rp.compile_seconds_of(12.5, 3, None) is None


# --- a fixed-step run ------------------------------------------------------------------------------------

def tiny_trainer(corpus, losses=None, *, seed=0, eval_s=0.0, **overrides):
    """The lab's trainer on the tiny preset; ``losses``: what its validations return (each after sleeping
    ``eval_s``), so that what the protocol does with them is known."""
    import time

    import torch

    from fasttrain.lab.build import make_trainer
    from fasttrain.lab.config import preset

    cfg = preset("tiny", **{"device": "cpu", "eval_tokens": None, "eval_interval": 0, "seed": seed, **overrides})
    trainer = make_trainer(cfg, corpus, torch.device("cpu"))
    if losses is not None:
        values = iter(losses)

        def evaluate(tokens=None):
            time.sleep(eval_s)
            return next(values), 1000
        trainer.evaluate = evaluate
    return trainer


def test_a_fixed_step_run_times_training_only_and_keeps_the_first_crossing_apart(corpus):
    trainer = tiny_trainer(corpus, [1.6, 1.46, 1.48, 1.465], eval_s=0.25, max_steps=20, eval_interval=5)
    import time

    t = time.perf_counter()
    rec = rp.run_fixed_steps(trainer, target=1.47)
    wall = time.perf_counter() - t
    assert trainer.step_index == 20 and rec["steps"] == 20
    # three validations on the way (5, 10, 15) and the final one, after the last step
    assert [e["step"] for e in rec["evals"]] == [5, 10, 15, 20]
    assert rec["final_val_loss"] == 1.465 and rec["first_crossing_step"] == 10
    # the validations' sleep (4 x 0.25 s) is in eval_s and outside train_s
    assert rec["eval_s"] >= 4 * 0.25 and wall - rec["train_s"] >= 4 * 0.25 and rec["train_s"] > 0
    assert rec["first_crossing_s"] == rec["evals"][1]["train_s"] < rec["train_s"]


def test_the_final_validation_scores_the_whole_split(corpus):
    trainer = tiny_trainer(corpus, max_steps=3)
    rec = rp.run_fixed_steps(trainer)
    assert rec["final_val_tokens"] == len(corpus.val) - 1 and rec["evals"][-1]["step"] == 3
    with pytest.raises(FasttrainError, match="whole validation split"):
        rp.run_fixed_steps(tiny_trainer(corpus, max_steps=3, eval_tokens=512))


def test_a_diverged_run_has_no_final_loss_and_the_recipe_misses(corpus):
    runs = [rp.run_fixed_steps(tiny_trainer(corpus, [1.45], seed=s, max_steps=2)) for s in range(4)]
    runs.append(rp.run_fixed_steps(tiny_trainer(corpus, [float("inf")], seed=4, max_steps=2)))
    assert runs[-1]["diverged"] and runs[-1]["final_val_loss"] is None
    s = rp.summarize_recipe(runs, planned_seeds=5)
    assert not s["counts"] and s["missing"] == "only 4 of 5 seeds finished" and s["steps"] == 2


# --- record.json ---------------------------------------------------------------------------------------

def _run(seed, final, steps=3):
    return {"seed": seed, "steps": steps, "planned_steps": steps, "diverged": False, "train_s": 0.5 + seed / 100,
            "ms_per_step": 1.0, "eval_s": 0.1, "evals": [], "final_val_loss": final, "final_val_tokens": 100,
            "final_eval_ms": 10.0, "first_crossing_s": None, "first_crossing_step": None}


def _counted_summary():
    runs = [_run(s, v) for s, v in enumerate([1.455, 1.458, 1.457, 1.456, 1.459])]
    return rp.summarize_recipe(runs, planned_seeds=5)


def test_record_json_has_the_fixed_keys_and_shape(tmp_path):
    summary = _counted_summary()
    assert summary["counts"] and summary["steps"] == 3
    rec = rp.record(summary, command="fasttrain lab speedrun --rungs muon", process_cold_s=19.5, process_warm_s=None,
                    choosing_seeds=[100, 101, 102], rung="muon", t=summary["t"])
    path = rp.write_record(rec, tmp_path / "nvidia-h100")
    data = json.loads(path.read_text())
    assert list(data)[:len(rp.RECORD_KEYS)] == list(rp.RECORD_KEYS)
    assert data["seeds"] == [0, 1, 2, 3, 4] and data["final_val_losses"] == [1.455, 1.458, 1.457, 1.456, 1.459]
    assert data["mean_final_val_loss"] == pytest.approx(1.457) and 0 < data["p_value"] < 0.01
    assert data["choosing_seeds"] == [100, 101, 102] and data["judging_seeds"] == data["seeds"]
    assert data["confirmation"] is None
    assert data["train_s"] == 0.52 and data["rung"] == "muon" and data["process_warm_s"] is None
    assert rp.read_record(path) == data


@pytest.mark.parametrize("change,message", [
    (lambda r: r.pop("p_value"), "lacks p_value"),
    (lambda r: r.update(seeds=[1, 1, 2, 3, 4]), "distinct"),
    (lambda r: r.update(final_val_losses=[1.4]), "one finite number per seed"),
    (lambda r: r.update(mean_final_val_loss=1.2), "mean of final_val_losses"),
    (lambda r: r.update(p_value=2), "p_value must be"),
    (lambda r: r.update(command=""), "command"),
    (lambda r: r.pop("choosing_seeds"), "lacks choosing_seeds"),
    (lambda r: r.update(choosing_seeds=[7, 3]), "seeds [3] both chose and judged"),
    (lambda r: r.update(judging_seeds=[0, 1, 2, 3, 9]), "judging_seeds must be the seeds"),
    (lambda r: r.update(seeds=[0, 1, 2], judging_seeds=[0, 1, 2], final_val_losses=[1.4] * 3,
                        mean_final_val_loss=1.4), "at least 5 seeds"),
    (lambda r: r.update(confirmation={"seeds": [9]}), "confirmation lacks"),
    (lambda r: r.update(confirmation=dict(CONFIRMED, seeds=[8, 20])), "confirmation seeds [8] already"),
])
def test_a_malformed_record_is_one_line(change, message):
    rec = rp.record(_counted_summary(), command="x", choosing_seeds=[7, 8])
    change(rec)
    with pytest.raises(FasttrainError) as info:
        rp.check_record(rec)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_a_missing_recipe_makes_no_record():
    runs = [_run(s, 1.5) for s in range(5)]
    with pytest.raises(FasttrainError, match="only a counted recipe"):
        rp.record(rp.summarize_recipe(runs, planned_seeds=5), command="x", choosing_seeds=[])


CONFIRMED = {"seeds": [20, 21, 22, 23, 24], "final_val_losses": [1.45] * 5, "mean_final_val_loss": 1.45, "p_value": 0.0,
             "train_s": 0.5, "holds": True, "command": "fasttrain lab speedrun confirm record.json"}


def test_the_round_two_record_does_not_count_at_the_new_alpha():
    # round two's committed record: mean 1.4667, p = 0.045 over seeds 1337-1341; a record now wants p < 0.01
    losses = [1.4691454937382817, 1.468113875435911, 1.4609458085494302, 1.466519009877921, 1.468596939320709]
    v = rp.verdict(losses, 1.47)
    assert rp.ALPHA == 0.01 and 0.04 < v["p_value"] < 0.05
    assert not v["counts"] and ">= 0.01" in v["missing"]


def test_fresh_seeds_follow_every_seed_the_record_spent():
    rec = rp.record(_counted_summary(), command="x", choosing_seeds=[7, 8])
    assert rp.fresh_seeds(rec, 5) == [9, 10, 11, 12, 13]
    rec["confirmation"] = dict(CONFIRMED)
    assert rp.used_seeds(rec) == {0, 1, 2, 3, 4, 7, 8, 20, 21, 22, 23, 24}
    assert rp.fresh_seeds(rec, 2) == [25, 26]
    with pytest.raises(FasttrainError, match="positive count"):
        rp.fresh_seeds(rec, 0)


def test_a_confirmation_is_the_verdict_over_fresh_seeds_alone():
    rec = rp.record(_counted_summary(), command="x", choosing_seeds=[7, 8])
    good = [_run(s, v) for s, v in zip(range(20, 25), [1.452, 1.455, 1.451, 1.454, 1.453])]
    conf = rp.confirmation(rec, good, command="fasttrain lab speedrun confirm r.json")
    assert conf["holds"] and conf["seeds"] == [20, 21, 22, 23, 24] and conf["p_value"] < 0.01
    assert conf["mean_final_val_loss"] == pytest.approx(1.453) and conf["train_s"] == pytest.approx(0.72)
    assert list(conf)[:1] == ["seeds"] and set(rp.CONFIRMATION_KEYS) <= set(conf)
    rec["confirmation"] = conf
    rp.check_record(rec)
    # the same recipe ending near the target on the fresh seeds: written, and it does not hold
    near = [_run(s, v) for s, v in zip(range(20, 25), [1.466, 1.472, 1.469, 1.464, 1.471])]
    miss = rp.confirmation(rec, near, command="x")
    assert not miss["holds"] and miss["missing"].startswith("p = ")
    # a seed that judged (or chose) the record is refused; so is another step count
    with pytest.raises(FasttrainError, match=r"seeds \[3, 8\] already chose or judged"):
        rp.confirmation(rec, [_run(s, 1.45) for s in (3, 8, 30, 31, 32)], command="x")
    with pytest.raises(FasttrainError, match="ran 4 steps, the record's recipe 3"):
        rp.confirmation(rec, [_run(s, 1.45, steps=4) for s in range(30, 35)], command="x")
