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
from fasttrain.files import atomic_write_text, swap_folder
from fasttrain.lab.config import LabConfig, missing_extra
from fasttrain.lab.measure import gpu_name
from fasttrain.lab.outputs import CHECKPOINT_FORMAT, check_save_folder, remove_stale_temporaries


def save_checkpoint(model, path, *, chars: str, lab: dict, extra: dict | None = None, tokenizer=None) -> Path:
    """A folder with ``model.safetensors`` (weights) and ``config.json`` (the model's config, the
    vocabulary, the lab configuration), written to a temporary folder and renamed into place.

    An existing checkpoint of ours at ``path`` is replaced whole: it is renamed aside, the new one
    renamed in, then the old one removed, so a crash leaves either the old or the new one (at
    worst the old one under a ``.old`` name beside it). A folder holding anything else is refused
    (:func:`fasttrain.lab.outputs.check_save_folder`), here too and not only before training.
    ``tokenizer``: the corpus' tokenizer, whose files (a BPE's ``tokenizer.json``) are saved with it."""
    try:
        from safetensors.torch import save_model
    except ImportError as exc:
        raise missing_extra("safetensors (--save)", exc) from None
    final = check_save_folder(path, "--save")
    remove_stale_temporaries(final.parent, final.name + ".")     # a save killed mid-write left these
    tmp = Path(tempfile.mkdtemp(prefix=final.name + ".", suffix=".tmp", dir=final.parent))
    try:
        save_model(model, str(tmp / "model.safetensors"))
        meta = {"format": CHECKPOINT_FORMAT, "model": model.config.to_dict(), "chars": chars,
                "lab": lab, **(extra or {})}
        (tmp / "config.json").write_text(json.dumps(meta, indent=1))
        if tokenizer is not None:
            # a BPE tokenizer's files beside the weights: lab sample and lab eval encode with it
            from fasttrain.lab.tokenizer import save_tokenizer

            save_tokenizer(tokenizer, tmp)
        swap_folder(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


# a checkpoint's config.json "model": field -> (type, rule) as the model needs it; the messages
# name config.json and the field, never a training flag (``lab eval`` has none of them)
_POSITIVE = ("layers", "heads", "hidden", "ffn", "vocab", "seq")
_CHOICES = {"norm": ("rms", "layer"), "pos": ("rope", "learned"), "ffn_act": ("swiglu", "gelu", "relu"),
            "attention": ("eager", "sdpa"), "recompute": ("none", "selective", "full")}
_FLAGS = ("tied", "bias", "liger")


def check_model_config(model, where) -> None:
    """Refuse a checkpoint's ``model`` entry that cannot build the model, naming the field."""
    from dataclasses import fields as dc_fields

    from fasttrain.lab.model import GPTConfig

    if not isinstance(model, dict):
        raise FasttrainError(f"{where}: \"model\" must be an object of the model's shape, got "
                             f"{type(model).__name__ if model is not None else 'null'}; write the checkpoint again "
                             f"with: fasttrain lab --save DIR")
    known = {f.name for f in dc_fields(GPTConfig)}
    unknown = sorted(set(model) - known)
    if unknown:
        raise FasttrainError(f"{where}: unknown field model.{unknown[0]} (a checkpoint of another version?)")
    missing = [name for name in _POSITIVE if name not in model]
    if missing:
        raise FasttrainError(f"{where}: model.{missing[0]} is missing (needs {', '.join(_POSITIVE)})")

    def is_int(v):
        return isinstance(v, int) and not isinstance(v, bool)

    for name in _POSITIVE:
        if not is_int(model[name]) or model[name] < 1:
            raise FasttrainError(f"{where}: model.{name} must be a positive integer, got {json.dumps(model[name])}")
    for name in ("prompt_tokens",):
        if name in model and (not is_int(model[name]) or model[name] < 0):
            raise FasttrainError(f"{where}: model.{name} must be an integer >= 0, got {json.dumps(model[name])}")
    if model.get("kv_heads") is not None and (not is_int(model["kv_heads"]) or model["kv_heads"] < 1):
        raise FasttrainError(f"{where}: model.kv_heads must be a positive integer or null, got "
                             f"{json.dumps(model['kv_heads'])}")
    for name, choices in _CHOICES.items():
        if name in model and model[name] not in choices:
            raise FasttrainError(f"{where}: model.{name} must be one of {', '.join(choices)}, got "
                                 f"{json.dumps(model[name])}")
    for name in _FLAGS:
        if name in model and not isinstance(model[name], bool):
            raise FasttrainError(f"{where}: model.{name} must be true or false, got {json.dumps(model[name])}")
    dropout = model.get("dropout", 0.0)
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        raise FasttrainError(f"{where}: model.dropout must be a number in [0, 1), got {json.dumps(dropout)}")
    heads, hidden, kv = model["heads"], model["hidden"], model.get("kv_heads") or model["heads"]
    if hidden % heads:
        raise FasttrainError(f"{where}: model.heads ({heads}) must divide model.hidden ({hidden})")
    if heads % kv:
        raise FasttrainError(f"{where}: model.kv_heads ({kv}) must divide model.heads ({heads})")
    if model.get("pos", "rope") == "rope" and (hidden // heads) % 2:
        raise FasttrainError(f"{where}: RoPE needs an even head size; model.hidden / model.heads = {hidden // heads}")


def read_checkpoint(path) -> dict:
    """A checkpoint's config.json, checked field by field (one line naming config.json and the
    field for anything the model cannot be built from)."""
    p = Path(os.fspath(path)).expanduser()
    cfg_file, weights = p / "config.json", p / "model.safetensors"
    if not p.is_dir():
        raise FasttrainError(f"{path} is not a lab checkpoint ({'a file, not a folder' if p.exists() else 'no such folder'}); "
                             "give a folder written with: fasttrain lab --save DIR")
    if not cfg_file.is_file() or not weights.is_file():
        raise FasttrainError(f"{path} is not a lab checkpoint (needs config.json and model.safetensors); "
                             f"write one with: fasttrain lab --save DIR")
    try:
        meta = json.loads(cfg_file.read_text())
    except UnicodeDecodeError:
        raise FasttrainError(f"{cfg_file}: not a text file; not a lab checkpoint config") from None
    except ValueError as exc:
        raise FasttrainError(f"{cfg_file}: unreadable JSON ({exc.msg} at line {exc.lineno}); "
                             f"not a lab checkpoint config") from None
    if not isinstance(meta, dict):
        raise FasttrainError(f"{cfg_file}: must be a JSON object with \"model\" and \"chars\", got a JSON "
                             f"{type(meta).__name__}; not a lab checkpoint config")
    if "model" not in meta:
        raise FasttrainError(f"{cfg_file}: the \"model\" field is missing; not a lab checkpoint config")
    check_model_config(meta["model"], cfg_file)
    chars = meta.get("chars")
    if chars is not None and (not isinstance(chars, str) or len(chars) > meta["model"]["vocab"]):
        raise FasttrainError(f"{cfg_file}: \"chars\" must be the vocabulary as one string of at most model.vocab "
                             f"({meta['model']['vocab']}) characters")
    for name in ("eval", "lab"):
        if meta.get(name) is not None and not isinstance(meta[name], dict):
            raise FasttrainError(f"{cfg_file}: \"{name}\" must be an object, got {json.dumps(meta[name])[:40]}")
    return meta


def _first_sentence(text: str, limit: int = 120) -> str:
    """``text`` shortened at a word boundary (never cut mid-word)."""
    text = " ".join(str(text).split())
    if len(text) <= limit:
        return text
    return text[:limit].rsplit(" ", 1)[0] + " ..."


def load_weights(model, path) -> None:
    """Load a checkpoint's weights into ``model``, first checking every tensor's name and shape
    against the model config.json describes (one line naming the first that differs)."""
    try:
        from safetensors import safe_open
        from safetensors.torch import load_model
    except ImportError as exc:
        raise missing_extra("safetensors (--init-from)", exc) from None
    weights = Path(os.fspath(path)).expanduser() / "model.safetensors"
    try:
        with safe_open(str(weights), framework="pt") as f:
            shapes = {name: list(f.get_slice(name).get_shape()) for name in f.keys()}
    except Exception as exc:            # safetensors raises its own error types for a corrupt header
        raise FasttrainError(f"{weights}: not a readable safetensors file ({_first_sentence(exc)}); write the "
                             f"checkpoint again with: fasttrain lab --save DIR") from None
    expected = {name: list(t.shape) for name, t in model.state_dict().items()}
    for name, shape in expected.items():
        if name == "prompt" and name not in shapes:
            continue                    # a soft prompt is created fresh for prompt tuning
        if name not in shapes:
            raise FasttrainError(f"{weights} has no tensor {name}, which config.json's model needs; config.json "
                                 f"does not match the weights")
        if shapes[name] != shape:
            raise FasttrainError(f"{weights}: tensor {name} has shape {shapes[name]}, config.json's model needs "
                                 f"{shape}; config.json does not match the weights")
    try:
        missing, unexpected = load_model(model, str(weights), strict=False)
    except Exception as exc:
        raise FasttrainError(f"{weights}: cannot load the weights ({type(exc).__name__}: "
                             f"{_first_sentence(exc)})") from None
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


def check_recorded_eval(recorded: dict, where) -> None:
    """The checkpoint's record of its own evaluation, which ``lab eval`` replays by default."""
    for name in ("eval_batch_size", "eval_tokens"):
        value = recorded.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise FasttrainError(f"{where}: eval.{name} must be a positive integer or null, got {json.dumps(value)}")
    for name in ("bf16", "fp16", "tf32"):
        if name in recorded and not isinstance(recorded[name], bool):
            raise FasttrainError(f"{where}: eval.{name} must be true or false, got {json.dumps(recorded[name])}")


def write_record(record: dict, path) -> Path:
    """The run record as strict JSON (non-finite numbers as null), written whole or not at all."""
    from fasttrain.files import finite_or_none

    atomic_write_text(path, json.dumps(finite_or_none(record), indent=1, default=str, allow_nan=False) + "\n")
    return Path(path)
