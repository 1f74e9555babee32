"""``fasttrain lab speedrun``: the Shakespeare speedrun ladder, under the record protocol.

Each rung is the ``shakespeare-char`` preset plus the overrides of every rung up to it (plain
:class:`~fasttrain.lab.config.LabConfig` fields, gpt-fast style), so each adds one change to the
rung before it. Rung 0 is the preset as users run it (eager PyTorch, fp32, AdamW, batches cut on
the CPU) with one change that makes it a recipe: its cosine schedule ends at a fixed step count.

Every row is a **recipe** (:mod:`fasttrain.lab.experiments.record_protocol`): a fixed number of steps
(``max_steps``), everything else fixed. Per seed, one run trains exactly those steps; its figure
is their training time (device-synchronized, validation excluded), and after the last step the
model is scored over the **whole** validation split. A row counts when the mean of its seeds'
final losses is at or below the target (1.47 nats per character) with a one-sided t-test p < 0.01
over at least 5 seeds; a row that does not is shown as missing, with the reason. Validation on the
way (``--eval-interval``, a setting, not a rung) only gives the first crossing, a secondary column.

What is timed, per row:

- setup, once: building the model, compiling or capturing CUDA graphs and warming up
  (``timing_warmup_steps`` training steps and one validation); the warm-up trains the same
  parameters, so they are then restored in place (the initial weights of the seed copied into the
  same tensors, a fresh optimizer, step 0) and compiled code and CUDA graphs stay valid for every
  seed. ``compile_s``: the setup less what the same work (model build, warm-up steps at the
  row's step time, one validation) costs once compiled;
- per seed: the training time of the fixed steps (the figure), the validations apart;
- the wall time of the row and of the whole process (from the interpreter's start, /proc on Linux).

Speed-ups divide median training times of rows measured in the same invocation (the baseline is
rung 0 when it ran); a ratio over a row that does not count is marked (its loss was not good enough).
"""

from __future__ import annotations

import datetime as _dt
import gc
import math
import os
import shlex
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import click

from fasttrain.errors import FasttrainError
from fasttrain.files import check_new_folder
from fasttrain.lab.progress import report
from fasttrain.lab.experiments import experiment
from fasttrain.lab.config import LabConfig, preset
from fasttrain.lab.experiments.experiment import Experiment
from fasttrain.lab.experiments.record_protocol import ALPHA, MIN_SEEDS
from fasttrain.lab.overrides import parse_assignments, parse_variant
from fasttrain.lab.experiments.speedrun_ladder import LADDER, RECIPE_STEPS, Rung  # noqa: F401 (Rung: the ladder's type)
from fasttrain.lab.experiments.speedrun_search import (BASE_RUNG, MARGIN, RECIPES, Recipe, check_seeds, choose,
                                                       parse_margin, parse_recipes, parse_seed_list, recipe_names)
from fasttrain.lab.experiments.speedrun_report import (DEFAULT_SEEDS, ladder_markdown, median_run, merge_command, readme_command,
                                           record_command, save_fastest, summarize, write_results)

TARGET = 1.47
BASE_PRESET = "shakespeare-char"


COMPILING = ("torch_compile", "cuda_graph_step")    # a row whose setup compiles or captures


def compiles(cfg) -> bool:
    return any(getattr(cfg, name, False) for name in COMPILING)


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

GRAPH_STEP_NEEDS_CUDA = ("graph-step needs a CUDA GPU (the step is captured as a CUDA graph); choose other rungs on "
                         "the CPU (see: fasttrain lab speedrun --list)")


