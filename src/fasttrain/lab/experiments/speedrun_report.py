"""What a speedrun leaves behind: figures over seeds, the ladder table, the result files, the record, the
README section.

A ladder result (the dict :func:`fasttrain.lab.experiments.speedrun.run_ladder` returns) becomes

- per row, the record protocol's verdict (:func:`summarize`: counts or missing and why, mean and
  standard deviation of the seeds' final validation losses, t, df, p) with the median training time,
  the first crossing and the compile time; speed-ups between rows (:func:`speedup`, :func:`step_speedup`);
- ``ladder.md`` (:func:`ladder_markdown`), ``speedrun.csv`` (long format, :func:`to_csv`),
  ``speedrun.json`` and one run record per rung and seed (:func:`write_results`);
- the model of the fastest counted row's median seed (:func:`save_fastest`);
- ``record.json`` of the fastest counted row (:func:`record_of`, ``fasttrain lab speedrun record``), with
  the whole process's cold and warm times measured from the shell (``dev/speedrun/cold_start.sh``);
- the results index's speedrun section (:func:`readme_section`, ``fasttrain lab speedrun readme --into
  results/README.md``).
"""

from __future__ import annotations

import csv
import io
import json
import os
import statistics
from pathlib import Path

import click

from fasttrain.errors import FasttrainError
from fasttrain.lab.experiments.record_protocol import ALPHA, MIN_SEEDS, breakeven_steps, compile_seconds_of, summarize_recipe
from fasttrain.timing import summarize as spread_of

DEFAULT_SEEDS = MIN_SEEDS   # the seeds of a full row; rows with fewer are marked † and cannot count
README_START, README_END = "<!-- speedrun-results:start -->", "<!-- speedrun-results:end -->"


# --- statistics over seeds -------------------------------------------------------------------------

def _spread(values) -> dict | None:
    """p20/p50/p80, mean and n of the values that are not None; None when there are none."""
    stats = spread_of(values)
    return stats if stats["n"] else None


def summarize(row: dict, *, target: float, min_seeds: int = MIN_SEEDS) -> dict:
    """The row's verdict under the record protocol and its figures over seeds. A row with an error or cut
    short by the budget does not count (its seeds did not all finish)."""
    runs = row["runs"]
    out = summarize_recipe(runs, planned_seeds=len(row["seeds"]), target=target, min_seeds=min_seeds)
    if "error" in row:
        out.update(counts=False, missing=f"failed: {row['error'][:120]}")
    elif not runs:
        out.update(counts=False, missing="not run (out of --budget-s)" if row.get("skipped") else "not run")
    out.update({
        "seeds_run": len(runs),
        "train_s": _spread([r["train_s"] for r in runs if r["final_val_loss"] is not None]),
        "ms_per_step": _spread([r["ms_per_step"] for r in runs if r["ms_per_step"] is not None]),
        "first_crossing_s": _spread([r["first_crossing_s"] for r in runs]),
        "eval_s": _spread([r["eval_s"] for r in runs]),
        "final_eval_ms": _spread([r["final_eval_ms"] for r in runs]),
        "reset_s": _spread([r.get("reset_s") for r in runs]),
        "compile_s": compile_seconds(row, out.get("ms_per_step_median")),
    })
    return out


def compile_seconds(row: dict, ms_per_step: float | None) -> float | None:
    """What the setup of a compiling row spent beyond the work itself: setup less the model build, the
    warm-up steps at the row's own step time and one validation at its final-validation time."""
    if not row.get("compiles") or row.get("setup_s") is None or ms_per_step is None:
        return None
    finals = [r["final_eval_ms"] for r in row["runs"] if r.get("final_eval_ms") is not None]
    eval_s = statistics.median(finals) / 1e3 if finals else 0.0
    return compile_seconds_of(row["setup_s"] - row.get("build_s", 0.0) - eval_s, row["warmup_steps"], ms_per_step)


