"""The lab suite's report: ``lab.md``'s tables (the lecture's table against the measured ticks, every row,
the batch-size sweep) and its PNG plots (memory against throughput, the sweep, the loss curves).

The numbers come from :mod:`fasttrain.bench.lab` (:func:`~fasttrain.bench.lab.derive` and the verdicts);
this module only lays them out.
"""

from __future__ import annotations

from pathlib import Path

from fasttrain.bench.lab import (MEMORY_YES, NEVER, SPEED_YES, SWEEP_RUNG, derive, sweep_cases, sweep_edge,
                                 technique_verdicts)
from fasttrain.bench import figures
from fasttrain.bench.results import CaseResult, SuiteResult
from fasttrain.bench.suite import Images, Suite
from fasttrain.bench.tables import fmt_num, image_links, machine_line, skipped_list, versions
from fasttrain.bench.tables import table as md_table
from fasttrain.files import save_figure


# --- Markdown -----------------------------------------------------------------------------------

def _yes(value: str | None) -> str:
    return "-" if value is None else ("**yes**" if value == "yes" else "no")


def _agree(value: bool | None) -> str:
    return "-" if value is None else ("agrees" if value else "**differs**")


def _mib_cell(value) -> str:
    return "-" if value is None else fmt_num(value)


def setting_line(result: SuiteResult) -> str:
    data = result.dataset
    base = next((c for c in result.ran() if c.label == "baseline"), None)
    cfg = base.config if base else next((c.config for c in result.cases if c.config and c.rung != SWEEP_RUNG), {})
    if not cfg:
        return ""
    tokens = (data.get("steps", 0) + data.get("warmup", 0)) * cfg["per_device_train_batch_size"] * \
        cfg["gradient_accumulation_steps"] * cfg["context"]
    seeds = f"{result.repeats} seed(s)"
    return (f"preset `{data.get('preset')}` (context {cfg['context']}, batch {cfg['per_device_train_batch_size']}, "
            f"lr {cfg['learning_rate']}); every row trains {tokens:,} tokens (the baseline's "
            f"{data.get('warmup', 0)} + {data.get('steps', 0)} steps), the first {data.get('warmup', 0)} steps timed "
            f"apart; {seeds} per row")


def _units(data: dict) -> str:
    """What the corpus' split sizes count: characters, or a tokenizer's tokens (named)."""
    if data.get("unit") != "tokens":
        return "characters"
    tok = data.get("tokenizer") or {}
    if not isinstance(tok, dict) or not tok:
        return "tokens"
    size = f", {tok['vocab_size']:,} ids" if isinstance(tok.get("vocab_size"), int) else ""
    return f"tokens ({tok.get('kind', '?')} tokenizer {tok.get('path') or tok.get('name') or ''}{size})".replace(" )", ")")


