"""The shared driver: one training run of any engine under the contract, and its run record."""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import time
import zipfile
import zlib
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
from fasttrain.files import finite_or_none  # noqa: F401 - the run records of this driver and its callers
from fasttrain.files import atomic_path, atomic_write_text, check_distinct_outputs, check_output_path

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
    # None, or where the loss stopped being finite: {"epoch": e, "what": "train loss", ...}; training
    # stops after that epoch (the weights are NaN or inf from then on)
    diverged: dict | None = None
    schema: int = SCHEMA

    def to_dict(self) -> dict:
        data = finite_or_none(asdict(self))
        return {"schema": data.pop("schema"), **data}

    def save(self, path: str | os.PathLike) -> None:
        # allow_nan=False: the file is strict JSON (non-finite numbers are already null)
        atomic_write_text(path, json.dumps(self.to_dict(), indent=2, allow_nan=False) + "\n")

    @classmethod
    def from_dict(cls, data: dict) -> "RunRecord":
        if data.get("schema") != SCHEMA:
            raise FasttrainError(f"run record schema {data.get('schema')!r} is not {SCHEMA}")
        return cls(**data)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "RunRecord":
        return cls.from_dict(json.loads(Path(path).read_text()))


def _divergence(row: dict) -> dict | None:
    """Where an epoch's losses stopped being finite, or None."""
    for key in ("train_loss", "test_loss"):
        value = row.get(key)
        if value is not None and not math.isfinite(value):
            return {"epoch": row["epoch"], "what": key.replace("_", " "), "value": str(value)}
    return None


def check_writable(path: str | os.PathLike | None, what: str) -> None:
    """Fail before training, not after, when an output path cannot be written."""
    check_output_path(path, what)


def save_weights(path: str | os.PathLike, weights: Weights) -> None:
    """``W1, b1, W2, b2, ...`` with ``W`` of shape (fan_in, fan_out), written atomically."""
    arrays = {}
    for i, (w, b) in enumerate(weights, start=1):
        arrays[f"W{i}"], arrays[f"b{i}"] = np.asarray(w), np.asarray(b)
    with atomic_path(path, suffix=".npz") as tmp:
        np.savez(tmp, **arrays)


def load_weights(path: str | os.PathLike) -> Weights:
    """Weights saved by :func:`save_weights`, checked (:func:`check_weights`) before use."""
    path = Path(path)
    hint = "give a .npz written by fasttrain train --save-weights"
    if path.is_dir():
        raise FasttrainError(f"{path}: is a folder, not a weights file; {hint}")
    if path.exists() and not path.is_file():
        raise FasttrainError(f"{path}: not a regular file; {hint}")
    try:
        loaded = np.load(path, allow_pickle=False)
        if not isinstance(loaded, np.lib.npyio.NpzFile):
            raise ValueError("a single array, not an .npz archive")
        with loaded as npz:
            names = set(npz.files)
            n = len([k for k in names if re.fullmatch(r"W\d+", k)])
            if n == 0:
                raise FasttrainError(f"{path}: holds no weights (no W1, b1, ...; it has: "
                                     f"{', '.join(sorted(names)[:6]) or 'nothing'}); {hint}")
            missing = [k for i in range(1, n + 1) for k in (f"W{i}", f"b{i}") if k not in names]
            if missing:
                raise FasttrainError(f"{path}: {missing[0]} is missing (layers must be W1, b1, ..., W{n}, b{n}); {hint}")
            weights = [(npz[f"W{i}"], npz[f"b{i}"]) for i in range(1, n + 1)]
    except FileNotFoundError:
        raise FasttrainError(f"{path}: weights file not found; {hint}") from None
    except FasttrainError:
        raise
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile, zlib.error) as exc:
        raise FasttrainError(f"{path}: not a readable fasttrain weights file, truncated or of another format "
                             f"({type(exc).__name__}: {str(exc).split('. ')[0] or 'unreadable'}); {hint}") from None
    check_weights(weights, str(path))
    return weights