def median_run(row: dict) -> dict | None:
    """The finished run whose training time is the median of the row's (the lower one for an even count)."""
    runs = sorted((r for r in row["runs"] if r["final_val_loss"] is not None), key=lambda r: r["train_s"])
    return runs[(len(runs) - 1) // 2] if runs else None


def speedup(earlier: dict | None, row: dict) -> tuple[float | None, bool]:
    """(ratio of median training times earlier/row, whether the row divided by does not count)."""
    if earlier is None:
        return None, False
    a, b = earlier["summary"]["train_s_median"], row["summary"]["train_s_median"]
    if not a or not b:
        return None, False
    return a / b, not earlier["summary"]["counts"]


def step_speedup(earlier: dict | None, row: dict) -> float | None:
    a = earlier and earlier["summary"]["ms_per_step"]
    b = row["summary"]["ms_per_step"]
    return a["p50"] / b["p50"] if a and b else None


def breakeven_of(result: dict, row: dict) -> float | None:
    """Steps after which a compiling row's compilation has paid: its compile time over the step time it
    saves against the nearest earlier row of the same invocation that does not compile."""
    if not row.get("compiles"):
        return None
    rows = result["rows"]
    i = next(k for k, r in enumerate(rows) if r is row)
    eager = next((r for r in reversed(rows[:i]) if not r.get("compiles") and r["summary"]["ms_per_step"]), None)
    mine = row["summary"]["ms_per_step"]
    if eager is None or not mine:
        return None
    return breakeven_steps(row["summary"]["compile_s"], eager["summary"]["ms_per_step"]["p50"] / 1e3,
                           mine["p50"] / 1e3)


# --- the fastest model ----------------------------------------------------------------------------

def save_fastest(path, row: dict, run: dict, state: dict, *, corpus, target: float) -> dict:
    """The final model of ``run`` (weights as trained, fp32) with what its evaluation used."""
    from fasttrain.lab.model import GPTConfig, build
    from fasttrain.lab.checkpoint import save_checkpoint

    model = build(GPTConfig.from_dict(row["model"]), "cpu")
    model.load_state_dict(state)
    extra = {"val_loss": run["final_val_loss"], "val_tokens": run["final_val_tokens"],
             "eval_batch_size": row["eval"]["eval_batch_size"], "step": run["steps"], "eval": row["eval"],
             "split": {"train_fraction": 0.9, "train_chars": int(len(corpus.train)),
                       "val_chars": int(len(corpus.val))},
             "speedrun": {"rung": row["name"], "label": row["label"], "seed": run["seed"], "target": target,
                          "steps": run["steps"], "train_s": run["train_s"]}}
    lab = dict(row["config"], seed=run["seed"])
    save_checkpoint(model, path, chars=corpus.chars, lab=lab, extra=extra)
    return {"path": str(path), "rung": row["name"], "seed": run["seed"], "val_loss": run["final_val_loss"]}


# --- result files ------------------------------------------------------------------------------------

def _num(v, digits: int = 3) -> str:
    if v is None:
        return "-"
    if abs(v) >= 10 ** digits:
        return f"{v:,.0f}"
    text = f"{v:.{digits}g}"
    return f"{v:.2e}" if "e" in text else text


def _ratio(value: float | None, over_a_miss: bool = False) -> str:
    if value is None:
        return "-"
    return f"*{_num(value)}×*" if over_a_miss else f"{_num(value)}×"


def baseline_row(result: dict) -> dict | None:
    rows = [r for r in result["rows"] if "error" not in r and r["runs"]]
    return next((r for r in rows if r["index"] == 0), rows[0] if rows else None)


def _loss_cell(s: dict) -> str:
    if s.get("mean") is None:
        return "-"
    return f"{s['mean']:.4f}" + (f" ± {s['std']:.4f}" if s.get("std") is not None else "")


def _t_cell(s: dict) -> str:
    return "-" if s.get("t") is None else f"{s['t']:.2f} ({s['df']})"


def ladder_markdown(result: dict) -> str:
    """The ladder table with its header (GPU, command, target, protocol) and the definitions of its columns."""
    target = result["target"]
    base = baseline_row(result)
    rows_md, prev = [], None
    few = False
    min_seeds = (result.get("settings") or {}).get("min_seeds", MIN_SEEDS)
    for row in result["rows"]:
        s = row["summary"]
        tt = s["train_s"]
        if "error" in row:
            time_cell = f"failed: {row['error'][:80]}"
        elif not row["runs"]:
            time_cell = "not run (out of --budget-s)"
        elif s["train_s_median"] is not None:
            time_cell = f"**{_num(s['train_s_median'])}**" if s["counts"] else _num(s["train_s_median"])
        else:
            time_cell = "- (diverged)"
        spread = f"{_num(tt['p20'])}–{_num(tt['p80'])}" if tt else "-"
        x_prev, prev_miss = speedup(prev, row)
        x_base, base_miss = speedup(base, row) if base is not row else (None, False)
        seeds_cell = f"{s['seeds_run']}/{len(row['seeds'])}"
        if row.get("skipped"):
            seeds_cell += " (out of budget)"
        if len(row["seeds"]) < min_seeds:
            seeds_cell += " †"
            few = True
        ms = s["ms_per_step"]
        counts_cell = "**yes**" if s["counts"] else f"no: {s['missing']}"
        crossing = s["first_crossing_s"]
        rows_md.append([
            row["label"], row["name"], row["change"], _num(s.get("steps")), _num(ms and ms["p50"]), time_cell, spread,
            _ratio(x_prev, prev_miss), _ratio(x_base, base_miss), _ratio(step_speedup(base, row)), _loss_cell(s),
            _t_cell(s), "-" if s.get("p_value") is None else f"{s['p_value']:.2g}", counts_cell,
            _num(crossing and crossing["p50"]) + ("" if not crossing or crossing["n"] == s["seeds_run"] else
                                                  f" ({crossing['n']}/{s['seeds_run']})"),
            _num(row.get("setup_s")), _num(s.get("compile_s")), _num(breakeven_of(result, row)),
            _num(s["eval_s"] and s["eval_s"]["p50"]), _num(row.get("wall_s")), seeds_cell,
        ])
        if "error" not in row and row["runs"]:
            prev = row
    header = ["#", "rung", "change (since the row above)", "steps", "ms/step", "train s (median)", "p20–p80", "× prev",
              f"× {base['name'] if base else 'baseline'}", "step × base", "final val loss (mean ± sd)", "t (df)", "p",
              "counts", f"first ≤ {target} (s)", "setup s", "compile s", "breakeven steps", "eval s", "wall s",
              "seeds"]
    align = "rll" + "r" * (len(header) - 3)
    seps = {"l": "---", "r": "---:"}
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join(seps[a] for a in align) + " |"]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in r) + " |" for r in rows_md]
    env = result.get("environment") or {}
    gpu = (env.get("gpu") or {}).get("name") or result.get("device")
    settings = result.get("settings", {})
    alpha = settings.get("alpha", ALPHA)
    parts = [
        f"### Shakespeare speedrun: training time of fixed-step recipes whose final validation loss is ≤ {target}",
        f"GPU: **{gpu}** · torch {result.get('torch')} · git {env.get('git_sha') or '?'} · {result.get('started')}"
        + (f" · whole process {result['process_wall_s']:.0f} s" if result.get("process_wall_s") else ""),
        f"Command: `{result.get('command') or 'fasttrain lab speedrun'}`",
        "\n".join(lines),
        f"*Protocol: each row is a recipe of a fixed number of steps. Per seed, train s is the training time of those "
        f"steps (device synchronized; batches, forward, backward, optimizer; validation excluded), median over seeds, "
        f"p20–p80 across them. After the last step the model is scored over {_scored(result)}. A row counts when its "
        f"seeds' mean final validation loss is ≤ {target} by a one-sided one-sample t-test (H1: mean < {target}; "
        f"t = (mean − {target}) / (sd / √n), df = n − 1) with p < {alpha} over at least {min_seeds} seeds; otherwise "
        f"the counts column says what is missing. × prev / × baseline: ratio of median training times, measured "
        f"{_where_measured(result)}; in italics where the row divided by does not count. step × base: ratio of "
        f"ms/step. First ≤ {target}: training time to the first validation at or below the target (validation every "
        f"{settings.get('eval_interval') or '-'} steps and at the end; a secondary figure, never the one that counts). "
        f"setup: build, compilation or CUDA-graph capture and warm-up steps (parameters restored after), once per row; "
        f"compile s: the setup less the work itself (build, warm-up steps at the row's step time, one validation); "
        f"breakeven steps: compile s over the step time saved against the nearest earlier row that does not compile "
        f"(compiling pays after that many steps). eval: validation time per seed, apart from training. wall: the "
        f"whole row, every seed.*",
    ]
    if few:
        parts.append(f"*† fewer seeds than the protocol's {min_seeds}: the row's speed is measured, its loss cannot "
                     f"count.*")
    if result.get("saved"):
        sv = result["saved"]
        parts.append(f"*Saved: the final model of rung {sv['rung']} (seed {sv['seed']}, the median training time; "
                     f"final validation loss {sv['val_loss']:.6f}); check it with `fasttrain lab eval {sv['path']}`.*")
    return "\n\n".join(parts) + "\n"