@dataclass(frozen=True)
class Row(Experiment):
    """One row of the ladder table (an :class:`~fasttrain.lab.experiments.experiment.Experiment`: its overrides of the base
    preset, its seeds): a rung (or a variant of the last rung chosen). ``label``: "3" for a rung, the variant's
    name otherwise; ``cfg``: its configuration, built and validated by :func:`plan`."""

    name: str
    change: str              # what changed since the row above (every rung in between, for a gap)
    planned_seeds: int       # the seeds the other rows get (a row with fewer is marked)
    index: int | None = None
    cfg: LabConfig | None = None

    def shown(self) -> str:
        return self.name


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
         device: str | None = None, data_dir: str | None = None, eval_interval: int = 0) -> list[Row]:
    """The rows to run: each chosen rung's configuration (validated now, before anything trains).
    ``rung_seeds`` (and ``baseline_seeds``, for rung 0) run some rungs on the first few seeds only (such a
    row cannot count: the protocol wants at least 5 seeds). ``eval_interval``: validations on the way (the
    first crossing; 0: the final one only), a setting of every row."""
    sets = dict(sets or {})
    if sets.get("eval_tokens") is not None or any(o.get("eval_tokens") is not None for _, o in variants):
        raise FasttrainError("the record protocol scores the whole validation split: drop eval_tokens from --set and "
                             "--variant")
    if not (isinstance(eval_interval, int) and eval_interval >= 0):
        raise FasttrainError(f"--eval-interval must be a non-negative number of steps (0: the final validation "
                             f"only), got {eval_interval!r}")
    sets.update(eval_interval=eval_interval, eval_tokens=None)
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
    prev, first = -1, str(rungs[0])          # every row is measured against the first (the speedups' baseline)
    for i in rungs:
        steps = LADDER[prev + 1: i + 1] if i > prev else LADDER[i: i + 1]
        change = LADDER[0].change if i == 0 else " + ".join(r.change for r in steps)
        rows.append(_row(str(i), LADDER[i].name, change, {**cumulative_overrides(i), **sets},
                         seeds[:rung_seeds.get(i, len(seeds))], len(seeds), i, first))
        prev = i
    top = rungs[-1]
    names = {r.name for r in rows}
    for name, overrides in variants:
        if name in names or name.isdigit():
            raise FasttrainError(f"--variant name {name!r} is taken; give each variant its own name")
        names.add(name)
        change = f"rung {top} ({LADDER[top].name}) with " + ", ".join(f"{k}={v}" for k, v in overrides.items())
        rows.append(_row(name, name, change, {**cumulative_overrides(top), **overrides, **sets}, seeds, len(seeds),
                         None, first))
    # every row's configuration built from the preset and validated now, before anything trains
    return [replace(p.experiment, cfg=p.config, gpu_only=GRAPH_STEP_NEEDS_CUDA if p.config.cuda_graph_step else None)
            for p in experiment.prepare(rows, preset(base_preset))]


def _row(label: str, name: str, change: str, overrides: dict, seeds, planned: int, index: int | None,
         first: str) -> Row:
    return Row(label, name, change, planned, index, overrides={**overrides, "name": name}, seeds=list(seeds),
               compared_with=None if label == first else first)


# --- timing one row ------------------------------------------------------------------------------

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


def build_trainer(cfg: LabConfig, corpus, device):
    """The lab's trainer for ``cfg`` (:func:`~fasttrain.lab.build.make_trainer`; whole-model or per-block
    compilation, the inductor or cudagraphs backend), or with ``cuda_graph_step`` one whose step is a single
    CUDA graph (:class:`~fasttrain.lab.experiments.coldstart.GraphStepTrainer`)."""
    from fasttrain.lab.build import make_trainer

    if cfg.cuda_graph_step:
        from fasttrain.lab.experiments.coldstart import GraphStepTrainer

        return GraphStepTrainer.for_config(cfg, corpus, device)
    return make_trainer(cfg, corpus, device)


