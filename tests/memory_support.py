"""Test support: what trains in a :class:`Setup`, built for real: the reference model, the
optimizer of ``setup.optim``, and peft's LoRA or a soft prompt on a frozen base.

The memory tests build these on the CPU and compare the bytes of the real parameter, gradient and
optimizer-state tensors with ``precise``'s count. Every import of torch, peft and
torchao happens inside the functions (optional extras).
"""

from __future__ import annotations

from fasttrain.errors import FasttrainError
from fasttrain.memory.config import Setup


def build_model(setup: Setup, device=None):
    """The reference model of ``setup`` (``model(idx, targets) -> loss``): the lab's model, with
    its native soft prompt when ``prompt_tokens`` (P x h vectors prepended after the embedding,
    their outputs cut off before the head). One place to re-point when the model moves."""
    from dataclasses import replace

    from fasttrain.lab import model as lab_model

    config = replace(lab_model.GPTConfig.from_setup(setup), prompt_tokens=setup.prompt_tokens)
    return lab_model.build(config, device)


def _require(module: str, extra: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise FasttrainError(f"{module} is not installed: pip install '{extra}' (or pip install {module})") from exc


def attach(model, setup: Setup):
    """Freeze the base and attach what ``setup`` trains: peft LoRA (``lora_rank``) on the
    ``lora_targets`` linears, or only the model's soft prompt (``prompt_tokens``). Full fine-tuning returns
    ``model`` unchanged. Returns the model to train."""
    if setup.lora_rank:
        peft = _require("peft", "fasttrain[lab]")
        config = peft.LoraConfig(r=setup.lora_rank, lora_alpha=2 * setup.lora_rank,
                                 lora_dropout=float(setup.lora_dropout), target_modules=list(setup.lora_targets))
        return peft.get_peft_model(model, config)
    if setup.prompt_tokens:
        for name, p in model.named_parameters():
            p.requires_grad_(name == "prompt")
    return model


def make_optimizer(params, setup: Setup, lr: float = 1e-4, foreach: bool | None = None):
    """The optimizer of ``setup.optim`` over ``params`` (the trainable tensors).

    adamw: ``torch.optim.AdamW`` (foreach or fused per ``setup.optimizer``); adamw_8bit:
    ``torchao.optim.AdamW8bit``; adafactor: ``torch.optim.Adafactor``; sgd / sgd_momentum:
    ``torch.optim.SGD`` (momentum 0.9)."""
    import torch

    params = list(params)
    kind = setup.optim
    if kind == "adamw":
        kw = {"fused": True} if setup.optimizer == "fused" else {"foreach": True}
        return torch.optim.AdamW(params, lr=lr, **kw)
    if kind == "adafactor":
        return torch.optim.Adafactor(params, lr=lr, foreach=True if foreach is None else foreach)
    if kind == "adamw_8bit":
        optim = _require("torchao.optim", "fasttrain[lab]")
        return optim.AdamW8bit(params, lr=lr)
    if kind in ("sgd", "sgd_momentum"):
        return torch.optim.SGD(params, lr=lr, momentum=0.9 if kind == "sgd_momentum" else 0.0, foreach=True)
    raise FasttrainError(f"unknown optimizer {kind!r}")


def tensor_bytes(model, opt) -> dict:
    """Bytes of the real tensors: parameters (all), gradients (present now), optimizer state
    (tensor subclasses counted through their inner tensors), the 0-dim step counters apart."""
    import torch

    def nbytes(t):
        if type(t) is not torch.Tensor and hasattr(t, "__tensor_flatten__"):
            names, _ = t.__tensor_flatten__()
            return sum(nbytes(getattr(t, n)) for n in names)
        return t.numel() * t.element_size()

    params = list(model.parameters())
    state = steps = 0
    for st in opt.state.values():
        for key, value in st.items():
            if not isinstance(value, torch.Tensor):
                continue
            if key == "step":
                steps += nbytes(value)
            else:
                state += nbytes(value)
    return {"params": sum(nbytes(p) for p in params),
            "trainable": sum(p.numel() for p in params if p.requires_grad),
            "grads": sum(nbytes(p.grad) for p in params if p.grad is not None),
            "optimizer": state, "steps": steps}
