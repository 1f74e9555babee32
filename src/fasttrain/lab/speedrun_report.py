"""What a speedrun leaves behind: figures over seeds, the ladder table, the result files, the README section.

A ladder result (the dict :func:`fasttrain.lab.speedrun.run_ladder` returns) becomes

- per row, p20/p50/p80 over seeds of every timed quantity (:func:`summarize`) and speed-ups between
  rows (:func:`speedup`, :func:`step_speedup`);
- ``ladder.md`` (:func:`ladder_markdown`), ``speedrun.csv`` (long format, :func:`to_csv`),
  ``speedrun.json`` and one run record per rung and seed (:func:`write_results`);
- the fastest row's final model (:func:`save_fastest`);
- the README's speedrun section (:func:`readme_section`, ``fasttrain lab speedrun readme``).
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import click

from fasttrain.errors import FasttrainError
from fasttrain.timing import summarize as spread_of

DEFAULT_SEEDS = 3           # the seeds of a full row; rows with fewer are marked † in the table
README_START, README_END = "<!-- speedrun-results:start -->", "<!-- speedrun-results:end -->"


# --- statistics over seeds -------------------------------------------------------------------------

def _spread(values) -> dict | None:
    """p20/p50/p80, mean and n of the values that are not None; None when there are none."""
    stats = spread_of(values)
    return stats if stats["n"] else None


def summarize(row: dict) -> dict:
    """The row's figures over seeds; ``counts`` only if every planned seed ran and reached the target."""
    runs = row["runs"]
    reached = [r for r in runs if r["reached"]]
    counts = bool(runs) and len(reached) == len(row["seeds"]) and "error" not in row and "skipped" not in row
    # a row that does not count has no time to target; what is known is that each run that missed
    # trained train_s without reaching it (the shortest such run bounds a speed-up over this row)
    missed = [r["train_s"] for r in runs if not r["reached"]]
    return {
        "counts": counts, "seeds_run": len(runs), "seeds_reached": len(reached),
        "time_to_target_s": _spread([r["time_to_target_s"] for r in reached]) if counts else None,
        "missed_train_s": min(missed) if missed else None,
        "steps_to_target": _spread([r["steps_to_target"] for r in reached]) if counts else None,
        "ms_per_step": _spread([r["ms_per_step"] for r in runs]),
        "train_s": _spread([r["train_s"] for r in runs]),
        "eval_s": _spread([r["eval_s"] for r in runs]),
        "eval_ms_each": _spread([e["ms"] for r in runs for e in r["evals"]]),
        "reset_s": _spread([r["reset_s"] for r in runs]),
        "wall_s_per_seed": _spread([r["wall_s"] for r in runs]),
        "best_val_loss": _spread([r["best_val_loss"] for r in runs]),
        "stops": [r["stop"] for r in runs],
    }


def median_run(row: dict) -> dict | None:
    """The run whose time to target is the median of the row's (the lower one for an even count)."""
    runs = sorted((r for r in row["runs"] if r["reached"]), key=lambda r: r["time_to_target_s"])
    return runs[(len(runs) - 1) // 2] if runs else None


def speedup(earlier: dict | None, row: dict) -> tuple[float | None, bool]:
    """(ratio of median times to target earlier/row, is_lower_bound)."""
    if earlier is None or not row["summary"]["counts"]:
        return None, False
    mine = row["summary"]["time_to_target_s"]["p50"]
    s = earlier["summary"]
    if s["counts"]:
        return s["time_to_target_s"]["p50"] / mine, False
    if s["missed_train_s"]:
        return s["missed_train_s"] / mine, True
    return None, False


def step_speedup(earlier: dict | None, row: dict) -> float | None:
    a = earlier and earlier["summary"]["ms_per_step"]
    b = row["summary"]["ms_per_step"]
    return a["p50"] / b["p50"] if a and b else None


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
                          "time_to_target_s": run["time_to_target_s"], "steps_to_target": run["steps_to_target"]}}
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


def _ratio(value: float | None, lower_bound: bool = False) -> str:
    return "-" if value is None else ("≥ " if lower_bound else "") + f"{_num(value)}×"


def baseline_row(result: dict) -> dict | None:
    rows = [r for r in result["rows"] if "error" not in r and r["runs"]]
    return next((r for r in rows if r["index"] == 0), rows[0] if rows else None)


