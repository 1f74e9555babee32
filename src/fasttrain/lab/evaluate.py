"""``fasttrain lab eval``: the validation loss of a checkpoint written with ``--save``, from it alone."""

from __future__ import annotations

import os
from pathlib import Path

from fasttrain.errors import FasttrainError
from fasttrain.lab.build import build_model, config_from_model, resolve_device
from fasttrain.lab.checkpoint import check_recorded_eval, load_weights, read_checkpoint
from fasttrain.lab.config import LabConfig, validate
from fasttrain.lab.measure import gpu_name, tf32_matmuls
from fasttrain.lab.trainer import Trainer


def evaluate_checkpoint(path, data_dir=None, *, eval_tokens: int | None = None, device: str = "auto",
                        batch: int | None = None, bf16: bool | None = None, tf32: bool | None = None,
                        corpus=None) -> dict:
    """The validation loss of a checkpoint written with ``--save``, from it alone.

    Every setting left ``None`` comes from the checkpoint's record of its own evaluation
    (:func:`eval_settings`): the validation batch, the token budget (default the whole split),
    autocast and TF32. With those the same sums are formed in the same order and dtype, so on the
    same kind of device the recorded loss comes back exactly."""
    from fasttrain.lab import hf

    from fasttrain.lab.preflight import check_device

    if eval_tokens is not None and (isinstance(eval_tokens, bool) or not isinstance(eval_tokens, int)
                                    or eval_tokens < 1):
        raise FasttrainError(f"--eval-tokens must be a positive integer, got {eval_tokens!r}")
    check_device(device)
    if hf.is_hf_checkpoint(path):
        return _evaluate_hf_checkpoint(path, data_dir, eval_tokens=eval_tokens, device=device, batch=batch, bf16=bf16,
                                       tf32=tf32, corpus=corpus)
    meta = read_checkpoint(path)
    recorded = meta.get("eval") or {}
    check_recorded_eval(recorded, Path(os.fspath(path)).expanduser() / "config.json")
    batch, eval_tokens, bf16, fp16, tf32 = recorded_settings(meta, batch=batch, eval_tokens=eval_tokens, bf16=bf16,
                                                             tf32=tf32)
    corpus = corpus or corpus_of(meta, data_dir, path)
    model = meta["model"]
    cfg = LabConfig(name="eval", device=device, bf16=bf16, fp16=fp16, tf32=tf32, init_from=str(path),
                    eval_tokens=eval_tokens, eval_batch_size=batch, per_device_train_batch_size=batch, max_steps=1,
                    prompt_tuning_tokens=model.get("prompt_tokens", 0), attn_implementation=model.get("attention", "eager"),
                    dropout=0.0)
    from fasttrain.lab.model import GPTConfig

    cfg = validate(config_from_model(cfg, GPTConfig.from_dict(model)))
    dev = resolve_device(cfg)
    with tf32_matmuls(tf32):
        trainer = Trainer(cfg, build_model(cfg, corpus.vocab_size, dev, checkpoint=meta), corpus, dev)
        if cfg.prompt_tuning_tokens:
            load_weights(trainer.model, path)           # the trained prompt, not a fresh one
        loss, n, ms = trainer.timed_evaluation()
    return _result(path, meta, dev, loss, n, ms, eval_batch_size=batch, eval_tokens=eval_tokens, bf16=bf16, fp16=fp16,
                   tf32=tf32)