def check_weights(weights: Weights, source: str = "weights") -> None:
    """Refuse weights no model of the contract can have: ``W1`` (784, H1), ``b1`` (H1,), ...,
    ``Wn`` (H_{n-1}, 10), ``bn`` (10,), each layer's input the previous layer's output, all finite."""
    from fasttrain.contract import INPUT_DIM, NUM_CLASSES

    fan_in = INPUT_DIM
    for i, (w, b) in enumerate(weights, start=1):
        for name, array in ((f"W{i}", w), (f"b{i}", b)):
            if not np.issubdtype(array.dtype, np.floating):
                raise FasttrainError(f"{source}: {name} holds {array.dtype} values, not floats; not fasttrain weights")
        if w.ndim != 2 or w.shape[0] != fan_in:
            raise FasttrainError(f"{source}: W{i} has shape {w.shape}, expected ({fan_in}, width): each layer takes "
                                 f"the previous one's {fan_in} outputs (the first takes {INPUT_DIM} pixels)")
        if b.shape != (w.shape[1],):
            raise FasttrainError(f"{source}: b{i} has shape {b.shape}, expected ({w.shape[1]},) to match W{i}")
        fan_in = w.shape[1]
        if not (np.all(np.isfinite(w)) and np.all(np.isfinite(b))):
            raise FasttrainError(f"{source}: W{i} or b{i} holds NaN or inf (a diverged run?); retrain with a lower --lr")
    if fan_in != NUM_CLASSES:
        raise FasttrainError(f"{source}: the last layer has {fan_in} outputs, but the datasets have {NUM_CLASSES} "
                             "classes; these are not weights of a fasttrain model")


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
    if len(data.test_labels) == 0:
        raise FasttrainError(f"{data.name}: the test set is empty; nothing to evaluate on")
    job = Job(spec, config, data, initial_weights(spec, config.seed), plan)
    engine.check(job)

    run_start = time.perf_counter()
    session = engine.prepare(job)
    # overflow to inf or NaN is detected and reported as divergence below, not as NumPy warnings; the session
    # is closed however the run ends
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"), contextlib.closing(session):
        session.sync()  # setup ends when the device is idle, so no setup work leaks into epoch 1
        setup_ms = (time.perf_counter() - run_start) * 1e3
        watch = Stopwatch(session.sync)
        epochs, curve = [], _Curve(config.log_every)
        step = 0
        diverged = None
        for epoch, steps in enumerate(plan.steps_per_epoch, start=1):
            order = epoch_order(config.seed, epoch, data.n_train)
            train_ms, stats = watch.time_ms(lambda: session.train_epoch(epoch, order, steps))
            assert isinstance(stats, EpochStats)
            curve.add_epoch(step + 1, steps, None if stats.step_losses is None else np.asarray(stats.step_losses))
            step += steps
            train_loss = None if stats.loss_sum is None else stats.loss_sum / stats.count
            diverged = _divergence({"epoch": epoch, "train_loss": train_loss})
            last = epoch == plan.n_epochs or diverged is not None
            test_loss = test_acc = None
            eval_ms = 0.0
            if last or epoch % config.eval_every == 0:
                eval_ms, (test_loss, test_acc) = watch.time_ms(session.evaluate)
            row = {
                "epoch": epoch,
                "steps": steps,
                "train_ms": train_ms,
                "eval_ms": eval_ms,
                "train_loss": train_loss,
                "train_acc": None if stats.correct is None else stats.correct / stats.count,
                "test_loss": None if test_loss is None else float(test_loss),
                "test_acc": None if test_acc is None else float(test_acc),
            }
            diverged = diverged or _divergence(row)
            epochs.append(row)
            if on_epoch:
                on_epoch(row)
            if diverged is not None:
                break  # NaN or inf weights from here on: more epochs would time nothing meaningful
        total_ms = (time.perf_counter() - run_start) * 1e3
        weights = session.weights()
        env = environment()
        env.update(session.environment())

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
        diverged=diverged,
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
    check_distinct_outputs(**{"--out": out, "--save-weights": save_weights_to})
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

    weights = [(np.asarray(w), np.asarray(b)) for w, b in weights]
    check_weights(weights)
    return evaluate([(np.asarray(w, np.float64), np.asarray(b, np.float64)) for w, b in weights], data, np.float64)
