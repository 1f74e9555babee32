"""Many models at once: a learning-rate and seed sweep trained in one process (``--lr a,b --seed x,y``).

Model ``k`` of a sweep is the single run of its own config: its seed gives its initial weights and every
epoch's batch order, exactly as ``fasttrain train --seed s --lr a`` alone; what the models share is the model
shape, batch, precision and length. The driver below is :func:`fasttrain.training.run` for K models: the
engine's :class:`~fasttrain.engines.base.SweepSession` trains all of them in each timed epoch (one device
synchronization around the whole sweep's epoch), and each model gets its own run record, whose ``train_ms``
are the whole sweep's epoch times (the models trained together; there is no time of one of them alone).
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from dataclasses import dataclass, field

import numpy as np

from fasttrain.contract import ModelSpec, TrainConfig, default_config, epoch_order, initial_weights, parse_model, schedule
from fasttrain.data.datasets import Dataset, load_dataset
from fasttrain.engines import get_engine
from fasttrain.engines.base import EpochStats, SweepJob, SweepMemory, Weights, make_options, options_dict
from fasttrain.environment import environment
from fasttrain.errors import EngineUnavailable, FasttrainError
from fasttrain.timing import Stopwatch, summarize_epochs
from fasttrain.training import RunRecord, _Curve, _divergence, save_weights

GIB = 1024**3


def sweep_configs(base: TrainConfig, lrs: list[float], seeds: list[int]) -> list[TrainConfig]:
    """Every (lr, seed) combination, learning rate major: ``[(lr0, s0), (lr0, s1), ..., (lr1, s0), ...]``."""
    return [base.with_(lr=lr, seed=seed) for lr in lrs for seed in seeds]


def model_label(config: TrainConfig) -> str:
    """A model's name in a sweep's tables and files: ``lr0.1-seed3``."""
    return f"lr{config.lr:g}-seed{config.seed}"


def parse_sweep_list(text: str, flag: str, kind: type) -> list:
    """A command line's comma list (``--lr 0.03,0.1,0.3``, ``--seed 0,1,2``) as numbers of ``kind`` (float or
    int); an empty item or a word that is not such a number is one line. Ranges are :class:`TrainConfig`'s."""
    items = [item.strip() for item in str(text).split(",")]
    example = "0.03,0.1,0.3" if kind is float else "0,1,2"
    if any(not item for item in items):
        raise FasttrainError(f"{flag} {text!r}: an empty item; give values separated by single commas "
                             f"(e.g. {flag} {example})")
    values = []
    for item in items:
        try:
            values.append(kind(item))
        except ValueError:
            what = "a number" if kind is float else "an integer"
            raise FasttrainError(f"{flag}: {item!r} is not {what} (e.g. {flag} {example})") from None
    return values


def check_sweep_values(lrs, seeds) -> tuple[list[float], list[int]]:
    """The swept values as lists of floats and ints, refused (one line) when a list is empty or names a value
    twice (0.1 and 0.10 are one learning rate); each value's range is :class:`TrainConfig`'s to check."""
    out = []
    for flag, values, kind in (("--lr", lrs, float), ("--seed", seeds, int)):
        if isinstance(values, (int, float, str)):
            values = [values]
        values = list(values)
        if not values:
            raise FasttrainError(f"{flag}: give at least one value")
        seen = set()
        for value in values:
            if kind is int and (isinstance(value, bool) or not isinstance(value, (int, np.integer))):
                raise FasttrainError(f"{flag}: {value!r} is not an integer")
            if kind is float and (isinstance(value, bool) or not isinstance(value, (int, float, np.number))):
                raise FasttrainError(f"{flag}: {value!r} is not a number")
            key = kind(value)
            if key in seen:
                raise FasttrainError(f"{flag} lists {value:g} twice; give each value once")
            seen.add(key)
        out.append([kind(v) for v in values])
    return out[0], out[1]


