"""The sweep: time against hidden size (mlp:Hx3, 5000 steps, batch 32), its Markdown (training time,
speed relative to the baseline row and to JAX in the same invocation, setup, accuracy) and its plots:
``sweep_time.png`` (training time against hidden size per engine, log-log, p20–p80 band) and
``sweep_relative.png`` (speed relative to the baseline row against hidden size)."""

from __future__ import annotations

from pathlib import Path

from fasttrain.bench import figures
from fasttrain.bench.results import SuiteResult
from fasttrain.bench.stats import ratio
from fasttrain.bench.suite import Images, Suite, SuiteSpec, engine_rows
from fasttrain.bench.tables import (baseline_labels, fmt_num, fmt_pct, fmt_ratio, header, image_links, skipped_list,
                                    table)
from fasttrain.contract import parse_model
from fasttrain.files import save_figure

SWEEP_HIDDEN = (128, 256, 512, 1024, 2048, 4096, 8192)
QUICK_HIDDEN = (128, 256, 512)


def build(quick: bool = False, repeats: int | None = None, hidden: tuple[int, ...] | None = None) -> Suite:
    hidden = tuple(hidden or (QUICK_HIDDEN if quick else SWEEP_HIDDEN))
    config = dict(epochs=None, steps=100 if quick else 5000, batch_size=32, lr=0.003)
    return Suite("sweep", "Sweep: mlp:Hx3, batch 32, lr 0.003", engine_rows("sweep"), tuple(f"mlp:{h}x3" for h in hidden),
                 config, repeats or (1 if quick else 3), quick, metric="train_ms")


def sweep_grid(result: SuiteResult, value) -> tuple[list[str], list[int], dict[tuple[str, int], float | None]]:
    """(row labels, hidden sizes, {(label, hidden): value(case)}) over the cases that ran."""
    ran = result.ran()
    labels = list(dict.fromkeys(c.label for c in ran))
    hidden = sorted({parse_model(c.model).hidden[0] for c in ran})
    grid = {(c.label, parse_model(c.model).hidden[0]): value(c) for c in ran}
    return labels, hidden, grid


def baseline_times(result: SuiteResult, suite: Suite | None = None) -> dict[int, float]:
    _labels, _hidden, grid = sweep_grid(result, lambda c: c.metric("train_ms"))
    labels = baseline_labels(result, suite or build())
    return {h: v for (label, h), v in grid.items() if label in labels[:1] and v}


def peer_ratios(result: SuiteResult, peer: str = "jax") -> dict[str, dict[int, float | None]]:
    """{row label: {hidden: the ``peer`` engine's time / the row's time}} for every other row whose model ran a
    ``peer`` row of its own precision in the same invocation (``run_id``; a merged folder holds several): the
    sweep's yardstick is the strongest framework measured beside the row, never a number from another run."""
    ran = result.ran()
    peers = {(c.run_id, c.precision, c.model): c for c in ran if c.engine == peer}
    out: dict[str, dict[int, float | None]] = {}
    for c in ran:
        ref = peers.get((c.run_id, c.precision, c.model))
        if c.engine == peer or ref is None:
            continue
        h = parse_model(c.model).hidden[0]
        out.setdefault(c.label, {})[h] = ratio(ref.metric("train_ms"), c.metric("train_ms"))
    return out


def markdown(result: SuiteResult, images: Images = None, suite: Suite | None = None) -> str:
    parts = [f"### {result.title}", header(result), *image_links(images)]
    labels, hidden, times = sweep_grid(result, lambda c: c.metric("train_ms"))
    if not labels:
        parts.append("*No row ran on this machine.*")
    else:
        _l, _h, setup = sweep_grid(result, lambda c: c.metric("setup_ms"))
        _l, _h, acc = sweep_grid(result, lambda c: c.metric("test_acc", "mean"))
        suite = suite or build()
        base = baseline_times(result, suite)
        head = ["engine"] + [f"h={h}" for h in hidden]

        def grid_rows(cell):
            return [[label] + [cell(label, h) for h in hidden] for label in labels]

        def time_cell(grid, label, h):
            v = grid.get((label, h))
            return "" if v is None else fmt_num(v / 1e3)

        parts.append("Training time, seconds (all steps; p50 across seeds; setup and evaluation excluded):\n\n"
                     + table(head, grid_rows(lambda l, h: time_cell(times, l, h)), "l" + "r" * len(hidden)))
        if base:
            parts.append(f"Speed relative to {baseline_labels(result, suite)[0]} (its time / the row's time; > 1 is faster):\n\n"
                         + table(head, grid_rows(lambda l, h: fmt_ratio(ratio(base.get(h), times.get((l, h))))),
                                  "l" + "r" * len(hidden)))
        versus = peer_ratios(result)
        if versus:
            parts.append("Speed relative to the JAX engine in the same invocation and precision (the JAX row's time "
                         "/ the row's time; > 1 is faster; rows from another invocation are left out):\n\n"
                         + table(head, [[label] + [fmt_ratio(versus[label].get(h)) for h in hidden] for label in versus],
                                  "l" + "r" * len(hidden)))
        parts.append("Setup (upload, compilation, warm-up), seconds:\n\n"
                     + table(head, grid_rows(lambda l, h: time_cell(setup, l, h)), "l" + "r" * len(hidden)))
        parts.append("Final test accuracy (mean over seeds):\n\n"
                     + table(head, grid_rows(lambda l, h: "" if acc.get((l, h)) is None else fmt_pct(acc[(l, h)])),
                              "l" + "r" * len(hidden)))
    skipped = skipped_list(result)
    if skipped:
        parts.append("Rows not run here:\n\n" + skipped)
    return "\n\n".join(parts) + "\n"