def _free(device) -> None:
    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def run_row(row: Row, corpus, *, target: float, keep_states: bool = False, deadline: float | None = None,
            compile_cache: str | None = None, log=None, seed_done=None) -> dict:
    """Every seed of one row on one built (and compiled) model: setup once, then per seed a reset and a
    fixed-step run (:func:`~fasttrain.lab.experiments.record_protocol.run_fixed_steps`). Returns the row's record
    (with ``states``, the final weights per seed on the CPU, when ``keep_states``)."""
    import torch

    from fasttrain.lab.build import resolve_device
    from fasttrain.lab.checkpoint import eval_settings
    from fasttrain.lab.measure import tf32_matmuls
    from fasttrain.lab.experiments.record_protocol import run_fixed_steps

    log = log or (lambda s: None)
    cfg = row.cfg.with_(seed=row.seeds[0])
    device = resolve_device(cfg)
    wall0 = time.perf_counter()
    runs: list[dict] = []
    states: dict[int, dict] = {}
    out_of_budget = False
    cache = None
    with tf32_matmuls(cfg.tf32):
        t = time.perf_counter()
        trainer = build_trainer(cfg, corpus, device)
        _sync(device)
        build_s = time.perf_counter() - t
        warm = max(1, cfg.timing_warmup_steps)
        from fasttrain.lab.trainer import Metrics

        warmup = Metrics(cfg.with_(timing_warmup_steps=0), device, trainer.world, curve=False)
        trainer.train(warm, metrics=warmup, timing="step", evaluate=False)    # each warm-up step timed
        warmup_ms = list(warmup.step_ms)
        t1 = time.perf_counter()
        trainer.evaluate()
        _sync(device)
        warmup_eval_ms = 1e3 * (time.perf_counter() - t1)
        trainer.reset(row.seeds[0])         # the warm-up trained these parameters: back to the seed's start
        _sync(device)
        setup_s = time.perf_counter() - t
        if compile_cache and compiles(cfg):
            from fasttrain.lab.experiments.coldstart import save_compile_cache

            cache = save_compile_cache(compile_cache)
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
            rec = run_fixed_steps(trainer, target=target, log=log)
            rec.update(reset_s=reset_s, wall_s=time.perf_counter() - seed_wall0)
            runs.append(rec)
            log(f"[{row.label} {row.name}] seed {seed}: {rec['steps']} steps in {rec['train_s']:.2f} s "
                f"({rec['ms_per_step']:.2f} ms/step), final validation loss "
                + (f"{rec['final_val_loss']:.4f}" if rec["final_val_loss"] is not None else "none (diverged)"))
            if seed_done is not None:
                seed_done(rec["final_val_loss"])     # outside the timed steps: the bar adds no host work to them
            if keep_states and rec["final_val_loss"] is not None:
                states[seed] = {n: v.detach().to("cpu", copy=True) for n, v in trainer.model.state_dict().items()}
        eval_record = eval_settings(cfg, cfg.per_device_train_batch_size, device)
        model_config = trainer.model_config.to_dict()
    del trainer
    if compiles(cfg):
        torch.compiler.reset()          # the next row's model compiles afresh (no stale guards, no cache limit)
    _free(device)
    return {"label": row.label, "index": row.index, "name": row.name, "change": row.change, "config": cfg.to_dict(),
            "model": model_config, "seeds": list(row.seeds), "planned_seeds": row.planned_seeds, "setup_s": setup_s,
            "build_s": build_s, "warmup_steps": warm, "warmup_ms": warmup_ms, "warmup_eval_ms": warmup_eval_ms,
            "compiles": compiles(cfg), "compile_cache": cache, "wall_s": time.perf_counter() - wall0, "runs": runs,
            "eval": eval_record, "states": states, **({"skipped": "budget"} if out_of_budget else {})}


# --- the whole ladder ------------------------------------------------------------------------------

def _not_run(row: Row, **why) -> dict:
    return {"label": row.label, "index": row.index, "name": row.name, "change": row.change,
            "config": row.cfg.to_dict(), "seeds": list(row.seeds), "planned_seeds": row.planned_seeds,
            "setup_s": None, "wall_s": None, "runs": [], "states": {}, **why}


