"""PNG plots of suite results (matplotlib, Agg backend; an optional dependency).

- ``ladder.png``: ms per epoch of each row, log scale, p20–p80 whiskers, the seed study's figures
  as hollow markers.
- ``sweep_time.png``: training time against hidden size, per engine (log-log), p20–p80 band.
- ``sweep_relative.png``: speed relative to PyTorch eager against hidden size.
- ``curves.png``: every engine's loss curve over the NumPy fp64 reference, and their difference.
"""

from __future__ import annotations

import math
from pathlib import Path

from fasttrain.bench.report import baseline_labels, baseline_times, fmt_num, gpu_name, sweep_grid
from fasttrain.bench.runner import SuiteResult
from fasttrain.bench.stats import ratio
from fasttrain.bench.suites import SEED_CUDA_MS, SEED_NOTE
from fasttrain.files import save_figure

MATPLOTLIB_MISSING = "plots skipped: matplotlib is not installed (pip install 'fasttrain[plot]')"


def matplotlib_or_none():
    """pyplot on the Agg backend, or None when matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _colormap(engine: str) -> str:
    """The engine's own colormap (``Engine.color``); grey for an engine no longer registered."""
    from fasttrain.engines import registry

    engine_cls = registry().get(engine)
    return engine_cls.color if engine_cls is not None else "Greys"


def colors(labels_engines: list[tuple[str, str]]) -> dict[str, tuple]:
    """One hue per engine (its declared colormap), darker for later rows, so a row keeps its colour in every plot."""
    import matplotlib

    by_engine: dict[str, list[str]] = {}
    for label, engine in labels_engines:
        by_engine.setdefault(engine, [])
        if label not in by_engine[engine]:
            by_engine[engine].append(label)
    out = {}
    for engine, labels in by_engine.items():
        cmap = matplotlib.colormaps[_colormap(engine)]
        for i, label in enumerate(labels):
            shade = 0.55 if len(labels) == 1 else 0.4 + 0.5 * i / (len(labels) - 1)
            out[label] = cmap(shade)
    return out


def _machine(result: SuiteResult) -> str:
    env = result.environment
    gpu = gpu_name(env)
    name = gpu if gpu != "none" else f"CPU: {env.get('cpu', '?')}, {env.get('cores', '?')} cores"
    data = result.dataset
    extra = " · SYNTHETIC data" if data.get("synthetic") else ""
    if result.quick:
        extra += " · --quick"
    return f"{name} · {data['name']} {data['n_train']:,}/{data['n_test']:,}{extra}"