def _where_measured(result: dict) -> str:
    parts = result.get("parts")
    if not parts:
        return "in this one invocation"
    return (f"in {len(parts)} invocations on the same GPU, merged by `fasttrain lab speedrun merge` (rungs "
            + "; ".join(", ".join(p["rungs"]) for p in parts) + ")")


def _scored(result: dict) -> str:
    """What each validation scored: the whole split, or the token budget a run was given."""
    total = result["data"]["val_chars"] - 1
    tokens = {e["tokens"] for row in result["rows"] for run in row["runs"] for e in run["evals"]}
    if not tokens or tokens == {total}:
        return f"the whole validation split ({total:,} predicted characters)"
    return (f"the first {', '.join(f'{t:,}' for t in sorted(tokens))} of the {total:,} predicted validation "
            "characters (a token budget)")


CSV_COLUMNS = ("suite", "row", "rung", "metric", "unit", "p20", "p50", "p80", "n", "counts", "missing", "seeds",
               "target", "gpu", "torch", "git_sha", "timestamp")
METRICS = (("train_s", "s"), ("ms_per_step", "ms"), ("first_crossing_s", "s"), ("eval_s", "s"),
           ("final_eval_ms", "ms"), ("reset_s", "s"))


def to_csv(result: dict) -> str:
    """Long format: one line per row and metric, p20/p50/p80 over seeds; the protocol's statistics (mean and
    sd of the final losses, t, df, p) and each seed's final loss as single values."""
    env = result.get("environment") or {}
    gpu = (env.get("gpu") or {}).get("name") or result.get("device")
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=CSV_COLUMNS, lineterminator="\n")
    writer.writeheader()
    base = baseline_row(result)
    for row in result["rows"]:
        s = row["summary"]
        common = {"suite": "speedrun", "row": row["label"], "rung": row["name"], "counts": s["counts"],
                  "missing": s["missing"] or "", "seeds": len(row["seeds"]), "target": result["target"],
                  "gpu": gpu, "torch": result.get("torch"), "git_sha": env.get("git_sha"),
                  "timestamp": result.get("started")}
        extra = [("steps", "steps", s.get("steps")), ("mean_final_val_loss", "nats/char", s.get("mean")),
                 ("sd_final_val_loss", "nats/char", s.get("std")), ("t", "-", s.get("t")), ("df", "-", s.get("df")),
                 ("p_value", "-", s.get("p_value")), ("setup_s", "s", row.get("setup_s")),
                 ("compile_s", "s", s.get("compile_s")), ("breakeven_steps", "steps", breakeven_of(result, row)),
                 ("rung_wall_s", "s", row.get("wall_s"))]
        extra += [(f"final_val_loss_seed{r['seed']}", "nats/char", r["final_val_loss"]) for r in row["runs"]]
        x_base, over_miss = speedup(base, row) if base is not row else (None, False)
        extra.append(("speedup_vs_uncounted_baseline" if over_miss else "speedup_vs_baseline", "x", x_base))
        for metric, unit in METRICS:
            p = s.get(metric)
            if p:
                writer.writerow({**common, "metric": metric, "unit": unit, "p20": p["p20"], "p50": p["p50"],
                                 "p80": p["p80"], "n": p["n"]})
        for metric, unit, value in extra:
            if value is not None:
                writer.writerow({**common, "metric": metric, "unit": unit, "p20": value, "p50": value, "p80": value,
                                 "n": 1})
    return buf.getvalue()


