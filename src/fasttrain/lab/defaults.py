"""A transformers model's own defaults (``--model hf:...``): nothing of the lab GPT's presets applies.

The context is the model's positions (``max_position_embeddings`` or its family's name for it); the
run lowers it to what the corpus allows once the corpus is read (:func:`fit_context`). The schedule
depends on what the run is:

- a fine-tune (the folder holds weights, or a hub name): the weights already encode what the model
  knows, and steps of a pre-training size would overwrite it within a few hundred steps; so a peak
  learning rate of 2e-5 (an order below pre-training rates), decaying to a tenth of it, AdamW's beta2
  0.999 and no weight decay (the Trainer's defaults: nothing pulls the known weights towards 0),
  1,000 steps, a warm-up of 3% of the steps;
- a pre-training run (a config only, the weights drawn afresh): the largest stable step shrinks as
  the model widens, so the peak learning rate falls with the parameter count P,
  ``lr = 6e-4 * sqrt(1.25e8 / P)``, held within [1.5e-4, 1e-3] (6e-4 at 125M parameters, 3e-4 at
  500M, the floor from 2B on, the ceiling for models under 45M), decaying to a tenth of it; beta2
  0.95 (the second moment follows the loss's fast early changes), weight decay 0.1, 5,000 steps and
  a warm-up of 2% of the steps.

Both take 8 sequences per device, the Trainer's default. A warm-up is at least one step and is
computed from the run's own ``--max-steps`` when it is given; a run whose steps end inside its
warm-up says so (:func:`warmup_note`).
"""

from __future__ import annotations

import math
from pathlib import Path

from fasttrain.errors import FasttrainError
from fasttrain.lab.config import DERIVED, HF_PREFIX, is_hf

FINE_TUNE = dict(learning_rate=2e-5, min_lr=2e-6, adam_beta2=0.999, weight_decay=0.0, max_steps=1000)
FINE_TUNE_WARMUP = 0.03
PRETRAIN = dict(adam_beta2=0.95, weight_decay=0.1, max_steps=5000)
PRETRAIN_WARMUP = 0.02
MICRO_BATCH = 8


def pretrain_lr(params: int) -> float:
    """The peak learning rate of a pre-training run of ``params`` parameters (see the module docstring)."""
    return min(1e-3, max(1.5e-4, 6e-4 * math.sqrt(1.25e8 / max(1, params))))


def approx_params(config) -> int:
    """About how many parameters a transformers config describes: per layer 4 h^2 (attention) plus
    2 h f (an MLP) or 3 h f (a gated one: SiLU's gate, up and down), plus the embedding v h (twice when
    the output layer is not tied to it)."""
    h = _first(config, "hidden_size", "n_embd", "d_model") or 0
    from fasttrain.lab.hf.config import layer_count

    layers = layer_count(config) or 0
    ffn = _first(config, "intermediate_size", "n_inner", "ffn_dim") or 4 * h
    vocab = _first(config, "vocab_size") or 0
    gated = str(getattr(config, "hidden_act", "") or getattr(config, "activation_function", "")) in ("silu", "swiglu")
    tied = bool(getattr(config, "tie_word_embeddings", True))
    return layers * (4 * h * h + (3 if gated else 2) * h * ffn) + vocab * h * (1 if tied else 2)


def _first(config, *names):
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def model_name(spec: str) -> str:
    """The run's name for ``hf:PATH_OR_NAME``: the folder's name (or the hub name's last part)."""
    source = spec[len(HF_PREFIX):] if is_hf(spec) else spec
    return Path(source.rstrip("/")).name or source


def hf_defaults(spec: str, given: dict) -> dict:
    """``{field: (value, why)}``: the defaults of the transformers model ``spec`` (``hf:...``) given the
    settings ``given`` by the file and the flags (a warm-up follows the run's own ``max_steps``)."""
    from fasttrain.lab.hf.config import has_weights, load_hf_config, max_positions

    if not is_hf(spec):
        raise FasttrainError(f"unknown --model {spec!r}; use gpt (the lab's own) or hf:PATH_OR_NAME")
    config, folder = load_hf_config(spec)
    out = {"name": (model_name(spec), "the model's folder")}
    positions = max_positions(config)
    if positions:
        out["context"] = (positions, "the model's positions; lowered to what the corpus allows")
    out["per_device_train_batch_size"] = (MICRO_BATCH, "the Trainer's default")
    params = approx_params(config)
    if has_weights(folder):
        kind = f"a fine-tune of about {_count(params)} parameters"
        schedule, share = dict(FINE_TUNE), FINE_TUNE_WARMUP
    else:
        kind = f"pre-training about {_count(params)} parameters from the config"
        lr = pretrain_lr(params)
        schedule, share = dict(PRETRAIN, learning_rate=float(f"{lr:.3g}"), min_lr=float(f"{lr / 10:.3g}")), \
            PRETRAIN_WARMUP
    for key, value in schedule.items():
        out[key] = (value, kind)
    steps = given.get("max_steps", schedule["max_steps"])
    out["warmup_steps"] = (max(1, round(share * steps)), f"{share:.0%} of {steps:,} steps, {kind}")
    return out


def _count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(n)


def warmup_note(cfg) -> str | None:
    """One line when every step of the run is a learning-rate warm-up step (it ends before the peak)."""
    if cfg.warmup_steps and cfg.max_steps <= cfg.warmup_steps:
        return (f"note: all {cfg.max_steps} steps sit inside the learning-rate warm-up ({cfg.warmup_steps} steps): "
                f"the rate never reaches --learning-rate {cfg.learning_rate:g}; lower --warmup-steps or raise "
                f"--max-steps")
    return None


def fit_context(cfg, train_tokens: int, log=None):
    """``cfg`` with its context lowered to what a training split of ``train_tokens`` tokens allows (a
    window of context + 1 tokens needs a start to draw: context <= tokens - 2), saying so."""
    most = train_tokens - 2
    if cfg.context <= most or most < 1:
        return cfg
    if log:
        log(f"context {cfg.context} (the model's positions) lowered to {most}: the training split holds "
            f"{train_tokens:,} tokens")
    return cfg.with_(context=most)


__all__ = ["hf_defaults", "warmup_note", "fit_context", "pretrain_lr", "approx_params", "model_name"]
