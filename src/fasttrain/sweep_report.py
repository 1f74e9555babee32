"""What a sweep writes: its summary (``sweep.json``), its table (``sweep.md``), its plot (``sweep.png``) and
the folders they go to (``--out DIR``: a run record per model beside them; ``--save-weights DIR``: the
weights of each model).

A sweep's folder holds one sweep. It may be new, empty, or hold an earlier sweep's files (written by this
module: ``sweep.json``, ``sweep.md``, ``sweep.png`` and ``<label>.json``, or ``<label>.npz`` for weights);
anything else in it is refused before any work, so a sweep never mixes its files with others. A rerun
replaces the earlier sweep: the new files are written whole (each through a temporary name), then the
earlier sweep's files the new one did not rewrite are removed.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

from fasttrain.errors import FasttrainError
from fasttrain.files import atomic_write_text, check_new_folder, finite_or_none, save_figure

SUMMARY_SCHEMA = 1
SUMMARY_KIND = "fasttrain sweep"
SWEEP_FILES = ("sweep.json", "sweep.md", "sweep.png")
# a model's files: lr<%g>-seed<int>.json / .npz (model_label), and the temporary names of an interrupted write
_LABEL = r"lr[0-9][0-9.e+-]*-seed[0-9]+"


def _ours(name: str, suffix: str) -> bool:
    """A file an earlier sweep of this module wrote into a folder of kind ``suffix`` (json: --out, npz: weights)."""
    finished = re.fullmatch(rf"{_LABEL}\.{suffix}", name) or (suffix == "json" and name in SWEEP_FILES)
    return bool(finished)


def check_sweep_folder(path: str | os.PathLike, flag: str, suffix: str) -> Path:
    """Refuse, before any work, a folder a sweep cannot write: see the module docstring. Nothing is created."""
    folder = check_new_folder(path, flag)
    if not folder.exists():
        return folder
    if not os.access(folder, os.W_OK):
        raise FasttrainError(f"{flag} {os.fspath(path)}: folder is not writable; choose another")
    others = sorted(p.name for p in folder.iterdir() if not _ours(p.name, suffix))
    if others:
        what = "run records (<lr..-seed..>.json) and sweep.json/md/png" if suffix == "json" else \
            "weights (<lr..-seed..>.npz)"
        raise FasttrainError(f"{flag} {os.fspath(path)}: the folder holds {others[0]!r}"
                             f"{f' and {len(others) - 1} more' if len(others) > 1 else ''}, not a sweep's {what}; "
                             "give a new or empty folder")
    return folder


def _replace_earlier(folder: Path, written: set[str], suffix: str) -> None:
    """Remove the earlier sweep's files this one did not rewrite (its other models)."""
    for path in folder.iterdir():
        if path.name not in written and _ours(path.name, suffix):
            path.unlink(missing_ok=True)


def write_weights_folder(folder: Path, labels: list[str], weights, save) -> list[Path]:
    folder.mkdir(exist_ok=True)
    paths = []
    for label, model_weights in zip(labels, weights):
        paths.append(folder / f"{label}.npz")
        save(paths[-1], model_weights)
    _replace_earlier(folder, {p.name for p in paths}, "npz")
    return paths


def write_sweep_folder(folder: Path, result) -> list[Path]:
    """A run record per model, then sweep.json, sweep.md and sweep.png (when matplotlib is installed)."""
    folder.mkdir(exist_ok=True)
    paths = []
    for label, record in zip(result.labels, result.records):
        paths.append(folder / f"{label}.json")
        record.save(paths[-1])
    summary_data = summary(result)
    paths.append(folder / "sweep.json")
    atomic_write_text(paths[-1], json.dumps(finite_or_none(summary_data), indent=2, allow_nan=False) + "\n")
    paths.append(folder / "sweep.md")
    atomic_write_text(paths[-1], markdown(summary_data))
    plot = sweep_plot(summary_data, folder / "sweep.png")
    if plot is not None:
        paths.append(plot)
    _replace_earlier(folder, {p.name for p in paths}, "json")
    return paths


# --- the summary ---------------------------------------------------------------------------


def final_train_loss(record) -> float | None:
    """The last epoch's mean train loss (None when the engine did not measure it)."""
    return next((e["train_loss"] for e in reversed(record.epochs) if e["train_loss"] is not None), None)


def summary(result) -> dict:
    """``sweep.json``: the engine, model, shared config, swept values, the sweep's timing, each model's final
    figures and whether it diverged, and the environment (that of the run records, less the model index)."""
    first = result.records[0]
    env = {k: v for k, v in first.environment.items() if k != "sweep"}
    shared = {k: v for k, v in first.config.items() if k not in ("lr", "seed")}
    models = []
    for label, record in zip(result.labels, result.records):
        models.append({
            "label": label, "lr": record.config["lr"], "seed": record.config["seed"],
            "final_train_loss": final_train_loss(record),
            "test_loss": record.final["test_loss"], "test_acc": record.final["test_acc"],
            "diverged": record.diverged, "record": f"{label}.json",
        })
    return {
        "schema": SUMMARY_SCHEMA, "kind": SUMMARY_KIND, "engine": result.engine,
        "engine_options": first.engine_options, "model": first.model, "dataset": first.dataset,
        "config": shared, "lrs": list(result.lrs), "seeds": list(result.seeds), "models": models,
        "timing": result.timing, "environment": env,
    }


