"""The lab's optimizers, their learning-rate schedule and the bytes of their state.

``build_optimizer`` maps ``--optim`` onto torch, torchao or bitsandbytes (weight decay on matrices
only); ``build_muon`` pairs Muon on the blocks' matrices with AdamW on the rest
(:class:`OptimizerGroup` steps them as one); the Muon here is torch.optim.Muon's update with the
Newton-Schulz iterations batched over same-shape matrices in bf16 (:func:`orthogonalize`, compiled on
a GPU). ``tensor_bytes`` and ``optimizer_state_bytes``
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
    if world is not None and world.distributed:
        # DTensors of several meshes (TP, FSDP, both) beside plain tensors: one kind per foreach list
        from fasttrain.lab.parallel.distributed import split_param_groups

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


# Newton-Schulz quintic coefficients (a, b, c) and step count: torch.optim.Muon's defaults
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5


def orthogonalize(g, steps: int = NS_STEPS, coefficients=NS_COEFFICIENTS, eps: float = 1e-7):
    """The nearest semi-orthogonal matrix to each matrix of ``g`` (shape (..., m, n)), approximately, by the
    quintic Newton-Schulz iteration in bf16, all matrices of the stack at once (one batched matmul per
    product instead of one small matmul per matrix).

    X0 = G / ||G||_F (per matrix: every singular value <= 1), transposed so that m <= n (the Gram matrix
    X X^T is the smaller one); then ``steps`` times

        A = X X^T,   B = b A + c A A,   X <- a X + B X

    which maps each singular value s to a s + b s^3 + c s^5 and drives them towards 1 (to about
    U(0.7, 1.2), which Muon does not mind). The same sums in the same order as torch.optim.Muon's
    per-matrix ``addmm`` form (``baddbmm`` is its batched twin)."""
    import torch

    a, b, c = coefficients
    x = g.bfloat16()
    tall = g.size(-2) > g.size(-1)
    if tall:
        x = x.mT
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)
    flat = x.reshape(-1, *x.shape[-2:])
    for _ in range(steps):
        gram = flat @ flat.mT
        update = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        flat = torch.baddbmm(flat, update, flat, beta=a)
    x = flat.reshape(x.shape)
    return x.mT if tall else x


def orthogonalize_each(g, steps: int = NS_STEPS, coefficients=NS_COEFFICIENTS, eps: float = 1e-7):
    """One matrix at a time (torch.optim.Muon's way): the reference the batched form is checked against."""
    import torch

    a, b, c = coefficients
    x = g.bfloat16()
    tall = g.size(0) > g.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T
        update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, update, x, beta=a)
    return x.T if tall else x


_COMPILED: dict = {}


def _orthogonalizer(device, compile: bool | None):
    """:func:`orthogonalize`, compiled once per process where a GPU runs it (``compile`` None: auto)."""
    if compile is None:
        compile = device.type == "cuda"
    if not compile:
        return orthogonalize
    if "ns" not in _COMPILED:
        import torch

        # dynamic=False: one specialised kernel set per stack shape (a model has two or three)
        _COMPILED["ns"] = torch.compile(orthogonalize, fullgraph=True, dynamic=False)
    return _COMPILED["ns"]