def run_ladder(rows: list[Row], *, target: float = TARGET, min_seeds: int = MIN_SEEDS, save: str | None = None,
               out: str | None = None, corpus=None, command: str | None = None, budget_s: float | None = None,
               compile_cache: str | None = None, log=None, progress=None) -> dict:
    """Run every row, write the results after each (``out``) and the model of the fastest counted row's
    median seed (``save``; ``result["saved"]`` stays None when no row counts). ``budget_s``: no row or seed
    starts after this many seconds from the call (results stay whole). ``compile_cache``: a file of compiled
    artifacts loaded first (when it exists) and rewritten after each compiling row's setup."""
    # where a whole process's seconds go (the cold-start profile): its age at each milestone, from /proc
    phases = {"entered_s": process_age_s()}
    from fasttrain.environment import environment
    from fasttrain.lab.build import resolve_device
    from fasttrain.lab.data import load_corpus

    if not (isinstance(target, (int, float)) and math.isfinite(target) and target > 0):
        raise FasttrainError(f"--target must be a positive number of nats per character, got {target!r}")
    if budget_s is not None and budget_s < 0:
        raise FasttrainError(f"--budget-s must be >= 0 (0: none), got {budget_s}")
    if not rows:
        raise FasttrainError("nothing to run: no rung chosen")
    from fasttrain.lab.outputs import check_save_folder, expand

    if out is not None:
        check_new_folder(out, "--out")
        out = str(expand(out, "--out"))
    if save is not None:
        check_save_folder(save, "--save")       # a folder of other files is refused, one of our checkpoints replaced whole
        save = str(expand(save, "--save"))
        if out is not None and Path(out).resolve() == Path(save).resolve():
            raise FasttrainError(f"--out and --save name the same folder {save}; the results and the checkpoint "
                                 f"need their own folders")
    cache_loaded = None
    if compile_cache:
        from fasttrain.lab.experiments.coldstart import check_compile_cache, load_compile_cache

        check_compile_cache(compile_cache)
    log = log or (lambda s: None)
    device = resolve_device(rows[0].cfg)
    # a row that cannot run here (graph-step without a CUDA GPU) is refused before any work
    prepared = experiment.prepare(rows, config=lambda row: row.cfg, cuda=device.type == "cuda")
    deadline = time.perf_counter() + budget_s if budget_s else None
    corpus = corpus or load_corpus(rows[0].cfg.data_dir)
    if compile_cache:
        cache_loaded = load_compile_cache(compile_cache)
        log(f"compile cache {compile_cache}: " + (f"loaded {cache_loaded['bytes']:,} bytes in "
                                                  f"{cache_loaded['load_s']:.2f} s" if cache_loaded["loaded"]
                                                  else "empty (this run fills it)"))
    phases["corpus_loaded_s"] = process_age_s()
    import torch

    result = {
        "kind": "lab-speedrun", "protocol": "fixed-steps", "target": target, "command": command,
        "environment": environment(), "torch": torch.__version__, "device": _device_name(device), "started": _now(),
        "settings": {"budget_s": budget_s, "min_seeds": min_seeds, "alpha": ALPHA,
                     "eval_interval": rows[0].cfg.eval_interval, "compile_cache": cache_loaded,
                     "seeds": max((r.seeds for r in rows), key=len)},
        "data": {"chars": len(corpus.chars), "train_chars": int(len(corpus.train)), "val_chars": int(len(corpus.val)),
                 "split": "first 90% of the characters train, last 10% validate"},
        "rows": [], "saved": None, "process_phases": phases,
    }
    phases["environment_s"] = process_age_s()
    best_row, best_state = None, None
    # ``progress(done, total, loss)``: after every seed's run (its final validation loss), never inside one
    seeds_total, seeds_done = sum(len(r.seeds) for r in rows), 0

    def seed_done(final_loss):
        nonlocal seeds_done
        seeds_done += 1
        report(progress, seeds_done, seeds_total, final_loss)

    report(progress, 0, seeds_total)

    def run_one(row: Row, cfg: LabConfig) -> dict:
        try:
            if deadline is not None and time.perf_counter() >= deadline:
                log(f"[{row.label} {row.name}] out of --budget-s: not run")
                return _not_run(row, skipped="budget")
            return run_row(row, corpus, target=target, keep_states=save is not None, deadline=deadline,
                           compile_cache=compile_cache, log=log, seed_done=seed_done)
        except FasttrainError:
            raise
        except Exception as exc:        # one rung failing (a compiler error, out of memory) must not lose the rest
            msg = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"[:300]
            log(f"[{row.label} {row.name}] failed: {msg}")
            _free(device)
            return _not_run(row, error=msg)

    def finished(row: Row, rec: dict) -> None:
        # the verdict, the fastest so far and the results written after every row: a run cut short keeps its rows
        nonlocal best_row, best_state
        states = rec.pop("states")
        rec["summary"] = summarize(rec, target=target, min_seeds=min_seeds)
        result["rows"].append(rec)
        s = rec["summary"]
        log(f"[{row.label} {row.name}] " + ("counts" if s["counts"] else f"missing: {s['missing']}")
            + (f"; mean final loss {s['mean']:.4f}, p = {s['p_value']:.3g}" if s.get("p_value") is not None else ""))
        if s["counts"] and (best_row is None or s["train_s_median"] < best_row["summary"]["train_s_median"]):
            pick = median_run(rec)
            best_row, best_state = rec, (pick, states.get(pick["seed"]))
        result["process_wall_s"] = process_age_s()
        if out:
            write_results(result, out)

    experiment.run(prepared, run_one, on_row=finished)
    phases["rows_done_s"] = process_age_s()
    result["fastest"] = None if best_row is None else {
        "label": best_row["label"], "name": best_row["name"], "train_s": best_row["summary"]["train_s_median"],
        "seed": best_state[0]["seed"]}
    if save and best_row is not None:
        result["saved"] = save_fastest(save, best_row, *best_state, corpus=corpus, target=target)
        log(f"saved {best_row['name']} seed {best_state[0]['seed']} to {save}")
    result["finished"] = _now()
    result["process_wall_s"] = phases["saved_s"] = process_age_s()
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
@click.option("--seeds", help=f"A count (default {DEFAULT_SEEDS}, from the preset's seed) or a comma-separated list; "
                              f"a row counts with at least {MIN_SEEDS}.")
@click.option("--baseline-seeds", type=int, help="Fewer seeds for rung 0 (the slow one); marked †, it cannot count.")
@click.option("--rung-seeds", help="Fewer seeds for some rungs, RUNG=COUNT[,...] (e.g. 0=1,1-5=1); marked †.")
@click.option("--budget-s", type=float, default=0.0, show_default=True,
              help="Start no rung or seed after this many seconds (0: no budget); what ran is written.")
@click.option("--target", type=float, default=TARGET, show_default=True,
              help="Mean final validation loss to beat (nats per character, whole validation split).")
