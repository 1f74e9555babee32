"""The shared driver: one training run of any engine under the contract, and its run record."""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from fasttrain.timing import Stopwatch, summarize_epochs
from fasttrain.contract import (
    ModelSpec,
    TrainConfig,
    default_config,
    epoch_order,
    initial_weights,
    parse_model,
    schedule,
)
from fasttrain.data.datasets import Dataset, load_dataset
from fasttrain.engines import get_engine
from fasttrain.engines.base import EpochStats, Job, Weights, make_options, options_dict
from fasttrain.environment import environment
from fasttrain.errors import EngineUnavailable, FasttrainError

SCHEMA = 1


@dataclass
class RunRecord:
    """One training run (JSON ``schema: 1``); see :mod:`fasttrain.timing` for what is timed."""

    engine: str
    engine_options: dict
    model: dict
    config: dict
    dataset: str
    environment: dict
    setup_ms: float
    epochs: list[dict] = field(default_factory=list)
    curve: list[dict] = field(default_factory=list)
    total_ms: float = 0.0
    avg_epoch_ms_second_half: float = 0.0
    epoch_ms: dict = field(default_factory=dict)
    final: dict = field(default_factory=dict)
    schema: int = SCHEMA

    def to_dict(self) -> dict:
        data = asdict(self)
        return {"schema": data.pop("schema"), **data}

    def save(self, path: str | os.PathLike) -> None:
        atomic_write_text(path, json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def from_dict(cls, data: dict) -> "RunRecord":
        if data.get("schema") != SCHEMA:
            raise FasttrainError(f"run record schema {data.get('schema')!r} is not {SCHEMA}")
        return cls(**data)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "RunRecord":
        return cls.from_dict(json.loads(Path(path).read_text()))


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write via a temporary file in the same folder and rename: no half-written file at ``path``."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent or ".")
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def check_writable(path: str | os.PathLike | None, what: str) -> None:
    """Fail before training, not after, when an output path cannot be written."""
    if path is None:
        return
    parent = Path(path).expanduser().resolve().parent
    if not parent.is_dir():
        raise FasttrainError(f"{what} {path}: folder {parent} does not exist; create it first")
    if not os.access(parent, os.W_OK):
        raise FasttrainError(f"{what} {path}: folder {parent} is not writable")


def save_weights(path: str | os.PathLike, weights: Weights) -> None:
    """``W1, b1, W2, b2, ...`` with ``W`` of shape (fan_in, fan_out), written atomically."""
    path = Path(path)
    arrays = {}
    for i, (w, b) in enumerate(weights, start=1):
        arrays[f"W{i}"], arrays[f"b{i}"] = np.asarray(w), np.asarray(b)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".npz", dir=path.parent or ".")
    os.close(fd)
    try:
        np.savez(tmp, **arrays)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_weights(path: str | os.PathLike) -> Weights:
    try:
        with np.load(path) as npz:
            n = len([k for k in npz.files if k.startswith("W")])
            return [(npz[f"W{i}"], npz[f"b{i}"]) for i in range(1, n + 1)]
    except FileNotFoundError:
        raise FasttrainError(f"{path}: weights file not found") from None
    except (OSError, ValueError, KeyError) as exc:
        raise FasttrainError(f"{path}: not a fasttrain weights file ({exc})") from None


class _Curve:
    """Loss-curve points ``{step, loss}`` every ``log_every`` steps, each the mean loss of the steps
    since the previous point. A window with a step whose loss was not recorded (an engine that
    measures loss only every few epochs) yields no point, rather than a mean over part of it."""

    def __init__(self, log_every: int):
        self.log_every = log_every
        self.points: list[dict] = []
        self._pending: list[float] = []
        self._complete = True

    def add_epoch(self, first_step: int, steps: int, losses: np.ndarray | None) -> None:
        for offset in range(steps):
            if losses is None:
                self._complete = False
            else:
                self._pending.append(float(losses[offset]))
            step = first_step + offset
            if step % self.log_every == 0:
                self._flush(step)

    def finish(self, last_step: int) -> list[dict]:
        self._flush(last_step)
        return self.points

    def _flush(self, step: int) -> None:
        if self._complete and self._pending:
            self.points.append({"step": step, "loss": float(np.mean(self._pending))})
        self._pending.clear()
        self._complete = True


EpochCallback = Callable[[dict], None]


