"""``fasttrain lab speedrun``: the Shakespeare speedrun ladder.

Each rung is the ``shakespeare-char`` preset plus the overrides of every rung up to it (plain
:class:`~fasttrain.lab.config.LabConfig` fields, gpt-fast style), so each adds one change to the
rung before it. Rung 0 is the preset as users run it: eager PyTorch, fp32, AdamW, batches cut on
the CPU. A run of a rung trains until the first validation over the **whole** validation split
at or below the target (1.47 nats per character), the end of its schedule, a training-time cap,
or ``patience`` steps without a new best validation loss (over-fitting: the loss only rises after).

What is timed, per rung and seed:

- training time: from a device synchronization before the first step to one after the step of
  each evaluation, summed over the segments between evaluations (batch cutting, forward,
  backward, optimizer, learning-rate schedule included; evaluation excluded). The time to target
  is the training time up to the first evaluation at or below the target; ms/step is the
  training time over the steps run;
- evaluation time (every validation, synchronized), reported apart;
- setup, once per rung: building the model, compiling and warming up (``timing_warmup_steps``
  training steps and one validation, which compile the step and capture its CUDA graphs); the
  warm-up trains the same parameters, so they are then restored in place (:meth:`Trainer.reset`:
  the initial weights of the seed copied into the same tensors, a fresh optimizer, step 0) and
  compiled code and CUDA graphs stay valid for every seed. ``reset_s`` is that restoration, per seed;
- wall time of the rung (setup, every seed's training and evaluations) and of the whole process
  (from the interpreter's start, read from /proc on Linux).

A rung counts only if every seed reaches the target; its figure is the median over seeds. Speed-ups
divide by the rows measured in the same invocation (the baseline is rung 0 when it ran); where the
row divided by does not count, the ratio is a lower bound (``≥``): its shortest run that missed
trained that long without reaching the target.
"""

from __future__ import annotations

import datetime as _dt
import gc
import math
import os
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import click

from fasttrain.errors import FasttrainError
from fasttrain.files import check_new_folder
from fasttrain.lab.config import LabConfig, preset
from fasttrain.lab.overrides import parse_assignments, parse_variant
from fasttrain.lab.speedrun_ladder import LADDER, Rung
from fasttrain.lab.speedrun_report import (DEFAULT_SEEDS, ladder_markdown, median_run, merge_command, readme_command,
                                           save_fastest, summarize, write_results)

TARGET = 1.47
BASE_PRESET = "shakespeare-char"


def rung_names() -> list[str]:
    return [r.name for r in LADDER]


def cumulative_overrides(index: int) -> dict:
    merged: dict = {}
    for rung in LADDER[: index + 1]:
        merged.update(rung.overrides)
    return merged


# --- parsing the command's input -----------------------------------------------------------------

def parse_rungs(text: str | None) -> list[int]:
    """``None``/"all" -> every rung; else comma-separated indices, names or ranges ``a-b`` (in ladder order)."""
    if text is None or text.strip() == "all":
        return list(range(len(LADDER)))
    names = rung_names()
    chosen: list[int] = []
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        if item in names:
            chosen.append(names.index(item))
            continue
        lo, sep, hi = item.partition("-")
        try:
            first, last = (int(lo), int(hi)) if sep and lo.isdigit() else (int(item), int(item))
        except ValueError:
            first = last = -1
        if not (0 <= first <= last < len(LADDER)):
            raise FasttrainError(f"unknown rung {item!r}; use 0-{len(LADDER) - 1} or one of {', '.join(names)} "
                                 f"(comma-separated; see: fasttrain lab speedrun --list)")
        chosen.extend(range(first, last + 1))
    if not chosen:
        raise FasttrainError("--rungs is empty; name at least one rung (see: fasttrain lab speedrun --list)")
    return sorted(set(chosen))


