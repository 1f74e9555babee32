"""``fasttrain lab speedrun search`` and ``confirm``: a record chosen on some seeds, judged on others, confirmed
on fresh ones.

Round two picked its step count by looking at the seeds its t-test then judged, and kept the fastest of
several counted rows: a record that held once in three reruns. Here the three jobs get disjoint seeds:

1. **choose** (the choosing seeds): for each recipe, the shortest of its candidate step counts whose
   mean final validation loss over the choosing seeds is at or below ``target - margin``
   (:func:`search_steps`, a bisection: with the cosine schedule ending at the last step, a longer
   recipe ends lower in this range, so the candidates that pass are a suffix of the sorted list); then
   the recipe whose chosen steps train fastest (:func:`choose`);
2. **judge** (the judging seeds, >= 5, none of them seen by step 1): that one recipe, under the record
   protocol (one-sided t-test, p < 0.01); it counts or it does not, there is no second pick;
3. **confirm** (``confirm RECORD``, a second invocation, fresh seeds): the record's recipe run again from
   its saved configuration, the verdict over the fresh seeds written into the record (``confirmation``).

Why a margin: the judging verdict needs mean <= target - t(0.99, 4) sd / sqrt 5 = target - 1.68 sd; with the
seed-to-seed spread of the H100 rows (sd 0.0012 to 0.0067) a recipe chosen at the target itself would count
about half the time. The default margin, 0.008, is 1.68 x 0.0045 plus 0.0005 for the choosing mean's own
error.

Every recipe is built for 5 seconds of training without a compiler: the ``graph-step`` rung (the whole step
as one CUDA graph, 0.15 s of setup instead of 20-30 s of compilation) plus the changes that keep the task
(same data, split and characters, the whole validation split). Every run goes through the lab's one trainer
(:func:`fasttrain.lab.experiments.speedrun.run_row` -> :meth:`fasttrain.lab.trainer.Trainer.train`).
"""

from __future__ import annotations

import math
import shlex
import statistics
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import click

from fasttrain.errors import FasttrainError
from fasttrain.lab.experiments.record_protocol import ALPHA, MIN_SEEDS, TARGET

BASE_RUNG = "graph-step"
MARGIN = 0.008


@dataclass(frozen=True)
class Recipe:
    """A candidate record: overrides of the ``graph-step`` rung and the step counts to search (ascending)."""

    name: str
    change: str
    overrides: dict
    steps: tuple[int, ...]


RECIPES: tuple[Recipe, ...] = (
    Recipe("graph-step", "the graph-step rung as it is (the preset's model, dropout 0.2, fused AdamW, no compiler)",
           {}, (1200, 1400, 1600, 1800, 2000)),
    Recipe("softcap-zero", "graph-step with logits soft-capped at 30 and zero-initialized output projections (both "
                           "ended lower than the plain recipe on the H100)",
           dict(logit_softcap=30.0, zero_init_proj=True), (1100, 1250, 1400, 1550, 1700)),
    Recipe("drop-0.1", "softcap-zero with dropout 0.1: it learns faster a step, so a shorter schedule may end before "
                       "it over-fits", dict(logit_softcap=30.0, zero_init_proj=True, dropout=0.1),
           (800, 950, 1100, 1250, 1400)),
    Recipe("muon", "softcap-zero with Muon for the blocks' matrices (AdamW for embeddings and norms)",
           dict(logit_softcap=30.0, zero_init_proj=True, optim="muon"), (1000, 1200, 1400, 1600, 1800)),
    Recipe("no-dropout", "softcap-zero without dropout (its kernels were the profile's largest pointwise ones) and "
                         "a 4-layer model, a short schedule before it over-fits",
           dict(logit_softcap=30.0, zero_init_proj=True, dropout=0.0, layers=4), (400, 500, 600, 700, 800)),
)


def recipe_names() -> list[str]:
    return [r.name for r in RECIPES]


def parse_recipes(text: str | None) -> list[Recipe]:
    """"softcap-zero,drop-0.1" -> those recipes (in the order given); None or "all": every one."""
    if text is None or text.strip() == "all":
        return list(RECIPES)
    by_name = {r.name: r for r in RECIPES}
    chosen = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [n for n in chosen if n not in by_name]
    if unknown or not chosen:
        raise FasttrainError(f"--recipes {text!r}: use names from {', '.join(by_name)} (comma-separated) or all")
    return [by_name[n] for n in dict.fromkeys(chosen)]


