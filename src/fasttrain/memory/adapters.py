"""What trains in a :class:`Setup`, built for real: the reference model, the optimizer of
``setup.optim``, and peft's LoRA or a soft prompt on a frozen base.

The tests (and ``validate``) build these on the CPU and compare the bytes of the real parameter,
gradient and optimizer-state tensors with ``precise``'s count. Every import of torch, peft and
torchao happens inside the functions (optional extras).
"""

from __future__ import annotations

from fasttrain.errors import FasttrainError
from fasttrain.memory.config import Setup


def build_model(setup: Setup, device=None):
    """The reference model of ``setup`` (``model(idx, targets) -> loss``). One place to re-point
    when the model moves. With a soft prompt the model sees s + P positions (tables, mask)."""
    from fasttrain.memory import gpt

    if setup.prompt_tokens:
        setup = setup.with_(seq=setup.seq + setup.prompt_tokens)
    return gpt.build(setup, device)


def _require(module: str, extra: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise FasttrainError(f"{module} is not installed: pip install '{extra}' (or pip install {module})") from exc


def attach(model, setup: Setup):
    """Freeze the base and attach what ``setup`` trains: peft LoRA (``lora_rank``) on the
    ``lora_targets`` linears, or ``prompt_tokens`` soft-prompt vectors. Full fine-tuning returns
    ``model`` unchanged. Returns the model to train."""
    if setup.lora_rank:
        peft = _require("peft", "fasttrain[lab]")
        config = peft.LoraConfig(r=setup.lora_rank, lora_alpha=2 * setup.lora_rank,
                                 lora_dropout=float(setup.lora_dropout), target_modules=list(setup.lora_targets))
        return peft.get_peft_model(model, config)
    if setup.prompt_tokens:
        return PromptTuned(model, setup)
    return model


def PromptTuned(model, setup: Setup):
    """Prompt tuning on the reference model as peft does it for a causal LM: ``P`` trainable
    vectors (an ``nn.Embedding(P, h)`` looked up with 0..P-1) prepended to the token embeddings,
    the targets of those positions ignored (-100); the base frozen."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    P = setup.prompt_tokens

    class _PromptTuned(nn.Module):
        def __init__(self):
            super().__init__()
            self.base = model
            for p in self.base.parameters():
                p.requires_grad_(False)
            self.prompt = nn.Embedding(P, setup.hidden, device=model.tok.weight.device)

        def forward(self, idx, targets):
            base = self.base
            b_, s_ = idx.shape
            ids = torch.arange(P, device=idx.device).expand(b_, P)
            x = torch.cat((self.prompt(ids), base.tok(idx)), dim=1)          # (b, P + s, h)
            n = P + s_
            if base.pos is not None:
                x = x + base.pos(torch.arange(n, device=idx.device))
            x = F.dropout(x, 0.1 if setup.dropout else 0.0, self.training)
            cos = sin = None
            if setup.pos == "rope":
                dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
                cos, sin = base.tables(dtype)
                cos, sin = cos[:n], sin[:n]
            for block in base.blocks:
                if setup.recompute == "full":
                    x = torch.utils.checkpoint.checkpoint(block, x, cos, sin, use_reentrant=False)
                else:
                    x = block(x, cos, sin)
            x = base.norm(x)
            logits = base.head(x) if base.head is not None else F.linear(x, base.tok.weight)
            ignore = torch.full((b_, P), -100, dtype=targets.dtype, device=targets.device)
            full_targets = torch.cat((ignore, targets), dim=1)
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), full_targets.reshape(-1), ignore_index=-100)

    import torch.utils.checkpoint  # noqa: F401  (full recomputation above)

    return _PromptTuned()


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
