"""Writing suite results: long CSV, JSON of the full run records, and each suite's Markdown and plots
(laid out by the suite's own module, found through its registration).

Every figure in a table is read from the results here, never typed in; the only numbers that do
not come from a run are the seed study's, in their own column marked as measured elsewhere.
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

from fasttrain.bench.results import SuiteResult
from fasttrain.bench.suites import spec
from fasttrain.bench.suites import table as workload_table
from fasttrain.bench.tables import environment_of, gpu_name, versions
from fasttrain.errors import FasttrainError
from fasttrain.files import atomic_write_text

CSV_COLUMNS = ("suite", "engine", "rung", "model", "metric", "unit", "p20", "p50", "p80", "n", "gpu", "versions",
               "git_sha", "timestamp", "label", "precision", "dataset", "mean", "models")

DEVIATION_METRICS = {  # curves: name in CaseResult.deviation -> (CSV metric, unit)
    "curve_max_abs": ("curve_max_abs_dev", "loss"),
    "train_loss_max_rel": ("train_loss_max_rel_dev", "fraction"),
    "test_acc_diff_pp": ("test_acc_diff", "pp"),
}


# --- CSV -----------------------------------------------------------------------------------


def csv_rows(result: SuiteResult) -> list[dict]:
    """Long format: one line per (case, metric), statistics across the case's runs."""
    rows = []
    for case in result.ran():
        env = environment_of(case)
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


# --- Markdown and plots: the suite's own ------------------------------------------------------


def _markdown_and_plots(result: SuiteResult):
    """(markdown, plot files, write_plots, suite as defined today) of ``result``'s suite; a suite no longer
    registered is laid out as the generic table, without plots."""
    try:
        registered = spec(result.suite)
    except ValueError:
        return workload_table.markdown, (), None, None
    return registered.markdown, registered.plot_files, registered.write_plots, registered.suite(result.quick)


def to_markdown(result: SuiteResult, image_dir: Path | None = None, link_base: str = "") -> str:
    """The suite's Markdown; with ``image_dir``, links to the plots found there (as ``link_base/<name>``)."""
    markdown, plot_files, _write, suite = _markdown_and_plots(result)
    images = None
    if image_dir is not None:
        images = [(alt, f"{link_base}{name}") for alt, name in plot_files if (image_dir / name).is_file()]
    return markdown(result, images, suite)


def write_plots(result: SuiteResult, out: Path) -> list[Path]:
    """The suite's PNG plots under ``out`` (none without matplotlib, or for a suite of tables only)."""
    _markdown, _files, write, _suite = _markdown_and_plots(result)
    return [] if write is None else [p for p in write(result, out) if p is not None]


def write_outputs(result: SuiteResult, out: Path) -> list[Path]:
    """``<suite>.json``, ``<suite>.csv``, ``<suite>.md`` under ``out`` (plots: :func:`write_plots`)."""
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for suffix, text in (("json", to_json(result)), ("csv", to_csv([result])), ("md", to_markdown(result, out))):
        path = out / f"{result.suite}.{suffix}"
        atomic_write_text(path, text)
        paths.append(path)
    return paths