def parse_seeds(text: str | None, first: int) -> list[int]:
    """"3" -> three seeds from ``first``; "1337,42" -> those seeds (a list of one: "42,")."""
    text = str(DEFAULT_SEEDS) if text is None else str(text).strip()
    bad = FasttrainError(f"--seeds {text!r}: give a count (e.g. 3) or a comma-separated list of distinct "
                         f"non-negative integers (e.g. 1337,1338)")
    if "," not in text:
        try:
            count = int(text)
        except ValueError:
            raise bad from None
        if count < 1:
            raise bad
        return [first + i for i in range(count)]
    try:
        seeds = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise bad from None
    if not seeds or any(s < 0 for s in seeds) or len(set(seeds)) != len(seeds):
        raise bad
    return seeds


# --- the plan ----------------------------------------------------------------------------------

@dataclass
class Row:
    """One row of the ladder table: a rung (or a variant of the last rung chosen) and its seeds."""

    label: str               # "3" for a rung, the variant's name otherwise
    name: str
    change: str              # what changed since the row above (every rung in between, for a gap)
    cfg: LabConfig
    seeds: list[int]
    planned_seeds: int       # the seeds the other rows get (a row with fewer is marked)
    index: int | None = None


def parse_rung_seeds(text: str | None) -> dict[int, int]:
    """"0=1,5-6=2" -> {0: 1, 5: 2, 6: 2}: fewer seeds for some rungs (names allowed)."""
    out: dict[int, int] = {}
    for item in (t.strip() for t in (text or "").split(",") if t.strip()):
        rungs, sep, count = item.partition("=")
        try:
            n = int(count)
        except ValueError:
            n = 0
        if not sep or n < 1:
            raise FasttrainError(f"--rung-seeds {item!r}: write RUNG=COUNT (e.g. 0=1,5=1), COUNT >= 1")
        for i in parse_rungs(rungs):
            out[i] = n
    return out


def plan(rungs: list[int], seeds: list[int], *, base_preset: str = BASE_PRESET, baseline_seeds: int | None = None,
         rung_seeds: dict[int, int] | None = None, variants: list[tuple[str, dict]] = (), sets: dict | None = None,
         device: str | None = None, data_dir: str | None = None) -> list[Row]:
    """The rows to run: each chosen rung's configuration (validated now, before anything trains).
    ``rung_seeds`` (and ``baseline_seeds``, for rung 0) run some rungs on the first few seeds only."""
    sets = dict(sets or {})
    rung_seeds = dict(rung_seeds or {})
    if baseline_seeds is not None:
        rung_seeds[0] = baseline_seeds
    for i, n in rung_seeds.items():
        if not 1 <= n <= len(seeds):
            which = "--baseline-seeds" if i == 0 and n == baseline_seeds else f"--rung-seeds for rung {i}"
            raise FasttrainError(f"{which} must be between 1 and the number of seeds ({len(seeds)}), got {n}")
    if device is not None:
        sets["device"] = device
    if data_dir is not None:
        sets["data_dir"] = data_dir
    rows: list[Row] = []
    prev = -1
    for i in rungs:
        steps = LADDER[prev + 1: i + 1] if i > prev else LADDER[i: i + 1]
        change = LADDER[0].change if i == 0 else " + ".join(r.change for r in steps)
        cfg = preset(base_preset, **{**cumulative_overrides(i), **sets}).with_(name=LADDER[i].name)
        row_seeds = list(seeds[:rung_seeds.get(i, len(seeds))])
        rows.append(Row(str(i), LADDER[i].name, change, cfg, row_seeds, len(seeds), i))
        prev = i
    top = rungs[-1]
    names = {r.name for r in rows}
    for name, overrides in variants:
        if name in names or name.isdigit():
            raise FasttrainError(f"--variant name {name!r} is taken; give each variant its own name")
        names.add(name)
        change = f"rung {top} ({LADDER[top].name}) with " + ", ".join(f"{k}={v}" for k, v in overrides.items())
        cfg = preset(base_preset, **{**cumulative_overrides(top), **overrides, **sets}).with_(name=name)
        rows.append(Row(name, name, change, cfg, list(seeds), len(seeds)))
    return rows


# --- timing one run ------------------------------------------------------------------------------