def parse_seed_list(text: str, flag: str) -> list[int]:
    """"100-102,7" -> [100, 101, 102, 7]: distinct non-negative integers."""
    bad = FasttrainError(f"{flag} {text!r}: give distinct non-negative integers, comma-separated, ranges a-b allowed "
                         f"(e.g. 2000-2002)")
    seeds: list[int] = []
    for item in (t.strip() for t in str(text).split(",") if t.strip()):
        lo, sep, hi = item.partition("-")
        try:
            seeds.extend(range(int(lo), int(hi) + 1) if sep else [int(item)])
        except ValueError:
            raise bad from None
    if not seeds or any(s < 0 for s in seeds) or len(set(seeds)) != len(seeds):
        raise bad
    return seeds


def check_seeds(choosing: list[int], judging: list[int]) -> None:
    """The protocol's seeds, before any work: enough of each, and no seed both chooses and judges."""
    if len(choosing) < 2:
        raise FasttrainError(f"--choosing-seeds: give at least 2 (a mean and its spread), got {len(choosing)}")
    if len(judging) < MIN_SEEDS:
        raise FasttrainError(f"--judging-seeds: the protocol judges on at least {MIN_SEEDS} seeds, got {len(judging)}")
    both = sorted(set(choosing) & set(judging))
    if both:
        raise FasttrainError(f"seeds {both} are both choosing and judging seeds; a seed that chose the recipe cannot "
                             f"judge it: give disjoint lists")


# --- choosing ---------------------------------------------------------------------------------------

def passes(losses, *, target: float, margin: float) -> bool:
    """Whether a probe's final losses count with margin: every seed finished and their mean <= target - margin."""
    done = [v for v in losses if v is not None and math.isfinite(v)]
    return bool(done) and len(done) == len(losses) and statistics.fmean(done) <= target - margin


def search_steps(probe, candidates, *, target: float = TARGET, margin: float = MARGIN) -> dict:
    """The shortest of ``candidates`` (step counts, ascending) that counts with margin, by bisection.

    ``probe(steps)`` runs the recipe at ``steps`` on the choosing seeds and returns ``final_val_losses`` and
    ``train_s`` (the median training time). Assumes a longer recipe ends no higher (its cosine ends at its
    last step): the passing candidates are then a suffix, and at most ceil(log2(n + 1)) probes find its start.
    Returns the chosen ``steps`` (None: not even the longest passes), its probe, and every probe in order."""
    steps = sorted(set(candidates))
    if not steps or any(not (isinstance(s, int) and s > 0) for s in steps):
        raise FasttrainError(f"a step search needs positive step counts, got {list(candidates)!r}")
    lo, hi, best, probes = 0, len(steps) - 1, None, []
    while lo <= hi:
        mid = (lo + hi) // 2
        res = probe(steps[mid])
        losses = list(res["final_val_losses"])
        ok = passes(losses, target=target, margin=margin)
        done = [v for v in losses if v is not None and math.isfinite(v)]
        probes.append({"steps": steps[mid], "final_val_losses": losses, "train_s": res.get("train_s"),
                       "mean": statistics.fmean(done) if done else None, "passes": ok})
        if ok:
            best, hi = len(probes) - 1, mid - 1
        else:
            lo = mid + 1
    chosen = probes[best] if best is not None else None
    return {"steps": chosen and chosen["steps"], "train_s": chosen and chosen["train_s"], "probes": probes,
            "candidates": steps, "target": target, "margin": margin}


def choose(recipes, probe, *, target: float = TARGET, margin: float = MARGIN, log=None) -> dict:
    """Search each recipe's steps (``probe(recipe, steps)``) and pick the one whose chosen steps trained fastest
    on the choosing seeds. Returns ``recipes`` (each search) and ``chosen`` (the recipe's name, or None)."""
    log = log or (lambda s: None)
    searched = []
    for recipe in recipes:
        found = search_steps(lambda steps: probe(recipe, steps), recipe.steps, target=target, margin=margin)
        searched.append({"recipe": recipe.name, "change": recipe.change, "overrides": recipe.overrides, **found})
        log(f"[search {recipe.name}] " + (f"{found['steps']} steps ({found['train_s']:.2f} s)" if found["steps"]
                                          else f"none of {found['candidates']} steps ends <= {target} - {margin}"))
    ok = [s for s in searched if s["steps"] is not None and s["train_s"] is not None]
    chosen = min(ok, key=lambda s: s["train_s"]) if ok else None
    return {"recipes": searched, "chosen": chosen and chosen["recipe"], "steps": chosen and chosen["steps"]}


# --- the rows the lab's trainer runs -----------------------------------------------------------------