def check_sweep_memory(memory: SweepMemory | None, k: int, spec: ModelSpec) -> None:
    """Refuse a sweep that cannot fit, before any work, naming the largest K that does."""
    if memory is None:
        return
    need = memory.shared + k * memory.per_model
    if need <= memory.available:
        return
    largest = memory.largest_k()
    fit = (f"at most {largest} models fit; give fewer --lr/--seed values" if largest >= 1 else
           "not even one model fits; use a smaller model or batch")
    raise FasttrainError(
        f"a sweep of {k} {spec.name} models needs about {need / GIB:.2f} GiB in {memory.where} "
        f"({memory.shared / GIB:.2f} GiB shared + {k} x {memory.per_model / GIB:.3f} GiB), but "
        f"{memory.available / GIB:.2f} GiB are free; {fit}")


def run_sweep(engine_name: str, spec: ModelSpec, configs: list[TrainConfig], data: Dataset,
              engine_options: dict | None = None, on_epoch=None):
    """Train the models of ``configs`` at once; returns ``(records, weights, sweep)``: a run record and the
    weights of each model (in ``configs`` order) and the sweep's own timing (:func:`sweep_timing`)."""
    if not configs:
        raise FasttrainError("a sweep needs at least one model")
    shared = {k: v for k, v in configs[0].to_dict().items() if k not in ("lr", "seed")}
    for config in configs[1:]:
        if {k: v for k, v in config.to_dict().items() if k not in ("lr", "seed")} != shared:
            raise FasttrainError("the models of a sweep differ only in lr and seed")
    engine_cls = get_engine(engine_name)
    reason = engine_cls.available()
    if reason:
        raise EngineUnavailable(f"engine {engine_name} cannot run here: {reason}")
    engine = engine_cls(make_options(engine_cls, engine_options))
    check_sweep_engine(engine, spec, configs[0])
    plan = schedule(configs[0], data.n_train)
    if len(data.test_labels) == 0:
        raise FasttrainError(f"{data.name}: the test set is empty; nothing to evaluate on")
    check_sweep_memory(engine.sweep_memory(spec, configs[0], data.n_train, len(data.test_labels), plan.n_epochs),
                       len(configs), spec)
    job = SweepJob(spec, tuple(configs), data, tuple(initial_weights(spec, c.seed) for c in configs), plan)
    k = job.k

    run_start = time.perf_counter()
    session = engine.prepare_sweep(job)
    # overflow to inf or NaN is detected and reported as divergence below, not as NumPy warnings; the session
    # is closed however the run ends
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"), contextlib.closing(session):
        session.sync()
        setup_ms = (time.perf_counter() - run_start) * 1e3
        watch = Stopwatch(session.sync)
        rows: list[list[dict]] = [[] for _ in range(k)]
        curves = [_Curve(c.log_every) for c in configs]
        diverged: list[dict | None] = [None] * k
        step = 0
        sweep_epoch_ms, sweep_eval_ms = [], []
        eval_every = configs[0].eval_every
        for epoch, steps in enumerate(plan.steps_per_epoch, start=1):
            orders = [epoch_order(c.seed, epoch, data.n_train) for c in configs]
            train_ms, stats = watch.time_ms(lambda: session.train_epoch(epoch, orders, steps))
            if len(stats) != k or not all(isinstance(s, EpochStats) for s in stats):
                raise FasttrainError(f"internal: engine {engine_name} returned {len(stats)} epoch stats for {k} models")
            sweep_epoch_ms.append(train_ms)
            train_losses = [None if s.loss_sum is None else s.loss_sum / s.count for s in stats]
            newly = [diverged[i] is None and _divergence({"epoch": epoch, "train_loss": train_losses[i]}) is not None
                     for i in range(k)]
            live = [i for i in range(k) if diverged[i] is None]
            last = epoch == plan.n_epochs or all(diverged[i] is not None or newly[i] for i in range(k))
            # model i is scored when its own run would be: its last epoch (the schedule's, or the one where its
            # train loss stopped being finite) or every eval_every epochs; the others' scores are not kept, so
            # each record is exactly that of the model's single run
            scored = [epoch == plan.n_epochs or epoch % eval_every == 0 or newly[i] for i in range(k)]
            scores = [(None, None)] * k
            eval_ms = 0.0
            if last or any(scored[i] for i in live):
                eval_ms, scores = watch.time_ms(session.evaluate)
            sweep_eval_ms.append(eval_ms)
            for i in live:
                s = stats[i]
                curves[i].add_epoch(step + 1, steps, None if s.step_losses is None else np.asarray(s.step_losses))
                test_loss, test_acc = scores[i] if scored[i] else (None, None)
                row = {
                    "epoch": epoch, "steps": steps, "train_ms": train_ms, "eval_ms": eval_ms,
                    "train_loss": train_losses[i],
                    "train_acc": None if s.correct is None else s.correct / s.count,
                    "test_loss": None if test_loss is None else float(test_loss),
                    "test_acc": None if test_acc is None else float(test_acc),
                }
                diverged[i] = _divergence(row)
                rows[i].append(row)
            step += steps
            if on_epoch:
                on_epoch({"epoch": epoch, "train_ms": train_ms, "eval_ms": eval_ms, "live": len(live),
                          "models": [rows[i][-1] if rows[i] and rows[i][-1]["epoch"] == epoch else None
                                     for i in range(k)]})
            if all(d is not None for d in diverged):
                break   # every model is NaN or inf: more epochs would time nothing meaningful
        total_ms = (time.perf_counter() - run_start) * 1e3
        weights = session.weights()
        env = environment()
        env.update(session.environment())

    timing = sweep_timing(sweep_epoch_ms, sweep_eval_ms, setup_ms, total_ms, k, plan.full_epoch_steps)
    records = []
    for i, config in enumerate(configs):
        model_rows = rows[i]
        stats = summarize_epochs([r["train_ms"] for r in model_rows])
        records.append(RunRecord(
            engine=engine_name, engine_options=options_dict(engine.options),
            model={"name": spec.name, "widths": list(spec.widths), "params": spec.n_params},
            config=config.to_dict(), dataset=data.name,
            environment={**env, "sweep": {"models": k, "index": i, "label": model_label(config)}},
            setup_ms=setup_ms, epochs=model_rows, curve=curves[i].finish(sum(r["steps"] for r in model_rows)),
            total_ms=total_ms, avg_epoch_ms_second_half=stats["mean_second_half"], epoch_ms=stats,
            final={"test_loss": model_rows[-1]["test_loss"], "test_acc": model_rows[-1]["test_acc"]},
            diverged=diverged[i]))
    return records, weights, timing