@click.option("--eval-interval", type=int, default=0, show_default=True,
              help="Validations every N steps on the way, for the first crossing (a secondary column; timed apart); "
                   "0: the final validation only.")
@click.option("--compile-cache", type=click.Path(dir_okay=False),
              help="A file of compiled artifacts (torch.compiler.save_cache_artifacts): loaded first when it exists, "
                   "written after each compiling row's setup.")
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
              help="Write the final model of the fastest counted row's median seed here (model.safetensors + "
                   "config.json); re-score it with fasttrain lab eval.")
@click.option("--list", "list_rungs", is_flag=True, help="List the rungs and exit.")
@click.option("--quiet", is_flag=True, help="No progress lines.")
@click.pass_context
def command(ctx, rungs, seeds, baseline_seeds, rung_seeds, budget_s, target, eval_interval, compile_cache, variants,
            sets, base_preset, device, data_dir, out_dir, save, list_rungs, quiet) -> None:
    """The Shakespeare speedrun: the training time of fixed-step recipes whose mean final validation loss is
    surely below 1.47, one change per rung."""
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
                rung_seeds=parse_rung_seeds(rung_seeds), variants=[parse_variant(v) for v in variants],
                sets=overrides, device=device, data_dir=data_dir, eval_interval=eval_interval)
    log = None if quiet else (lambda line: err.print(line, markup=False, highlight=False))
    from fasttrain.lab.progress import RunProgress

    # one bar over every seed of every row, moved between runs (the timed steps stay free of host work)
    bar = None if quiet else RunProgress("speedrun (seeds)", sum(len(r.seeds) for r in rows), console=err,
                                         say_expected=False)
    if bar is not None:
        bar.start()
    try:
        result = run_ladder(rows, target=target, save=save, out=out_dir, budget_s=budget_s or None,
                            compile_cache=compile_cache,
                            command=" ".join(["fasttrain", "lab", "speedrun", *map(shlex.quote, sys.argv[3:])])
                            if sys.argv[1:3] == ["lab", "speedrun"] else None, log=log, progress=bar)
    finally:
        if bar is not None:
            bar.stop()
    out.print(ladder_markdown(result), markup=False, highlight=False, soft_wrap=True)
    if out_dir:
        out.print(f"results: {out_dir}/ (speedrun.json, speedrun.csv, ladder.md, runs/)", markup=False)
    if save and not result["saved"]:
        raise FasttrainError(f"no row counts (mean final loss surely <= {target} over >= {MIN_SEEDS} seeds): "
                             f"nothing saved to {save}")


# --- round three: recipes chosen on some seeds, judged on others, confirmed on fresh ones (speedrun_search) -----------------------------------------------------------------

def recipe_row(recipe: Recipe, steps: int, seeds, *, base_preset: str | None = None, sets: dict | None = None,
               device: str | None = None, data_dir: str | None = None):
    """The speedrun row of ``recipe`` at ``steps`` on ``seeds``: the ``graph-step`` rung's overrides of the
    preset, the recipe's, then ``sets``; the final validation only, over the whole split (validated now)."""
    sets = dict(sets or {})
    if sets.get("eval_tokens") is not None:
        raise FasttrainError("the record protocol scores the whole validation split: drop eval_tokens from --set")
    overrides = {**cumulative_overrides(rung_names().index(BASE_RUNG)), **recipe.overrides, **sets,
                 "max_steps": steps, "eval_interval": 0, "eval_tokens": None, "name": recipe.name}
    if device is not None:
        overrides["device"] = device
    if data_dir is not None:
        overrides["data_dir"] = data_dir
    row = Row(recipe.name, recipe.name, recipe.change, len(seeds), None, overrides=overrides, seeds=list(seeds))
    p = experiment.prepare([row], preset(base_preset or BASE_PRESET))[0]
    return replace(row, cfg=p.config, gpu_only=GRAPH_STEP_NEEDS_CUDA if p.config.cuda_graph_step else None)


def user_sets(cfg) -> str:
    """The recipe's settings beyond the ``graph-step`` rung, as the text ``--set`` takes (the cold-process timing
    runs the rung with them)."""
    from fasttrain.lab.overrides import changed

    rung = preset(BASE_PRESET).with_(**cumulative_overrides(rung_names().index(BASE_RUNG)))
    sets = {k: v for k, v in changed(cfg, rung).items() if k not in ("name", "seed", "device", "data_dir",
                                                                       "eval_interval", "eval_tokens")}
    return ",".join(f"{k}={v}" for k, v in sorted(sets.items()))


def user_command(cfg) -> str:
    """The one-seed command a user runs for the record's recipe: the ``graph-step`` rung with its ``--set``."""
    text = user_sets(cfg)
    return shlex.join(["fasttrain", "lab", "speedrun", "--rungs", BASE_RUNG, "--seeds", "1",
                       *(["--set", text] if text else [])])


