"""The scaling experiment's report: ``scaling.csv``, ``scaling.md`` and the plots, from the run
records a sweep (:mod:`fasttrain.lab.experiments.scaling`) wrote. Definitions are in that module's docstring."""

from __future__ import annotations

import json
from pathlib import Path

from fasttrain.errors import FasttrainError
from fasttrain.files import atomic_path, atomic_write_text, save_figure

MiB = 2 ** 20

def load_runs(folder) -> dict[str, dict]:
    folder = Path(folder)
    runs = {}
    for path in sorted(folder.glob("*.json")):
        if path.name in ("sweep.json",):
            continue
        try:
            record = json.loads(path.read_text())
        except ValueError:
            raise FasttrainError(f"{path}: not a JSON run record") from None
        if record.get("kind") == "lab-run":
            runs[path.stem] = record
    if not runs:
        raise FasttrainError(f"{folder}: no lab run records (*.json) to report on; run the sweep first")
    return runs


def _label(stem: str) -> tuple[str, str]:
    preset, _, label = stem.partition(".")
    return preset, label or "1gpu"


ORDER = ["1gpu", "ddp", "zero1", "fsdp-zero2", "fsdp-zero3", "tp", "ddp-weak", "zero1-weak", "fsdp-zero2-weak",
         "fsdp-zero3-weak", "1gpu-bf16", "fsdp-zero3-bf16"]


def _order(label: str) -> tuple[int, int]:
    """(GPU count of a ``<N>gpu-`` label, else 0; the strategy's place): a sweep over several counts sorts by
    count, then as a sweep over one."""
    count, sep, rest = label.partition("gpu-")
    if sep and count.isdigit():
        return int(count), ORDER.index(rest) if rest in ORDER else 99
    return 0, ORDER.index(label) if label in ORDER else 99


def _peaks(record) -> list[int | None]:
    d = record.get("distributed")
    if d:
        return [r["peak_allocated_bytes"] for r in d["per_rank"]]
    return [record["memory"]["peak_allocated_bytes"]]


def loss_deviation(mine: dict, theirs: dict) -> tuple[float | None, float | None, int]:
    """Two loss curves (step -> loss) over the steps both logged: the largest absolute and relative difference,
    and how many steps were compared."""
    common = sorted(set(mine) & set(theirs))
    if not common:
        return None, None, 0
    return (max(abs(mine[s] - theirs[s]) for s in common),
            max(abs(mine[s] - theirs[s]) / abs(theirs[s]) for s in common if theirs[s]), len(common))


def rows(runs: dict[str, dict]) -> list[dict]:
    """One row per run: the numbers of the tables (MiB, tokens/s, efficiency, loss difference)."""
    out = []
    for stem, rec in runs.items():
        preset, label = _label(stem)
        base_label = "1gpu-bf16" if label.endswith("bf16") else "1gpu"
        base = runs.get(f"{preset}.{base_label}")
        d = rec.get("distributed") or {}
        world = d.get("world_size", 1)
        peaks = [p for p in _peaks(rec) if p is not None]
        est = rec.get("estimate", {}).get("precise_bytes")
        peak = max(peaks) if peaks else None
        row = {"preset": preset, "strategy": label, "world": world, "dp": d.get("dp", 1), "tp": d.get("tp", 1),
               "device": rec.get("device"), "precision": rec.get("precision"),
               "global_batch": d.get("global_batch_size", rec["batch"]["per_device_train_batch_size"]
                                     * rec["batch"]["gradient_accumulation_steps"]),
               "per_device_batch": rec["batch"]["per_device_train_batch_size"],
               "peak_mib_per_rank": [p / MiB for p in peaks], "peak_mib": None if peak is None else peak / MiB,
               "estimate_mib": None if est is None else est / MiB,
               "estimate_error_pct": None if (est is None or not peak) else 100.0 * (est - peak) / peak,
               "tokens_per_s": rec.get("tokens_per_s"), "step_ms": rec.get("step_ms"),
               "val_loss": rec["final"]["val_loss"], "efficiency": None, "max_loss_diff": None,
               "max_rel_loss_diff": None}
        if base is not None and base is not rec:
            if base.get("tokens_per_s") and row["tokens_per_s"]:
                row["efficiency"] = row["tokens_per_s"] / (world * base["tokens_per_s"])
            same_batch = row["global_batch"] == (base["batch"]["per_device_train_batch_size"]
                                                 * base["batch"]["gradient_accumulation_steps"])
            if same_batch:
                row["max_loss_diff"], row["max_rel_loss_diff"], _ = loss_deviation(
                    {p["step"]: p["loss"] for p in rec["loss_curve"]}, {p["step"]: p["loss"] for p in base["loss_curve"]})
        out.append(row)
    out.sort(key=lambda r: (r["preset"], _order(r["strategy"])))
    return out