def ladder_markdown(result: dict) -> str:
    """The ladder table with its header (GPU, command, target) and the definitions of its columns."""
    target = result["target"]
    base = baseline_row(result)
    rows_md, prev = [], None
    few = False
    for row in result["rows"]:
        s = row["summary"]
        tt = s["time_to_target_s"]
        if "error" in row:
            time_cell = f"failed: {row['error'][:80]}"
        elif not row["runs"]:
            time_cell = "not run (out of --budget-s)"
        elif tt:
            time_cell = f"**{_num(tt['p50'])}**"
        else:
            stops = ", ".join(sorted(set(s["stops"]))) or "-"
            time_cell = f"not reached ({stops})"
        spread = f"{_num(tt['p20'])}–{_num(tt['p80'])}" if tt else "-"
        x_prev, prev_lb = speedup(prev, row)
        x_base, base_lb = speedup(base, row) if base is not row else (None, False)
        seeds_cell = f"{s['seeds_reached']}/{len(row['seeds'])}"
        if s["seeds_run"] < len(row["seeds"]):
            seeds_cell += f" ({s['seeds_run']} ran" + (", out of budget)" if row.get("skipped") else ")")
        if len(row["seeds"]) < DEFAULT_SEEDS:
            seeds_cell += " †"
            few = True
        ms = s["ms_per_step"]
        rows_md.append([
            row["label"], row["name"], row["change"], _num(ms and ms["p50"]), time_cell, spread,
            _num(s["steps_to_target"] and s["steps_to_target"]["p50"]),
            _ratio(x_prev, prev_lb), _ratio(x_base, base_lb), _ratio(step_speedup(base, row)),
            _num(row.get("setup_s")), _num(s["eval_s"] and s["eval_s"]["p50"]), _num(row.get("wall_s")),
            f"{s['best_val_loss']['p50']:.4f}" if s["best_val_loss"] else "-", seeds_cell,
        ])
        if "error" not in row and row["runs"]:
            prev = row
    header = ["#", "rung", "change (since the row above)", "ms/step", f"time to ≤ {target} (s, median)", "p20–p80",
              "steps", "× prev", f"× {base['name'] if base else 'baseline'}", "step × base", "setup s", "eval s",
              "wall s", "best val loss", "seeds reached"]
    align = "rll" + "r" * (len(header) - 3)
    seps = {"l": "---", "r": "---:"}
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join(seps[a] for a in align) + " |"]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in r) + " |" for r in rows_md]
    env = result.get("environment") or {}
    gpu = (env.get("gpu") or {}).get("name") or result.get("device")
    settings = result.get("settings", {})
    parts = [
        f"### Shakespeare speedrun: training time to validation loss ≤ {target}",
        f"GPU: **{gpu}** · torch {result.get('torch')} · git {env.get('git_sha') or '?'} · {result.get('started')}"
        + (f" · whole process {result['process_wall_s']:.0f} s" if result.get("process_wall_s") else ""),
        f"Command: `{result.get('command') or 'fasttrain lab speedrun'}`",
        "\n".join(lines),
        "*Time to target: training time (device synchronized; batches, forward, backward, optimizer) up to the "
        f"first validation over {_scored(result)} at or below "
        f"{target}; median over seeds, p20–p80 across seeds. A rung counts only if every seed reaches the target. "
        "ms/step: training time over the steps run. × prev / × baseline: ratio of median times to target, measured "
        f"{_where_measured(result)}; ≥ marks a lower bound where the row divided by does not count: a run of it "
        "trained that long (the shortest such run) without reaching the target. step × base: ratio of ms/step. setup: build, compilation and warm-up steps "
        "(parameters restored after), once per rung. eval: validation time per seed, apart from training. "
        f"wall: the whole rung, every seed. Runs stop at the target, the schedule's end, {settings.get('max_train_s')} s "
        f"of training, or {settings.get('patience_steps')} steps without a new best validation loss (over-fitting).*",
    ]
    if few:
        parts.append(f"*† fewer seeds than the {DEFAULT_SEEDS} of a full row (to save device time).*")
    if result.get("saved"):
        sv = result["saved"]
        parts.append(f"*Saved: the final model of rung {sv['rung']} (seed {sv['seed']}, validation loss "
                     f"{sv['val_loss']:.6f}); check it with `fasttrain lab eval {sv['path']}`.*")
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


CSV_COLUMNS = ("suite", "row", "rung", "metric", "unit", "p20", "p50", "p80", "n", "counts", "seeds_reached", "seeds",
               "target", "gpu", "torch", "git_sha", "timestamp")
