"""Lab checkpoints: a folder with ``model.safetensors`` and ``config.json``, written atomically;
loading their weights, and run records (JSON, written atomically too). Scoring a checkpoint again
by itself is :mod:`fasttrain.lab.evaluate` (it builds a trainer; this module stays below it)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from fasttrain.errors import FasttrainError
from fasttrain.files import atomic_write_text
from fasttrain.lab.config import LabConfig, missing_extra
from fasttrain.lab.measure import gpu_name


def save_checkpoint(model, path, *, chars: str, lab: dict, extra: dict | None = None) -> Path:
    """A folder with ``model.safetensors`` (weights) and ``config.json`` (the model's config, the
    vocabulary, the lab configuration), written to a temporary folder and renamed into place."""
    try:
        from safetensors.torch import save_model
    except ImportError as exc:
        raise missing_extra("safetensors (--save)", exc) from None
    final = Path(path)
    tmp = Path(tempfile.mkdtemp(prefix=final.name + ".", suffix=".tmp", dir=final.parent))
    try:
        save_model(model, str(tmp / "model.safetensors"))
        meta = {"format": "fasttrain-lab-checkpoint-1", "model": model.config.to_dict(), "chars": chars,
                "lab": lab, **(extra or {})}
        (tmp / "config.json").write_text(json.dumps(meta, indent=1))
        if final.exists():
            old = final.with_name(final.name + ".old")
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def read_checkpoint(path) -> dict:
    p = Path(path)
    cfg_file, weights = p / "config.json", p / "model.safetensors"
    if not cfg_file.exists() or not weights.exists():
        raise FasttrainError(f"{p} is not a lab checkpoint (needs config.json and model.safetensors); "
                             f"write one with: fasttrain lab --save {p}")
    try:
        meta = json.loads(cfg_file.read_text())
        meta["model"]
    except (ValueError, KeyError):
        raise FasttrainError(f"{cfg_file}: not a lab checkpoint config (unreadable JSON)") from None
    return meta


def load_weights(model, path) -> None:
    try:
        from safetensors.torch import load_model
    except ImportError as exc:
        raise missing_extra("safetensors (--init-from)", exc) from None
    try:
        missing, unexpected = load_model(model, str(Path(path) / "model.safetensors"), strict=False)
    except Exception as exc:
        raise FasttrainError(f"{path}: cannot load the weights ({type(exc).__name__}: {str(exc)[:120]})") from None
    if set(missing) - {"prompt"} or unexpected:
        raise FasttrainError(f"{path}: weights do not match the model (missing {sorted(missing)[:3]}, "
                             f"unexpected {sorted(unexpected)[:3]})")


def eval_settings(cfg: LabConfig, batch: int, device) -> dict:
    """What an evaluation's numbers depend on, stored with a checkpoint so that ``lab eval``
    forms the same sums in the same order and dtype: the validation batch (windows per forward),
    the token budget, autocast, TF32 and the device it ran on."""
    return {"eval_batch_size": cfg.eval_batch_size or batch, "eval_tokens": cfg.eval_tokens, "bf16": cfg.bf16,
            "fp16": cfg.fp16, "tf32": cfg.tf32, "device_type": device.type, "device": gpu_name(device),
            "attn_implementation": cfg.attn_implementation}


def write_record(record: dict, path) -> Path:
    """The run record as strict JSON (non-finite numbers as null), written whole or not at all."""
    from fasttrain.files import finite_or_none

    atomic_write_text(path, json.dumps(finite_or_none(record), indent=1, default=str, allow_nan=False) + "\n")
    return Path(path)