def _sweep_axes(plt, result: SuiteResult, ylabel: str, title: str):
    fig, ax = plt.subplots(figsize=(10, 5.8), layout="constrained")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("hidden size h (mlp 784-h-h-h-10)")
    ax.set_ylabel(ylabel)
    figures.titles(fig, ax, title, result)
    return fig, ax


def write_plots(result: SuiteResult, out: Path) -> list[Path]:
    plt = figures.matplotlib_or_none()
    ran = result.ran()
    if plt is None or not ran:
        return []
    figures.style(plt)
    palette = figures.colors([(c.label, c.engine) for c in ran])
    labels, hidden, p50 = sweep_grid(result, lambda c: c.metric("train_ms"))
    _l, _h, p20 = sweep_grid(result, lambda c: c.metric("train_ms", "p20"))
    _l, _h, p80 = sweep_grid(result, lambda c: c.metric("train_ms", "p80"))
    cfg = ran[0].config
    steps = f"{cfg['steps']:,} steps" if cfg.get("steps") else f"{cfg['epochs']} epochs"
    n = max(c.metric("train_ms", "n") for c in ran)
    paths = []

    fig, ax = _sweep_axes(plt, result, f"training time, s (p50 of {n} seed(s), band p20–p80)",
                          f"Training time against hidden size: {steps}, batch {cfg['batch_size']}, lr {cfg['lr']}")
    for label in labels:
        hs = [h for h in hidden if (label, h) in p50]
        ax.plot(hs, [p50[(label, h)] / 1e3 for h in hs], marker="o", ms=4, lw=1.8, color=palette[label], label=label)
        ax.fill_between(hs, [p20[(label, h)] / 1e3 for h in hs], [p80[(label, h)] / 1e3 for h in hs],
                        color=palette[label], alpha=0.15, lw=0)
    ax.set_xticks(hidden, [str(h) for h in hidden])
    figures.log_ticks(ax.yaxis)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=9)
    paths.append(out / "sweep_time.png")
    save_figure(fig, paths[-1])
    plt.close(fig)

    suite = build()
    base = baseline_times(result, suite)
    if base:
        fig, ax = _sweep_axes(plt, result, f"speed-up over {baseline_labels(result, suite)[0]} (its time / the row's time)",
                              f"Speed relative to {baseline_labels(result, suite)[0]}: {steps}, batch {cfg['batch_size']}, lr {cfg['lr']}")
        ax.axhline(1.0, color="black", lw=0.8, ls="--")
        for label in labels:
            hs = [h for h in hidden if (label, h) in p50 and h in base]
            ax.plot(hs, [ratio(base[h], p50[(label, h)]) for h in hs], marker="o", ms=4, lw=1.8,
                    color=palette[label], label=label)
        ax.set_xticks(hidden, [str(h) for h in hidden])
        figures.log_ticks(ax.yaxis, "×")
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=9)
        paths.append(out / "sweep_relative.png")
        save_figure(fig, paths[-1])
        plt.close(fig)
    return paths


SPEC = SuiteSpec("sweep", "Time against hidden size: mlp:Hx3, 5000 steps, batch 32, lr 0.003, fp16 (JAX and rungs 7-8 also bf16), "
                   "3 seeds; each CUDA row against JAX of its precision.", build, markdown,
                 (("training time against hidden size", "sweep_time.png"),
                  ("speed relative to PyTorch eager against hidden size", "sweep_relative.png")), write_plots)
