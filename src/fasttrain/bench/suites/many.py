"""The ``many`` suite: how many models an engine trains per second when it trains K of them at once.

A case is a row (an engine whose class sets ``sweep``), a model and K = n x n models: n learning rates
around the model's default (:func:`lr_factors`: half-octave steps, the default among them, at most 4x it,
so that no model diverges) times n seeds. Each repeat ``r`` of a case is one sweep (:func:`fasttrain.sweep.run_sweep`,
seeds ``r*n .. r*n+n-1``); the figure is its throughput: model-epochs per second of training time for logreg
(``K x epochs / training seconds``), model-runs per second for the MLPs (``K / training seconds``), setup and
evaluation excluded as in every suite. The run record kept for a repeat is that of the model at the default lr and
the repeat's first seed (in every K's grid, so accuracies compare across K); its epoch times are the sweep's.

The report puts each row's throughput against K, the time of K models over the time of one (same row), the
throughput over the JAX engine's (the rows with ``baseline=True``, else those of engine ``jax``) at the same K,
and the goal lines.
"""

from __future__ import annotations

import math
from pathlib import Path

from fasttrain.bench.results import SuiteResult
from fasttrain.bench.suite import Images, Suite, SuiteSpec, engine_rows
from fasttrain.bench.tables import fmt_num, header, image_links, skipped_list, table
from fasttrain.bench.workloads import LOGREG, MLP
from fasttrain.bench.stats import ratio
from fasttrain.errors import FasttrainError
from fasttrain.files import finite_or_none

# (model, K, the most its training time may be, as a multiple of one model's on the same row)
# (model, K, the most its training time may be as a multiple of one model's on the same row, the engine whose
# rows the goal is set for: the cuda engine's rung 8; the other rows are shown beside it)
TIME_GOALS = (("logreg", 16, 1.5, "cuda"), ("mlp:128x3", 16, 2.0, "cuda"))
JAX_GOAL = 10.0   # the throughput over the JAX engine's sweep at the same K