def write_csv(table: list[dict], path) -> Path:
    """Long format: preset, strategy, world, metric, rank, value, p20, p50, p80."""
    import csv

    path = Path(path)
    with atomic_path(path) as tmp, open(tmp, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["preset", "strategy", "world", "device", "precision", "global_batch", "metric", "rank", "value",
                    "p20", "p50", "p80"])
        for r in table:
            key = [r["preset"], r["strategy"], r["world"], r["device"], r["precision"], r["global_batch"]]
            for rank, mib in enumerate(r["peak_mib_per_rank"]):
                w.writerow([*key, "peak_allocated_mib", rank, f"{mib:.2f}", "", "", ""])
            for metric in ("estimate_mib", "estimate_error_pct", "tokens_per_s", "efficiency", "val_loss",
                           "max_loss_diff", "max_rel_loss_diff"):
                if r[metric] is not None:
                    w.writerow([*key, metric, "", f"{r[metric]:.6g}", "", "", ""])
            s = r["step_ms"] or {}
            if s.get("p50") is not None:
                w.writerow([*key, "step_ms", "", f"{s['mean']:.4f}", f"{s['p20']:.4f}", f"{s['p50']:.4f}",
                            f"{s['p80']:.4f}"])
    return path


def _fmt(value, spec) -> str:
    return "-" if value is None else format(value, spec)


def _pct(value) -> str:
    return "-" if value is None else f"{value:+.1f}%"