def run(
    engine_name: str,
    spec: ModelSpec,
    config: TrainConfig,
    data: Dataset,
    engine_options: dict | None = None,
    on_epoch: EpochCallback | None = None,
):
    """Train ``spec`` with an engine under ``config`` on ``data``; returns ``(record, weights)``."""
    engine_cls = get_engine(engine_name)
    reason = engine_cls.available()
    if reason:
        raise EngineUnavailable(f"engine {engine_name} cannot run here: {reason}")
    engine = engine_cls(make_options(engine_cls, engine_options))
    plan = schedule(config, data.n_train)
    job = Job(spec, config, data, initial_weights(spec, config.seed), plan)
    engine.check(job)

    run_start = time.perf_counter()
    session = engine.prepare(job)
    try:
        session.sync()  # setup ends when the device is idle, so no setup work leaks into epoch 1
        setup_ms = (time.perf_counter() - run_start) * 1e3
        watch = Stopwatch(session.sync)
        epochs, curve = [], _Curve(config.log_every)
        step = 0
        for epoch, steps in enumerate(plan.steps_per_epoch, start=1):
            order = epoch_order(config.seed, epoch, data.n_train)
            train_ms, stats = watch.time_ms(lambda: session.train_epoch(epoch, order, steps))
            assert isinstance(stats, EpochStats)
            curve.add_epoch(step + 1, steps, None if stats.step_losses is None else np.asarray(stats.step_losses))
            step += steps
            last = epoch == plan.n_epochs
            test_loss = test_acc = None
            eval_ms = 0.0
            if last or epoch % config.eval_every == 0:
                eval_ms, (test_loss, test_acc) = watch.time_ms(session.evaluate)
            row = {
                "epoch": epoch,
                "steps": steps,
                "train_ms": train_ms,
                "eval_ms": eval_ms,
                "train_loss": None if stats.loss_sum is None else stats.loss_sum / stats.count,
                "train_acc": None if stats.correct is None else stats.correct / stats.count,
                "test_loss": None if test_loss is None else float(test_loss),
                "test_acc": None if test_acc is None else float(test_acc),
            }
            epochs.append(row)
            if on_epoch:
                on_epoch(row)
        total_ms = (time.perf_counter() - run_start) * 1e3
        weights = session.weights()
        env = environment()
        env.update(session.environment())
    finally:
        session.close()

    epoch_ms = [row["train_ms"] for row in epochs]
    stats = summarize_epochs(epoch_ms)
    record = RunRecord(
        engine=engine_name,
        engine_options=options_dict(engine.options),
        model={"name": spec.name, "widths": list(spec.widths), "params": spec.n_params},
        config=config.to_dict(),
        dataset=data.name,
        environment=env,
        setup_ms=setup_ms,
        epochs=epochs,
        curve=curve.finish(step),
        total_ms=total_ms,
        avg_epoch_ms_second_half=stats["mean_second_half"],
        epoch_ms=stats,
        final={"test_loss": epochs[-1]["test_loss"], "test_acc": epochs[-1]["test_acc"]},
    )
    return record, weights


def train(
    engine: str = "numpy",
    model: str | ModelSpec = "logreg",
    *,
    data: Dataset | None = None,
    dataset: str = "mnist",
    data_dir: str | os.PathLike | None = None,
    engine_options: dict | None = None,
    on_epoch: EpochCallback | None = None,
    out: str | os.PathLike | None = None,
    save_weights_to: str | os.PathLike | None = None,
    **config,
) -> RunRecord:
    """Train and return the run record. ``config`` keys are :class:`TrainConfig` fields
    (``epochs``, ``steps``, ``batch_size``, ``lr``, ``seed``, ``precision``, ...); unset ones take the
    model's defaults. ``data`` overrides loading ``dataset`` from ``data_dir``."""
    spec = parse_model(model) if isinstance(model, str) else model
    cfg = default_config(spec, **config)
    engine_cls = get_engine(engine)
    # everything that can be rejected without data is rejected before the data loads
    engine_cls(make_options(engine_cls, engine_options)).check_config(spec, cfg)
    reason = engine_cls.available()
    if reason:
        raise EngineUnavailable(f"engine {engine} cannot run here: {reason}")
    check_writable(out, "--out")
    check_writable(save_weights_to, "--save-weights")
    if data is None:
        data = load_dataset(dataset, data_dir)
    record, weights = run(engine, spec, cfg, data, engine_options, on_epoch)
    if save_weights_to is not None:
        save_weights(save_weights_to, weights)
    if out is not None:
        record.save(out)
    return record


def evaluate_weights(weights: Weights, data: Dataset) -> tuple[float, float]:
    """(test loss, test accuracy) of saved weights, computed in float64 by the reference."""
    from fasttrain.reference import evaluate

    return evaluate([(np.asarray(w, np.float64), np.asarray(b, np.float64)) for w, b in weights], data, np.float64)