def process_age_s() -> float | None:
    """Seconds since this process started (interpreter start and imports included), from /proc."""
    try:
        start_ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def _sync(device) -> None:
    from fasttrain.lab.measure import sync

    sync(device)


def train_to_target(trainer, *, target: float, max_train_s: float, patience_steps: int, log=None) -> dict:
    """One run from ``trainer``'s current (fresh) state, through the trainer's loop timed by
    segments between evaluations, until the target, the schedule's end, the training-time cap or
    ``patience_steps`` without a new best validation loss."""
    from fasttrain.lab.trainer import Metrics

    cfg = trainer.cfg
    log = log or (lambda s: None)
    metrics = Metrics(cfg, trainer.device, trainer.world, curve=False)
    best = {"val": math.inf, "step": 0}
    hit = {}

    def stop(step, val, train_loss):
        e = metrics.evals[-1]
        log(f"  step {step:>5}  {e['train_s']:7.2f} s  val {val:.4f}  train {train_loss:.4f}")
        if not (math.isfinite(val) and math.isfinite(train_loss)):
            return "diverged"
        if val < best["val"]:
            best.update(val=val, step=step)
        if val <= target:
            hit.update(step=step, train_s=e["train_s"], val_loss=val)
            return "target"
        if max_train_s and e["train_s"] >= max_train_s:
            return "time_cap"
        if patience_steps and step - best["step"] >= patience_steps:
            return "over-fitting"
        return None

    reason = trainer.train(timing="segment", metrics=metrics, stop=stop)
    stop_reason = "max_steps" if reason == "steps" else reason
    evals = [{k: e[k] for k in ("step", "train_s", "val_loss", "train_loss", "tokens", "ms")} for e in metrics.evals]
    step, train_s = trainer.step_index, metrics.train_s
    return {
        "seed": cfg.seed, "reached": bool(hit), "stop": stop_reason,
        "time_to_target_s": hit.get("train_s"), "steps_to_target": hit.get("step"),
        "steps": step, "train_s": train_s, "ms_per_step": 1e3 * train_s / step if step else None,
        "eval_s": metrics.eval_ms / 1e3, "evals": evals, "best_val_loss": best["val"] if evals else None,
        "best_step": best["step"],
        "final_val_loss": evals[-1]["val_loss"] if evals else None,
        "final_val_tokens": evals[-1]["tokens"] if evals else None,
    }