def _command_line(sub: str) -> str | None:
    return " ".join(["fasttrain", "lab", "speedrun", sub, *map(shlex.quote, sys.argv[4:])]) \
        if sys.argv[1:4] == ["lab", "speedrun", sub] else None


def run_search(recipes, choosing: list[int], judging: list[int], *, target: float = TARGET, margin=MARGIN,
               out: str | None = None, save: str | None = None, corpus=None, base_preset: str | None = None,
               sets: dict | None = None, device: str | None = None, data_dir: str | None = None,
               command: str | None = None, machine: str | None = None, log=None) -> dict:
    """Choose on ``choosing``, judge the chosen recipe on ``judging`` (:func:`~fasttrain.lab.experiments.
    speedrun.run_ladder`: its result files and the checkpoint of its median seed), and write ``search.json``
    and, when it counts, ``record.json`` into ``out``. Returns the judged ladder result (``search``, the
    choice; ``record``, the record or None)."""
    from fasttrain.files import atomic_write_text, check_new_folder
    from fasttrain.lab.data import load_corpus
    from fasttrain.lab.experiments.record_protocol import write_record
    from fasttrain.lab.experiments.speedrun_report import record_of, write_results
    from fasttrain.lab.outputs import check_save_folder

    check_seeds(choosing, judging)
    margin = parse_margin(margin)
    if out is not None:
        check_new_folder(out, "--out")
    if save is not None:
        check_save_folder(save, "--save")
    log = log or (lambda s: None)
    rows = {r.name: recipe_row(r, r.steps[0], choosing, base_preset=base_preset, sets=sets, device=device,
                               data_dir=data_dir) for r in recipes}      # every recipe validated before any work
    first = next(iter(rows.values()))
    from fasttrain.lab.build import resolve_device

    experiment.prepare(list(rows.values()), config=lambda row: row.cfg, cuda=resolve_device(first.cfg).type == "cuda")
    corpus = corpus or load_corpus(first.cfg.data_dir)

    def probe(recipe: Recipe, steps: int) -> dict:
        row = recipe_row(recipe, steps, choosing, base_preset=base_preset, sets=sets, device=device,
                         data_dir=data_dir)
        rec = run_row(row, corpus, target=target, log=log)
        done = [r["train_s"] for r in rec["runs"] if r["final_val_loss"] is not None]
        return {"final_val_losses": [r["final_val_loss"] for r in rec["runs"]],
                "train_s": statistics.median(done) if done else None}

    search = choose(recipes, probe, target=target, margin=margin, judging_n=len(judging), log=log)
    search.update(choosing_seeds=list(choosing), judging_seeds=list(judging), alpha=ALPHA, target=target, margin=margin)
    if search["chosen"] is None:
        if out is not None:
            Path(out).mkdir(parents=True, exist_ok=True)
            atomic_write_text(Path(out) / "search.json", _json(search))
        return {"search": search, "record": None, "rows": []}
    recipe = next(r for r in recipes if r.name == search["chosen"])
    row = recipe_row(recipe, search["steps"], judging, base_preset=base_preset, sets=sets, device=device,
                     data_dir=data_dir)
    log(f"[judge {recipe.name}] {search['steps']} steps on the judging seeds {judging}")
    result = run_ladder([row], target=target, save=save, out=out, corpus=corpus, command=command, log=log)
    result.update(search=search, choosing_seeds=list(choosing), user_command=user_command(row.cfg),
                  user_sets=user_sets(row.cfg))
    summary = result["rows"][0]["summary"]
    result["record"] = record_of(result, machine=machine) if summary["counts"] else None
    if out is not None:
        write_results(result, out)
        atomic_write_text(Path(out) / "search.json", _json(search))
        if result["record"] is not None:
            write_record(result["record"], out)
    return result


def _json(obj) -> str:
    import json

    return json.dumps(obj, indent=1, default=str) + "\n"


# --- confirming ---------------------------------------------------------------------------------------

