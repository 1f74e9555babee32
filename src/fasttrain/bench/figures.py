"""The shared pieces of every suite's figures (matplotlib on the Agg backend, an optional dependency):
pyplot or None, one colour per row (an engine's own colormap), log ticks written as plain numbers, the
two-line title, the house style. Each suite's plots (``fasttrain.bench.suites.<name>``) are drawn with these.
"""

from __future__ import annotations

from fasttrain.bench.results import SuiteResult
from fasttrain.bench.tables import gpu_name

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


def machine_title(result: SuiteResult) -> str:
    env = result.environment
    gpu = gpu_name(env)
    name = gpu if gpu != "none" else f"CPU: {env.get('cpu', '?')}, {env.get('cores', '?')} cores"
    data = result.dataset
    extra = " · SYNTHETIC data" if data.get("synthetic") else ""
    if result.quick:
        extra += " · --quick"
    return f"{name} · {data['name']} {data['n_train']:,}/{data['n_test']:,}{extra}"


def log_ticks(axis, unit: str = "", decades: float = 3.0) -> None:
    """Log-scale ticks written as plain numbers (1,000 not 10^3): at 1, 2, 5 x 10^k over a few
    decades, at powers of ten alone over a wide span (where 1-2-5 labels would collide)."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0) if decades <= 4 else (1.0,)))
    axis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:,.10g}{unit}"))
    axis.set_minor_formatter(NullFormatter())


def titles(fig, ax, main: str, result: SuiteResult) -> None:
    """A bold headline (what is plotted) over a grey line (where it was measured)."""
    fig.suptitle(main, x=0.01, ha="left", fontsize=12, fontweight="bold")
    ax.set_title(machine_title(result), loc="left", fontsize=9, color="0.35", fontweight="normal")


def style(plt) -> None:
    plt.rcParams.update({
        "figure.dpi": 110, "savefig.dpi": 150, "font.size": 10, "axes.titlesize": 12, "axes.titleweight": "bold",
        "axes.spines.top": False, "axes.spines.right": False, "axes.grid": True, "grid.alpha": 0.3,
        "legend.frameon": False,
    })