def _log_ticks(axis, unit: str = "", decades: float = 3.0) -> None:
    """Log-scale ticks written as plain numbers (1,000 not 10^3): at 1, 2, 5 x 10^k over a few
    decades, at powers of ten alone over a wide span (where 1-2-5 labels would collide)."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0) if decades <= 4 else (1.0,)))
    axis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:,.10g}{unit}"))
    axis.set_minor_formatter(NullFormatter())


def _titles(fig, ax, main: str, result: SuiteResult) -> None:
    """A bold headline (what is plotted) over a grey line (where it was measured)."""
    fig.suptitle(main, x=0.01, ha="left", fontsize=12, fontweight="bold")
    ax.set_title(_machine(result), loc="left", fontsize=9, color="0.35", fontweight="normal")


def _style(plt) -> None:
    plt.rcParams.update({
        "figure.dpi": 110, "savefig.dpi": 150, "font.size": 10, "axes.titlesize": 12, "axes.titleweight": "bold",
        "axes.spines.top": False, "axes.spines.right": False, "axes.grid": True, "grid.alpha": 0.3,
        "legend.frameon": False,
    })


def ladder_plot(result: SuiteResult, path: Path) -> Path | None:
    plt = matplotlib_or_none()
    ran = result.ran()
    if plt is None or not ran:
        return None
    _style(plt)
    palette = colors([(c.label, c.engine) for c in ran])
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
    _log_ticks(ax.xaxis, decades=math.log10(right / left))
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
    _titles(fig, ax, f"Epoch time per engine and rung: logreg, batch {cfg['batch_size']}, {cfg['epochs']} epochs", result)
    save_figure(fig, path)
    plt.close(fig)
    return path


def _sweep_axes(plt, result: SuiteResult, ylabel: str, title: str):
    fig, ax = plt.subplots(figsize=(10, 5.8), layout="constrained")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("hidden size h (mlp 784-h-h-h-10)")
    ax.set_ylabel(ylabel)
    _titles(fig, ax, title, result)
    return fig, ax


def sweep_plots(result: SuiteResult, out: Path) -> list[Path]:
    plt = matplotlib_or_none()
    ran = result.ran()
    if plt is None or not ran:
        return []
    _style(plt)
    palette = colors([(c.label, c.engine) for c in ran])
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
    _log_ticks(ax.yaxis)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=9)
    paths.append(out / "sweep_time.png")
    save_figure(fig, paths[-1])
    plt.close(fig)

    base = baseline_times(result)
    if base:
        fig, ax = _sweep_axes(plt, result, f"speed-up over {baseline_labels(result)[0]} (its time / the row's time)",
                              f"Speed relative to {baseline_labels(result)[0]}: {steps}, batch {cfg['batch_size']}, lr {cfg['lr']}")
        ax.axhline(1.0, color="black", lw=0.8, ls="--")
        for label in labels:
            hs = [h for h in hidden if (label, h) in p50 and h in base]
            ax.plot(hs, [ratio(base[h], p50[(label, h)]) for h in hs], marker="o", ms=4, lw=1.8,
                    color=palette[label], label=label)
        ax.set_xticks(hidden, [str(h) for h in hidden])
        _log_ticks(ax.yaxis, "×")
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=9)
        paths.append(out / "sweep_relative.png")
        save_figure(fig, paths[-1])
        plt.close(fig)
    return paths


def curves_plot(result: SuiteResult, path: Path) -> Path | None:
    plt = matplotlib_or_none()
    ran = [c for c in result.ran() if c.records and c.records[0]["curve"]]
    if plt is None or not ran or not result.reference:
        return None
    _style(plt)
    palette = colors([(c.label, c.engine) for c in ran])
    model = ran[0].model
    ref = result.reference.get(model)
    if ref is None:
        return None
    ref_by_step = {p["step"]: p["loss"] for p in ref["curve"]}
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 7.5), sharex=True, gridspec_kw={"height_ratios": [3, 2]},
                                      layout="constrained")
    for case in ran:
        if case.model != model:
            continue
        curve = case.records[0]["curve"]
        label = f"{case.label} ({case.precision})" if case.precision != "fp32" else case.label
        top.plot([p["step"] for p in curve], [p["loss"] for p in curve], lw=1.1, color=palette[case.label], label=label)
        pts = [(p["step"], p["loss"] - ref_by_step[p["step"]]) for p in curve if p["step"] in ref_by_step]
        bottom.plot([s for s, _ in pts], [d for _, d in pts], lw=1.1, color=palette[case.label])
    top.plot([p["step"] for p in ref["curve"]], [p["loss"] for p in ref["curve"]], color="black", lw=1.6, ls="--",
             label="numpy fp64 (reference)")
    top.set_yscale("log")
    _log_ticks(top.yaxis)
    top.set_ylabel("train loss (mean since the previous point)")
    cfg = ran[0].config
    _titles(fig, top, f"Loss curves against the NumPy fp64 reference: {model}, batch {cfg['batch_size']}, "
                      f"lr {cfg['lr']}, seed 0", result)
    top.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8.5)
    bottom.axhline(0.0, color="black", lw=1.0, ls="--")
    bottom.set_yscale("symlog", linthresh=1e-6)
    bottom.set_ylabel("loss − reference loss")
    bottom.set_xlabel("SGD step")
    save_figure(fig, path)
    plt.close(fig)
    return path


def write_plots(result: SuiteResult, out: Path) -> list[Path]:
    if result.suite == "ladder":
        paths = [ladder_plot(result, out / "ladder.png")]
    elif result.suite == "sweep":
        paths = sweep_plots(result, out)
    elif result.suite == "curves":
        paths = [curves_plot(result, out / "curves.png")]
    elif result.suite == "many":
        from fasttrain.bench.many import plot as many_plot

        paths = [many_plot(result, out / "many.png")]
    elif result.suite == "lab":
        from fasttrain.bench.lab_report import write_plots as lab_plots

        paths = lab_plots(result, out)
    else:   # the suites of several workloads are tables only
        paths = []
    return [p for p in paths if p is not None]