def recipe_row(recipe: Recipe, steps: int, seeds, *, base_preset: str | None = None, sets: dict | None = None,
               device: str | None = None, data_dir: str | None = None):
    """The speedrun row of ``recipe`` at ``steps`` on ``seeds``: the ``graph-step`` rung's overrides of the
    preset, the recipe's, then ``sets``; the final validation only, over the whole split (validated now)."""
    from fasttrain.lab.config import preset
    from fasttrain.lab.experiments import experiment
    from fasttrain.lab.experiments.speedrun import (BASE_PRESET, GRAPH_STEP_NEEDS_CUDA, Row, cumulative_overrides,
                                                    rung_names)

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
    from fasttrain.lab.config import preset
    from fasttrain.lab.experiments.speedrun import BASE_PRESET, cumulative_overrides, rung_names
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


def run_search(recipes, choosing: list[int], judging: list[int], *, target: float = TARGET, margin: float = MARGIN,
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
    from fasttrain.lab.experiments.speedrun import run_ladder, run_row
    from fasttrain.lab.experiments.speedrun_report import record_of, write_results
    from fasttrain.lab.outputs import check_save_folder

    check_seeds(choosing, judging)
    if not (isinstance(margin, (int, float)) and math.isfinite(margin) and margin >= 0):
        raise FasttrainError(f"--margin must be a non-negative number of nats, got {margin!r}")
    if out is not None:
        check_new_folder(out, "--out")
    if save is not None:
        check_save_folder(save, "--save")
    log = log or (lambda s: None)
    rows = {r.name: recipe_row(r, r.steps[0], choosing, base_preset=base_preset, sets=sets, device=device,
                               data_dir=data_dir) for r in recipes}      # every recipe validated before any work
    first = next(iter(rows.values()))
    from fasttrain.lab.build import resolve_device
    from fasttrain.lab.experiments import experiment

    experiment.prepare(list(rows.values()), config=lambda row: row.cfg, cuda=resolve_device(first.cfg).type == "cuda")
    corpus = corpus or load_corpus(first.cfg.data_dir)

    def probe(recipe: Recipe, steps: int) -> dict:
        row = recipe_row(recipe, steps, choosing, base_preset=base_preset, sets=sets, device=device,
                         data_dir=data_dir)
        rec = run_row(row, corpus, target=target, log=log)
        done = [r["train_s"] for r in rec["runs"] if r["final_val_loss"] is not None]
        return {"final_val_losses": [r["final_val_loss"] for r in rec["runs"]],
                "train_s": statistics.median(done) if done else None}

    search = choose(recipes, probe, target=target, margin=margin, log=log)
    search.update(choosing_seeds=list(choosing), judging_seeds=list(judging), alpha=ALPHA)
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
    from fasttrain.lab.experiments import experiment
    from fasttrain.lab.experiments.record_protocol import (check_record, confirmation, fresh_seeds, read_record,
                                                           used_seeds)
    from fasttrain.lab.experiments.speedrun import GRAPH_STEP_NEEDS_CUDA, Row, process_age_s, run_row
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
    started = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    result = run_row(row, corpus, target=rec.get("target", TARGET), log=log)
    env = environment()
    rec["confirmation"] = confirmation(
        rec, result["runs"], command=command or f"fasttrain lab speedrun confirm {path}", started=started,
        gpu=(env.get("gpu") or {}).get("name") or gpu_name(resolve_device(cfg)), torch=torch.__version__,
        git_sha=env.get("git_sha"), setup_s=result["setup_s"], process_wall_s=process_age_s(),
        runs=[{k: r[k] for k in ("seed", "steps", "train_s", "ms_per_step", "final_val_loss")} for r in result["runs"]])
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
@click.option("--margin", type=float, default=MARGIN, show_default=True,
              help="The choosing seeds' mean must end this far below the target.")
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
        click.echo(f"{s['recipe']}: " + ", ".join(f"{p['steps']} steps mean {p['mean']:.4f}" + (" ok" if p["passes"]
                                                  else "") for p in s["probes"] if p["mean"] is not None))
    if search["chosen"] is None:
        raise FasttrainError(f"no recipe ends <= {target} - {margin} on the choosing seeds at any of its steps: "
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


__all__ = ["MARGIN", "RECIPES", "Recipe", "check_seeds", "choose", "confirm_command", "confirm_record",
           "confirmation_line", "parse_recipes", "parse_seed_list", "passes", "recipe_row", "run_search",
           "search_command", "search_steps", "user_command", "user_sets"]
