"""Many models at once: a learning-rate and seed sweep trained in one process (``--lr a,b --seed x,y``).

Model ``k`` of a sweep is the single run of its own config: its seed gives its initial weights and every
epoch's batch order, exactly as ``fasttrain train --seed s --lr a`` alone; what the models share is the model
shape, batch, precision and length. The driver below is :func:`fasttrain.training.run` for K models: the
engine's :class:`~fasttrain.engines.base.SweepSession` trains all of them in each timed epoch (one device
synchronization around the whole sweep's epoch), and each model gets its own run record, whose ``train_ms``
are the whole sweep's epoch times (the models trained together; there is no time of one of them alone).
"""

from __future__ import annotations

import math
import time

import numpy as np

from fasttrain.contract import ModelSpec, TrainConfig, epoch_order, initial_weights, schedule
from fasttrain.data.datasets import Dataset
from fasttrain.engines import get_engine
from fasttrain.engines.base import EpochStats, SweepJob, SweepMemory, SweepSession, Weights, make_options, options_dict
from fasttrain.environment import environment
from fasttrain.errors import EngineUnavailable, FasttrainError
from fasttrain.timing import Stopwatch, summarize_epochs
from fasttrain.training import RunRecord, _Curve, _divergence

GIB = 1024**3


def sweep_configs(base: TrainConfig, lrs: list[float], seeds: list[int]) -> list[TrainConfig]:
    """Every (lr, seed) combination, learning rate major: ``[(lr0, s0), (lr0, s1), ..., (lr1, s0), ...]``."""
    return [base.with_(lr=lr, seed=seed) for lr in lrs for seed in seeds]


def model_label(config: TrainConfig) -> str:
    """A model's name in a sweep's tables and files: ``lr0.1-seed3``."""
    return f"lr{config.lr:g}-seed{config.seed}"


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
    numpy_errors = np.seterr(over="ignore", invalid="ignore", divide="ignore")
    try:
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
            scores = [(None, None)] * k
            eval_ms = 0.0
            if last or epoch % eval_every == 0 or any(newly):
                eval_ms, scores = watch.time_ms(session.evaluate)
            sweep_eval_ms.append(eval_ms)
            for i in live:
                s = stats[i]
                curves[i].add_epoch(step + 1, steps, None if s.step_losses is None else np.asarray(s.step_losses))
                test_loss, test_acc = scores[i]
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
    finally:
        np.seterr(**numpy_errors)
        session.close()

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


class LoopSweepSession(SweepSession):
    """K single sessions trained one after the other each epoch: the reference a sweep engine is held to
    (each model's numbers are exactly those of its own run)."""

    def __init__(self, sessions):
        self.sessions = list(sessions)

    def train_epoch(self, epoch: int, orders: list[np.ndarray], steps: int) -> list[EpochStats]:
        return [s.train_epoch(epoch, order, steps) for s, order in zip(self.sessions, orders)]

    def evaluate(self) -> list[tuple[float, float]]:
        return [s.evaluate() for s in self.sessions]

    def weights(self) -> list[Weights]:
        return [s.weights() for s in self.sessions]

    def sync(self) -> None:
        for s in self.sessions:
            s.sync()

    def environment(self) -> dict:
        return self.sessions[0].environment() if self.sessions else {}

    def close(self) -> None:
        for s in self.sessions:
            s.close()