def write_results(result: dict, out) -> list[Path]:
    """``speedrun.json`` (everything), ``speedrun.csv``, ``ladder.md`` and ``runs/<row>-<rung>-seed<S>.json``
    (one run record per rung and seed), each written whole or not at all."""
    from fasttrain.files import atomic_write_text

    folder = Path(out)
    (folder / "runs").mkdir(parents=True, exist_ok=True)
    written = []
    for row in result["rows"]:
        for run in row["runs"]:
            rec = {"kind": "lab-speedrun-run", "target": result["target"], "row": row["label"], "rung": row["name"],
                   "change": row["change"], "config": dict(row["config"], seed=run["seed"]), "model": row.get("model"),
                   "setup_s_of_rung": row.get("setup_s"), "environment": result.get("environment"),
                   "torch": result.get("torch"), "device": result.get("device"), **run}
            path = folder / "runs" / f"{int(row['label']):02d}-{row['name']}-seed{run['seed']}.json" \
                if row["label"].isdigit() else folder / "runs" / f"v-{row['name']}-seed{run['seed']}.json"
            atomic_write_text(path, json.dumps(rec, indent=1, default=str) + "\n")
            written.append(path)
    for name, text in (("speedrun.json", json.dumps(result, indent=1, default=str) + "\n"),
                       ("speedrun.csv", to_csv(result)), ("ladder.md", ladder_markdown(result))):
        atomic_write_text(folder / name, text)
        written.append(folder / name)
    return written


def load_result(folder) -> dict:
    from fasttrain.files import read_json_object

    path = Path(folder) / "speedrun.json"
    result = read_json_object(path, "speedrun result", hint=f"run `fasttrain lab speedrun --out {folder}` first")
    if result.get("kind") != "lab-speedrun":
        raise FasttrainError(f"{path}: not a speedrun result (kind {result.get('kind')!r})")
    if result.get("protocol") != "fixed-steps":
        raise FasttrainError(f"{path}: a result of the earlier protocol (time to the first crossing); the record "
                             f"protocol needs a new run of fasttrain lab speedrun")
    return result


# The goals on an H100, for the fastest counted recipe: training time, and the whole process from the
# shell with empty (cold) and filled (warm) compiler caches
GOALS = (("train_s", "training time of the fixed steps (median over seeds)", 5.0),
         ("process_cold_s", "whole process, cold compiler caches", 20.0),
         ("process_warm_s", "whole process, warm compiler caches", 12.0))


def search_markdown(record: dict) -> str:
    """How the record was chosen and judged: the step search on the choosing seeds (every probe), the judging
    seeds, and the confirmation of a second invocation on fresh seeds (or that none ran yet)."""
    if "choosing_seeds" not in record:
        return ""
    margin = record.get("margin")
    rule = ("the margin auto: t(0.99, n_j - 1) sd / sqrt n_j + 2 sd / sqrt n_c from each probe's own spread, n_j the "
            "judging seeds" if margin == "auto" else f"the margin {margin}")
    lines = [f"Chosen on seeds {record['choosing_seeds']} (the shortest steps whose mean ends at or below "
             f"{record.get('target')} less {rule}), judged on seeds {record['judging_seeds']} alone "
             f"(p < {record.get('alpha')}).", ""]
    probes = [(r["recipe"], p) for r in record.get("search") or [] for p in r["probes"]]
    if probes:
        lines += ["| recipe | steps | choosing seeds' final losses | mean | margin | train s | passes |",
                  "| --- | ---: | --- | ---: | ---: | ---: | --- |"]
        for name, p in probes:
            losses = ", ".join("-" if v is None else f"{v:.4f}" for v in p["final_val_losses"])
            used = p.get("margin", margin if margin != "auto" else None)
            lines.append(f"| {name} | {p['steps']} | {losses} | {_num(p['mean'], 4)} | {_num(used, 4)} | "
                         f"{_num(p['train_s'])} | {'yes' if p['passes'] else 'no'} |")
        lines.append("")
    conf = record.get("confirmation")
    if conf is None:
        lines.append("Not yet confirmed on fresh seeds (`fasttrain lab speedrun confirm`).")
    else:
        lines.append(f"Confirmed by a second invocation (`{conf['command']}`) on fresh seeds {conf['seeds']}: mean "
                     f"final validation loss {conf['mean_final_val_loss']:.4f}, p = {conf['p_value']:.3g}, training "
                     f"{conf['train_s']:.2f} s (median): "
                     + ("**it holds**." if conf["holds"] else f"**it does not hold** ({conf.get('missing')})."))
    return "\n".join(lines) + "\n\n"