def markdown(result: SuiteResult, images: Images = None, suite: Suite | None = None) -> str:
    table = derive(result)
    env = result.environment
    data = result.dataset
    parts = [f"### {result.title}"]
    lines = [*(f"- Command: `{c}`" for c in (result.commands or [result.command]) if c),
             f"- Data: Tiny Shakespeare, {_units(data)} ({data['n_train']:,} train / {data['n_test']:,} validation)",
             f"- Setting: {setting_line(result)}",
             "- Baseline: fp32, eager attention, AdamW (torch's default implementation: foreach on CUDA), "
             "batches from a DataLoader with 0 workers, no checkpointing, no compilation",
             f"- Machine: {machine_line(env)}",
             f"- Software: Python {env.get('python', '?')}; {versions(env)}; git {env.get('git_sha') or '?'}",
             f"- Run: {result.timestamp}"]
    parts.append("\n".join(lines))
    parts += image_links(images)
    verdicts = technique_verdicts(table)
    rows = []
    for v in verdicts:
        if not v["rows"]:
            continue
        rows.append([v["technique"], v["lecture_speed"], _yes(v["speed"]) + _which(v["speed_rows"]),
                     _agree(v["speed_agree"]), v["lecture_memory"], _yes(v["memory"]) + _which(v["memory_rows"]),
                     _agree(v["memory_agree"])])
    if rows:
        parts.append("The lecture's table, measured (a technique is \"yes\" when any of its rows is):\n\n" + md_table(
            ["technique", "lecture: speed", "measured: speed", "", "lecture: memory", "measured: memory", ""],
            rows, "lllllll"))
    detail = []
    for r in table:
        case = r["case"]
        spread = f"{fmt_num(case.metric('step_ms', 'p20'))}–{fmt_num(case.metric('step_ms', 'p80'))}"
        lecture = r["lecture"]
        detail.append([
            r["technique"], case.label, case.precision, fmt_num(case.metric("tokens_per_s")),
            f"{fmt_num(case.metric('step_ms'))} ({spread})", fmt_num(case.metric("warmup_ms") / 1e3),
            _ratio_cell(r["speed_ratio"], r["pair"], case.label), _mib_cell(case.metric("peak_allocated")),
            _ratio_cell(r["memory_ratio"], r["pair"], case.label),
            _change(r["val_loss_change"]),
            f"{case.metric('val_loss'):.3f}" if case.metric("val_loss") is not None else "-",
            _yes(r["speed_tick"]), _yes(r["memory_tick"]),
            "-" if lecture is None else f"{lecture[0]} · {lecture[1]}",
            _row_agree(r),
            _estimate_cell(case),
        ])
    if detail:
        n = max((c.metric("tokens_per_s", "n") or 0 for c in result.ran()), default=0)
        parts.append("Every row:\n\n" + md_table(
            ["technique", "row", "precision", "tokens/s", "ms/step p50 (p20–p80)", "warm-up s", "× speed",
             "peak MiB", "× memory", "Δ val loss", "val loss", "speed", "memory", "lecture", "agree",
             "estimator MiB (error)"], detail, "lll" + "r" * 13))
        parts.append(
            f"*tokens/s: the timed steps' tokens over their mean time (device synchronized around every step, "
            f"the step's batch loading included), {'median over ' + str(n) + ' seeds' if n > 1 else 'one run (n=1)'}; "
            "ms/step: p50 with p20–p80 over the timed steps of one run (several seeds: across their medians); "
            "warm-up: the first steps (compilation, autotuning), not in tokens/s. × speed = tokens/s over the "
            "pair's; × memory = peak `max_memory_allocated` over the pair's (the pair: the baseline, or full "
            "fine-tuning of the same checkpoint for the PEFT rows). Δ val loss: this row's validation loss minus "
            "the pair's, over the whole validation split after the same number of training tokens. Measured "
            f"ticks: speed **yes** when × speed >= {SPEED_YES:.2f}, memory **yes** when × memory <= {MEMORY_YES:.2f}. "
            "lecture: its ticks for the row's technique (speed · memory; \"no / yes\": it depends, either agrees); "
            "agree: the row's measured ticks against them (a row shows one side of a technique: a smaller batch "
            "buys memory, a larger one speed, so the technique's verdict above is the one to read). estimator: "
            "the memory estimator's `precise` prediction of the peak, error against the measured peak.*")
    compiling = compile_table(table)
    if compiling:
        parts.append(compiling)
    over = _over_budget(result, table)
    if over:
        parts.append(f"*Trained more tokens than the budget (too few steps at their batch for a warm-up and one "
                     f"timed step; their loss change is not at equal tokens): {', '.join(over)}.*")
    sweep = sweep_cases(result)
    edge = sweep_edge(result)
    if sweep:
        srows = [[str(c.options.get("per_device_train_batch_size")), fmt_num(c.metric("tokens_per_s")),
                  fmt_num(c.metric("step_ms")), _mib_cell(c.metric("peak_allocated")),
                  _mib_cell(c.metric("peak_reserved")),
                  _estimate_cell(c)] for c in sweep]
        cfg = sweep[0].config
        parts.append(f"Batch-size sweep up to the out-of-memory edge: preset `{sweep[0].model}` "
                     f"({sweep[0].precision}, "
                     f"{cfg['attn_implementation']} attention, context {cfg['context']}), "
                     f"{data.get('sweep_steps')} timed steps per batch:\n\n"
                     + md_table(["batch", "tokens/s", "ms/step p50", "peak allocated MiB", "peak reserved MiB",
                               "estimator MiB (error)"], srows, "rrrrrr"))
    if edge is not None:
        parts.append(f"*Out-of-memory edge: {edge.reason}.*")
    skipped = [c for c in result.cases if c.status in ("skipped", "failed")]
    if skipped:
        sub = SuiteResult(result.suite, result.title, result.quick, result.command, result.timestamp, result.dataset,
                          result.environment, result.repeats, cases=skipped)
        parts.append("Rows not run here:\n\n" + skipped_list(sub))
    if not result.ran():
        parts.append("*No row ran on this machine.*")
    return "\n\n".join(parts) + "\n"