def _free(device) -> None:
    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def run_row(row: Row, corpus, *, target: float, max_train_s: float, patience_steps: int,
            stop_rung_on_miss: bool = True, keep_states: bool = False, deadline: float | None = None, log=None) -> dict:
    """Every seed of one row in one compiled model: setup (build, compile, warm-up) once, then per
    seed a reset and a timed run. Returns the row's record (with ``states``, the final weights
    per seed on the CPU, when ``keep_states``)."""
    import torch

    from fasttrain.lab.build import make_trainer, resolve_device
    from fasttrain.lab.checkpoint import eval_settings
    from fasttrain.lab.measure import tf32_matmuls

    log = log or (lambda s: None)
    cfg = row.cfg.with_(seed=row.seeds[0])
    device = resolve_device(cfg)
    wall0 = time.perf_counter()
    runs: list[dict] = []
    states: dict[int, dict] = {}
    out_of_budget = False
    with tf32_matmuls(cfg.tf32):
        t = time.perf_counter()
        trainer = make_trainer(cfg, corpus, device)
        warm = max(1, cfg.timing_warmup_steps)
        trainer.train(warm, evaluate=False)
        trainer.evaluate()
        trainer.reset(row.seeds[0])         # the warm-up trained these parameters: back to the seed's start
        _sync(device)
        setup_s = time.perf_counter() - t
        log(f"[{row.label} {row.name}] setup (build, compile, {warm} warm-up steps, one validation) {setup_s:.1f} s")
        for k, seed in enumerate(row.seeds):
            if deadline is not None and time.perf_counter() >= deadline:
                out_of_budget = True
                log(f"[{row.label} {row.name}] out of --budget-s: seeds {row.seeds[k:]} not run")
                break
            seed_wall0 = time.perf_counter()
            t = time.perf_counter()
            if k:
                trainer.reset(seed)
            _sync(device)
            reset_s = time.perf_counter() - t
            log(f"[{row.label} {row.name}] seed {seed}")
            rec = train_to_target(trainer, target=target, max_train_s=max_train_s, patience_steps=patience_steps,
                                  log=log)
            rec.update(reset_s=reset_s, wall_s=time.perf_counter() - seed_wall0)
            runs.append(rec)
            log(f"[{row.label} {row.name}] seed {seed}: "
                + (f"{target} reached at step {rec['steps_to_target']} after {rec['time_to_target_s']:.2f} s"
                   if rec["reached"] else f"not reached ({rec['stop']}; best {rec['best_val_loss']:.4f})")
                + f", {rec['ms_per_step']:.2f} ms/step")
            if keep_states:
                states[seed] = {n: v.detach().to("cpu", copy=True) for n, v in trainer.model.state_dict().items()}
            if not rec["reached"] and stop_rung_on_miss:
                break
        eval_record = eval_settings(cfg, trainer.batch, device)
        model_config = trainer.model_config.to_dict()
    del trainer
    if cfg.torch_compile:
        torch.compiler.reset()          # the next rung's model compiles afresh (no stale guards, no cache limit)
    _free(device)
    return {"label": row.label, "index": row.index, "name": row.name, "change": row.change, "config": cfg.to_dict(),
            "model": model_config, "seeds": list(row.seeds), "planned_seeds": row.planned_seeds, "setup_s": setup_s,
            "warmup_steps": warm, "wall_s": time.perf_counter() - wall0, "runs": runs, "eval": eval_record,
            "states": states, **({"skipped": "budget"} if out_of_budget else {})}


# --- the whole ladder ------------------------------------------------------------------------------