def markdown(table: list[dict]) -> str:
    lines = []
    for preset in dict.fromkeys(r["preset"] for r in table):
        sub = [r for r in table if r["preset"] == preset]
        lines += [f"### {preset} on {sub[0]['device']}", "",
                  "| strategy | GPUs | dp x tp | global batch | per-GPU batch | precision | peak MiB per GPU "
                  "| estimate MiB | est. error | tokens/s (world) | efficiency | max loss diff vs 1 GPU "
                  "| val loss |",
                  "|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
        for r in sub:
            peaks = " / ".join(f"{p:,.0f}" for p in r["peak_mib_per_rank"]) or "-"
            lines.append(f"| {r['strategy']} | {r['world']} | {r['dp']} x {r['tp']} | {r['global_batch']} | "
                         f"{r['per_device_batch']} | {r['precision']} | {peaks} | {_fmt(r['estimate_mib'], ',.0f')} | "
                         f"{_pct(r['estimate_error_pct'])} | {_fmt(r['tokens_per_s'], ',.0f')} | "
                         f"{_fmt(r['efficiency'], '.2f')} | {_fmt(r['max_loss_diff'], '.2e')} | "
                         f"{_fmt(r['val_loss'], '.4f')} |")
        lines.append("")
    lines += ["efficiency = tokens/s of the world / (GPUs x tokens/s of one GPU at the same global batch; "
              "a -weak run: at the same per-GPU batch). est. error = (estimate - measured) / measured, the "
              "measured peak being the largest over the ranks. Loss difference: the largest |loss_N - loss_1| "
              "over the logged steps at the same global batch (dropout 0).", ""]
    return "\n".join(lines)


def plots(table: list[dict], runs: dict[str, dict], out_dir) -> list[Path]:
    """memory.png (per-GPU peak and estimate by strategy), throughput.png, loss.png."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    out_dir = Path(out_dir)
    written = []
    presets = list(dict.fromkeys(r["preset"] for r in table))
    fig, axes = plt.subplots(1, len(presets), figsize=(6 * len(presets), 4), squeeze=False)
    for ax, preset in zip(axes[0], presets):
        sub = [r for r in table if r["preset"] == preset and r["peak_mib"] is not None]
        xs = range(len(sub))
        ax.bar([x - 0.2 for x in xs], [r["peak_mib"] for r in sub], 0.4, color="tab:blue",
               label="measured (max over GPUs)")
        ax.bar([x + 0.2 for x in xs], [r["estimate_mib"] or 0 for r in sub], 0.4, color="tab:orange",
               label="estimator (precise)")
        if not sub:
            ax.text(0.5, 0.5, "no GPU peaks (CPU runs)", ha="center", transform=ax.transAxes)
        ax.set_xticks(list(xs), [r["strategy"] for r in sub], rotation=30, ha="right")
        ax.set_ylabel("peak MiB per GPU")
        ax.set_title(preset)
        ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, out_dir / "memory.png", dpi=120)
    written.append(out_dir / "memory.png")
    plt.close(fig)
    fig, axes = plt.subplots(1, len(presets), figsize=(6 * len(presets), 4), squeeze=False)
    for ax, preset in zip(axes[0], presets):
        sub = [r for r in table if r["preset"] == preset and r["tokens_per_s"]]
        ax.bar(range(len(sub)), [r["tokens_per_s"] for r in sub])
        for x, r in enumerate(sub):
            if r["efficiency"] is not None:
                ax.text(x, r["tokens_per_s"], f"{r['efficiency']:.2f}", ha="center", va="bottom", fontsize=8)
        ax.set_xticks(list(range(len(sub))), [r["strategy"] for r in sub], rotation=30, ha="right")
        ax.set_ylabel("tokens/s (whole world); label: scaling efficiency")
        ax.set_title(preset)
    fig.tight_layout()
    save_figure(fig, out_dir / "throughput.png", dpi=120)
    written.append(out_dir / "throughput.png")
    plt.close(fig)
    # top: the curves; bottom: loss(N GPUs) - loss(1 GPU) step by step, where the reduction order shows
    fig, axes = plt.subplots(2, len(presets), figsize=(6 * len(presets), 7), squeeze=False, sharex="col")
    for col, preset in enumerate(presets):
        top, bottom = axes[0][col], axes[1][col]
        for stem, rec in runs.items():
            p, label = _label(stem)
            if p != preset or label.endswith("-weak"):     # another global batch: another function
                continue
            curve = rec["loss_curve"]
            top.plot([c["step"] for c in curve], [c["loss"] for c in curve], label=label,
                     lw=2.5 if label.startswith("1gpu") else 1, ls="-" if label.startswith("1gpu") else "--")
            base = runs.get(f"{preset}.{'1gpu-bf16' if label.endswith('bf16') else '1gpu'}")
            if base is not None and base is not rec:
                ref = {c["step"]: c["loss"] for c in base["loss_curve"]}
                steps = [c["step"] for c in curve if c["step"] in ref]
                bottom.plot(steps, [c["loss"] - ref[c["step"]] for c in curve if c["step"] in ref], label=label, lw=1)
        top.set_ylabel("training loss")
        top.set_title(f"{preset}: N GPUs against 1 at the same global batch")
        top.legend(fontsize=7)
        bottom.axhline(0.0, color="black", lw=0.5)
        bottom.set_xlabel("step")
        bottom.set_ylabel("loss(N GPUs) - loss(1 GPU)")
    fig.tight_layout()
    save_figure(fig, out_dir / "loss.png", dpi=120)
    written.append(out_dir / "loss.png")
    plt.close(fig)
    return written


def report(folder, out_dir=None) -> dict:
    """Tables and plots from the run records in ``folder``; returns the paths written."""
    runs = load_runs(folder)
    out_dir = Path(out_dir or folder)
    out_dir.mkdir(parents=True, exist_ok=True)
    table = rows(runs)
    csv_path = write_csv(table, out_dir / "scaling.csv")
    md_path = out_dir / "scaling.md"
    atomic_write_text(md_path, markdown(table))
    return {"csv": csv_path, "markdown": md_path, "plots": plots(table, runs, out_dir), "rows": table}