def sweep_timing(epoch_ms: list[float], eval_ms: list[float], setup_ms: float, total_ms: float, k: int,
                 full_epoch_steps: int) -> dict:
    """The sweep's own figures: its epochs' times (all K models together), evaluation apart, and throughput
    as model-epochs per second of training time (``k * epochs / train seconds``)."""
    train_ms = float(sum(epoch_ms))
    epochs = len(epoch_ms)
    return {
        "models": k,
        "setup_ms": setup_ms,
        "train_ms": train_ms,
        "eval_ms": float(sum(eval_ms)),
        "total_ms": total_ms,
        "epochs": epochs,
        "epoch_ms": summarize_epochs(epoch_ms),
        "model_epochs_per_s": k * epochs / (train_ms / 1e3) if train_ms > 0 else math.inf,
        "model_runs_per_s": k / (train_ms / 1e3) if train_ms > 0 else math.inf,
        "full_epoch_steps": full_epoch_steps,
    }


def check_sweep_engine(engine, spec: ModelSpec, config: TrainConfig) -> None:
    """The engine trains sweeps, and this model and config (its own limits, as for a single run)."""
    if engine.sweep is None:
        from fasttrain.engines import registry

        able = [name for name, cls in registry().items() if cls.sweep is not None]
        raise FasttrainError(f"engine {engine.name} does not train several models at once; engines that do: "
                             f"{', '.join(able)} (or give one --lr and one --seed)")
    engine.check_config(spec, config)