def run_ladder(rows: list[Row], *, target: float = TARGET, max_train_s: float = 300.0, patience_steps: int = 1000,
               stop_rung_on_miss: bool = True, save: str | None = None, out: str | None = None, corpus=None,
               command: str | None = None, budget_s: float | None = None, log=None) -> dict:
    """Run every row, write the results after each (``out``) and the fastest row's model (``save``;
    ``result["saved"]`` stays None when no row reached the target on every seed).
    ``budget_s``: no row or seed starts after this many seconds from the call (results stay whole)."""
    from fasttrain.environment import environment
    from fasttrain.lab.build import resolve_device
    from fasttrain.lab.data import load_corpus

    if not (isinstance(target, (int, float)) and math.isfinite(target) and target > 0):
        raise FasttrainError(f"--target must be a positive number of nats per character, got {target!r}")
    if max_train_s is not None and max_train_s < 0:
        raise FasttrainError(f"--max-train-s must be >= 0 (0: no cap), got {max_train_s}")
    if budget_s is not None and budget_s < 0:
        raise FasttrainError(f"--budget-s must be >= 0 (0: none), got {budget_s}")
    if patience_steps < 0:
        raise FasttrainError(f"--patience-steps must be >= 0 (0: never stop early), got {patience_steps}")
    if not rows:
        raise FasttrainError("nothing to run: no rung chosen")
    for path, what in ((out, "--out"), (save, "--save")):
        if path is not None:
            check_new_folder(path, what)
    log = log or (lambda s: None)
    deadline = time.perf_counter() + budget_s if budget_s else None
    corpus = corpus or load_corpus(rows[0].cfg.data_dir)
    device = resolve_device(rows[0].cfg)
    import torch

    result = {
        "kind": "lab-speedrun", "target": target, "command": command, "environment": environment(),
        "torch": torch.__version__, "device": _device_name(device), "started": _now(),
        "settings": {"max_train_s": max_train_s, "patience_steps": patience_steps, "budget_s": budget_s,
                     "stop_rung_on_miss": stop_rung_on_miss, "seeds": max((r.seeds for r in rows), key=len)},
        "data": {"chars": len(corpus.chars), "train_chars": int(len(corpus.train)), "val_chars": int(len(corpus.val)),
                 "split": "first 90% of the characters train, last 10% validate"},
        "rows": [], "saved": None,
    }
    best_row, best_state = None, None
    for row in rows:
        try:
            if deadline is not None and time.perf_counter() >= deadline:
                log(f"[{row.label} {row.name}] out of --budget-s: not run")
                rec = {"label": row.label, "index": row.index, "name": row.name, "change": row.change,
                       "config": row.cfg.to_dict(), "seeds": list(row.seeds), "planned_seeds": row.planned_seeds,
                       "setup_s": None, "wall_s": None, "runs": [], "states": {}, "skipped": "budget"}
            else:
                rec = run_row(row, corpus, target=target, max_train_s=max_train_s, patience_steps=patience_steps,
                              stop_rung_on_miss=stop_rung_on_miss, keep_states=save is not None, deadline=deadline,
                              log=log)
        except FasttrainError:
            raise
        except Exception as exc:        # one rung failing (a compiler error, out of memory) must not lose the rest
            msg = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"[:300]
            log(f"[{row.label} {row.name}] failed: {msg}")
            rec = {"label": row.label, "index": row.index, "name": row.name, "change": row.change,
                   "config": row.cfg.to_dict(), "seeds": list(row.seeds), "planned_seeds": row.planned_seeds,
                   "setup_s": None, "wall_s": None, "runs": [], "states": {}, "error": msg}
            _free(device)
        states = rec.pop("states")
        rec["summary"] = summarize(rec)
        result["rows"].append(rec)
        if rec["summary"]["counts"] and (best_row is None or rec["summary"]["time_to_target_s"]["p50"]
                                         < best_row["summary"]["time_to_target_s"]["p50"]):
            best_row, pick = rec, median_run(rec)
            best_state = (pick, states.get(pick["seed"]))
        result["process_wall_s"] = process_age_s()
        if out:
            write_results(result, out)
    result["fastest"] = None if best_row is None else {
        "label": best_row["label"], "name": best_row["name"],
        "time_to_target_s": best_row["summary"]["time_to_target_s"]["p50"], "seed": best_state[0]["seed"]}
    if save and best_row is not None:
        result["saved"] = save_fastest(save, best_row, *best_state, corpus=corpus, target=target)
        log(f"saved {best_row['name']} seed {best_state[0]['seed']} to {save}")
    result["finished"] = _now()
    result["process_wall_s"] = process_age_s()
    if out:
        write_results(result, out)
    return result


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def _device_name(device) -> str:
    from fasttrain.lab.measure import gpu_name as _gpu_name

    return _gpu_name(device)


# --- the command -----------------------------------------------------------------------------------

def _rung_list() -> str:
    lines = []
    for i, rung in enumerate(LADDER):
        sets = ", ".join(f"{k}={v}" for k, v in rung.overrides.items()) or "(the preset)"
        lines.append(f"{i:>2}  {rung.name:14s} {sets:42s} {rung.change}")
    return "\n".join(lines)


@click.group("speedrun", invoke_without_command=True, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--rungs", help="Rungs to run: indices, names or ranges, comma-separated (e.g. 0,5,8 or 0-3,cuda-graphs); "
                              "default all. Each rung includes every change before it.")
@click.option("--seeds", help=f"A count (default {DEFAULT_SEEDS}, from the preset's seed) or a comma-separated list.")
@click.option("--baseline-seeds", type=int, help="Fewer seeds for rung 0 (the slow one); marked † in the table.")
@click.option("--rung-seeds", help="Fewer seeds for some rungs, RUNG=COUNT[,...] (e.g. 0=1,1-5=1); marked †.")
@click.option("--budget-s", type=float, default=0.0, show_default=True,
              help="Start no rung or seed after this many seconds (0: no budget); what ran is written.")
@click.option("--target", type=float, default=TARGET, show_default=True,
              help="Validation loss (nats per character, whole validation split) to reach.")
