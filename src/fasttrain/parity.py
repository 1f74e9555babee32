"""Parity with the float64 reference: the one set of helpers tests and benchmarks share.

Every engine is held to the NumPy engine run in fp64 on the same initial weights and the same
batch order (the contract guarantees both for a given seed).
"""

from __future__ import annotations

from fasttrain.contract import ModelSpec, TrainConfig, parse_model
from fasttrain.data.datasets import Dataset
from fasttrain.reference import relative_max_error
from fasttrain.training import RunRecord, run


def reference_run(model: ModelSpec | str, config: TrainConfig, data: Dataset):
    """(record, weights) of the NumPy fp64 reference for ``config`` (its precision is replaced by fp64)."""
    spec = parse_model(model) if isinstance(model, str) else model
    return run("numpy", spec, config.with_(precision="fp64"), data)


def engine_run(engine: str, model: ModelSpec | str, config: TrainConfig, data: Dataset, options: dict | None = None):
    spec = parse_model(model) if isinstance(model, str) else model
    return run(engine, spec, config, data, options)


def parity_run(engine: str, model: ModelSpec | str, data: Dataset, options: dict | None = None, **config):
    """``(record, reference record, weights, reference weights)``: ``engine`` and the fp64 reference trained
    on the same weights and batches under ``default_config(model, **config)``."""
    from fasttrain.contract import default_config

    spec = parse_model(model) if isinstance(model, str) else model
    cfg = default_config(spec, **config)
    ref_record, ref_weights = reference_run(spec, cfg, data)
    record, weights = run(engine, spec, cfg, data, options)
    return record, ref_record, weights, ref_weights


def weight_error(weights, reference_weights) -> float:
    """``max|W - W_ref| / max|W_ref|``."""
    return relative_max_error(weights, reference_weights)


def loss_deviation(record: RunRecord, reference: RunRecord) -> float:
    """Largest relative difference of per-epoch train loss (epochs where both measured it)."""
    worst = 0.0
    for row, ref in zip(record.epochs, reference.epochs):
        if row["train_loss"] is not None and ref["train_loss"] is not None:
            worst = max(worst, abs(row["train_loss"] - ref["train_loss"]) / abs(ref["train_loss"]))
    return worst


def curve_deviation(record: RunRecord, reference: RunRecord) -> float:
    """Largest absolute difference between two loss curves at the steps both logged."""
    ref = {p["step"]: p["loss"] for p in reference.curve}
    diffs = [abs(p["loss"] - ref[p["step"]]) for p in record.curve if p["step"] in ref]
    return max(diffs) if diffs else float("nan")
