"""The lab's optimizers, their learning-rate schedule and the bytes of their state.

``build_optimizer`` maps ``--optim`` onto torch, torchao or bitsandbytes (weight decay on matrices
only); ``build_muon`` pairs Muon on the blocks' matrices with AdamW on the rest
(:class:`OptimizerGroup` steps them as one). ``tensor_bytes`` and ``optimizer_state_bytes``
measure memory on the tensors themselves, quantized and sharded ones included. ``lr_at``:
linear warm-up, then cosine decay.
"""

from __future__ import annotations

import math
import re

from fasttrain.errors import FasttrainError
from fasttrain.lab.config import LabConfig, missing_extra

# bytes of optimizer state per trainable parameter as the estimator takes it (k in its formulas)
OPT_BYTES = {"adamw_torch": 8, "adamw_torch_fused": 8, "adamw_8bit": 2, "adafactor": 0, "sgd": 0, "muon": 4}


def lr_at(cfg: LabConfig, step: int) -> float:
    """Linear warm-up to ``learning_rate``, then cosine decay to ``min_lr`` at ``max_steps``."""
    if step < cfg.warmup_steps:
        return cfg.learning_rate * (step + 1) / (cfg.warmup_steps + 1)
    span = max(1, cfg.max_steps - cfg.warmup_steps)
    ratio = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (cfg.learning_rate - cfg.min_lr)


def build_optimizer(cfg: LabConfig, model, lr: float | None = None, world=None):
    """``cfg.optim`` over the trainable parameters; weight decay on matrices (dim >= 2) only."""
    import torch

    lr = cfg.learning_rate if lr is None else lr
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    rest = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": rest, "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    if cfg.weight_decay == 0.0:
        # no decay anywhere: one group (a for-each optimizer then steps every tensor in one call, as
        # the memory estimator's validation measured it)
        groups = [{"params": params, "weight_decay": 0.0}]
    if world is not None and world.strategy == "tp":
        from fasttrain.lab.distributed import split_param_groups

        groups = split_param_groups(groups)
    betas = (cfg.adam_beta1, cfg.adam_beta2)
    if cfg.optim == "adamw_torch":
        return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=cfg.adam_epsilon)
    if cfg.optim == "adamw_torch_fused":
        return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=cfg.adam_epsilon, fused=True)
    if cfg.optim == "adafactor":
        # torch's Adafactor: factored second moment (a row and a column vector per matrix), no
        # first moment; lr caps the relative step size
        return torch.optim.Adafactor(groups, lr=lr)
    if cfg.optim == "sgd":
        return torch.optim.SGD(groups, lr=lr)        # no momentum (as TrainingArguments' "sgd"): no state
    if cfg.optim == "muon":
        return build_muon(cfg, model, lr)
    # adamw_8bit: block-wise quantized moments (2 x 1 byte + one fp32 scale per block of 256)
    try:
        from torchao.optim import AdamW8bit
    except ImportError as exc:
        try:
            import bitsandbytes as bnb
        except ImportError:
            raise missing_extra("torchao (or bitsandbytes) for --optim adamw_8bit", exc) from None
        return bnb.optim.AdamW8bit(groups, lr=lr, betas=betas, eps=cfg.adam_epsilon)
    return AdamW8bit(groups, lr=lr, betas=betas, eps=cfg.adam_epsilon)


class OptimizerGroup:
    """Several optimizers stepped as one: ``param_groups`` and ``state`` are their union, so the
    learning-rate schedule and the state count see a single optimizer."""

    def __init__(self, *optimizers):
        self.optimizers = optimizers

    @property
    def param_groups(self) -> list:
        return [g for opt in self.optimizers for g in opt.param_groups]

    @property
    def state(self) -> dict:
        merged = {}
        for opt in self.optimizers:
            merged.update(opt.state)
        return merged

    def step(self) -> None:
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {"optimizers": [opt.state_dict() for opt in self.optimizers]}

    def load_state_dict(self, state: dict) -> None:
        for opt, s in zip(self.optimizers, state["optimizers"]):
            opt.load_state_dict(s)


def build_muon(cfg: LabConfig, model, lr: float):
    """Muon for the blocks' 2-D weight matrices, AdamW for the rest (embeddings, norms, biases).

    Muon: momentum M <- mu M + G, update O = NewtonSchulz5(G + mu M) (Nesterov), the nearest
    semi-orthogonal matrix to it; ``match_rms_adamw`` scales O by 0.2 sqrt(max(rows, cols)) so
    its RMS matches AdamW's and one learning rate (and schedule) serves both optimizers."""
    import torch

    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    # the repeated blocks: the lab GPT's "blocks.N.", a transformers model's "layers.N." (Llama-likes) or "h.N." (GPT-2)
    hidden = [p for n, p in named if p.dim() == 2 and re.search(r"\.(blocks|layers|h)\.\d+\.", f".{n}")]
    hidden_ids = {id(p) for p in hidden}
    rest = [p for _, p in named if id(p) not in hidden_ids]
    if not hidden:
        raise FasttrainError("--optim muon found no trainable 2-D matrices in the transformer blocks")
    muon = torch.optim.Muon(hidden, lr=lr, weight_decay=cfg.weight_decay, momentum=0.95,
                            adjust_lr_fn="match_rms_adamw")
    decay = [p for p in rest if p.dim() >= 2]
    other = [p for p in rest if p.dim() < 2]
    groups = [g for g in ({"params": decay, "weight_decay": cfg.weight_decay}, {"params": other, "weight_decay": 0.0})
              if g["params"]]
    if not groups:
        return OptimizerGroup(muon)
    fused = all(p.device.type == "cuda" for p in rest)
    adamw = torch.optim.AdamW(groups, lr=lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_epsilon,
                              fused=fused or None)
    return OptimizerGroup(muon, adamw)


def _leaves(t):
    """The plain tensors holding ``t``'s data (tensor subclasses such as torchao's quantized
    optimizer state through their inner tensors; a DTensor -- FSDP, tensor parallelism --
    through this rank's shard)."""
    if hasattr(t, "to_local") and hasattr(t, "placements"):
        yield from _leaves(t.to_local())
        return
    if hasattr(t, "__tensor_flatten__") and type(t).__name__ != "Parameter":
        names, _ = t.__tensor_flatten__()
        for n in names:
            yield from _leaves(getattr(t, n))
    else:
        yield t


def tensor_bytes(t) -> int:
    """Bytes a tensor holds."""
    return sum(leaf.numel() * leaf.element_size() for leaf in _leaves(t))


def optimizer_state_bytes(opt, include_scalars: bool = True) -> int:
    """Bytes of every tensor in ``opt.state``, storage shared between entries counted once
    (torchao's 8-bit states share one 256-entry code table)."""
    import torch

    seen, total = set(), 0
    for state in opt.state.values():
        for v in state.values():
            if not isinstance(v, torch.Tensor) or (not include_scalars and v.dim() == 0):
                continue
            for leaf in _leaves(v):
                key = (leaf.untyped_storage().data_ptr(), leaf.device) if leaf.numel() else None
                if key is not None and key in seen:
                    continue
                seen.add(key)
                total += leaf.numel() * leaf.element_size()
    return total