def compile_table(table: list[dict]) -> str:
    """The compiling rows' cold and warm start: compile seconds and the steps after which compiling pays
    (empty when no row compiled)."""
    rows = []
    by_label = {r["case"].label: r["case"] for r in table}
    for r in table:
        case = r["case"]
        if "compile_cold_s" not in case.metrics:
            continue
        pair = by_label.get(r["pair"])
        rows.append([case.label, fmt_num(case.metric("step_ms")), r["pair"],
                     fmt_num(pair.metric("step_ms")) if pair is not None and pair is not case else "-",
                     fmt_num(case.metric("warmup_ms") / 1e3) if case.metric("warmup_ms") is not None else "-",
                     fmt_num(case.metric("compile_cold_s")), fmt_num(case.metric("compile_warm_s")),
                     _breakeven_cell(case, "cold"), _breakeven_cell(case, "warm")])
    if not rows:
        return ""
    return ("Compiling rows, cold and warm start:\n\n" + md_table(
        ["row", "ms/step p50", "pair", "pair ms/step p50", "warm-up s", "compile s cold", "compile s warm",
         "pays after (cold)", "pays after (warm)"], rows, "lrlrrrrrr")
        + "\n\n*compile s = the warm-up steps' time less those steps at the row's ms/step p50. cold: the row's "
        "first run with empty compiler caches (inductor's and Triton's folders new and empty, the in-memory "
        "caches dropped); warm: the same model built and warmed up again in the same process, reading the "
        "folders that run filled (the in-memory caches dropped first, as a new process finds them). pays after: "
        "compile s / (the pair's ms/step - the row's), in steps; never: the compiled step is not faster.*")


def _breakeven_cell(case: CaseResult, which: str) -> str:
    entry = case.metrics.get(f"breakeven_steps_{which}")
    if entry is None:
        return "-"
    if entry["unit"] == NEVER:
        return NEVER
    return fmt_num(entry["p50"])


def _over_budget(result: SuiteResult, table: list[dict]) -> list[str]:
    base = next((r["case"] for r in table if r["case"].label == "baseline"), None)
    if base is None:
        return []

    def tokens(case):
        c = case.config
        return c["max_steps"] * c["per_device_train_batch_size"] * c["gradient_accumulation_steps"] * c["context"]

    budget = tokens(base)
    return [r["case"].label for r in table if tokens(r["case"]) > 1.05 * budget]


def _estimate_cell(case: CaseResult) -> str:
    est, err = case.metric("estimate_precise"), case.metric("estimate_error")
    if est is None:
        return "-"
    return fmt_num(est) + ("" if err is None else f" ({err:+.1f}%)")


def _change(value) -> str:
    if value is None:
        return "-"
    return "0.000" if abs(value) < 5e-4 else f"{value:+.3f}"


def _which(labels: list[str]) -> str:
    return f" ({', '.join(labels)})" if labels else ""


def _ratio_cell(value, pair: str, label: str) -> str:
    if pair == label:
        return "(pair)" if label != "baseline" else "(baseline)"
    return "-" if value is None else f"{fmt_num(value)}×"


def _row_agree(r: dict) -> str:
    marks = [a for a in (r["speed_agree"], r["memory_agree"]) if a is not None]
    if not marks:
        return "-"
    words = []
    for axis in ("speed", "memory"):
        a = r[f"{axis}_agree"]
        if a is not None:
            words.append(f"{axis} {'✓' if a else '✗'}")
    return ", ".join(words)


# --- plots --------------------------------------------------------------------------------------

def write_plots(result: SuiteResult, out: Path) -> list[Path]:
    plt = figures.matplotlib_or_none()
    if plt is None:
        return []
    figures.style(plt)
    paths = [_scatter(plt, result, out / "lab_scatter.png"), _sweep_plot(plt, result, out / "lab_batch_sweep.png"),
             _curves(plt, result, out / "lab_loss_curves.png")]
    return [p for p in paths if p is not None]


