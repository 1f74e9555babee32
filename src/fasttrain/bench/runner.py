"""Running a suite: which rows can run here, the runs over seeds, and the results as data.

A row is skipped, with the reason printed and kept in the results, when its engine is not built
yet, cannot run here (its ``available()`` reason), lacks an option the row names or the row's
precision, or refuses the job (a :class:`~fasttrain.errors.FasttrainError` from the engine). Any
other exception marks the row failed, with its traceback kept in the JSON, and the suite goes on.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import traceback
from collections.abc import Callable

import numpy as np
from rich.markup import escape

from fasttrain.bench import stats
from fasttrain.bench.device import release_memory
from fasttrain.bench.results import NOT_SELECTED, CaseResult, Progress, SuiteResult, utc_now
from fasttrain.bench.suite import Case, Suite
from fasttrain.bench.suites import spec
from fasttrain.contract import default_config, parse_model
from fasttrain.data.datasets import Dataset
from fasttrain.engines.rows import OFF
from fasttrain.errors import FasttrainError



# --- what can run here ---------------------------------------------------------------------


def _off_value(engine_cls, fld: dataclasses.Field):
    """The value that switches an engine flag off, or ``_OMIT`` when its default (None) already is off."""
    if type(fld.default) is bool:
        return False
    choices = fld.metadata.get("choices") or ()
    for word in ("off", "none", "no", "false", "disabled", ""):
        if word in choices:
            return word
    if fld.default is None:
        return _OMIT
    raise FasttrainError(f"engine {engine_cls.name}: option --{fld.name.replace('_', '-')} has no 'off' value "
                         f"(choices: {', '.join(map(str, choices)) or 'any'}); update the suite row")


_OMIT = object()


def resolve_options(engine_cls, options: dict) -> dict:
    """A row's options for ``engine_cls``: ``OFF`` replaced by the engine's off value, names checked."""
    from fasttrain.engines.base import make_options

    fields = {f.name: f for f in dataclasses.fields(engine_cls.Options)}
    resolved = {}
    for key, value in options.items():
        name = key.replace("-", "_")
        if name not in fields:
            known = ", ".join("--" + n.replace("_", "-") for n in fields) or "none"
            raise FasttrainError(f"engine {engine_cls.name} has no option --{name.replace('_', '-')} (yet; its options: {known})")
        if value is OFF:
            value = _off_value(engine_cls, fields[name])
            if value is _OMIT:
                continue
        resolved[name] = value
    make_options(engine_cls, resolved)  # types and choices, one-line error
    return resolved


def skip_reason(case: Case, engines_filter: set[str] | None = None) -> str | None:
    """Why ``case`` cannot run here, or None."""
    from fasttrain.engines import registry

    row = case.row
    if engines_filter is not None and row.engine not in engines_filter:
        return NOT_SELECTED
    engines = registry()
    if row.engine not in engines:
        return f"engine {row.engine} is not registered (no package in fasttrain.engines provides it)"
    engine_cls = engines[row.engine]
    if case.k is not None and engine_cls.sweep is None:
        return f"engine {row.engine} does not train several models at once (its class sets no sweep)"
    reason = engine_cls.available()
    if reason:
        return reason
    try:
        resolve_options(engine_cls, row.options)
    except FasttrainError as exc:
        return str(exc)
    precision = case.config.get("precision", "fp32")
    if precision not in engine_cls.precisions:
        return f"engine {row.engine} does not support precision {precision} (it supports: {', '.join(engine_cls.precisions)})"
    return None


def plan(suite: Suite, engines_filter: set[str] | None = None) -> list[tuple[Case, str | None]]:
    """Every case of the suite with the reason it is skipped (None: it runs)."""
    out = []
    for case in suite.cases():
        reason = skip_reason(case, engines_filter)
        if reason is None and suite.quick and not case.row.quick:
            reason = case.row.quick_note or "left out of --quick"
        out.append((case, reason))
    return out


def check_engines_filter(names: set[str] | None) -> None:
    from fasttrain.engines import registry

    if not names:
        return
    known = set(registry())
    unknown = sorted(names - known)
    if unknown:
        raise FasttrainError(f"--engines: unknown engine {unknown[0]!r}; choose from: {', '.join(sorted(known))}")


# --- running -------------------------------------------------------------------------------


_RUN_ID = f"{utc_now()}-pid{os.getpid()}"   # this process's invocation of a suite


def _case_result(case: Case, status: str, reason: str | None = None, options: dict | None = None) -> CaseResult:
    return CaseResult(
        suite=case.suite, label=case.row.label, engine=case.row.engine, rung=case.row.rung, model=case.model,
        precision=case.config.get("precision", "fp32"), options=_jsonable(options if options is not None else case.row.options),
        config=dict(case.config), seed_ms=case.row.seed_ms, status=status, reason=reason, timestamp=utc_now(),
        k=case.k, run_id=_RUN_ID,
    )


def _jsonable(options: dict) -> dict:
    return {k: ("off" if v is OFF else v) for k, v in options.items()}






def run_suite(
    suite: Suite,
    data: Dataset,
    *,
    engines_filter: set[str] | None = None,
    command: str = "",
    dataset_info: dict | None = None,
    progress: Progress | None = None,
    runner: Callable | None = None,
    on_case: Callable[[SuiteResult], None] | None = None,
    sweep_runner: Callable | None = None,
) -> SuiteResult:
    """Run every case that can run here, ``suite.repeats`` seeds each (curves: seed 0 only).

    ``on_case(result)`` is called after each case that ran, with the results so far (the CLI saves
    them, so a run cut short keeps what it finished). A case of K models (the many suite) runs through
    ``sweep_runner`` (default: the runner the suite's registration carries), the others through ``runner``."""
    from fasttrain.engines import reference_engine
    from fasttrain.environment import environment
    from fasttrain.training import run as train_run

    runner = runner or train_run
    progress = progress or Progress()
    planned = plan(suite, engines_filter)
    runnable = [case for case, reason in planned if reason is None]
    seeds = list(range(suite.repeats))
    ref_models = sorted({case.model for case in runnable if suite.reference_models is None
                         or case.model in suite.reference_models}, key=lambda m: parse_model(m).n_params) \
        if suite.reference else []
    result = SuiteResult(suite.name, suite.title, suite.quick, command, utc_now(),
                         dataset_info or {"name": data.name, "n_train": data.n_train, "n_test": len(data.test_labels)},
                         environment(), suite.repeats, commands=[command] if command else [],
                         baselines=suite.baselines())
    progress.start(len(runnable) * len(seeds) + len(ref_models), suite.name)
    told = set()
    try:
        for model in ref_models:
            reference = reference_engine()
            progress.describe(f"{suite.name}: {reference} fp64 reference {model}")
            config = default_config(parse_model(model), **{**suite.config_for(model), "precision": "fp64", "seed": 0})
            record, _ = runner(reference, parse_model(model), config, data, {})
            result.reference[model] = record.to_dict()
            progress.advance()
        for case, reason in planned:
            if reason is not None:
                if reason != NOT_SELECTED and (case.row.label, reason) not in told:  # once per row, not per model
                    told.add((case.row.label, reason))
                    progress.log(f"[yellow]skip[/] {suite.name} {case.row.label}: {escape(reason)}")
                result.cases.append(_case_result(case, "skipped", reason))
                continue
            if case.k is not None:
                case_runner = functools.partial(sweep_runner or _sweep_runner_of(suite), k=case.k)
            else:
                case_runner = runner
            result.cases.append(_run_case(suite, case, seeds, data, case_runner, progress, result.reference))
            if on_case:
                on_case(result)
    finally:
        progress.stop()
    return result


def _sweep_runner_of(suite: Suite) -> Callable:
    """How the suite runs a case of K models: the runner its registration carries."""
    try:
        runner = spec(suite.name).case_runner
    except ValueError:
        runner = None
    if runner is None:
        raise FasttrainError(f"suite {suite.name} has cases of K models but no runner for them in its registration")
    return runner


def _run_case(suite: Suite, case: Case, seeds, data, runner, progress: Progress, reference: dict) -> CaseResult:
    from fasttrain.engines import get_engine

    engine_cls = get_engine(case.row.engine)
    options = resolve_options(engine_cls, case.row.options)
    spec = parse_model(case.model)
    out = _case_result(case, "ok", options=options)
    many = "" if case.k is None else f" K={case.k}"
    for i, seed in enumerate(seeds):
        progress.describe(f"{suite.name}: {case.row.label} {case.model}{many} seed {seed}")
        config = default_config(spec, **{**case.config, "seed": seed})
        out.config = config.to_dict()
        try:
            record, _weights = runner(case.row.engine, spec, config, data, options)
        except FasttrainError as exc:
            release_memory()
            out.status, out.reason = "skipped", str(exc)
            progress.log(f"[yellow]skip[/] {suite.name} {case.row.label} {case.model}{many}: {escape(str(exc))}")
            progress.advance(len(seeds) - i)
            return out
        except Exception as exc:  # noqa: BLE001 - one broken engine must not lose the rest of the suite
            release_memory()
            out.status, out.reason = "failed", f"{type(exc).__name__}: {exc}".splitlines()[0]
            out.traceback = traceback.format_exc()
            progress.log(f"[red]FAILED[/] {suite.name} {case.row.label} {case.model}{many} seed {seed}: {escape(out.reason)}")
            progress.advance(len(seeds) - i)
            return out
        out.seeds.append(seed)
        out.records.append(record.to_dict())
        if getattr(record, "diverged", None):
            # a diverged run's times and scores mean nothing: the row is failed, with its record kept
            out.status = "failed"
            out.reason = f"training diverged at epoch {record.diverged['epoch']} ({record.diverged['what']}) on seed {seed}"
            if record.diverged.get("model"):   # a sweep: which of its models
                out.reason += f" (model {record.diverged['model']} of {case.k})"
            progress.log(f"[red]FAILED[/] {suite.name} {case.row.label} {case.model}{many}: {escape(out.reason)}")
            progress.advance(len(seeds) - i)
            release_memory()
            return out
        del record, _weights
        release_memory()
        progress.advance()
    out.metrics = stats.case_metrics(out.records)
    if suite.reference and case.model in reference:
        out.deviation = _deviation(out.records[0], reference[case.model])
    progress.log(_summary_line(suite, out))
    return out


def _deviation(record: dict, reference: dict) -> dict:
    """How far a run is from the fp64 reference on the same seed (:mod:`fasttrain.parity`)."""
    from fasttrain.parity import curve_deviation, loss_deviation
    from fasttrain.training import RunRecord

    run, ref = RunRecord.from_dict(record), RunRecord.from_dict(reference)
    curve = curve_deviation(run, ref)
    acc, ref_acc = record["final"]["test_acc"], reference["final"]["test_acc"]
    return {
        "curve_max_abs": None if not np.isfinite(curve) else float(curve),
        "train_loss_max_rel": float(loss_deviation(run, ref)) if any(e["train_loss"] is not None for e in run.epochs) else None,
        "test_acc_diff_pp": None if acc is None or ref_acc is None else 100.0 * (acc - ref_acc),
    }


def _summary_line(suite: Suite, case: CaseResult) -> str:
    n = case.metrics["epoch_ms"]["n"]
    acc = case.metric("test_acc", "mean")
    acc_text = "-" if acc is None else f"{100 * acc:.2f}%"
    if case.k is not None:
        metric = suite.metric_for(case.model)
        rate = case.metric(metric)
        unit = "model-epochs/s" if metric == "model_epochs_per_s" else "model-runs/s"
        return (f"[green]ok[/] {suite.name} {case.label} {case.model} K={case.k}: "
                f"{'-' if rate is None else f'{rate:,.3g}'} {unit}, train {case.metric('train_ms') / 1e3:.3f} s "
                f"(p50 of {n}), acc {acc_text}")
    if suite.metric_for(case.model) == "train_ms":
        timing = f"train {case.metric('train_ms') / 1e3:.3f} s"
    else:
        timing = f"epoch {case.metric('epoch_ms'):.2f} ms"
    extra = ""
    if case.deviation and case.deviation["curve_max_abs"] is not None:
        extra = f"  max |loss - ref| {case.deviation['curve_max_abs']:.2e}"
    return f"[green]ok[/] {suite.name} {case.label} {case.model}: {timing} (p50 of {n}), acc {acc_text}{extra}"


# --- merging with earlier results ----------------------------------------------------------


def _model_size(name: str) -> int:
    """Parameters of an MNIST model name; 0 for another suite's workload (the lab's presets)."""
    try:
        return parse_model(name).n_params
    except FasttrainError:
        return 0


def merge(new: SuiteResult, old: SuiteResult | None) -> tuple[SuiteResult, int]:
    """Fold earlier results of the same suite into ``new``; returns (result, cases kept from ``old``).

    A case ``new`` ran (or tried to) replaces the earlier one. A case ``new`` did not run (another
    ``--hidden``, or left out by ``--engines``) keeps its earlier result when that one ran.
    Earlier results with another dataset or ``--quick`` setting are dropped, not mixed in."""
    if old is None or old.quick != new.quick or old.dataset != new.dataset:
        return new, 0
    new = dataclasses.replace(new)  # a copy: the running suite's result stays as it is
    new_by_key = {c.key: c for c in new.cases}
    old_by_key = {c.key: c for c in old.cases}
    merged, kept = [], 0
    for key in dict.fromkeys([*new_by_key, *old_by_key]):
        fresh, earlier = new_by_key.get(key), old_by_key.get(key)
        if fresh is not None and fresh.reason != NOT_SELECTED:
            merged.append(fresh)
        elif earlier is not None and (earlier.ok or fresh is None):
            merged.append(earlier)
            kept += earlier.ok
        else:
            merged.append(fresh)
    # rows in the suite's own order (a part run with --rows or --engines holds only some of them)
    try:
        defined = [row.label for row in spec(new.suite).build().rows]
    except ValueError:
        defined = []
    labels = list(dict.fromkeys([*defined, *(c.label for c in old.cases), *(c.label for c in new.cases)]))
    merged.sort(key=lambda c: (_model_size(c.model), labels.index(c.label) if c.label in labels else len(labels),
                               c.k or 0))
    new.cases = merged
    new.reference = {**old.reference, **new.reference}
    new.baselines = new.baselines or old.baselines
    if kept:
        new.commands = list(dict.fromkeys([*old.commands, *new.commands]))
    return new, kept
