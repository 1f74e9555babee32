"""Writing suite results: long CSV, JSON of the full run records, Markdown tables.

Every figure in a table is read from the results here, never typed in; the only numbers that do
not come from a run are the seed study's, in their own column marked as measured elsewhere.
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

from fasttrain.bench.runner import NOT_SELECTED, CaseResult, SuiteResult
from fasttrain.bench.stats import ratio
from fasttrain.bench.suites import SEED_CUDA_MS, SEED_NOTE, build
from fasttrain.contract import parse_model
from fasttrain.errors import FasttrainError
from fasttrain.files import atomic_write_text

CSV_COLUMNS = ("suite", "engine", "rung", "model", "metric", "unit", "p20", "p50", "p80", "n", "gpu", "versions",
               "git_sha", "timestamp", "label", "precision", "dataset", "mean", "models")

DEVIATION_METRICS = {  # curves: name in CaseResult.deviation -> (CSV metric, unit)
    "curve_max_abs": ("curve_max_abs_dev", "loss"),
    "train_loss_max_rel": ("train_loss_max_rel_dev", "fraction"),
    "test_acc_diff_pp": ("test_acc_diff", "pp"),
}


# --- small formatting helpers --------------------------------------------------------------


def fmt_num(value: float | None, digits: int = 3) -> str:
    """Three significant digits, thousands separated: 12,500 · 38.2 · 5.23 · 0.412."""
    if value is None:
        return "-"
    if abs(value) >= 10 ** digits:
        return f"{value:,.0f}"
    text = f"{value:.{digits}g}"
    if "e" in text:
        return f"{value:.2e}"
    return text


def fmt_pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.2f}%"


def fmt_ratio(value: float | None) -> str:
    return "-" if value is None else f"{fmt_num(value)}×"


def baseline_labels(result: SuiteResult) -> list[str]:
    """The rows the speed-up columns divide by: as recorded, else as the suite defines them today."""
    if result.baselines:
        return list(result.baselines)
    try:
        return build(result.suite).baselines()
    except ValueError:
        return []


def baseline_case(result: SuiteResult, case: CaseResult) -> CaseResult | None:
    """The baseline row that ran on ``case``'s model, in its precision where there is one."""
    labels = baseline_labels(result)
    same_model = [c for c in result.ran() if c.label in labels and c.model == case.model]
    return next((c for c in same_model if c.precision == case.precision), same_model[0] if same_model else None)


def _env(case: CaseResult) -> dict:
    return case.records[0]["environment"] if case.records else {}


def gpu_name(env: dict) -> str:
    gpu = env.get("gpu")
    return gpu["name"] if gpu else "none"


def versions(env: dict) -> str:
    return "; ".join(f"{k}={v}" for k, v in sorted((env.get("libraries") or {}).items()))


def machine_line(env: dict) -> str:
    gpu = env.get("gpu")
    cpu = f"{env.get('cpu', '?')} ({env.get('cores', '?')} cores)"
    if gpu:
        return (f"{gpu['name']} (driver {gpu['driver']}, {gpu['memory_mib']} MiB, max clocks SM {gpu['max_sm_clock_mhz']} MHz"
                f" / memory {gpu['max_mem_clock_mhz']} MHz); host CPU {cpu}")
    return f"no GPU; CPU {cpu}"


def dataset_line(dataset: dict) -> str:
    text = f"{dataset['name']} ({dataset['n_train']:,} train / {dataset['n_test']:,} test examples)"
    if dataset.get("synthetic"):
        text += ", SYNTHETIC data (no MNIST found): timings are valid, accuracies mean nothing"
    elif dataset.get("subset"):
        text += ", the first examples of each split (--quick)"
    return text


# --- CSV -----------------------------------------------------------------------------------