METRICS = (("time_to_target_s", "s"), ("steps_to_target", "steps"), ("ms_per_step", "ms"), ("train_s", "s"),
           ("eval_s", "s"), ("eval_ms_each", "ms"), ("reset_s", "s"), ("wall_s_per_seed", "s"),
           ("best_val_loss", "nats/char"))


def to_csv(result: dict) -> str:
    """Long format: one line per row and metric, p20/p50/p80 over seeds."""
    env = result.get("environment") or {}
    gpu = (env.get("gpu") or {}).get("name") or result.get("device")
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=CSV_COLUMNS, lineterminator="\n")
    writer.writeheader()
    base = baseline_row(result)
    for row in result["rows"]:
        s = row["summary"]
        common = {"suite": "speedrun", "row": row["label"], "rung": row["name"], "counts": s["counts"],
                  "seeds_reached": s["seeds_reached"], "seeds": len(row["seeds"]), "target": result["target"],
                  "gpu": gpu, "torch": result.get("torch"), "git_sha": env.get("git_sha"),
                  "timestamp": result.get("started")}
        extra = [("setup_s", "s", row.get("setup_s")), ("rung_wall_s", "s", row.get("wall_s"))]
        x_base, lb = speedup(base, row) if base is not row else (None, False)
        extra.append(("speedup_vs_baseline_lower_bound" if lb else "speedup_vs_baseline", "x", x_base))
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
    path = Path(folder) / "speedrun.json"
    try:
        result = json.loads(path.read_text())
    except FileNotFoundError:
        raise FasttrainError(f"{path}: no such file; run `fasttrain lab speedrun --out {folder}` first") from None
    except ValueError:
        raise FasttrainError(f"{path}: not a speedrun result (unreadable JSON)") from None
    if result.get("kind") != "lab-speedrun":
        raise FasttrainError(f"{path}: not a speedrun result (kind {result.get('kind')!r})")
    return result


def readme_section(folder) -> str:
    """The README's speedrun section from a result folder (every figure read from its files)."""
    result = load_result(folder)
    return (f"Generated by `fasttrain lab speedrun readme {Path(folder).as_posix()}` from "
            f"[`{Path(folder).as_posix()}/speedrun.json`]({Path(folder).as_posix()}/speedrun.json) "
            f"(run records per rung and seed in `runs/`, long-format CSV in `speedrun.csv`).\n\n"
            + ladder_markdown(result))


@click.command("readme")
@click.argument("results_dir", type=click.Path())
@click.option("--into", type=click.Path(dir_okay=False),
              help=f"Replace the text between the lines {README_START} and {README_END} of this file.")
def readme_command(results_dir, into) -> None:
    """Print (or write into a README) the speedrun section generated from a result folder."""
    section = readme_section(results_dir)
    if into:
        from fasttrain.files import replace_between_markers

        replace_between_markers(into, section, start=README_START, end=README_END)
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
                          ("data", lambda r: r.get("data")),
                          ("settings", lambda r: {k: v for k, v in (r.get("settings") or {}).items()
                                                  if k not in ("budget_s", "seeds")})):
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
    from fasttrain.lab.speedrun_ladder import LADDER

    prev = -1
    for row in rows:
        i = row.get("index")
        if isinstance(i, int) and 0 <= i < len(LADDER) and row["name"] == LADDER[i].name:
            row["change"] = LADDER[0].change if i == 0 else " + ".join(r.change for r in LADDER[prev + 1: i + 1])
            prev = i
    counted = [r for r in rows if r["summary"]["counts"]]
    fastest_row = min(counted, key=lambda r: r["summary"]["time_to_target_s"]["p50"]) if counted else None
    saved = None
    fastest = None
    if fastest_row is not None:
        fastest = {"label": fastest_row["label"], "name": fastest_row["name"],
                   "time_to_target_s": fastest_row["summary"]["time_to_target_s"]["p50"],
                   "seed": median_run(fastest_row)["seed"]}
        saved = next((p["saved"] for p in parts if p.get("saved") and p["saved"].get("rung") == fastest_row["name"]),
                     None)
    settings = dict(first.get("settings") or {})
    settings["seeds"] = max((p.get("settings", {}).get("seeds") or [] for p in parts), key=len)
    return {
        **{k: first.get(k) for k in ("kind", "target", "environment", "torch", "device", "data")},
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


__all__ = ["DEFAULT_SEEDS", "merge_command", "merge_results", "README_END", "README_START", "baseline_row", "ladder_markdown", "load_result",
           "median_run", "readme_command", "readme_section", "save_fastest", "speedup", "step_speedup", "summarize",
           "to_csv", "write_results"]