@click.option("--max-train-s", type=float, default=300.0, show_default=True,
              help="Training-time cap per run (seconds; 0: none); a run that hits it misses the target.")
@click.option("--patience-steps", type=int, default=1000, show_default=True,
              help="Stop a run after this many steps without a new best validation loss (0: never).")
@click.option("--stop-rung-on-miss/--all-seeds-on-miss", default=True, show_default=True,
              help="Skip a rung's remaining seeds once one misses (it cannot count any more).")
@click.option("--variant", "variants", multiple=True,
              help="An extra row: the last chosen rung with overrides, NAME:FIELD=VALUE[,...] (repeatable), "
                   "e.g. lr-2e-3:learning_rate=2e-3,min_lr=2e-4.")
@click.option("--set", "sets", multiple=True,
              help="Overrides for every row, FIELD=VALUE[,...] (e.g. eval_batch_size=128).")
@click.option("--preset", "base_preset", default=BASE_PRESET, show_default=True,
              help="The preset the ladder starts from (tiny: a CPU smoke run).")
@click.option("--device", help="auto, cpu, cuda or cuda:N (default: the preset's, auto).")
@click.option("--data-dir", help="Data root holding tinyshakespeare/input.txt.")
@click.option("--out", "out_dir", type=click.Path(file_okay=False),
              help="Write speedrun.json, speedrun.csv, ladder.md and runs/*.json here.")
@click.option("--save", type=click.Path(file_okay=False),
              help="Write the fastest rung's final model here (model.safetensors + config.json).")
@click.option("--list", "list_rungs", is_flag=True, help="List the rungs and exit.")
@click.option("--quiet", is_flag=True, help="No progress lines.")
@click.pass_context
def command(ctx, rungs, seeds, baseline_seeds, rung_seeds, budget_s, target, max_train_s, patience_steps,
            stop_rung_on_miss, variants, sets, base_preset, device, data_dir, out_dir, save, list_rungs, quiet) -> None:
    """The Shakespeare speedrun: time to validation loss 1.47, one change per rung."""
    if ctx.invoked_subcommand is not None:
        return
    from rich.console import Console

    out = Console(width=200)
    if list_rungs:
        out.print(_rung_list(), markup=False, highlight=False)
        return
    err = Console(stderr=True)
    if not (math.isfinite(target) and target > 0):
        raise FasttrainError(f"--target must be a positive number of nats per character, got {target}")
    chosen = parse_rungs(rungs)
    first_seed = preset(base_preset).seed
    seed_list = parse_seeds(seeds, first_seed)
    overrides: dict = {}
    for text in sets:
        overrides.update(parse_assignments(text))
    rows = plan(chosen, seed_list, base_preset=base_preset, baseline_seeds=baseline_seeds,
                rung_seeds=parse_rung_seeds(rung_seeds),
                variants=[parse_variant(v) for v in variants], sets=overrides, device=device, data_dir=data_dir)
    log = None if quiet else (lambda line: err.print(line, markup=False, highlight=False))
    result = run_ladder(rows, target=target, max_train_s=max_train_s, patience_steps=patience_steps,
                        stop_rung_on_miss=stop_rung_on_miss, save=save, out=out_dir, budget_s=budget_s or None,
                        command=" ".join(["fasttrain", "lab", "speedrun", *map(shlex.quote, sys.argv[3:])])
                        if sys.argv[1:3] == ["lab", "speedrun"] else None, log=log)
    out.print(ladder_markdown(result), markup=False, highlight=False, soft_wrap=True)
    if out_dir:
        out.print(f"results: {out_dir}/ (speedrun.json, speedrun.csv, ladder.md, runs/)", markup=False)
    if save and not result["saved"]:
        raise FasttrainError(f"no rung reached {target} on every seed: nothing saved to {save} "
                             f"(raise --max-train-s or choose other rungs)")


command.add_command(readme_command)
command.add_command(merge_command)


__all__ = ["LADDER", "TARGET", "Rung", "Row", "command", "parse_rungs", "parse_seeds", "plan", "run_ladder",
           "train_to_target"]