def lr_factors(n: int) -> list[float]:
    """n learning-rate multipliers in half-octave steps with 1 among them: 1; 1, 1.41; 0.71 .. 2; 0.35 .. 4."""
    return [2.0 ** (e / 2) for e in range(1 - (n + 1) // 2, n // 2 + 1)]


def sweep_grid(k: int, lr: float, repeat: int) -> tuple[list[float], list[int]]:
    """The (lrs, seeds) of a K-model case's repeat ``repeat``: K = n x n."""
    n = math.isqrt(k)
    if n * n != k or k < 1:
        raise FasttrainError(f"the many suite trains K = n x n models (1, 4, 16, 64, ...), not {k}")
    return [lr * f for f in lr_factors(n)], [repeat * n + j for j in range(n)]


class SweepCaseRecord:
    """One repeat of a case: the kept model's run record plus the sweep (its timing, every model's finals)."""

    def __init__(self, records, timing: dict, lrs: list[float], seeds: list[int], kept: int):
        from fasttrain.sweep import model_label
        from fasttrain.contract import TrainConfig

        self.records, self.timing, self.lrs, self.seeds, self.kept = records, timing, lrs, seeds, kept
        self.labels = [model_label(TrainConfig(**r.config)) for r in records]
        first = next((i for i, r in enumerate(records) if r.diverged is not None), None)
        self.diverged = None if first is None else {**records[first].diverged, "model": self.labels[first]}

    def to_dict(self) -> dict:
        data = self.records[self.kept].to_dict()
        data["sweep"] = finite_or_none({
            "models": len(self.records), "lrs": self.lrs, "seeds": self.seeds, "kept": self.labels[self.kept],
            "timing": self.timing,
            "final": [{"label": label, "lr": r.config["lr"], "seed": r.config["seed"], **r.final,
                       "diverged": r.diverged is not None} for label, r in zip(self.labels, self.records)],
        })
        return data


def run_many(engine: str, spec, config, data, options: dict, k: int):
    """One repeat of a K-model case (the runner's ``sweep_runner``): ``config.seed`` is the repeat's index."""
    from fasttrain.sweep import run_sweep, sweep_configs

    lrs, seeds = sweep_grid(k, config.lr, config.seed)
    configs = sweep_configs(config, lrs, seeds)
    records, _weights, timing = run_sweep(engine, spec, configs, data, options)
    del _weights
    kept = lrs.index(config.lr) * len(seeds)
    return SweepCaseRecord(records, timing, lrs, seeds, kept), None


# --- the report ----------------------------------------------------------------------------


def _metric(model: str) -> tuple[str, str]:
    return ("model_epochs_per_s", "model-epochs/s") if model == "logreg" else ("model_runs_per_s", "model-runs/s")


def grid(result: SuiteResult, model: str, value) -> tuple[list[str], list[int], dict[tuple[str, int], float | None]]:
    """(row labels, Ks, {(label, K): value(case)}) of one model's cases that ran."""
    ran = [c for c in result.ran() if c.model == model and c.k is not None]
    labels = list(dict.fromkeys(c.label for c in ran))
    ks = sorted({c.k for c in ran})
    return labels, ks, {(c.label, c.k): value(c) for c in ran}


def jax_labels(result: SuiteResult) -> list[str]:
    """The rows the throughput ratio divides by: those marked ``baseline``, else those of engine jax."""
    ran = [c for c in result.ran() if c.k is not None]
    marked = [c.label for c in ran if c.label in (result.baselines or [])]
    return list(dict.fromkeys(marked or [c.label for c in ran if c.engine == "jax"]))


def time_ratio(times: dict, label: str, k: int) -> float | None:
    """The training time of K models over that of one, same row."""
    return ratio(times.get((label, k)), times.get((label, 1)))


def jax_ratio(rates: dict, label: str, k: int, jax: list[str]) -> float | None:
    base = next((rates[(j, k)] for j in jax if rates.get((j, k))), None)
    return ratio(rates.get((label, k)), base)


def goal_lines(result: SuiteResult) -> list[str]:
    """The goals, each with every row's figure, measured or not."""
    lines = []
    engine_of = {c.label: c.engine for c in result.ran()}
    for model, k, most, engine in TIME_GOALS:
        labels, ks, times = grid(result, model, lambda c: c.metric("train_ms"))
        figures = [(label, time_ratio(times, label, k)) for label in labels]
        figures = [(label, r) for label, r in figures if r is not None]
        held = [f for f in figures if engine_of.get(f[0]) == engine]
        if not held:
            lines.append(f"- {k} {model} models in ≤ {fmt_num(most)}× the time of one ({engine}): not measured "
                         f"here (needs K=1 and K={k} of a {engine} row)")
            continue
        best = min(held, key=lambda f: f[1])
        others = ", ".join(f"{label} {fmt_num(r)}×" for label, r in figures if label != best[0])
        lines.append(f"- {k} {model} models in **{fmt_num(best[1])}×** the time of one ({best[0]}; goal ≤ "
                     f"{fmt_num(most)}×: {'met' if best[1] <= most else '**not met**'})"
                     + (f"; others: {others}" if others else ""))
    jax = jax_labels(result)
    models = list(dict.fromkeys(c.model for c in result.ran() if c.k is not None))
    figures = []
    for model in models:
        metric, _unit = _metric(model)
        labels, ks, rates = grid(result, model, lambda c, m=metric: c.metric(m))
        for label in labels:
            if label in jax:
                continue
            common = [k for k in ks if rates.get((label, k)) and jax_ratio(rates, label, k, jax) is not None]
            if common:
                figures.append((label, model, common[-1], jax_ratio(rates, label, common[-1], jax)))
    if not jax or not figures:
        lines.append(f"- ≥ {fmt_num(JAX_GOAL)}× the JAX vmap throughput at the same K: not measured here "
                     "(needs the jax rows and another row at the same K)")
    else:
        text = "; ".join(f"{label} · {model} K={k}: {'**' + fmt_num(r) + '×**' if r >= JAX_GOAL else fmt_num(r) + '×'}"
                         for label, model, k, r in figures)
        lines.append(f"- ≥ {fmt_num(JAX_GOAL)}× the JAX vmap throughput ({', '.join(jax)}) at the same K, at the "
                     f"largest K both ran: {text}")
    return lines


def markdown(result: SuiteResult, images: Images = None, suite: Suite | None = None) -> str:
    parts = [f"### {result.title}", header(result), *image_links(images)]
    models = list(dict.fromkeys(c.model for c in result.ran() if c.k is not None))
    if not models:
        parts.append("*No row ran on this machine.*")
    else:
        parts.append("Goals:\n\n" + "\n".join(goal_lines(result)))
    jax = jax_labels(result)
    for model in models:
        metric, unit = _metric(model)
        labels, ks, rates = grid(result, model, lambda c: c.metric(metric))
        _l, _k, times = grid(result, model, lambda c: c.metric("train_ms"))
        cfg = next(c.config for c in result.ran() if c.model == model)
        length = f"{cfg['epochs']} epochs" if cfg.get("steps") is None else f"{cfg['steps']:,} steps"
        head = ["row"] + [f"K={k}" for k in ks]
        align = "l" + "r" * len(ks)

        def rows(cell):
            return [[label] + [cell(label, k) for k in ks] for label in labels]

        parts.append(f"**{model}** ({length}, batch {cfg['batch_size']}): throughput, {unit} of training time "
                     "(p50 across repeats):\n\n"
                     + table(head, rows(lambda l, k: fmt_num(rates.get((l, k)))), align))
        parts.append(f"{model}: training time of K models over the time of one (same row; 1× would be free):\n\n"
                     + table(head, rows(lambda l, k: _ratio_cell(time_ratio(times, l, k))), align))
        if jax:
            parts.append(f"{model}: throughput over the JAX engine's ({', '.join(jax)}) at the same K:\n\n"
                         + table(head, rows(lambda l, k: _ratio_cell(jax_ratio(rates, l, k, jax))), align))
    if models:
        parts.append("*K models: n learning rates (the default and half-octave steps around it, at most 4× it) × n "
                     "seeds, each model its own run (its seed's weights and batch order, its lr). Throughput: "
                     "K × epochs (logreg) or K (MLPs) over the training time of the whole sweep (every SGD step "
                     "of every model; setup and evaluation excluded). Test accuracies are in `many.json` (the "
                     "default lr's model of each repeat, and every model's final figures).*")
    skipped = skipped_list(result)
    if skipped:
        parts.append("Rows not run here:\n\n" + skipped)
    return "\n\n".join(parts) + "\n"


def _ratio_cell(value: float | None) -> str:
    return "-" if value is None else f"{fmt_num(value)}×"


def plot(result: SuiteResult, path: Path) -> Path | None:
    """Throughput against K, log-log: a panel per model, a line per row (p20–p80 band across repeats)."""
    from fasttrain.bench import figures
    from fasttrain.files import save_figure

    plt = figures.matplotlib_or_none()
    ran = [c for c in result.ran() if c.k is not None]
    if plt is None or not ran:
        return None
    figures.style(plt)
    palette = figures.colors([(c.label, c.engine) for c in ran])
    models = list(dict.fromkeys(c.model for c in ran))
    fig, axes = plt.subplots(1, len(models), figsize=(max(9.5, 5.2 * len(models)), 4.6), layout="constrained", squeeze=False)
    for ax, model in zip(axes[0], models):
        metric, unit = _metric(model)
        labels, ks, p50 = grid(result, model, lambda c: c.metric(metric))
        _l, _k, p20 = grid(result, model, lambda c: c.metric(metric, "p20"))
        _l, _k, p80 = grid(result, model, lambda c: c.metric(metric, "p80"))
        for label in labels:
            xs = [k for k in ks if p50.get((label, k))]
            ax.plot(xs, [p50[(label, k)] for k in xs], marker="o", ms=4, lw=1.8, color=palette[label], label=label)
            ax.fill_between(xs, [p20[(label, k)] for k in xs], [p80[(label, k)] for k in xs], color=palette[label],
                            alpha=0.15, lw=0)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        values = [v for v in (*p20.values(), *p80.values(), *p50.values()) if v]
        if values:
            low, high = min(values) / 1.5, max(values) * 1.5
            ax.set_ylim(low, high)
            figures.log_ticks(ax.yaxis, decades=math.log10(high / low))
        ax.set_xticks(ks, [str(k) for k in ks])
        ax.set_xlabel("models trained at once, K")
        ax.set_ylabel(f"{unit} of training time")
        ax.set_title(model, loc="left", fontsize=11)
    handles = {}
    for ax in axes[0]:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, handle)
    fig.legend(handles.values(), handles.keys(), loc="outside lower center", ncol=min(4, len(handles)), fontsize=9)
    fig.suptitle(f"Many models at once: throughput against K\n{figures.machine_title(result)}", x=0.01, ha="left", fontsize=11,
                 fontweight="bold")
    save_figure(fig, path)
    plt.close(fig)
    return path


MANY_K = (1, 4, 16, 64)
QUICK_MANY_K = (1, 4)
MANY_MODELS = ("logreg", "mlp:128x3", "mlp:1024x3")


def build(quick: bool = False, repeats: int | None = None, hidden=None) -> Suite:
    # K = n x n models: n learning rates around the model's default (sweep_grid above) x n seeds;
    # logreg is measured in model-epochs per second of training, the MLPs in model-runs per second
    logreg = {**LOGREG, "epochs": 2} if quick else LOGREG
    mlp = {**MLP, "steps": 100} if quick else MLP
    return Suite("many", "Many models at once: K models (lr × seed) trained in one process", engine_rows("many"),
                 MANY_MODELS, {}, repeats or (1 if quick else 3), quick,
                 model_config={m: (logreg if m == "logreg" else mlp) for m in MANY_MODELS},
                 metric="model_runs_per_s", model_metric={"logreg": "model_epochs_per_s"},
                 ks=QUICK_MANY_K if quick else MANY_K)


def write_plots(result: SuiteResult, out: Path) -> list[Path]:
    return [p for p in [plot(result, out / "many.png")] if p is not None]


SPEC = SuiteSpec("many", "Many models at once: throughput of K = 1, 4, 16, 64 models (lr x seed grids) trained in one "
                  "process, per engine, on logreg (20 epochs) and mlp:128x3, mlp:1024x3 (5000 steps).", build, markdown,
                 (("throughput against the number of models trained at once", "many.png"),), write_plots,
                 case_runner=run_many)