def confirm_record(path, *, seeds: list[int] | None = None, count: int | None = None, corpus=None,
                   device: str | None = None, data_dir: str | None = None, command: str | None = None,
                   log=None) -> dict:
    """Rerun the record at ``path`` on fresh seeds (``seeds``, or ``count`` seeds after every used one; each
    checked against the seeds that chose and judged it before any work), through the lab's trainer, and
    write the verdict into the record as ``confirmation`` (the file replaced whole). Returns it."""
    import datetime as _dt

    import torch

    from fasttrain.environment import environment
    from fasttrain.files import atomic_write_text
    from fasttrain.lab.build import resolve_device
    from fasttrain.lab.data import load_corpus
    from fasttrain.lab.experiments.record_protocol import (check_record, confirmation, fresh_seeds, read_record,
                                                           used_seeds)
    from fasttrain.lab.measure import gpu_name
    from fasttrain.lab.overrides import config_from_dict

    path = Path(path)
    rec = read_record(path)
    if not isinstance(rec.get("config"), dict):
        raise FasttrainError(f"{path}: the record has no recipe configuration (config); make it with fasttrain lab "
                             f"speedrun search")
    if seeds is None:
        seeds = fresh_seeds(rec, count or len(rec["seeds"]))
    spent = sorted(set(seeds) & used_seeds(rec))
    if spent:
        raise FasttrainError(f"seeds {spent} already chose, judged or confirmed this record; confirm on fresh seeds "
                             f"(omit --seeds: the next unused ones)")
    if len(seeds) < MIN_SEEDS:
        raise FasttrainError(f"--seeds: a confirmation needs at least {MIN_SEEDS} seeds, got {len(seeds)}")
    cfg = config_from_dict(rec["config"])
    cfg = cfg.with_(**{k: v for k, v in (("device", device), ("data_dir", data_dir)) if v is not None})
    row = Row(str(rec.get("label") or rec.get("rung") or "record"), str(rec.get("rung") or cfg.name),
              "the record's recipe on fresh seeds", len(seeds), None, overrides={}, seeds=list(seeds), cfg=cfg,
              gpu_only=GRAPH_STEP_NEEDS_CUDA if cfg.cuda_graph_step else None)
    experiment.prepare([row], config=lambda r: r.cfg, cuda=resolve_device(cfg).type == "cuda")
    corpus = corpus or load_corpus(cfg.data_dir)
    data = rec.get("data") or {}
    here = {"chars": len(corpus.chars), "train_chars": int(len(corpus.train)), "val_chars": int(len(corpus.val))}
    if data and any(data.get(k) != v for k, v in here.items()):
        raise FasttrainError(f"the corpus here ({here}) is not the corpus the record was judged on "
                             f"({ {k: data.get(k) for k in here} }); give its --data-dir")
    started = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    result = run_row(row, corpus, target=rec.get("target", TARGET), log=log)
    env = environment()
    rec["confirmation"] = confirmation(
        rec, result["runs"], command=command or f"fasttrain lab speedrun confirm {path}", started=started,
        gpu=(env.get("gpu") or {}).get("name") or gpu_name(resolve_device(cfg)), torch=torch.__version__,
        git_sha=env.get("git_sha"), setup_s=result["setup_s"], process_wall_s=process_age_s(),
        per_seed=[{k: r[k] for k in ("seed", "steps", "train_s", "ms_per_step", "final_val_loss")} for r in result["runs"]])
    check_record(rec)
    atomic_write_text(path, _json(rec))
    return rec["confirmation"]


def confirmation_line(conf: dict) -> str:
    s = (f"mean final validation loss {conf['mean_final_val_loss']:.4f} over fresh seeds {conf['seeds']}, "
         f"p = {conf['p_value']:.3g}, training {conf['train_s']:.2f} s (median)")
    return f"the record holds: {s}" if conf["holds"] else f"the record does not hold ({conf['missing']}): {s}"


# --- the commands ---------------------------------------------------------------------------------------

@click.command("search")
@click.option("--recipes", help=f"Recipes to search, comma-separated, or all (default): {', '.join(recipe_names())}.")
@click.option("--choosing-seeds", required=True, help="Seeds that choose the steps and the recipe (e.g. 2000-2002).")
@click.option("--judging-seeds", required=True,
              help=f"Seeds that judge the chosen recipe, at least {MIN_SEEDS}, none of the choosing ones (e.g. 3000-3004).")
@click.option("--steps", "steps_text", help="Candidate step counts for every recipe, comma-separated (default: each "
                                           "recipe's own).")
@click.option("--margin", default=MARGIN, show_default=True,
              help="The choosing seeds' mean must end this far below the target: auto (from their spread and the "
                   "judging seeds' count, so the judging and confirming verdicts pass with it) or nats.")
@click.option("--target", type=float, default=TARGET, show_default=True, help="Mean final validation loss to beat.")
@click.option("--set", "sets", multiple=True, help="Overrides for every recipe, FIELD=VALUE[,...].")
@click.option("--preset", "base_preset", help="The preset the recipes start from (tiny: a smoke run).")
@click.option("--device", help="auto, cpu, cuda or cuda:N.")
@click.option("--data-dir", help="Data root holding tinyshakespeare/input.txt.")
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False),
              help="Write search.json, the judged row's speedrun.json/.csv/ladder.md/runs and record.json here.")
