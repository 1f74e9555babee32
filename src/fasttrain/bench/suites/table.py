"""The table of a suite of several workloads (record, peers, an engine's own suite, and any suite without
a layout of its own): per model, its figure (ms per epoch or s per run, p50 with p20–p80), setup, test
accuracy, the speed-up over the baseline row and, where the suite has them, the targets and the parity
with the float64 reference. Such suites write no plots."""

from __future__ import annotations

from fasttrain.bench.results import CaseResult, SuiteResult
from fasttrain.bench.stats import ratio
from fasttrain.bench.suite import Images, Suite, SuiteBuilder, SuiteSpec, engine_rows
from fasttrain.bench.tables import (baseline_case, fmt_num, fmt_pct, fmt_ratio, header, image_links, skipped_list,
                                    table)
from fasttrain.bench.workloads import workloads


def _metric_cell(case: CaseResult, metric: str) -> str:
    value = case.metric(metric)
    if value is None:
        return "-"
    return f"{fmt_num(value)} ms" if metric == "epoch_ms" else f"{fmt_num(value / 1e3)} s"


def _spread(case: CaseResult, metric: str) -> str:
    lo, hi = case.metric(metric, "p20"), case.metric(metric, "p80")
    scale = 1.0 if metric == "epoch_ms" else 1e-3
    return "-" if lo is None else f"{fmt_num(lo * scale)}–{fmt_num(hi * scale)}"


def markdown(result: SuiteResult, images: Images = None, suite: Suite | None = None) -> str:
    """A suite of several workloads (record, peers, triton, and any suite without its own layout): per model,
    its figure (ms per epoch or s per run, p50 with p20–p80), setup, test accuracy, the speed-up over the
    baseline row, and, where the suite ran the fp64 reference, the parity and the target columns."""
    # a label can recur with another target on another model: key each row by the models it runs on
    rows_by_key = {(r.label, m): r for r in (suite.rows if suite else ()) for m in (r.models or suite.models)}
    has_target = any(r.target_ms is not None for r in rows_by_key.values())
    parts = [f"### {result.title}", header(result), *image_links(images)]
    ran = result.ran()
    head = ["model", "row", "precision", "figure (p50)", "p20–p80", "setup s", "test acc", "× baseline"]
    if has_target:
        head[5:5] = ["target", "met"]
    if result.reference:
        head += ["max rel. train-loss dev. vs fp64", "Δ test acc vs fp64 (pp)"]
    lines = []
    for case in ran:
        metric = suite.metric_for(case.model) if suite else "epoch_ms"
        base = baseline_case(result, case, suite)
        speedup = None if base is None or base is case else ratio(base.metric(metric), case.metric(metric))
        line = [case.model, case.label, case.precision, f"**{_metric_cell(case, metric)}**", _spread(case, metric),
                fmt_num(case.metric("setup_ms") / 1e3), fmt_pct(case.metric("test_acc", "mean")),
                "(baseline)" if base is case else fmt_ratio(speedup)]
        if has_target:
            row = rows_by_key.get((case.label, case.model))
            target = None if row is None else row.target_ms
            unit = 1.0 if metric == "epoch_ms" else 1e-3
            if target is None:
                line[5:5] = ["", ""]
            else:
                shown = f"<= {fmt_num(target * unit)} {'ms' if metric == 'epoch_ms' else 's'}"
                line[5:5] = [shown + (f" (floor {row.floor})" if row.floor else ""),
                             "yes" if case.metric(metric) <= target else "**no**"]
        if result.reference:
            dev = case.deviation or {}
            rel, diff = dev.get("train_loss_max_rel"), dev.get("test_acc_diff_pp")
            line += ["-" if rel is None else f"{100 * rel:.2f}%", "-" if diff is None else f"{diff:+.2f}"]
        lines.append(line)
    if lines:
        parts.append(table(head, lines, "lll" + "r" * (len(head) - 3)))
        parts.append("*figure: the mean epoch time over the second half of training (ms) for logreg, the training "
                     "time of the whole run (s) for the MLPs; p50 across seeds with p20–p80; setup (upload, "
                     "compilation, warm-up) apart; × baseline: the baseline row's figure over this row's, same model "
                     "and precision"
                     + ("; parity: the seed-0 run against the float64 reference on the same weights and batches"
                        if result.reference else "") + ".*")
    else:
        parts.append("*No row ran on this machine.*")
    skipped = skipped_list(result)
    if skipped:
        parts.append("Rows not run here:\n\n" + skipped)
    return "\n\n".join(parts) + "\n"


def workload_suite(name: str, title: str) -> SuiteBuilder:
    """A suite of the four benchmarks whose rows come from the engines (what an engine's own suite is)."""

    def builder(quick: bool = False, repeats: int | None = None, hidden=None) -> Suite:
        models, configs = workloads(quick)
        return Suite(name, title, engine_rows(name), models, {}, repeats or (1 if quick else 3), quick,
                     model_config=configs, metric="train_ms", model_metric={"logreg": "epoch_ms"})

    return builder


def workload_spec(name: str, help: str) -> SuiteSpec:
    """The registration of a suite of the four benchmarks whose rows come from the engines (an engine's own
    suite: ``Engine.suites``), laid out as this table."""
    return SuiteSpec(name, help, workload_suite(name, help.rstrip(".")), markdown)
