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

Why a margin, and which: the judging verdict needs mean <= target - t(0.99, n_j - 1) sd / sqrt n_j over the
n_j judging seeds, and the confirmation the same over fresh ones. A recipe chosen where its choosing mean sits
just inside that line passes each invocation about half the time: its choosing mean is itself off by about
sd / sqrt n_c, and each later mean by sd / sqrt n_j. The ``auto`` margin (the default) is read off the probe's
own spread:

    margin = t(0.99, n_j - 1) sd / sqrt n_j + 2 sd / sqrt n_c

(the verdict's line, plus two standard errors of the choosing mean). Measured on the H100: a fixed margin of
0.008 and then 0.010 chose recipes (drop-0.1 at 1,250 steps, wd-0.5 at 1,250) that counted on their judging
seeds and did not hold on the confirming ones (p = 0.013, 0.016), with seed-to-seed sd 0.004 to 0.009.
A number given instead (``--margin 0.01``) is used as it is.

Every recipe is built for 5 seconds of training without a compiler: the ``graph-step`` rung (the whole step
as one CUDA graph, 0.15 s of setup instead of 20-30 s of compilation) plus the changes that keep the task
(same data, split and characters, the whole validation split). This module holds the choice (pure: it is
handed a ``probe``); the runs, through the lab's one trainer (``run_row`` -> :meth:`fasttrain.lab.trainer.
Trainer.train`), and the ``search`` and ``confirm`` commands are in :mod:`fasttrain.lab.experiments.speedrun`.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from fasttrain.errors import FasttrainError
from fasttrain.lab.experiments.record_protocol import ALPHA, MIN_SEEDS, TARGET, scipy_stats

BASE_RUNG = "graph-step"
MARGIN = "auto"


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
           dict(logit_softcap=30.0, zero_init_proj=True), (1100, 1250, 1400, 1550, 1700, 1850)),
    Recipe("drop-0.1", "softcap-zero with dropout 0.1: it learns faster a step, so a shorter schedule may end before "
                       "it over-fits", dict(logit_softcap=30.0, zero_init_proj=True, dropout=0.1),
           (800, 950, 1100, 1250, 1400)),
    Recipe("wd-0.5", "drop-0.1 with AdamW's decoupled weight decay at 0.5 instead of 0.1 (each step shrinks the "
                     "weights by lr x 0.5): more regularization where dropout 0.1 leaves the recipe over-fitting; "
                     "the H100 exploration (2 seeds, results/speedrun/nvidia-h100-explore) ended 0.005 lower at 1,400 "
                     "steps than drop-0.1", dict(logit_softcap=30.0, zero_init_proj=True, dropout=0.1, weight_decay=0.5),
           (1100, 1250, 1400, 1550)),
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

def parse_margin(margin) -> float | str:
    """``auto`` or a non-negative number of nats (a flag's text or a value)."""
    if margin == "auto":
        return margin
    try:
        value = float(margin)
    except (TypeError, ValueError):
        value = float("nan")
    if not (math.isfinite(value) and value >= 0):
        raise FasttrainError(f"--margin must be auto or a non-negative number of nats, got {margin!r}")
    return value


def auto_margin(losses, judging_n: int, alpha: float = ALPHA) -> float:
    """t(1 - alpha, n_j - 1) sd / sqrt n_j + 2 sd / sqrt n_c, sd the choosing losses' spread (n_c of them):
    how far below the target a choosing mean must sit for the judging and the confirming verdicts to pass with
    it (module docstring)."""
    sd = statistics.stdev(losses)
    t = float(scipy_stats().t.ppf(1 - alpha, judging_n - 1))
    return t * sd / math.sqrt(judging_n) + 2 * sd / math.sqrt(len(losses))


def finished(losses) -> list[float]:
    """The final losses of the seeds that finished (a diverged seed's is None or not finite)."""
    return [v for v in losses if v is not None and math.isfinite(v)]


def passes(losses, *, target: float, margin=MARGIN, judging_n: int = MIN_SEEDS) -> tuple[bool, float | None]:
    """Whether a probe's final losses count with margin (every seed finished and their mean <= target -
    margin), and the margin used (``auto``: :func:`auto_margin` for ``judging_n`` judging seeds; None where a
    seed did not finish)."""
    done = finished(losses)
    if not done or len(done) != len(losses):
        return False, None
    used = auto_margin(done, judging_n) if margin == "auto" else float(margin)
    return statistics.fmean(done) <= target - used, used


def search_steps(probe, candidates, *, target: float = TARGET, margin=MARGIN, judging_n: int = MIN_SEEDS) -> dict:
    """The shortest of ``candidates`` (step counts, ascending) that counts with margin, by bisection.

    ``probe(steps)`` runs the recipe at ``steps`` on the choosing seeds and returns ``final_val_losses`` and
    ``train_s`` (the median training time). Assumes a longer recipe ends no higher (its cosine ends at its
    last step): the passing candidates are then a suffix, and at most ceil(log2(n + 1)) probes find its start.
    The assumption can fail where a recipe over-fits (on the H100, dropout 0.1 ended at 1.4587 after 1,400
    steps and 1.4628 after 1,550 on seeds 2000-2004): ``monotone`` says whether the probed means fell with the
    steps, and where they did not, the answer is only as good as the probes (probe the counts one by one with
    a single-count ``--steps``). Returns the chosen ``steps`` (None: not even the longest passes), its probe,
    and every probe in order."""
    steps = sorted(set(candidates))
    if not steps or any(not (isinstance(s, int) and s > 0) for s in steps):
        raise FasttrainError(f"a step search needs positive step counts, got {list(candidates)!r}")
    lo, hi, best, probes = 0, len(steps) - 1, None, []
    while lo <= hi:
        mid = (lo + hi) // 2
        res = probe(steps[mid])
        losses = list(res["final_val_losses"])
        ok, used = passes(losses, target=target, margin=margin, judging_n=judging_n)
        done = finished(losses)
        probes.append({"steps": steps[mid], "final_val_losses": losses, "train_s": res.get("train_s"),
                       "mean": statistics.fmean(done) if done else None, "margin": used, "passes": ok})
        if ok:
            best, hi = len(probes) - 1, mid - 1
        else:
            lo = mid + 1
    chosen = probes[best] if best is not None else None
    return {"steps": chosen and chosen["steps"], "train_s": chosen and chosen["train_s"], "probes": probes,
            "candidates": steps, "target": target, "margin": margin, "monotone": means_fall_with_steps(probes)}


def means_fall_with_steps(probes) -> bool:
    """Whether the probes' mean final losses, in order of steps, never rise (the bisection's assumption)."""
    means = [p["mean"] for p in sorted(probes, key=lambda p: p["steps"]) if p["mean"] is not None]
    return all(later <= earlier for earlier, later in zip(means, means[1:]))


def choose(recipes, probe, *, target: float = TARGET, margin=MARGIN, judging_n: int = MIN_SEEDS, log=None) -> dict:
    """Search each recipe's steps (``probe(recipe, steps)``) and pick the one whose chosen steps trained fastest
    on the choosing seeds. Returns ``recipes`` (each search) and ``chosen`` (the recipe's name, or None)."""
    log = log or (lambda s: None)
    searched = []
    for recipe in recipes:
        found = search_steps(lambda steps: probe(recipe, steps), recipe.steps, target=target, margin=margin,
                             judging_n=judging_n)
        searched.append({"recipe": recipe.name, "change": recipe.change, "overrides": recipe.overrides, **found})
        log(f"[search {recipe.name}] " + (f"{found['steps']} steps ({found['train_s']:.2f} s)" if found["steps"]
                                          else f"none of {found['candidates']} steps ends <= {target} - margin "
                                               f"({margin})"))
        if not found["monotone"]:
            log(f"[search {recipe.name}] a longer probe ended higher than a shorter one ("
                + ", ".join(f"{p['steps']}: {p['mean']:.4f}" for p in sorted(found["probes"], key=lambda p: p["steps"])
                            if p["mean"] is not None)
                + "): the bisection assumes the loss falls with the steps; probe the counts one by one to be sure")
    ok = [s for s in searched if s["steps"] is not None and s["train_s"] is not None]
    chosen = min(ok, key=lambda s: s["train_s"]) if ok else None
    return {"recipes": searched, "chosen": chosen and chosen["recipe"], "steps": chosen and chosen["steps"]}


__all__ = ["BASE_RUNG", "MARGIN", "RECIPES", "Recipe", "auto_margin", "check_seeds", "choose", "finished", "parse_margin",
           "parse_recipes", "parse_seed_list",
           "means_fall_with_steps", "passes", "recipe_names", "search_steps"]
