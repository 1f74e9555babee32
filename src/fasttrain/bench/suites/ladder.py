"""The ladder: the seed study's table, every engine and rung on logreg (20 epochs, batch 128), its
Markdown (ms per epoch, × previous rung, × baseline, the seed study's figures beside) and ``ladder.png``
(ms per epoch of each row, log scale, p20–p80 whiskers, the seed study's figures as hollow markers)."""

from __future__ import annotations

import math
from pathlib import Path

from fasttrain.bench import figures
from fasttrain.bench.results import SuiteResult
from fasttrain.bench.stats import ratio
from fasttrain.bench.suite import Images, Suite, SuiteSpec, engine_rows
from fasttrain.bench.tables import (baseline_labels, fmt_num, fmt_pct, fmt_ratio, header, image_links, skipped_list,
                                    table)
from fasttrain.files import save_figure

SEED_NOTE = "measured elsewhere, unknown GPU"
# The seed study's CUDA ladder: six figures (ms per epoch, logreg, batch 128, unknown GPU) for seven rungs, so
# they are shown beside the ladder (a band in its plot), not matched to rows.
SEED_CUDA_MS = (38.0, 27.0, 20.7, 19.0, 18.0, 17.0)


def build(quick: bool = False, repeats: int | None = None, hidden=None) -> Suite:
    config = dict(epochs=3 if quick else 20, steps=None, batch_size=128, lr=0.1)
    return Suite("ladder", "Ladder: logreg, batch 128, lr 0.1", engine_rows("ladder"), ("logreg",), config,
                 repeats or (1 if quick else 3), quick)


def markdown(result: SuiteResult, images: Images = None, suite: Suite | None = None) -> str:
    ran = result.ran()
    base = next((c for c in ran if c.label in baseline_labels(result, suite or build())), None)
    base_ms = base.metric("epoch_ms") if base else None
    rows, prev = [], None
    for i, case in enumerate(ran, start=1):
        ms = case.metric("epoch_ms")
        spread = f"{fmt_num(case.metric('epoch_ms', 'p20'))}–{fmt_num(case.metric('epoch_ms', 'p80'))}"
        rows.append([
            str(i), case.label, case.precision, f"**{fmt_num(ms)}**", spread,
            fmt_num(case.metric("total_ms") / 1e3), fmt_num(case.metric("setup_ms") / 1e3),
            fmt_pct(case.metric("test_acc", "mean")),
            fmt_ratio(ratio(prev, ms)), fmt_ratio(ratio(base_ms, ms)),
            fmt_num(case.seed_ms) if case.seed_ms is not None else "",
        ])
        prev = ms
    n = max((c.metric("epoch_ms", "n") or 0 for c in ran), default=0)
    grid = table(
        ["#", "engine / rung", "precision", "ms/epoch (2nd half, p50)", "p20–p80", "total s", "setup s",
         "test acc", "× prev", f"× {base.label if base else 'baseline'}", f"seed study ms/epoch ({SEED_NOTE})"],
        rows, "rllrrrrrrrr",
    )
    notes = [
        f"ms/epoch: mean epoch time over the second half of training, median over {n} run(s) (p20–p80 across runs); "
        "total: wall time of the whole run (setup, epochs, evaluation); setup: upload, compilation, warm-up "
        "(not in ms/epoch); test acc: mean over seeds; × prev / × baseline: speedup of ms/epoch.",
        f"The seed study's column was {SEED_NOTE}: orientation only, not a comparison with the rows here. "
        f"Its CUDA ladder ({', '.join(fmt_num(v) for v in SEED_CUDA_MS)} ms/epoch) has six figures for our seven "
        "rungs 0–6, so they are not matched to rows.",
    ]
    parts = [f"### {result.title}", header(result), *image_links(images)]
    parts += [grid, "\n\n".join(f"*{n}*" for n in notes)] if ran else ["*No row ran on this machine.*"]
    skipped = skipped_list(result)
    if skipped:
        parts.append("Rows not run here:\n\n" + skipped)
    return "\n\n".join(parts) + "\n"


def plot(result: SuiteResult, path: Path) -> Path | None:
    plt = figures.matplotlib_or_none()
    ran = result.ran()
    if plt is None or not ran:
        return None
    figures.style(plt)
    palette = figures.colors([(c.label, c.engine) for c in ran])
    labels = [f"{c.label} ({c.precision})" if c.precision != "fp32" else c.label for c in ran]
    p50 = [c.metric("epoch_ms") for c in ran]
    lo = [c.metric("epoch_ms") - c.metric("epoch_ms", "p20") for c in ran]
    hi = [c.metric("epoch_ms", "p80") - c.metric("epoch_ms") for c in ran]
    fig, ax = plt.subplots(figsize=(10, 0.42 * len(ran) + 2.3), layout="constrained")
    y = list(range(len(ran)))
    ax.barh(y, p50, xerr=[lo, hi], color=[palette[c.label] for c in ran], edgecolor="black", linewidth=0.4,
            error_kw={"elinewidth": 0.8, "capsize": 2, "ecolor": "0.25"}, height=0.68, zorder=2)
    seeds = [(i, c.seed_ms) for i, c in enumerate(ran) if c.seed_ms is not None]
    if seeds:
        ax.scatter([s for _, s in seeds], [i for i, _ in seeds], marker="D", s=34, facecolors="none",
                   edgecolors="black", linewidths=1.1, zorder=3, label=f"seed study, same row ({SEED_NOTE})")
    ax.axvspan(min(SEED_CUDA_MS), max(SEED_CUDA_MS), color="0.5", alpha=0.15, lw=0, zorder=0,
               label=f"seed study's CUDA rungs, {fmt_num(min(SEED_CUDA_MS))}–{fmt_num(max(SEED_CUDA_MS))} ms "
                     "(not matched to rows)")
    fig.legend(loc="outside lower center", fontsize=9, ncol=2)
    left = min([*p50, min(SEED_CUDA_MS)]) / 2.5
    right = max([*(v + h for v, h in zip(p50, hi)), *(s for _, s in seeds), max(SEED_CUDA_MS)]) * 3.5
    ax.set_xscale("log")
    ax.set_xlim(left, right)
    figures.log_ticks(ax.xaxis, decades=math.log10(right / left))
    ax.set_yticks(y, labels)
    ax.invert_yaxis()
    ax.grid(axis="y", visible=False)
    for i, value in enumerate(p50):
        # the figure goes right of the whisker, and right of a seed marker that sits close to it
        x = value * 1.05 + hi[i]
        seed = ran[i].seed_ms
        if seed is not None and x / 1.3 < seed < x * 4:
            x = max(x, seed * 1.25)
        ax.text(x, i, f" {fmt_num(value)} ms", va="center", fontsize=9)
    n = max(c.metric("epoch_ms", "n") for c in ran)
    ax.set_xlabel(f"ms per epoch (mean over the 2nd half of training; p50 of {n} run(s), whiskers p20–p80; log scale)")
    cfg = ran[0].config
    figures.titles(fig, ax, f"Epoch time per engine and rung: logreg, batch {cfg['batch_size']}, {cfg['epochs']} epochs", result)
    save_figure(fig, path)
    plt.close(fig)
    return path


def write_plots(result: SuiteResult, out: Path) -> list[Path]:
    return [p for p in [plot(result, out / "ladder.png")] if p is not None]


SPEC = SuiteSpec("ladder", "The seed study's table: every engine and rung on logreg, 20 epochs, batch 128.", build, markdown,
                 (("ms per epoch, per engine and rung", "ladder.png"),), write_plots)