@click.option("--save", type=click.Path(file_okay=False), help="Write the judged recipe's median-seed model here.")
@click.option("--quiet", is_flag=True, help="No progress lines.")
def search_command(recipes, choosing_seeds, judging_seeds, steps_text, margin, target, sets, base_preset, device, data_dir, out_dir,
                   save, quiet) -> None:
    """Choose a recipe and its steps on some seeds, judge it on others (p < 0.01), write the record."""
    from fasttrain.lab.overrides import parse_assignments

    chosen = parse_recipes(recipes)
    if steps_text is not None:
        try:
            steps = tuple(sorted({int(t) for t in steps_text.split(",") if t.strip()}))
        except ValueError:
            steps = ()
        if not steps or steps[0] < 1:
            raise FasttrainError(f"--steps {steps_text!r}: give positive step counts, comma-separated (e.g. 800,1000)")
        chosen = [replace(r, steps=steps) for r in chosen]
    choosing = parse_seed_list(choosing_seeds, "--choosing-seeds")
    judging = parse_seed_list(judging_seeds, "--judging-seeds")
    overrides: dict = {}
    for text in sets:
        overrides.update(parse_assignments(text))
    log = None if quiet else (lambda line: click.echo(line, err=True))
    result = run_search(chosen, choosing, judging, target=target, margin=margin, out=out_dir, save=save,
                        base_preset=base_preset, sets=overrides, device=device, data_dir=data_dir,
                        command=_command_line("search"), machine=Path(out_dir).name, log=log)
    search = result["search"]
    for s in search["recipes"]:
        click.echo(f"{s['recipe']}: " + ", ".join(
            f"{p['steps']} steps mean {p['mean']:.4f}" + (f" (margin {p['margin']:.4f})" if p.get("margin") is not None
                                                          else "") + (" ok" if p["passes"] else "")
            for p in s["probes"] if p["mean"] is not None))
    if search["chosen"] is None:
        raise FasttrainError(f"no recipe ends <= {target} - margin ({margin}) on the choosing seeds at any of its steps: "
                             f"nothing judged (see {out_dir}/search.json)")
    s = result["rows"][0]["summary"]
    click.echo(f"chosen: {search['chosen']} at {search['steps']} steps; judged on {judging}: mean "
               f"{s['mean']:.4f}, p = {s['p_value']:.3g}: " + ("counts" if s["counts"] else f"missing: {s['missing']}"))
    if result["record"] is None:
        raise FasttrainError(f"the chosen recipe does not count on the judging seeds ({s['missing']}): no record")
    click.echo(f"wrote {out_dir}/record.json; confirm it: fasttrain lab speedrun confirm {out_dir}/record.json")


@click.command("confirm")
@click.argument("record_path", metavar="RECORD", type=click.Path(dir_okay=False))
@click.option("--seeds", help=f"Fresh seeds (a list, ranges a-b allowed) or a count (default: as many as judged, "
                              f"the next unused ones); at least {MIN_SEEDS}.")
@click.option("--device", help="auto, cpu, cuda or cuda:N (default: the record's).")
@click.option("--data-dir", help="Data root holding tinyshakespeare/input.txt.")
@click.option("--quiet", is_flag=True, help="No progress lines.")
@click.pass_context
def confirm_command(ctx, record_path, seeds, device, data_dir, quiet) -> None:
    """Rerun a record's recipe on fresh seeds; write the verdict into the record and say whether it holds."""
    seed_list, count = None, None
    if seeds is not None:
        if "," in seeds or "-" in seeds:
            seed_list = parse_seed_list(seeds, "--seeds")
        else:
            try:
                count = int(seeds)
            except ValueError:
                raise FasttrainError(f"--seeds {seeds!r}: a count or a list of seeds (e.g. 5 or 4000-4004)") from None
    log = None if quiet else (lambda line: click.echo(line, err=True))
    conf = confirm_record(record_path, seeds=seed_list, count=count, device=device, data_dir=data_dir,
                          command=_command_line("confirm"), log=log)
    click.echo(confirmation_line(conf))
    click.echo(f"wrote the confirmation into {record_path}")
    if not conf["holds"]:
        ctx.exit(1)


command.add_command(readme_command)
command.add_command(merge_command)
command.add_command(record_command)
command.add_command(search_command)
command.add_command(confirm_command)


__all__ = ["LADDER", "RECIPES", "RECIPE_STEPS", "TARGET", "Recipe", "Rung", "Row", "build_trainer", "command",
           "confirm_record", "confirmation_line", "parse_rungs", "parse_seeds", "plan", "recipe_row", "run_ladder", "run_row",
           "run_search", "user_command", "user_sets"]
