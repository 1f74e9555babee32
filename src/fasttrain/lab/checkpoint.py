"""Lab checkpoints: a folder with ``model.safetensors`` and ``config.json``, written atomically;
loading their weights, the validation loss of a checkpoint from it alone, and run records (JSON,
written atomically too)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from fasttrain.errors import FasttrainError
from fasttrain.files import atomic_write_text
from fasttrain.lab.config import LabConfig, missing_extra, validate
from fasttrain.lab.measure import gpu_name, sync, tf32_matmuls


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


def evaluate_checkpoint(path, data_dir=None, *, eval_tokens: int | None = None, device: str = "auto",
                        batch: int | None = None, bf16: bool | None = None, tf32: bool | None = None,
                        corpus=None) -> dict:
    """The validation loss of a checkpoint written with ``--save``, from it alone.

    Every setting left ``None`` comes from the checkpoint's record of its own evaluation
    (:func:`eval_settings`): the validation batch, the token budget (default the whole split),
    autocast and TF32. With those the same sums are formed in the same order and dtype, so on the
    same kind of device the recorded loss comes back exactly."""
    from fasttrain.lab import hf
    from fasttrain.lab.data import load_corpus
    from fasttrain.lab.train import Trainer, config_from_model, resolve_device

    if hf.is_hf_checkpoint(path):
        return _evaluate_hf_checkpoint(path, data_dir, eval_tokens=eval_tokens, device=device, batch=batch, bf16=bf16,
                                       tf32=tf32, corpus=corpus)
    meta = read_checkpoint(path)
    recorded = meta.get("eval") or {}
    batch = batch or recorded.get("eval_batch_size") or meta.get("eval_batch_size") or 64
    eval_tokens = eval_tokens if eval_tokens is not None else recorded.get("eval_tokens")
    bf16 = recorded.get("bf16", False) if bf16 is None else bf16
    fp16 = recorded.get("fp16", False) and not bf16
    tf32 = recorded.get("tf32", False) if tf32 is None else tf32
    corpus = corpus or load_corpus(data_dir)
    model = meta["model"]
    cfg = LabConfig(name="eval", device=device, bf16=bf16, fp16=fp16, tf32=tf32, init_from=str(path),
                    eval_tokens=eval_tokens, eval_batch_size=batch, per_device_train_batch_size=batch, max_steps=1,
                    prompt_tuning_tokens=model.get("prompt_tokens", 0), attn_implementation=model["attention"],
                    dropout=0.0)
    from fasttrain.lab.model import GPTConfig

    cfg = validate(config_from_model(cfg, GPTConfig.from_dict(model)))
    dev = resolve_device(cfg)
    with tf32_matmuls(tf32):
        trainer = Trainer(cfg, corpus, dev)
        if cfg.prompt_tuning_tokens:
            load_weights(trainer.model, path)           # the trained prompt, not a fresh one
        t = time.perf_counter()
        loss, n = trainer.evaluate()
        sync(dev)
        ms = 1e3 * (time.perf_counter() - t)
    return {"checkpoint": str(path), "val_loss": loss, "tokens": n, "ms": ms,
            "recorded_val_loss": meta.get("val_loss"), "device": gpu_name(dev),
            "recorded_device": recorded.get("device"),
            "settings": {"eval_batch_size": batch, "eval_tokens": eval_tokens, "bf16": bf16, "fp16": fp16,
                         "tf32": tf32}}


def _evaluate_hf_checkpoint(path, data_dir=None, *, eval_tokens=None, device="auto", batch=None, bf16=None, tf32=None,
                            corpus=None) -> dict:
    """:func:`evaluate_checkpoint` for a folder saved from ``--model hf:...`` (``fasttrain.json``
    beside the ``transformers`` files): the model loaded with ``from_pretrained`` (its soft prompt
    re-attached), scored by the same evaluation as in training."""
    from fasttrain.lab import hf
    from fasttrain.lab.data import load_corpus
    from fasttrain.lab.train import Trainer, resolve_device

    meta = hf.read_hf_checkpoint(path)
    recorded = meta.get("eval") or {}
    batch = batch or recorded.get("eval_batch_size") or meta.get("eval_batch_size") or 64
    eval_tokens = eval_tokens if eval_tokens is not None else recorded.get("eval_tokens")
    bf16 = recorded.get("bf16", False) if bf16 is None else bf16
    fp16 = recorded.get("fp16", False) and not bf16
    tf32 = recorded.get("tf32", False) if tf32 is None else tf32
    corpus = corpus or load_corpus(data_dir)
    if meta.get("chars") not in (None, corpus.chars):
        raise FasttrainError(f"{path} was trained on another vocabulary than this corpus")
    lab = meta.get("lab") or {}
    attention = recorded.get("attn_implementation") or lab.get("attn_implementation") or "sdpa"
    cfg = validate(LabConfig(name="eval", model=f"hf:{path}", device=device, bf16=bf16, fp16=fp16, tf32=tf32,
                             eval_tokens=eval_tokens, eval_batch_size=batch, per_device_train_batch_size=batch,
                             max_steps=1, context=lab.get("context", 256), attn_implementation=attention,
                             dropout=0.0))
    dev = resolve_device(cfg)
    with tf32_matmuls(tf32):
        trainer = Trainer(cfg, corpus, dev)
        if meta.get("prompt_tuning_tokens"):
            # the soft prompt is a peft adapter beside the base weights: the model with it attached
            model, _ = hf.load_hf_checkpoint(path, dev, attn_implementation=attention)
            trainer.lab_model.module = trainer.model.inner = model
        t = time.perf_counter()
        loss, n = trainer.evaluate()
        sync(dev)
        ms = 1e3 * (time.perf_counter() - t)
    return {"checkpoint": str(path), "val_loss": loss, "tokens": n, "ms": ms,
            "recorded_val_loss": meta.get("val_loss"), "device": gpu_name(dev),
            "recorded_device": recorded.get("device"),
            "settings": {"eval_batch_size": batch, "eval_tokens": eval_tokens, "bf16": bf16, "fp16": fp16,
                         "tf32": tf32}}


def write_record(record: dict, path) -> Path:
    """The run record as strict JSON (non-finite numbers as null), written whole or not at all."""
    from fasttrain.training import finite_or_none

    atomic_write_text(path, json.dumps(finite_or_none(record), indent=1, default=str, allow_nan=False) + "\n")
    return Path(path)