def goals_markdown(record: dict) -> str:
    """The record's figures against :data:`GOALS`: met, or missed by how much (an unmeasured figure says so)."""
    lines = ["| figure | goal (s) | measured (s) | verdict |", "| --- | ---: | ---: | --- |"]
    for key, what, goal in GOALS:
        value = record.get(key)
        if value is None:
            verdict, shown = "not measured", "-"
        else:
            shown = f"{value:.2f}"
            verdict = "met" if value <= goal else f"missed ({value / goal:.2f}x the goal)"
        lines.append(f"| {what} | {goal:g} | {shown} | {verdict} |")
    return "\n".join(lines) + "\n"


def process_markdown(times: list[dict]) -> str:
    """``cold_start.sh``'s whole-process timings: per rung and cache state, the process's seconds split into
    the setup (build, compilation, capture, warm-up), the training and the rest (imports, CUDA start-up, data,
    validation, writing); the bare start-up rows (import torch, CUDA initialization) alone."""
    lines = ["| rung | caches | process s | setup s | train s | rest s |", "| --- | --- | ---: | ---: | ---: | ---: |"]
    for t in times:
        setup, train = t.get("setup_s"), t.get("train_s")
        rest = t["process_s"] - setup - train if setup is not None and train is not None else None
        cells = [_num(v, 3) if v is not None else "-" for v in (t["process_s"], setup, train, rest)]
        failed = "" if t.get("rc", 0) == 0 else f" (exit {t['rc']})"
        lines.append(f"| {t['rung']} | {t['cache']}{failed} | " + " | ".join(cells) + " |")
    phased = [t for t in times if t.get("phases")]
    if phased:
        lines += ["", "Where a process's seconds go (its age at each milestone, from `/proc`, in `process_phases`):", "",
                  "| rung | caches | interpreter + CLI | import torch + data | build + capture | warm-up + validation "
                  "| train | rest of the row | exit |", "| --- | --- | " + "---: | " * 6 + "---: |"]
        for t in phased:
            parts = process_parts(t)
            lines.append(f"| {t['rung']} | {t['cache']} | " + " | ".join(_num(parts[k], 3) for k in PROCESS_PARTS)
                         + " |")
    return "\n".join(lines) + "\n"


PROCESS_PARTS = ("interpreter", "imports_data", "build", "warmup", "train", "rest_of_row", "exit")


def process_parts(t: dict) -> dict:
    """One timed process cut at its milestones (``phases``: the process's age on entering the ladder, after the
    data, after the row; the row's own build, warm-up and training): the parts add up to ``process_s``."""
    ph = t["phases"]
    warmup = ph["warmup_steps_s"] + ph["warmup_eval_s"]
    row = ph["rows_done_s"] - ph["corpus_loaded_s"]
    return {"interpreter": ph["entered_s"], "imports_data": ph["corpus_loaded_s"] - ph["entered_s"],
            "build": ph["build_s"], "warmup": warmup, "train": ph["train_s"],
            "rest_of_row": row - ph["build_s"] - warmup - ph["train_s"], "exit": t["process_s"] - ph["saved_s"]}


def profile_markdown(profile: dict) -> str:
    """``dev/speedrun/profile_step.py``'s step profile: wall and GPU-busy time per step, kernel families."""
    wall, busy = profile["wall_ms_per_step"], profile["gpu_busy_ms_per_step"]
    lines = [f"Rung `{profile['rung']}`, {profile['steps']} steps under torch.profiler: {wall:.2f} ms a step of wall "
             f"time, the GPU busy {busy:.2f} ms of it ({100 * busy / wall:.0f}%), "
             f"{profile['kernel_launches_per_step']:.0f} kernels a step.", "",
             "| kernels | ms per step | share of busy time |", "| --- | ---: | ---: |"]
    for family, ms in profile["by_family_ms_per_step"].items():
        lines.append(f"| {family} | {ms:.3f} | {100 * ms / busy:.0f}% |")
    top = profile["top_kernels"][:6]
    lines += ["", "Largest kernels: " + "; ".join(f"`{k['name'][:60]}` {k['ms_per_step']:.3f} ms "
                                                   f"(x{k['calls_per_step']:g})" for k in top) + "."]
    return "\n".join(lines) + "\n"


def _link(folder: Path, name: str, into_dir: Path | None = None) -> str:
    """``folder/name`` as a Markdown link: shown from the repository root, leading from ``into_dir`` (the
    folder of the file it is written into) where given, so that it resolves there."""
    shown = (folder / name).as_posix()
    target = Path(os.path.relpath((folder / name).resolve(), into_dir.resolve())).as_posix() if into_dir else shown
    return f"[`{shown}`]({target})"


