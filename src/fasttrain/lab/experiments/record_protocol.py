"""The speedrun's record protocol: when a recipe counts, what its figure is, and the record file.

A **recipe** is a configuration with everything fixed, the number of optimizer steps included. One
run of it on one seed (:func:`run_fixed_steps`) trains exactly those steps; its figure is their
**training time**: from a device synchronization before the first step to one after the last,
validations excluded (each validation is bracketed by synchronizations and its time is subtracted),
warm-up and compilation excluded (they happen before, in the setup, reported apart). After the last
step the model is scored once over the **whole** validation split: its *final validation loss*.

Validations before the end (every ``eval_interval`` steps, a setting of the run, not a change of the
recipe) only give the **first crossing**, the training time to the first validation at or below the
target: a secondary figure, never the one that counts (it picks each seed's luckiest moment).

A recipe **counts** (:func:`verdict`) when, over n >= 5 seeds, the mean final validation loss is at or
below the target (1.47 nats per character) and a one-sided one-sample t-test says so with p < 0.01:

    H0: mu >= target,  H1: mu < target
    t = (mean - target) / (s / sqrt(n)),  s = sample standard deviation (ddof = 1),  df = n - 1
    p = P(T_df <= t)   (Student's t distribution, lower tail)

(``scipy.stats.ttest_1samp(losses, target, alternative="less")``). A recipe that misses is reported as
missing, with the reason. Its figure is the median over seeds of the training time.

The seeds that **choose** a recipe (its steps, learning rate, schedule: ``fasttrain lab speedrun search``)
never **judge** it: a record names both sets (``choosing_seeds``, ``judging_seeds``, disjoint), and the
t-test runs on the judging seeds alone, so picking the luckiest of several tries on the same seeds cannot
make a recipe count. ``fasttrain lab speedrun confirm RECORD`` reruns the record's recipe in a new process on
fresh seeds (disjoint from both) and writes what it found into the record (``confirmation``).

The record of a machine (:func:`record`) is the chosen recipe judged, written to
``results/speedrun/<machine>/record.json`` with fixed keys (:data:`RECORD_KEYS`) so that any script
can check it (:func:`check_record`).
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

from fasttrain.errors import FasttrainError

TARGET = 1.47
MIN_SEEDS = 5
ALPHA = 0.01                # a record wants p < 0.01 (a 1-in-100 chance that a recipe at 1.47 passes)
RECORD_KEYS = ("steps", "seeds", "final_val_losses", "mean_final_val_loss", "p_value", "train_s", "process_cold_s",
               "process_warm_s", "command", "choosing_seeds", "judging_seeds", "confirmation")
CONFIRMATION_KEYS = ("seeds", "final_val_losses", "mean_final_val_loss", "p_value", "train_s", "holds", "command")


# --- the statistics -------------------------------------------------------------------------------

def scipy_stats():
    """``scipy.stats`` (the t-test and its quantiles), or a one-line error naming the extra that installs it."""
    try:
        from scipy import stats
    except ImportError as exc:
        from fasttrain.lab.config import missing_extra

        raise missing_extra("scipy (the record protocol's t-test)", exc) from None
    return stats


def t_test_below(losses, target: float = TARGET) -> dict:
    """One-sided one-sample t-test of "the mean final loss is below ``target``" (see the module docstring).

    Returns n, df, mean, std (ddof = 1), t and p. With every loss equal the standard deviation is 0: t is
    -inf (p = 0) when they are below the target, +inf (p = 1) above it, and undefined (nan, p = 1) at it."""
    values = [float(v) for v in losses]
    n = len(values)
    if n < 2:
        raise FasttrainError(f"the t-test needs at least 2 final losses, got {n}")
    if not all(math.isfinite(v) for v in values):
        raise FasttrainError(f"a final validation loss is not finite ({values}); the recipe diverged")
    mean = statistics.fmean(values)
    std = statistics.stdev(values)
    if std == 0.0:
        t = -math.inf if mean < target else math.inf if mean > target else math.nan
        p = 0.0 if mean < target else 1.0
    else:
        res = scipy_stats().ttest_1samp(values, target, alternative="less")
        t, p = float(res.statistic), float(res.pvalue)
    return {"test": "one-sided one-sample t-test (H1: mean final validation loss < target)", "target": target,
            "n": n, "df": n - 1, "mean": mean, "std": std, "t": t, "p_value": p}


def verdict(final_losses, target: float = TARGET, *, min_seeds: int = MIN_SEEDS, alpha: float = ALPHA,
            planned_seeds: int | None = None) -> dict:
    """Whether a recipe counts, from its seeds' final validation losses (None: a seed that did not finish).

    ``counts`` is True only with >= ``min_seeds`` finished seeds (all ``planned_seeds`` of them), a mean at
    or below ``target`` and p < ``alpha``; otherwise ``missing`` says why (the first reason that applies)."""
    losses = list(final_losses)
    planned = len(losses) if planned_seeds is None else planned_seeds
    done = [v for v in losses if v is not None]
    out: dict = {"counts": False, "missing": None, "final_val_losses": losses, "target": target, "alpha": alpha,
                 "min_seeds": min_seeds, "n": len(done), "df": None, "mean": None, "std": None, "t": None,
                 "p_value": None}
    if done and not all(math.isfinite(v) for v in done):
        out["missing"] = "a seed diverged (non-finite final validation loss)"
        return out
    if len(done) >= 2:
        out.update({k: v for k, v in t_test_below(done, target).items() if k not in ("test", "target")})
    elif done:
        out.update(mean=done[0])
    if len(done) < planned:
        out["missing"] = f"only {len(done)} of {planned} seeds finished"
    elif len(done) < min_seeds:
        out["missing"] = f"{len(done)} seeds; the protocol needs at least {min_seeds}"
    elif out["mean"] > target:
        out["missing"] = f"mean final validation loss {out['mean']:.4f} > {target}"
    elif not out["p_value"] < alpha:
        out["missing"] = f"p = {out['p_value']:.3g} >= {alpha} (mean {out['mean']:.4f} not surely below {target})"
    else:
        out["counts"] = True
    return out


def compile_seconds_of(spent_s: float | None, steps: int, ms_per_step: float | None) -> float | None:
    """The compile time hidden in ``spent_s`` seconds that ran ``steps`` steps: spent_s - steps * ms_per_step / 1e3,
    the steps counted at the steady step time (the time the same steps take once compiled); None when unknown,
    0 when the steps alone took longer (noise: nothing left to call compilation)."""
    if spent_s is None or ms_per_step is None:
        return None
    return max(0.0, spent_s - steps * ms_per_step / 1e3)


def breakeven_steps(compile_s: float | None, eager_step_s: float | None, compiled_step_s: float | None) -> float | None:
    """Steps after which compiling has paid for itself: compile_s / (eager_step_s - compiled_step_s);
    None when unknown, inf when the compiled step is not faster."""
    if compile_s is None or eager_step_s is None or compiled_step_s is None:
        return None
    saved = eager_step_s - compiled_step_s
    return compile_s / saved if saved > 0 else math.inf


# --- one run of a recipe ----------------------------------------------------------------------------

def run_fixed_steps(trainer, *, target: float = TARGET, log=None) -> dict:
    """Train the recipe's ``max_steps`` optimizer steps from ``trainer``'s current (fresh) state through the
    lab's loop (:meth:`fasttrain.lab.trainer.Trainer.train`, ``timing="segment"``: no synchronization inside
    the steps, the clock stopped around every validation), then score the whole validation split.

    ``trainer.cfg.eval_interval``: validations on the way, for the first crossing only (0: the final one
    alone). A non-finite validation or training loss stops the run (``diverged``: no final loss)."""
    from fasttrain.lab.trainer import Metrics

    cfg = trainer.cfg
    steps = cfg.max_steps - trainer.step_index
    if not (isinstance(steps, int) and steps > 0):
        raise FasttrainError(f"a recipe trains a fixed positive number of steps, got {steps!r}")
    if cfg.eval_tokens is not None:
        raise FasttrainError("the record protocol scores the whole validation split: set eval_tokens to none "
                             f"(it is {cfg.eval_tokens})")
    log = log or (lambda s: None)
    metrics = Metrics(cfg, trainer.device, trainer.world, curve=False)
    first: dict = {}

    def stop(step, val, train_loss):
        log(f"  step {step:>5}  {metrics.train_s:7.2f} s  val {val:.4f}  train {train_loss:.4f}")
        if not (math.isfinite(val) and math.isfinite(train_loss)):
            return "diverged"
        if not first and val <= target:
            first.update(step=step, train_s=metrics.train_s)
        return None

    reason = trainer.train(steps, metrics=metrics, timing="segment", stop=stop)
    step = trainer.step_index
    evals = [{k: e[k] for k in ("step", "train_s", "val_loss", "train_loss", "tokens", "ms")} for e in metrics.evals]
    finished = reason == "steps" and bool(evals) and evals[-1]["step"] == cfg.max_steps
    final = evals[-1] if finished else None
    return {"seed": cfg.seed, "steps": step, "planned_steps": cfg.max_steps, "diverged": reason == "diverged",
            "train_s": metrics.train_s, "ms_per_step": 1e3 * metrics.train_s / step if step else None,
            "eval_s": metrics.eval_ms / 1e3, "evals": evals,
            "final_val_loss": final["val_loss"] if final else None,
            "final_val_tokens": final["tokens"] if final else None, "final_eval_ms": final["ms"] if final else None,
            "first_crossing_s": first.get("train_s"), "first_crossing_step": first.get("step")}


def summarize_recipe(runs: list[dict], *, planned_seeds: int, target: float = TARGET, min_seeds: int = MIN_SEEDS,
                     alpha: float = ALPHA) -> dict:
    """A recipe's row: the verdict over its seeds' final losses and the median training time (over seeds
    that finished), first crossings as a secondary column."""
    finals = [r["final_val_loss"] for r in runs]
    out = verdict(finals + [None] * (planned_seeds - len(runs)), target, min_seeds=min_seeds, alpha=alpha,
                  planned_seeds=planned_seeds)
    done = [r for r in runs if r["final_val_loss"] is not None]
    out["seeds"] = [r["seed"] for r in runs]
    out["train_s_median"] = statistics.median(r["train_s"] for r in done) if done else None
    out["ms_per_step_median"] = statistics.median(r["ms_per_step"] for r in done) if done else None
    crossings = [r["first_crossing_s"] for r in runs]
    out["first_crossing_s_median"] = statistics.median(crossings) if crossings and None not in crossings else None
    out["steps"] = runs[0]["planned_steps"] if runs else None
    return out


# --- the record file -----------------------------------------------------------------------------------

def record(summary: dict, *, command: str, choosing_seeds, process_cold_s: float | None = None,
           process_warm_s: float | None = None, **extra) -> dict:
    """``record.json`` of a judged recipe, from its :func:`summarize_recipe` row (its seeds are the judging
    seeds); ``choosing_seeds``: the seeds that chose it (its steps, its settings), none of them judged;
    ``extra`` (the recipe's name, configuration, machine, checkpoint, t statistic...) goes beside the fixed
    keys. ``confirmation`` starts empty (null): ``fasttrain lab speedrun confirm`` fills it."""
    if not summary.get("counts"):
        raise FasttrainError(f"only a counted recipe makes a record ({summary.get('missing')})")
    rec = {"steps": summary["steps"], "seeds": list(summary["seeds"]),
           "final_val_losses": list(summary["final_val_losses"]), "mean_final_val_loss": summary["mean"],
           "p_value": summary["p_value"], "train_s": summary["train_s_median"], "process_cold_s": process_cold_s,
           "process_warm_s": process_warm_s, "command": command, "choosing_seeds": list(choosing_seeds),
           "judging_seeds": list(summary["seeds"]), "confirmation": None}
    rec.update({k: v for k, v in extra.items() if k not in rec})
    check_record(rec)
    return rec


def _number(v, none_ok: bool = False) -> bool:
    return (v is None and none_ok) or (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v))


def _seed_list(v) -> bool:
    return isinstance(v, list) and all(isinstance(s, int) and not isinstance(s, bool) for s in v) \
        and len(set(v)) == len(v)


def check_record(rec: dict) -> dict:
    """Raise a one-line error unless ``rec`` has the fixed keys with values of the right shape: the judging
    seeds are the seeds (at least :data:`MIN_SEEDS`), none of them chose anything, and a confirmation ran
    on seeds neither chose nor judged."""
    missing = [k for k in RECORD_KEYS if k not in rec]
    if missing:
        raise FasttrainError(f"record.json lacks {', '.join(missing)} (a record of the earlier protocol: make it "
                             f"again with fasttrain lab speedrun search)")
    problems = []
    if not (isinstance(rec["steps"], int) and rec["steps"] > 0):
        problems.append("steps must be a positive integer")
    seeds, losses = rec["seeds"], rec["final_val_losses"]
    if not _seed_list(seeds):
        problems.append("seeds must be a list of distinct integers")
    elif len(seeds) < MIN_SEEDS:
        problems.append(f"a record is judged on at least {MIN_SEEDS} seeds, it has {len(seeds)}")
    if not (isinstance(losses, list) and len(losses) == len(seeds) and all(_number(v) for v in losses)):
        problems.append("final_val_losses must be one finite number per seed")
    elif not (_number(rec["mean_final_val_loss"]) and abs(statistics.fmean(losses) - rec["mean_final_val_loss"]) < 1e-9):
        problems.append("mean_final_val_loss must be the mean of final_val_losses")
    if not (_number(rec["p_value"]) and 0.0 <= rec["p_value"] <= 1.0):
        problems.append("p_value must be a number in [0, 1]")
    if not (_number(rec["train_s"]) and rec["train_s"] > 0):
        problems.append("train_s must be a positive number of seconds")
    for key in ("process_cold_s", "process_warm_s"):
        if not _number(rec[key], none_ok=True):
            problems.append(f"{key} must be seconds or null")
    if not (isinstance(rec["command"], str) and rec["command"].strip()):
        problems.append("command must be the command line that made it")
    choosing, judging = rec["choosing_seeds"], rec["judging_seeds"]
    if not (_seed_list(choosing) and _seed_list(judging)):
        problems.append("choosing_seeds and judging_seeds must be lists of distinct integers")
    else:
        if judging != seeds:
            problems.append("judging_seeds must be the seeds the t-test ran on (seeds)")
        if set(choosing) & set(judging):
            problems.append(f"seeds {sorted(set(choosing) & set(judging))} both chose and judged the recipe")
        problems += _confirmation_problems(rec["confirmation"], set(choosing) | set(judging))
    if problems:
        raise FasttrainError("record.json: " + "; ".join(problems))
    return rec


def _confirmation_problems(conf, used: set) -> list[str]:
    if conf is None:
        return []
    if not isinstance(conf, dict):
        return ["confirmation must be null or an object"]
    missing = [k for k in CONFIRMATION_KEYS if k not in conf]
    if missing:
        return [f"confirmation lacks {', '.join(missing)}"]
    problems = []
    if not _seed_list(conf["seeds"]):
        problems.append("confirmation seeds must be a list of distinct integers")
    elif set(conf["seeds"]) & used:
        problems.append(f"confirmation seeds {sorted(set(conf['seeds']) & used)} already chose or judged the recipe")
    if not isinstance(conf["holds"], bool):
        problems.append("confirmation holds must be true or false")
    return problems


def fresh_seeds(rec: dict, count: int) -> list[int]:
    """``count`` seeds that neither chose nor judged nor confirmed the record's recipe: the next integers after
    the largest used."""
    if not (isinstance(count, int) and count >= 1):
        raise FasttrainError(f"--seeds must be a positive count, got {count!r}")
    used = used_seeds(rec)
    start = max(used) + 1 if used else 0
    return list(range(start, start + count))


def used_seeds(rec: dict) -> set[int]:
    """Every seed the record has spent: choosing, judging and (when confirmed) confirming."""
    conf = rec.get("confirmation") or {}
    return set(rec["choosing_seeds"]) | set(rec["judging_seeds"]) | set(conf.get("seeds") or [])


def confirmation(rec: dict, runs: list[dict], *, command: str, **extra) -> dict:
    """The ``confirmation`` of a record from a second invocation's runs of its recipe (``runs``: one
    :func:`run_fixed_steps` record per fresh seed): the verdict at the record's target and alpha over those
    seeds alone; ``holds`` when the recipe counts again."""
    seeds = [r["seed"] for r in runs]
    clash = set(seeds) & (set(rec["choosing_seeds"]) | set(rec["judging_seeds"]))
    if clash:
        raise FasttrainError(f"seeds {sorted(clash)} already chose or judged this record; confirm on fresh seeds")
    target, alpha = rec.get("target", TARGET), rec.get("alpha", ALPHA)
    s = summarize_recipe(runs, planned_seeds=len(runs), target=target, alpha=alpha,
                         min_seeds=min(MIN_SEEDS, len(rec["seeds"])))
    if s["steps"] != rec["steps"]:
        raise FasttrainError(f"the confirmation ran {s['steps']} steps, the record's recipe {rec['steps']}")
    return {"seeds": seeds, "final_val_losses": s["final_val_losses"], "mean_final_val_loss": s["mean"],
            "std": s["std"], "t": s["t"], "df": s["df"], "p_value": s["p_value"], "train_s": s["train_s_median"],
            "holds": bool(s["counts"]), "missing": s["missing"], "target": target, "alpha": alpha,
            "command": command, **extra}


def write_record(rec: dict, folder) -> Path:
    """``folder/record.json``, written whole or not at all."""
    from fasttrain.files import atomic_write_text

    check_record(rec)
    path = Path(folder) / "record.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(rec, indent=1) + "\n")
    return path


def read_record(path) -> dict:
    from fasttrain.files import read_json_object

    return check_record(read_json_object(path, "record"))


__all__ = ["ALPHA", "CONFIRMATION_KEYS", "MIN_SEEDS", "RECORD_KEYS", "TARGET", "breakeven_steps", "check_record",
           "confirmation", "fresh_seeds", "read_record", "record", "run_fixed_steps", "scipy_stats", "summarize_recipe",
           "t_test_below",
           "used_seeds", "verdict", "write_record"]