def _palette(labels: list[str]) -> dict:
    import matplotlib

    cmap = matplotlib.colormaps["tab20"]
    return {label: cmap(i % 20) for i, label in enumerate(labels)}


def _scatter(plt, result: SuiteResult, path: Path) -> Path | None:
    cases = [c for c in result.ran() if c.metric("peak_allocated") is not None and c.metric("tokens_per_s")]
    if not cases:
        return None
    fig, ax = plt.subplots(figsize=(11, 7), layout="constrained")
    techniques = list(dict.fromkeys(c.rung for c in cases))
    palette = _palette(techniques)
    for technique in techniques:
        mine = [c for c in cases if c.rung == technique]
        ax.scatter([c.metric("peak_allocated") for c in mine], [c.metric("tokens_per_s") for c in mine], s=46,
                   color=palette[technique], edgecolor="black", linewidth=0.5, label=technique, zorder=3,
                   marker="*" if technique == "baseline" else "o")
        for c in mine:
            ax.annotate(c.label, (c.metric("peak_allocated"), c.metric("tokens_per_s")), fontsize=7.5,
                        xytext=(4, 3), textcoords="offset points")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("peak memory allocated, MiB (log)")
    ax.set_ylabel("training throughput, tokens/s (log)")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8.5)
    figures.titles(fig, ax, "Memory against throughput: every configuration (up and left is better)", result)
    save_figure(fig, path)
    plt.close(fig)
    return path


def _sweep_plot(plt, result: SuiteResult, path: Path) -> Path | None:
    sweep = sweep_cases(result)
    if not sweep:
        return None
    batches = [c.options["per_device_train_batch_size"] for c in sweep]
    fig, ax = plt.subplots(figsize=(10, 5.8), layout="constrained")
    ax.plot(batches, [c.metric("tokens_per_s") for c in sweep], marker="o", lw=1.8, color="tab:blue",
            label="tokens/s")
    ax.set_xscale("log", base=2)
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.set_xlabel(f"batch size (sequences of {sweep[0].config['context']} tokens)")
    ax.set_ylabel("tokens/s", color="tab:blue")
    mem = ax.twinx()
    mem.plot(batches, [c.metric("peak_allocated") / 1024 if c.metric("peak_allocated") else None for c in sweep],
             marker="s", lw=1.2, ls="--", color="tab:red", label="peak allocated GiB")
    mem.set_ylabel("peak allocated, GiB", color="tab:red")
    mem.grid(False)
    edge = sweep_edge(result)
    if edge is not None:
        ax.axvline(edge.options["first_oom"], color="black", ls=":", lw=1.2)
        ax.text(edge.options["first_oom"], ax.get_ylim()[0], f" out of memory at {edge.options['first_oom']}\n"
                f" (largest fit {edge.options['largest_fit']})", fontsize=8.5, va="bottom")
    figures.titles(fig, ax, f"Throughput against batch size up to the out-of-memory edge: {sweep[0].model}", result)
    save_figure(fig, path)
    plt.close(fig)
    return path


def _curves(plt, result: SuiteResult, path: Path) -> Path | None:
    cases = [c for c in result.ran() if c.rung != SWEEP_RUNG and c.records and c.records[0].get("loss_curve")]
    if not cases:
        return None
    fig, ax = plt.subplots(figsize=(11, 6.5), layout="constrained")
    palette = _palette([c.label for c in cases])
    for c in cases:
        record = c.records[0]
        per_step = record["batch"]["tokens_per_step"]
        curve = record["loss_curve"]
        ax.plot([p["step"] * per_step / 1e6 for p in curve], [p["loss"] for p in curve], lw=1.1,
                color=palette[c.label], label=c.label, ls="--" if c.rung == "PEFT" else "-")
    ax.set_xlabel("training tokens seen, millions")
    ax.set_ylabel("training loss, nats/char")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7.5, ncol=1)
    figures.titles(fig, ax, "Loss curves at the same token budget (PEFT rows dashed: fine-tuning)", result)
    save_figure(fig, path)
    plt.close(fig)
    return path