def readme_section(folder, also=(), into=None) -> str:
    """The results index's speedrun section from a result folder (every figure read from its files): the
    ladder; the record (``record.json``) against the goals; the whole-process times (``cold/process_times*.jsonl``,
    one table per device call); then, for each folder of ``also`` (ladders of variants measured apart), its
    ladder; and every step profile (``profile-*.json``) found in these folders. Its headings are ``###``, under
    the index's heading of the area, each one once; ``into``: the file it goes into (its links lead from there)."""
    from fasttrain.files import read_json_object

    folder = Path(folder)
    into_dir = Path(into).parent if into is not None else None

    def link(where: Path, name: str) -> str:
        return _link(where, name, into_dir)

    result = load_result(folder)
    command = " ".join(["fasttrain lab speedrun readme", folder.as_posix(), *[f"--also {Path(a).as_posix()}" for a in also]])
    parts = [f"Generated by `{command}` from {link(folder, 'speedrun.json')} (run records per rung and seed in "
             f"`runs/`, long-format CSV in `speedrun.csv`).\n\n" + ladder_markdown(result)]
    record_path = folder / "record.json"
    if record_path.is_file():
        rec = read_json_object(record_path, what="speedrun record")
        parts.append(f"### The record and the goals\n\nFrom {link(folder, 'record.json')}: rung `{rec.get('rung')}`, "
                     f"{rec.get('steps')} steps, {len(rec.get('seeds') or [])} seeds, mean final validation loss "
                     f"{rec.get('mean_final_val_loss', float('nan')):.4f} (p = {rec.get('p_value', float('nan')):.3g}); "
                     f"command: `{rec.get('command')}`.\n\n" + search_markdown(rec) + goals_markdown(rec))
    # one file per device call of cold_start.sh (process_times.jsonl, process_times-*.jsonl): each its own table,
    # the first call's first; a later call's heading names its file
    for times_path in sorted((folder / "cold").glob("process_times*.jsonl"),
                             key=lambda p: (p.name != "process_times.jsonl", p.name)):
        name = f"cold/{times_path.name}"
        call = "" if times_path.name == "process_times.jsonl" else f" (`{name}`)"
        parts.append(f"### The whole process, from the shell{call}\n\nFrom {link(folder, name)} "
                     "(`dev/speedrun/cold_start.sh`, one device call: cold = empty inductor and autotuning caches (and, "
                     "where the script could, an emptied file cache: the libraries read from disk), warm "
                     "= the next process, caches filled by the run before, compile-cache = `--compile-cache FILE` loaded into a cold process; "
                     "rest = imports, CUDA start-up, data, validation and writing).\n\n"
                     + process_markdown(read_process_times(times_path)))
    for extra in also:
        extra = Path(extra)
        # the variants' ladder under this heading, without the ladder's own (the main ladder's title again)
        ladder = ladder_markdown(load_result(extra)).split("\n\n", 1)[1]
        named = f" (`{extra.as_posix()}`)" if len(also) > 1 else ""
        parts.append(f"### Variants measured apart{named}\n\nFrom {link(extra, 'speedrun.json')}:\n\n" + ladder)
    profiles = [path for where in (folder, *map(Path, also)) for path in sorted(where.glob("profile-*.json"))]
    for path in profiles:
        named = f" (`{path.name}`)" if len(profiles) > 1 else ""
        parts.append(f"### The step, kernel by kernel{named}\n\nFrom {link(path.parent, path.name)} "
                     f"(`dev/speedrun/profile_step.py`):\n\n" + profile_markdown(read_json_object(path, what="step profile")))
    return "\n".join(parts)


@click.command("readme")
@click.argument("results_dir", type=click.Path())
@click.option("--also", multiple=True, type=click.Path(file_okay=False),
              help="Another result folder whose ladder follows (variants measured in another invocation).")
@click.option("--into", type=click.Path(dir_okay=False),
              help=f"Replace the text between the lines {README_START} and {README_END} of this file "
                   f"(the results index: results/README.md).")
def readme_command(results_dir, also, into) -> None:
    """Print (or write into the results index) the speedrun section generated from a result folder."""
    section = readme_section(results_dir, also, into)
    if into:
        from fasttrain.files import write_into

        write_into(into, section, start=README_START, end=README_END)
        click.echo(f"wrote the speedrun section into {into}")
    else:
        click.echo(section, nl=False)


# --- one ladder from several invocations ------------------------------------------------------------


def _cut_short(row: dict) -> bool:
    """Whether --budget-s stopped a rung before all its seeds ran (a miss that stopped the rung is whole)."""
    return bool(row.get("skipped"))


def _row_key(row: dict) -> tuple:
    return (0, int(row["label"])) if str(row["label"]).isdigit() else (1, str(row["label"]))


