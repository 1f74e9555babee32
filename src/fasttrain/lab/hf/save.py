"""Save and load a transformers model the lab trained: ``save_pretrained``'s folder plus ``fasttrain.json``."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from fasttrain.errors import FasttrainError
from fasttrain.files import swap_folder
from fasttrain.lab.config import missing_extra
from fasttrain.lab.hf.config import _transformers
from fasttrain.lab.hf.peft import base_model_of, prompt_tokens_of

HF_CHECKPOINT_FORMAT = "fasttrain-lab-hf-1"
FASTTRAIN_JSON = "fasttrain.json"           # beside the HF files of a saved checkpoint: the lab's record
PROMPT_FOLDER = "prompt_tuning"             # a saved soft prompt (peft adapter) inside a checkpoint


# --- saving ----------------------------------------------------------------------------------------

def save_hf(module, folder, *, tokenizer=None, lab: dict | None = None, extra: dict | None = None) -> Path:
    """A folder ``AutoModelForCausalLM.from_pretrained`` loads: ``save_pretrained`` of the model
    (LoRA merged into its base weights first: W += (alpha / r) B A), the tokenizer if given, and
    ``fasttrain.json`` (the lab configuration, the final validation loss, what ``lab eval`` and
    ``lab sample`` need). A soft prompt cannot be folded into the weights: it is written as a peft
    adapter in ``prompt_tuning/`` beside the base model. Written to a temporary folder and renamed
    into place: the folder is whole or absent."""
    final = Path(folder)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=final.name + ".", suffix=".tmp", dir=final.parent))
    try:
        model = module._orig_mod if hasattr(module, "_orig_mod") else module
        prompt = prompt_tokens_of(model)
        if prompt:
            model.save_pretrained(str(tmp / PROMPT_FOLDER))
            base = model.get_base_model()
        elif hasattr(model, "merge_and_unload"):
            base = model.merge_and_unload()
        else:
            base = model
        base.save_pretrained(str(tmp))
        if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
            tokenizer.save_pretrained(str(tmp))
        elif tokenizer is not None:             # the lab's tokenizer object (lab/tokenizer.py): its files, if any
            from fasttrain.lab.tokenizer import save_tokenizer

            save_tokenizer(tokenizer, tmp)
        meta = {"format": HF_CHECKPOINT_FORMAT, "model_type": base.config.model_type,
                "prompt_tuning_tokens": prompt, "lab": lab or {}, **(extra or {})}
        (tmp / FASTTRAIN_JSON).write_text(json.dumps(meta, indent=1, default=str))
        swap_folder(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def fresh_copy(module):
    """A new model of ``module``'s config on the CPU (FSDP's gathered weights are loaded into it)."""
    import torch

    tf = _transformers()
    base = base_model_of(module)
    return tf.AutoModelForCausalLM.from_config(base.config, dtype=torch.float32)


def is_hf_checkpoint(path) -> bool:
    """Whether ``path`` is a folder the lab saved from a transformers model: it holds ``fasttrain.json``
    (whether that file is sound is :func:`read_hf_checkpoint`'s to say, in one line)."""
    return (Path(path).expanduser() / FASTTRAIN_JSON).is_file()


def read_hf_checkpoint(path) -> dict:
    """The lab's record of a saved transformers model (``fasttrain.json``), checked, after the folder's
    ``config.json`` and weights (:func:`~fasttrain.lab.hf.config.check_hf_folder`): one line naming the
    file and the field for anything damaged."""
    from fasttrain.lab.hf.config import check_hf_folder

    p = Path(path).expanduser()
    if not is_hf_checkpoint(p):
        raise FasttrainError(f"{p} is not a lab HF checkpoint (needs {FASTTRAIN_JSON}); write one with "
                             f"fasttrain lab --model hf:... --save {p}")
    record = p / FASTTRAIN_JSON
    try:
        meta = json.loads(record.read_text())
    except (UnicodeDecodeError, ValueError) as exc:
        raise FasttrainError(f"{record}: not readable JSON ({type(exc).__name__}); save the model again with "
                             f"fasttrain lab --model hf:... --save {p}") from None
    if not isinstance(meta, dict):
        raise FasttrainError(f"{record}: must be a JSON object (the lab's record of the model), got a JSON "
                             f"{type(meta).__name__}; save the model again with fasttrain lab --save")
    if meta.get("format") != HF_CHECKPOINT_FORMAT:
        raise FasttrainError(f"{record}: format {json.dumps(meta.get('format'))} is not {HF_CHECKPOINT_FORMAT}; "
                             f"not a folder the lab saved")
    for name in ("lab", "eval", "data"):
        if meta.get(name) is not None and not isinstance(meta[name], dict):
            raise FasttrainError(f"{record}: \"{name}\" must be an object, got {json.dumps(meta[name])[:40]}")
    if meta.get("chars") is not None and not isinstance(meta["chars"], str):
        raise FasttrainError(f"{record}: \"chars\" must be the vocabulary as one string, got "
                             f"{json.dumps(meta['chars'])[:40]}")
    check_hf_folder(f"hf:{p}")
    return meta


def load_hf_checkpoint(path, device="cpu", *, attn_implementation: str = "sdpa"):
    """The saved model (its soft prompt re-attached when it has one), in eval mode."""
    import torch

    tf = _transformers()
    p = Path(path)
    meta = read_hf_checkpoint(p)
    model = tf.AutoModelForCausalLM.from_pretrained(str(p), dtype=torch.float32,
                                                    attn_implementation=attn_implementation)
    if meta.get("prompt_tuning_tokens"):
        try:
            from peft import PeftModel
        except ImportError as exc:
            raise missing_extra("peft (a prompt-tuned checkpoint)", exc) from None
        model = PeftModel.from_pretrained(model, str(p / PROMPT_FOLDER))
    return model.to(device).eval(), meta


def load_tokenizer(path):
    """The tokenizer saved in a checkpoint folder, or None when it holds none."""
    p = Path(path)
    if not any((p / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    tf = _transformers()
    try:
        return tf.AutoTokenizer.from_pretrained(str(p))
    except (OSError, ValueError) as exc:
        raise FasttrainError(f"{p}: its tokenizer cannot be loaded ({str(exc).splitlines()[0][:160]})") from None