def _num(value, spec: str = ".4f") -> str:
    return "-" if value is None or (isinstance(value, float) and not math.isfinite(value)) else format(value, spec)


def timing_line(timing: dict) -> str:
    """One line: setup, training and evaluation time of the whole sweep, and its throughput."""
    rate = timing["model_epochs_per_s"]
    return (f"{timing['models']} models, {timing['epochs']} epochs: setup {timing['setup_ms']:.1f} ms, "
            f"training {timing['train_ms']:.1f} ms (p50 epoch {timing['epoch_ms']['p50']:.2f} ms), "
            f"evaluation {timing['eval_ms']:.1f} ms; {_num(rate, ',.1f')} model-epochs/s")


def table_rows(summary_data: dict) -> list[list[str]]:
    """model, lr, seed, final train loss, test loss, test acc, diverged: one row per model."""
    rows = []
    for m in summary_data["models"]:
        d = m["diverged"]
        rows.append([m["label"], f"{m['lr']:g}", str(m["seed"]), _num(m["final_train_loss"]), _num(m["test_loss"]),
                     _num(m["test_acc"]), "-" if d is None else f"yes, epoch {d['epoch']}"])
    return rows


TABLE_HEADER = ["model", "lr", "seed", "final train loss", "test loss", "test acc", "diverged"]


def markdown(summary_data: dict) -> str:
    cfg = summary_data["config"]
    length = f"{cfg['epochs']} epochs" if cfg.get("steps") is None else f"{cfg['steps']:,} steps"
    lines = [
        f"# Sweep: {summary_data['engine']} · {summary_data['model']['name']} · {summary_data['dataset']}",
        "",
        f"{len(summary_data['models'])} models trained at once: lr {', '.join(f'{v:g}' for v in summary_data['lrs'])}"
        f" × seed {', '.join(str(s) for s in summary_data['seeds'])}; shared: {length}, batch {cfg['batch_size']}, "
        f"{cfg['precision']}. Each model is its own run (its seed's weights and batch order, its lr); its run "
        "record is `<model>.json` beside this file.",
        "",
        "| " + " | ".join(TABLE_HEADER) + " |",
        "| " + " | ".join(["---"] + ["---:"] * (len(TABLE_HEADER) - 2) + ["---"]) + " |",
        *("| " + " | ".join(row) + " |" for row in table_rows(summary_data)),
        "",
        f"Timing (the whole sweep; all models share each timed epoch): {timing_line(summary_data['timing'])}.",
        "",
    ]
    return "\n".join(lines)


def sweep_plot(summary_data: dict, path: Path) -> Path | None:
    """Final test loss and test accuracy against lr, one line per seed (against seed when only seeds vary);
    a diverged model has no point. None when matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    models = summary_data["models"]
    by_lr = len(summary_data["lrs"]) > 1
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2), layout="constrained")
    for ax, key, name in ((axes[0], "test_loss", "final test loss"), (axes[1], "test_acc", "final test accuracy")):
        if by_lr:
            for seed in summary_data["seeds"]:
                points = [(m["lr"], m[key]) for m in models if m["seed"] == seed]
                xs = [x for x, _ in points]
                ys = [math.nan if y is None else y for _, y in points]
                ax.plot(xs, ys, marker="o", ms=4, lw=1.5, label=f"seed {seed}")
            ax.set_xscale("log")
            # ticks at the swept values only: the log axis' own minor labels overlap on a short range
            lrs = summary_data["lrs"]
            ax.set_xticks(lrs, labels=[f"{lr:g}" for lr in lrs])
            ax.xaxis.set_minor_formatter(plt.NullFormatter())
            ax.set_xlabel("learning rate (log scale)")
        else:
            ys = [math.nan if m[key] is None else m[key] for m in models]
            ax.plot([m["seed"] for m in models], ys, marker="o", ms=4, lw=1.5, label=f"lr {summary_data['lrs'][0]:g}")
            ax.set_xlabel("seed")
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
    diverged = sum(m["diverged"] is not None for m in models)
    note = f" ({diverged} diverged, not shown)" if diverged else ""
    fig.suptitle(f"{summary_data['engine']} · {summary_data['model']['name']}: {len(models)} models{note}",
                 x=0.01, ha="left", fontsize=11, fontweight="bold")
    handles, labels = axes[0].get_legend_handles_labels()
    if len(labels) <= 16:
        axes[1].legend(handles, labels, fontsize=8, frameon=False)
    save_figure(fig, path)
    plt.close(fig)
    return path