def merge_results(parts: list[dict]) -> dict:
    """One ladder from the results of several invocations on the same GPU (a ladder longer than one call may
    run, split by rungs): rows in rung order, each rung from exactly one part; the parts must share the GPU,
    torch, target, settings and data. The saved model is the one its part saved for the fastest counted row."""
    if len(parts) < 2:
        raise FasttrainError("merge needs at least two speedrun result folders")
    first = parts[0]

    def gpu(result):
        return ((result.get("environment") or {}).get("gpu") or {}).get("name") or result.get("device")

    for other in parts[1:]:
        for what, get in (("GPU", gpu), ("torch", lambda r: r.get("torch")), ("target", lambda r: r.get("target")),
                          ("protocol", lambda r: r.get("protocol")),
                          ("data", lambda r: r.get("data")),
                          ("settings", lambda r: {k: v for k, v in (r.get("settings") or {}).items()
                                                  if k not in ("budget_s", "seeds", "compile_cache")})):
            if get(other) != get(first):
                raise FasttrainError(f"cannot merge speedrun results of different {what}: {get(first)!r} and "
                                     f"{get(other)!r}")
    chosen: dict[str, tuple[int, dict]] = {}
    for i, part in enumerate(parts):
        for row in part["rows"]:
            if row["label"] in chosen:
                j, earlier = chosen[row["label"]]
                # a rung that --budget-s cut short (not every seed ran) may be run again whole in another part
                if _cut_short(earlier) and not _cut_short(row):
                    chosen[row["label"]] = (i, row)
                    continue
                if _cut_short(row) and not _cut_short(earlier):
                    continue
                raise FasttrainError(f"rung {row['label']} ({row['name']}) is in two of the results (parts {j + 1} "
                                     f"and {i + 1}); merge results of different rungs (a rung cut short by "
                                     "--budget-s may be completed by another part)")
            chosen[row["label"]] = (i, row)
    rows = sorted((dict(row) for _, row in chosen.values()), key=_row_key)
    # each rung's change is now said since the rung above it in the merged ladder (a part's first row listed
    # every change since the last rung of that part, e.g. all of them since the preset)
    from fasttrain.lab.experiments.speedrun_ladder import LADDER

    prev = -1
    for row in rows:
        i = row.get("index")
        if isinstance(i, int) and 0 <= i < len(LADDER) and row["name"] == LADDER[i].name:
            row["change"] = LADDER[0].change if i == 0 else " + ".join(r.change for r in LADDER[prev + 1: i + 1])
            prev = i
    counted = [r for r in rows if r["summary"]["counts"]]
    fastest_row = min(counted, key=lambda r: r["summary"]["train_s_median"]) if counted else None
    saved = None
    fastest = None
    if fastest_row is not None:
        fastest = {"label": fastest_row["label"], "name": fastest_row["name"],
                   "train_s": fastest_row["summary"]["train_s_median"],
                   "seed": median_run(fastest_row)["seed"]}
        saved = next((p["saved"] for p in parts if p.get("saved") and p["saved"].get("rung") == fastest_row["name"]),
                     None)
    settings = dict(first.get("settings") or {})
    settings["seeds"] = max((p.get("settings", {}).get("seeds") or [] for p in parts), key=len)
    return {
        **{k: first.get(k) for k in ("kind", "protocol", "target", "environment", "torch", "device", "data")},
        "command": " && ".join(p.get("command") or "fasttrain lab speedrun" for p in parts),
        "started": min(p.get("started") or "" for p in parts),
        "finished": max(p.get("finished") or "" for p in parts),
        "settings": settings,
        "parts": [{k: p.get(k) for k in ("command", "started", "finished", "process_wall_s")}
                  | {"rungs": [r["label"] for r in p["rows"] if any(r is row for _, row in chosen.values())],
                     "git_sha": (p.get("environment") or {}).get("git_sha")} for p in parts],
        "rows": rows, "saved": saved, "fastest": fastest, "process_wall_s": None,
    }


@click.command("merge")
@click.argument("parts", nargs=-1, type=click.Path())
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False),
              help="A new folder for the merged speedrun.json, speedrun.csv, ladder.md and runs/.")
def merge_command(parts, out_dir) -> None:
    """Merge the result folders of several `fasttrain lab speedrun --out` invocations (different rungs, the same
    GPU) into one ladder."""
    from fasttrain.files import check_new_folder

    check_new_folder(out_dir, "--out")
    merged = merge_results([load_result(p) for p in parts])
    write_results(merged, out_dir)
    click.echo(ladder_markdown(merged), nl=False)
    click.echo(f"results: {out_dir}/ (speedrun.json, speedrun.csv, ladder.md, runs/)")


# --- the record ------------------------------------------------------------------------------------


def read_process_times(path) -> list[dict]:
    """The whole-process timings ``dev/speedrun/cold_start.sh`` writes: one JSON object per line with
    ``rung``, ``cache`` (cold, warm, ...), ``process_s`` and ``rc``."""
    path = Path(path)
    try:
        lines = [line for line in path.read_text().splitlines() if line.strip()]
    except FileNotFoundError:
        raise FasttrainError(f"{path}: no such file; run dev/speedrun/cold_start.sh first") from None
    out = []
    for n, line in enumerate(lines, 1):
        try:
            item = json.loads(line)
        except ValueError:
            raise FasttrainError(f"{path} line {n}: not JSON (a cold_start.sh timing per line)") from None
        if not (isinstance(item, dict) and {"rung", "cache", "process_s"} <= set(item)):
            raise FasttrainError(f"{path} line {n}: needs rung, cache and process_s")
        out.append(item)
    return out