def _evaluate_hf_checkpoint(path, data_dir=None, *, eval_tokens=None, device="auto", batch=None, bf16=None, tf32=None,
                            corpus=None) -> dict:
    """:func:`evaluate_checkpoint` for a folder saved from ``--model hf:...`` (``fasttrain.json``
    beside the ``transformers`` files): the model loaded with ``from_pretrained`` (its soft prompt
    re-attached), scored by the trainer's evaluation with the recorded settings."""
    from fasttrain.errors import FasttrainError
    from fasttrain.lab import hf

    meta = hf.read_hf_checkpoint(path)
    recorded = meta.get("eval") or {}
    batch, eval_tokens, bf16, fp16, tf32 = recorded_settings(meta, batch=batch, eval_tokens=eval_tokens, bf16=bf16,
                                                             tf32=tf32)
    corpus = corpus or corpus_of(meta, data_dir, path)
    if meta.get("chars") not in (None, getattr(corpus, "chars", None)):
        raise FasttrainError(f"{path} was trained on another vocabulary than this corpus")
    lab = meta.get("lab") or {}
    attention = recorded.get("attn_implementation") or lab.get("attn_implementation") or "sdpa"
    cfg = validate(LabConfig(name="eval", model=f"hf:{path}", device=device, bf16=bf16, fp16=fp16, tf32=tf32,
                             eval_tokens=eval_tokens, eval_batch_size=batch, per_device_train_batch_size=batch,
                             max_steps=1, context=lab.get("context", 256), attn_implementation=attention,
                             dropout=0.0))
    dev = resolve_device(cfg)
    with tf32_matmuls(tf32):
        model = build_model(cfg, corpus.vocab_size, dev)
        if meta.get("prompt_tuning_tokens"):
            # the soft prompt is a peft adapter beside the base weights: the model with it attached
            model.module, _ = hf.load_hf_checkpoint(path, dev, attn_implementation=attention)
        trainer = Trainer(cfg, model, corpus, dev)
        loss, n, ms = trainer.timed_evaluation()
    return _result(path, meta, dev, loss, n, ms, eval_batch_size=batch, eval_tokens=eval_tokens, bf16=bf16, fp16=fp16,
                   tf32=tf32)


def _result(path, meta: dict, dev, loss: float, n: int, ms: float, **settings) -> dict:
    """What ``lab eval`` reports: the loss beside the one recorded at save, and the settings used."""
    return {"checkpoint": str(path), "val_loss": loss, "tokens": n, "ms": ms,
            "recorded_val_loss": meta.get("val_loss"), "device": gpu_name(dev),
            "recorded_device": (meta.get("eval") or {}).get("device"), "settings": settings}


def recorded_settings(meta: dict, *, batch, eval_tokens, bf16, tf32) -> tuple:
    """``(batch, eval_tokens, bf16, fp16, tf32)``: each setting given, else as the checkpoint recorded
    its own evaluation (the same sums in the same order and dtype: the recorded loss comes back)."""
    recorded = meta.get("eval") or {}
    batch = batch or recorded.get("eval_batch_size") or meta.get("eval_batch_size") or 64
    eval_tokens = eval_tokens if eval_tokens is not None else recorded.get("eval_tokens")
    bf16 = recorded.get("bf16", False) if bf16 is None else bf16
    fp16 = recorded.get("fp16", False) and not bf16
    tf32 = recorded.get("tf32", False) if tf32 is None else tf32
    return batch, eval_tokens, bf16, fp16, tf32


def corpus_of(meta: dict, data_dir, path):
    """The corpus a checkpoint was trained on, from its record (``data``: the files with their SHA-256,
    the split, the tokenizer); a checkpoint from before that record: Tiny Shakespeare, as then."""
    from fasttrain.lab.data import corpus_from_description, load_corpus

    desc = meta.get("data")
    settings = (desc or {}).get("settings") or {} if isinstance(desc, dict) else {}
    files = settings.get("train_file") or settings.get("train_bin")
    if isinstance(desc, dict) and (files or desc.get("source") not in ("text", "bin")):
        return corpus_from_description(desc, data_dir, tokenizer_folder=path)
    # no record, or a text given in memory (fasttrain.lab.run(data=...)): Tiny Shakespeare, as before
    # (from Python, pass the corpus itself: evaluate_checkpoint(path, corpus=...))
    return load_corpus(data_dir)


__all__ = ["evaluate_checkpoint", "corpus_of"]