def _adjusted_lr(lr: float, adjust_lr_fn: str | None, shape) -> float:
    # torch.optim.Muon's scaling of the step per matrix shape (A x B)
    rows, cols = shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return lr * math.sqrt(max(1.0, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    return lr


def _batched_muon_class():
    import torch

    class BatchedMuon(torch.optim.Optimizer):
        """torch.optim.Muon's update, with the Newton-Schulz iterations of all same-shape matrices stacked into
        one batched bf16 computation (compiled on a GPU): per step, instead of 5 x 3 small matmuls per matrix
        (launch-bound at this model's sizes), 5 x 3 batched matmuls per distinct shape. A tall matrix (m > n)
        is orthogonalized transposed, so it stacks with the wide ones of the transposed shape (an MLP's up
        and down projections share a stack).

        Per matrix W with gradient G and momentum buffer M (fp32, the parameter's shape):
            M <- mu M + (1 - mu) G;   U = (1 - mu) G + mu M (Nesterov) or M
            O = NewtonSchulz(U);      W <- (1 - lr wd) W - lr' O,   lr' = lr x the shape's adjustment"""

        def __init__(self, params, lr=1e-3, weight_decay=0.1, momentum=0.95, nesterov=True,
                     ns_coefficients=NS_COEFFICIENTS, eps=1e-7, ns_steps=NS_STEPS, adjust_lr_fn=None, compile=None):
            defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                            ns_coefficients=tuple(ns_coefficients), eps=eps, ns_steps=ns_steps,
                            adjust_lr_fn=adjust_lr_fn)
            super().__init__(params, defaults)
            self.compile = compile
            for group in self.param_groups:
                for p in group["params"]:
                    if p.dim() != 2:
                        raise FasttrainError(f"Muon takes 2-D matrices only, got a parameter of shape "
                                             f"{tuple(p.shape)}")

        @torch.no_grad()
        def step(self, closure=None):
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            for group in self.param_groups:
                # lr may be a device tensor (a captured CUDA graph reads it at every replay): no float() here
                lr, wd, mu = group["lr"], group["weight_decay"], group["momentum"]
                stacks: dict = {}
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    state = self.state[p]
                    if "momentum_buffer" not in state:
                        state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    rows, cols = p.shape
                    key = (min(rows, cols), max(rows, cols), p.device, p.dtype)
                    stacks.setdefault(key, []).append(p)
                for (_, _, device, _), params in stacks.items():
                    grads = [p.grad for p in params]
                    bufs = [self.state[p]["momentum_buffer"] for p in params]
                    torch._foreach_lerp_(bufs, grads, 1 - mu)
                    updates = torch._foreach_lerp(grads, bufs, mu) if group["nesterov"] else bufs
                    stacked = torch.stack([u.mT if u.size(0) > u.size(1) else u for u in updates])
                    ortho = _orthogonalizer(device, self.compile)(stacked, group["ns_steps"],
                                                                  group["ns_coefficients"], group["eps"])
                    ortho = ortho.to(params[0].dtype).unbind(0)
                    ortho = [o.mT if p.size(0) > p.size(1) else o for o, p in zip(ortho, params)]
                    if wd:
                        torch._foreach_mul_(params, 1 - lr * wd)
                    # W <- W - lr x ratio(shape) x O
                    scales = [-_adjusted_lr(1.0, group["adjust_lr_fn"], p.shape) for p in params]
                    steps = torch._foreach_mul(ortho, scales)
                    if isinstance(lr, torch.Tensor):
                        torch._foreach_mul_(steps, lr)
                        torch._foreach_add_(params, steps)
                    else:
                        torch._foreach_add_(params, steps, alpha=lr)
            return loss

    return BatchedMuon


def batched_muon(params, **kwargs):
    """A :class:`BatchedMuon` (the class is made on first use: torch is imported lazily)."""
    if "BatchedMuon" not in _COMPILED:
        _COMPILED["BatchedMuon"] = _batched_muon_class()
    return _COMPILED["BatchedMuon"](params, **kwargs)


def build_muon(cfg: LabConfig, model, lr, *, capturable: bool = False, compile_ns: bool | None = None):
    """Muon for the blocks' 2-D weight matrices, AdamW for the rest (embeddings, norms, biases).

    Muon: momentum M <- mu M + G, update O = NewtonSchulz5(G + mu M) (Nesterov), the nearest
    semi-orthogonal matrix to it; ``match_rms_adamw`` scales O by 0.2 sqrt(max(rows, cols)) so
    its RMS matches AdamW's and one learning rate (and schedule) serves both optimizers. The
    Newton-Schulz iterations run batched over same-shape matrices (:func:`batched_muon`; ``compile_ns``:
    compiled or not, None: on a GPU). ``capturable``: every step runs on the device without a host
    synchronization, ``lr`` a device tensor the schedule fills (a step captured as a CUDA graph)."""
    import torch

    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    # the repeated blocks: the lab GPT's "blocks.N.", a transformers model's "layers.N." (Llama-likes) or "h.N." (GPT-2)
    hidden = [p for n, p in named if p.dim() == 2 and re.search(r"\.(blocks|layers|h)\.\d+\.", f".{n}")]
    hidden_ids = {id(p) for p in hidden}
    rest = [p for _, p in named if id(p) not in hidden_ids]
    if not hidden:
        raise FasttrainError("--optim muon found no trainable 2-D matrices in the transformer blocks")
    muon = batched_muon(hidden, lr=lr, weight_decay=cfg.weight_decay, momentum=0.95, adjust_lr_fn="match_rms_adamw",
                        compile=compile_ns)
    decay = [p for p in rest if p.dim() >= 2]
    other = [p for p in rest if p.dim() < 2]
    groups = [g for g in ({"params": decay, "weight_decay": cfg.weight_decay}, {"params": other, "weight_decay": 0.0})
              if g["params"]]
    if not groups:
        return OptimizerGroup(muon)
    fused = all(p.device.type == "cuda" for p in rest)
    adamw = torch.optim.AdamW(groups, lr=lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_epsilon,
                              fused=fused or None, **({"capturable": True} if capturable else {}))
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