def process_time(times: list[dict], rung: str, cache: str) -> float | None:
    """The median whole-process time of ``rung`` with ``cache`` (cold or warm) among the successful runs."""
    values = [t["process_s"] for t in times if t["rung"] == rung and t["cache"] == cache and t.get("rc", 0) == 0]
    return statistics.median(values) if values else None


def record_of(result: dict, times: list[dict] | None = None, *, machine: str | None = None) -> dict:
    """``record.json`` of the judged recipe of a search's result (see record_protocol.RECORD_KEYS: its seeds
    judged it, ``result["choosing_seeds"]`` chose it), with its whole-process times from ``times`` (cold: a
    fresh process on a fresh machine; warm: the next one) when measured. A ladder of several counted rows
    judged on the same seeds is refused: keeping the fastest of them is a choice made on the judging seeds."""
    from fasttrain.lab.experiments.record_protocol import record

    counted = [r for r in result["rows"] if r["summary"]["counts"]]
    if not counted:
        raise FasttrainError("no row of this result counts: there is no record to write")
    if "choosing_seeds" not in result:
        raise FasttrainError("this result was not chosen apart from its judging seeds; make the record with "
                             "fasttrain lab speedrun search (choosing and judging seeds disjoint)")
    if len(result["rows"]) != 1:
        raise FasttrainError(f"{len(result['rows'])} rows were judged on the same seeds: keeping the fastest is a "
                             f"choice made on them; judge one recipe (fasttrain lab speedrun search)")
    row = counted[0]
    s = row["summary"]
    times = times or []
    env = result.get("environment") or {}
    saved = result.get("saved") if (result.get("saved") or {}).get("rung") == row["name"] else None
    search = result.get("search") or {}
    return record(s, command=result.get("command") or "fasttrain lab speedrun search",
                  choosing_seeds=result["choosing_seeds"],
                  process_cold_s=process_time(times, row["name"], "cold"),
                  process_warm_s=process_time(times, row["name"], "warm"),
                  rung=row["name"], label=row["label"], target=result["target"], t=s["t"], df=s["df"], std=s["std"],
                  alpha=s["alpha"], test="one-sided one-sample t-test (scipy.stats.ttest_1samp, alternative='less')",
                  ms_per_step=s["ms_per_step_median"], setup_s=row.get("setup_s"), compile_s=s.get("compile_s"),
                  first_crossing_s=s.get("first_crossing_s_median"), checkpoint=saved,
                  machine=machine, gpu=(env.get("gpu") or {}).get("name") or result.get("device"),
                  torch=result.get("torch"), git_sha=env.get("git_sha"), started=result.get("started"),
                  config=row["config"], user_command=result.get("user_command"), data=result.get("data"),
                  margin=search.get("margin", next((r.get("margin") for r in search.get("recipes", [])), None)),
                  search=[{k: r[k] for k in ("recipe", "steps", "probes")} for r in search.get("recipes", [])],
                  process_times=[t for t in times if t["rung"] in (row["name"], "startup")])


def kept_confirmation(path: Path, rec: dict) -> dict | None:
    """The confirmation of the record already at ``path`` when it confirmed this same recipe (the same steps,
    configuration and judging seeds): writing the record again (say, to add process times) keeps it."""
    from fasttrain.files import read_json_object

    if not path.is_file():
        return None
    old = read_json_object(path, "record")
    same = all(old.get(k) == rec.get(k) for k in ("steps", "config", "judging_seeds", "choosing_seeds"))
    return old.get("confirmation") if same else None


@click.command("record")
@click.argument("results_dir", type=click.Path())
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False),
              help="The machine's result folder, e.g. results/speedrun/nvidia-h100 (record.json goes there).")
@click.option("--process-times", type=click.Path(dir_okay=False),
              help="process_times.jsonl of dev/speedrun/cold_start.sh (the whole process, cold and warm).")
def record_command(results_dir, out_dir, process_times) -> None:
    """Write record.json for the judged recipe of a search's result folder (with the process times)."""
    from fasttrain.lab.experiments.record_protocol import write_record

    result = load_result(results_dir)
    times = read_process_times(process_times) if process_times else []
    rec = record_of(result, times, machine=Path(out_dir).name)
    rec["confirmation"] = kept_confirmation(Path(out_dir) / "record.json", rec)
    path = write_record(rec, out_dir)
    click.echo(json.dumps({k: rec[k] for k in ("steps", "mean_final_val_loss", "p_value", "train_s", "process_cold_s",
                                               "process_warm_s")}))
    click.echo(f"wrote {path}")


__all__ = ["DEFAULT_SEEDS", "GOALS", "README_END", "README_START", "baseline_row", "breakeven_of", "ladder_markdown",
           "goals_markdown", "kept_confirmation", "load_result", "search_markdown", "median_run", "merge_command", "merge_results", "process_markdown", "profile_markdown", "read_process_times", "readme_command",
           "readme_section", "record_command", "record_of", "save_fastest", "speedup", "step_speedup", "summarize",
           "to_csv", "write_results"]