# --- the API: fasttrain.train_sweep ---------------------------------------------------------


@dataclass
class SweepResult:
    """A sweep's outcome: a run record per model (``configs`` order: lr major), the sweep's timing
    (:func:`sweep_timing`) and each model's final weights; :meth:`summary` is what ``sweep.json`` holds."""

    engine: str
    model: str
    lrs: list[float]
    seeds: list[int]
    records: list[RunRecord]
    timing: dict
    weights: list[Weights] = field(default_factory=list, repr=False)

    @property
    def labels(self) -> list[str]:
        return [model_label(TrainConfig(**r.config)) for r in self.records]

    @property
    def all_diverged(self) -> bool:
        return all(r.diverged is not None for r in self.records)

    def summary(self) -> dict:
        from fasttrain.sweep_report import summary

        return summary(self)


def train_sweep(
    engine: str = "numpy",
    model: str | ModelSpec = "logreg",
    *,
    lrs,
    seeds,
    data: Dataset | None = None,
    dataset: str = "mnist",
    data_dir: str | os.PathLike | None = None,
    engine_options: dict | None = None,
    on_epoch=None,
    out: str | os.PathLike | None = None,
    save_weights_to: str | os.PathLike | None = None,
    **config,
) -> SweepResult:
    """Train every (lr, seed) combination of ``lrs`` x ``seeds`` at once with one engine and return a
    :class:`SweepResult`. ``config`` keys are the other :class:`TrainConfig` fields, shared by every model
    (unset ones take the model's defaults). ``out``: a folder for ``<label>.json`` per model and
    ``sweep.json``/``sweep.md``/``sweep.png``; ``save_weights_to``: a folder for ``<label>.npz`` per model.
    Everything that can be refused is refused before the data loads, the memory check before any work."""
    from fasttrain.files import check_distinct_outputs
    from fasttrain.sweep_report import check_sweep_folder, write_sweep_folder, write_weights_folder

    for key in ("lr", "seed"):
        if config.get(key) is not None:
            raise FasttrainError(f"give {key}s=[...] for a sweep, not {key}=")
        config.pop(key, None)
    spec = parse_model(model) if isinstance(model, str) else model
    lr_values, seed_values = check_sweep_values(lrs, seeds)
    base = default_config(spec, **config)
    configs = sweep_configs(base, lr_values, seed_values)   # each config checks its lr's and seed's range
    engine_cls = get_engine(engine)
    check_sweep_engine(engine_cls(make_options(engine_cls, engine_options)), spec, configs[0])
    reason = engine_cls.available()
    if reason:
        raise EngineUnavailable(f"engine {engine} cannot run here: {reason}")
    labels = [model_label(c) for c in configs]
    if len(set(labels)) != len(labels):   # two lrs printed alike by %g (0.1 and 0.1000001)
        raise FasttrainError(f"--lr values {', '.join(f'{v!r}' for v in lr_values)} name two models alike; "
                             "give learning rates that differ in their first six digits")
    check_distinct_outputs(**{"--out": out, "--save-weights": save_weights_to})
    out_folder = None if out is None else check_sweep_folder(out, "--out", "json")
    weights_folder = None if save_weights_to is None else check_sweep_folder(save_weights_to, "--save-weights", "npz")
    if data is None:
        data = load_dataset(dataset, data_dir)
    records, weights, timing = run_sweep(engine, spec, configs, data, engine_options, on_epoch)
    result = SweepResult(engine, spec.name, lr_values, seed_values, records, timing, weights)
    if weights_folder is not None:
        write_weights_folder(weights_folder, labels, weights, save_weights)
    if out_folder is not None:
        write_sweep_folder(out_folder, result)
    return result