def csv_rows(result: SuiteResult) -> list[dict]:
    """Long format: one line per (case, metric), statistics across the case's runs."""
    rows = []
    for case in result.ran():
        env = _env(case)
        common = dict(suite=case.suite, engine=case.engine, rung=case.rung, model=case.model, gpu=gpu_name(env),
                      versions=versions(env), git_sha=env.get("git_sha") or "", timestamp=case.timestamp,
                      label=case.label, precision=case.precision, dataset=result.dataset["name"],
                      models=case.k if case.k is not None else 1)
        for metric, entry in case.metrics.items():
            rows.append({**common, "metric": metric, "unit": entry["unit"], "p20": entry["p20"], "p50": entry["p50"],
                         "p80": entry["p80"], "n": entry["n"], "mean": entry["mean"]})
        for key, (metric, unit) in DEVIATION_METRICS.items():
            value = (case.deviation or {}).get(key)
            if value is not None:
                rows.append({**common, "metric": metric, "unit": unit, "p20": value, "p50": value, "p80": value,
                             "n": 1, "mean": value})
    return rows


def _csv_value(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def to_csv(results: list[SuiteResult]) -> str:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(CSV_COLUMNS)
    for result in results:
        for row in csv_rows(result):
            writer.writerow([_csv_value(row[c]) for c in CSV_COLUMNS])
    return buffer.getvalue()


# --- JSON ----------------------------------------------------------------------------------


def to_json(result: SuiteResult) -> str:
    return json.dumps(result.to_dict(), indent=1, allow_nan=False) + "\n"


def _no_constant(name: str):
    raise ValueError(f"it holds {name}, which is not JSON (results files write null for a missing number)")


def load_result(path: str | Path) -> SuiteResult:
    """A suite's results file, checked to be one: strict JSON (no NaN), an object with the fields
    of :class:`SuiteResult`; anything else is a one-line error naming the file."""
    path = Path(path)
    what = "not a fasttrain benchmark results file"
    try:
        data = json.loads(path.read_bytes().decode("utf-8"), parse_constant=_no_constant)
        if not isinstance(data, dict):
            raise ValueError(f"it holds a JSON {type(data).__name__}, not an object")
        if not isinstance(data.get("cases", []), list) or not all(isinstance(c, dict) for c in data.get("cases", [])):
            raise ValueError("its 'cases' is not a list of objects")
        result = SuiteResult.from_dict(data)
        for field_name in ("dataset", "environment"):
            if not isinstance(getattr(result, field_name), dict):
                raise ValueError(f"its {field_name!r} is not an object")
        return result
    except FileNotFoundError:
        raise FasttrainError(f"{path}: no benchmark results there; run: fasttrain bench all --out {path.parent}") from None
    except IsADirectoryError:
        raise FasttrainError(f"{path}: is a folder, not a results file") from None
    except UnicodeDecodeError:
        raise FasttrainError(f"{path}: {what} (binary, not UTF-8 text); move it away or rerun the suite") from None
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise FasttrainError(f"{path}: {what} ({str(exc).splitlines()[0][:200]}); move it away or rerun the suite") from None


# --- Markdown ------------------------------------------------------------------------------


def _table(header: list[str], rows: list[list[str]], align: str) -> str:
    marks = {"l": "---", "r": "---:", "c": ":---:"}
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join(marks[a] for a in align) + " |"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _plural(n: int, word: str) -> str:
    return f"{n:,} {word}" + ("" if n == 1 else "s")


def _config_line(result: SuiteResult) -> str:
    case = next(iter(result.ran()), None) or next(iter(result.cases), None)
    if case is None:
        return ""
    if case.k is not None:   # the many suite: each model's length and batch head its own tables
        return (f"K = n × n models per case (n learning rates around each model's default × n seeds), "
                f"{_plural(result.repeats, 'repeat')} (repeat r: seeds r·n .. r·n + n − 1)")
    seeds = f"seeds 0..{result.repeats - 1}" if result.repeats > 1 else "seed 0"

    def setting(cfg: dict) -> str:
        length = _plural(cfg["epochs"], "epoch") if cfg.get("steps") is None else _plural(cfg["steps"], "step")
        return f"{length}, batch {cfg['batch_size']}, lr {cfg['lr']}"

    # a suite of several workloads (record, peers) gives each model its own length, batch and lr
    per_model = {c.model: setting(c.config) for c in (result.ran() or result.cases)}
    if len(set(per_model.values())) > 1:
        return "; ".join(f"{m}: {v}" for m, v in per_model.items()) + f"; {seeds}"
    return f"{setting(case.config)}, {seeds}"


def git_line(result: SuiteResult) -> str:
    """The commit the rows ran at; for a merged result whose parts ran at several, each with what ran there:
    its models or its rows, whichever list is shorter."""
    def grouped(key) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for case in result.ran():
            sha = (_env(case).get("git_sha") or "")[:7]
            if sha and key(case) not in out.setdefault(sha, []):
                out[sha].append(key(case))
        return out

    by_model, by_row = grouped(lambda c: c.model), grouped(lambda c: c.label)
    if len(by_model) <= 1:
        return result.environment.get("git_sha") or next(iter(by_model), "?")
    best = min((by_model, by_row), key=lambda g: sum(len(v) for v in g.values()))
    return ", ".join(f"{sha} ({', '.join(names)})" for sha, names in best.items())


def header(result: SuiteResult) -> str:
    env = result.environment
    lines = [
        *(f"- Command: `{c}`" for c in (result.commands or [result.command]) if c),
        f"- Data: {dataset_line(result.dataset)}",
        f"- Setting: {_config_line(result)}",
        f"- Machine: {machine_line(env)}",
        f"- Software: Python {env.get('python', '?')}; {versions(env)}; git {git_line(result)}",
        f"- Run: {result.timestamp}" + (" (**--quick**: a short smoke run, not the benchmark protocol)" if result.quick else ""),
    ]
    return "\n".join(line for line in lines if line)


def skipped_list(result: SuiteResult) -> str:
    """Skipped and failed rows, grouped by engine and reason so the list stays short."""
    groups: dict[tuple[str, str, str], list[str]] = {}
    for case in result.cases:
        if case.ok or case.reason == NOT_SELECTED:
            continue
        groups.setdefault((case.status, case.engine, case.reason or ""), []).append(case.label)
    lines = []
    for (status, engine, reason), labels in groups.items():
        names = ", ".join(dict.fromkeys(labels))
        word = "FAILED" if status == "failed" else "not run"
        lines.append(f"- {word}: {names}: {reason}")
    return "\n".join(lines)


def _images(images: list[tuple[str, str]] | None) -> list[str]:
    return [" ".join(f"![{alt}]({path})" for alt, path in images)] if images else []


def ladder_markdown(result: SuiteResult, images: list[tuple[str, str]] | None = None) -> str:
    ran = result.ran()
    base = next((c for c in ran if c.label in baseline_labels(result)), None)
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
    table = _table(
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
    parts = [f"### {result.title}", header(result), *_images(images)]
    parts += [table, "\n\n".join(f"*{n}*" for n in notes)] if ran else ["*No row ran on this machine.*"]
    skipped = skipped_list(result)
    if skipped:
        parts.append("Rows not run here:\n\n" + skipped)
    return "\n\n".join(parts) + "\n"


def sweep_grid(result: SuiteResult, value) -> tuple[list[str], list[int], dict[tuple[str, int], float | None]]:
    """(row labels, hidden sizes, {(label, hidden): value(case)}) over the cases that ran."""
    ran = result.ran()
    labels = list(dict.fromkeys(c.label for c in ran))
    hidden = sorted({parse_model(c.model).hidden[0] for c in ran})
    grid = {(c.label, parse_model(c.model).hidden[0]): value(c) for c in ran}
    return labels, hidden, grid


def baseline_times(result: SuiteResult) -> dict[int, float]:
    _labels, _hidden, grid = sweep_grid(result, lambda c: c.metric("train_ms"))
    labels = baseline_labels(result)
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


def sweep_markdown(result: SuiteResult, images: list[tuple[str, str]] | None = None) -> str:
    parts = [f"### {result.title}", header(result), *_images(images)]
    labels, hidden, times = sweep_grid(result, lambda c: c.metric("train_ms"))
    if not labels:
        parts.append("*No row ran on this machine.*")
    else:
        _l, _h, setup = sweep_grid(result, lambda c: c.metric("setup_ms"))
        _l, _h, acc = sweep_grid(result, lambda c: c.metric("test_acc", "mean"))
        base = baseline_times(result)
        head = ["engine"] + [f"h={h}" for h in hidden]

        def grid_rows(cell):
            return [[label] + [cell(label, h) for h in hidden] for label in labels]

        def time_cell(grid, label, h):
            v = grid.get((label, h))
            return "" if v is None else fmt_num(v / 1e3)

        parts.append("Training time, seconds (all steps; p50 across seeds; setup and evaluation excluded):\n\n"
                     + _table(head, grid_rows(lambda l, h: time_cell(times, l, h)), "l" + "r" * len(hidden)))
        if base:
            parts.append(f"Speed relative to {baseline_labels(result)[0]} (its time / the row's time; > 1 is faster):\n\n"
                         + _table(head, grid_rows(lambda l, h: fmt_ratio(ratio(base.get(h), times.get((l, h))))),
                                  "l" + "r" * len(hidden)))
        versus = peer_ratios(result)
        if versus:
            parts.append("Speed relative to the JAX engine in the same invocation and precision (the JAX row's time "
                         "/ the row's time; > 1 is faster; rows from another invocation are left out):\n\n"
                         + _table(head, [[label] + [fmt_ratio(versus[label].get(h)) for h in hidden] for label in versus],
                                  "l" + "r" * len(hidden)))
        parts.append("Setup (upload, compilation, warm-up), seconds:\n\n"
                     + _table(head, grid_rows(lambda l, h: time_cell(setup, l, h)), "l" + "r" * len(hidden)))
        parts.append("Final test accuracy (mean over seeds):\n\n"
                     + _table(head, grid_rows(lambda l, h: "" if acc.get((l, h)) is None else fmt_pct(acc[(l, h)])),
                              "l" + "r" * len(hidden)))
    skipped = skipped_list(result)
    if skipped:
        parts.append("Rows not run here:\n\n" + skipped)
    return "\n\n".join(parts) + "\n"


def curves_markdown(result: SuiteResult, images: list[tuple[str, str]] | None = None) -> str:
    parts = [f"### {result.title}", header(result), *_images(images)]
    rows = []
    for model, ref in result.reference.items():
        last = ref["curve"][-1]["loss"] if ref["curve"] else None
        rows.append([f"numpy fp64 (reference) · {model}", "fp64", fmt_num(last, 4), "0", "0",
                     fmt_pct(ref["final"]["test_acc"]), "0"])
    for case in result.ran():
        record, dev = case.records[0], case.deviation or {}
        last = record["curve"][-1]["loss"] if record["curve"] else None
        diff = dev.get("test_acc_diff_pp")
        rows.append([
            case.label + ("" if len(result.reference) <= 1 else f" · {case.model}"), case.precision, fmt_num(last, 4),
            "-" if dev.get("curve_max_abs") is None else f"{dev['curve_max_abs']:.2e}",
            "-" if dev.get("train_loss_max_rel") is None else f"{dev['train_loss_max_rel']:.2e}",
            fmt_pct(record["final"]["test_acc"]), "-" if diff is None else f"{diff:+.2f}",
        ])
    if rows:
        parts.append(_table(["engine / rung", "precision", "final loss", "max \\|loss − ref\\|", "max rel. train-loss dev.",
                             "test acc", "Δ acc (pp)"], rows, "llrrrrr"))
        parts.append("*ref: the NumPy engine in float64 on the same seed, weights and batches. max |loss − ref|: the "
                     "largest difference between the two loss curves at the logged steps (each point the mean loss "
                     "since the previous one); max rel. train-loss dev.: the largest relative difference of an "
                     "epoch's mean train loss.*")
    else:
        parts.append("*No row ran on this machine.*")
    skipped = skipped_list(result)
    if skipped:
        parts.append("Rows not run here:\n\n" + skipped)
    return "\n\n".join(parts) + "\n"


def _metric_cell(case: CaseResult, metric: str) -> str:
    value = case.metric(metric)
    if value is None:
        return "-"
    return f"{fmt_num(value)} ms" if metric == "epoch_ms" else f"{fmt_num(value / 1e3)} s"


def _spread(case: CaseResult, metric: str) -> str:
    lo, hi = case.metric(metric, "p20"), case.metric(metric, "p80")
    scale = 1.0 if metric == "epoch_ms" else 1e-3
    return "-" if lo is None else f"{fmt_num(lo * scale)}–{fmt_num(hi * scale)}"


def table_markdown(result: SuiteResult, images: list[tuple[str, str]] | None = None) -> str:
    """A suite of several workloads (record, peers, triton, and any suite without its own layout): per model,
    its figure (ms per epoch or s per run, p50 with p20–p80), setup, test accuracy, the speed-up over the
    baseline row, and, where the suite ran the fp64 reference, the parity and the target columns."""
    try:
        suite = build(result.suite, result.quick)
    except ValueError:
        suite = None
    # a label can recur with another target on another model: key each row by the models it runs on
    rows_by_key = {(r.label, m): r for r in (suite.rows if suite else ()) for m in (r.models or suite.models)}
    has_target = any(r.target_ms is not None for r in rows_by_key.values())
    parts = [f"### {result.title}", header(result), *_images(images)]
    ran = result.ran()
    head = ["model", "row", "precision", "figure (p50)", "p20–p80", "setup s", "test acc", "× baseline"]
    if has_target:
        head[5:5] = ["target", "met"]
    if result.reference:
        head += ["max rel. train-loss dev. vs fp64", "Δ test acc vs fp64 (pp)"]
    lines = []
    for case in ran:
        metric = suite.metric_for(case.model) if suite else "epoch_ms"
        base = baseline_case(result, case)
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
        parts.append(_table(head, lines, "lll" + "r" * (len(head) - 3)))
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


def lab_markdown(result: SuiteResult, images: list[tuple[str, str]] | None = None) -> str:
    from fasttrain.bench.lab_report import markdown

    return markdown(result, images)


def many_markdown(result: SuiteResult, images: list[tuple[str, str]] | None = None) -> str:
    from fasttrain.bench.many import markdown

    return markdown(result, images)


MARKDOWN = {"ladder": ladder_markdown, "sweep": sweep_markdown, "curves": curves_markdown, "lab": lab_markdown,
            "many": many_markdown}


PLOTS = {  # the PNG files each suite writes (fasttrain.bench.plots), with their alt text
    "ladder": [("ms per epoch, per engine and rung", "ladder.png")],
    "sweep": [("training time against hidden size", "sweep_time.png"),
              ("speed relative to PyTorch eager against hidden size", "sweep_relative.png")],
    "curves": [("loss curves of every engine against the NumPy fp64 reference", "curves.png")],
    "many": [("throughput against the number of models trained at once", "many.png")],
    "lab": [("memory against throughput of every configuration", "lab_scatter.png"),
            ("throughput against batch size up to the out-of-memory edge", "lab_batch_sweep.png"),
            ("training loss against tokens seen, every row", "lab_loss_curves.png")],
}


def to_markdown(result: SuiteResult, image_dir: Path | None = None, link_base: str = "") -> str:
    """The suite's Markdown; with ``image_dir``, links to the plots found there (as ``link_base/<name>``)."""
    images = None
    if image_dir is not None:
        images = [(alt, f"{link_base}{name}") for alt, name in PLOTS.get(result.suite, ())
                  if (image_dir / name).is_file()]
    return MARKDOWN.get(result.suite, table_markdown)(result, images)


def write_outputs(result: SuiteResult, out: Path) -> list[Path]:
    """``<suite>.json``, ``<suite>.csv``, ``<suite>.md`` under ``out`` (plots: :mod:`fasttrain.bench.plots`)."""
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for suffix, text in (("json", to_json(result)), ("csv", to_csv([result])), ("md", to_markdown(result, out))):
        path = out / f"{result.suite}.{suffix}"
        atomic_write_text(path, text)
        paths.append(path)
    return paths
