"""Architecture and schedule options the speedrun community found, as small functions the lab's model
and trainer call when a configuration turns them on (each is a rung of the speedrun, kept only where it
pays here). All are off by default, so the counted model stays as ``fasttrain.lab.model`` describes it.

- :func:`qk_norm`: queries and keys RMS-normalized over the head dimension before attention (the
  logits q.k / sqrt(d) stay bounded however the projections grow: a larger learning rate is stable);
- :func:`relu_squared`: the MLP's activation relu(x)^2 (sparse like ReLU, smooth at 0 like GELU);
- :func:`zero_output_projections`: the projections that write into the residual stream (attention's
  output projection, the MLP's down projection) start at zero, so every block starts as the identity;
- :class:`UNetSkips`: the first half of the blocks hands its outputs to the second half in reverse
  order (block L-1-i receives the output of block i, times a learned scalar that starts at 1);
- :func:`softcap`: logits squashed to (-cap, cap) by cap tanh(z / cap) (no logit runs away);
- :func:`ramp`: a value (sequence length, batch size) growing from ``start`` to ``end`` over the first
  ``steps`` optimizer steps in a few discrete sizes (each size one compiled graph).
"""

from __future__ import annotations

import math

from fasttrain.errors import FasttrainError


def qk_norm(q, k, eps: float = 1e-6):
    """q, k of shape (..., d): each vector scaled to unit RMS, x / sqrt(mean(x^2) + eps) (no weight)."""
    import torch.nn.functional as F

    return F.rms_norm(q, (q.size(-1),), eps=eps), F.rms_norm(k, (k.size(-1),), eps=eps)


def relu_squared(x):
    """relu(x)^2."""
    import torch.nn.functional as F

    return F.relu(x).square()


def zero_output_projections(model, names=("attn.proj.weight", "mlp.down.weight")) -> int:
    """Zero the residual-stream output projections of every block in place; returns how many."""
    import torch

    count = 0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(names):
                p.zero_()
                count += 1
    if not count:
        raise FasttrainError(f"zero-initialized projections: no parameter named *{' or *'.join(names)} in this model")
    return count


def unet_skip_weights(layers: int, device=None):
    """The learned scalars of the skips: one per pair (block i -> block L-1-i), starting at 1."""
    import torch

    if layers < 2:
        raise FasttrainError(f"U-net skips need at least 2 layers, got {layers}")
    return torch.nn.Parameter(torch.ones(layers // 2, device=device))


def unet_forward(blocks, x, weights, *args):
    """Run ``blocks`` (each ``block(x, *args)``) with U-net skips: the outputs of the first L//2 blocks are
    kept; before block L-1-i (i < L//2) its input gains weights[i] times the output of block i. With an odd
    L the middle block gets no skip."""
    layers = len(blocks)
    half = layers // 2
    kept = []
    for j, block in enumerate(blocks):
        i = layers - 1 - j
        if j >= layers - half:
            x = x + weights[i] * kept[i]
        x = block(x, *args)
        if j < half:
            kept.append(x)
    return x


def softcap(logits, cap: float):
    """cap tanh(logits / cap): ~logits for |logits| << cap, never beyond +-cap; cap <= 0: unchanged."""
    import torch

    if not cap or cap <= 0:
        return logits
    return cap * torch.tanh(logits / cap)


def ramp(step: int, start: int, end: int, steps: int, multiple: int = 1, stages: int = 4) -> int:
    """The value at ``step`` of a ramp from ``start`` to ``end`` over ``steps`` steps, in ``stages`` equal
    stages (held constant within each), rounded down to a multiple of ``multiple`` (at least ``multiple``);
    ``end`` from ``steps`` on, and always when ``steps`` or ``start`` is 0 (off)."""
    if not steps or not start or step >= steps:
        return end
    stage = min(stages - 1, step * stages // steps)
    value = start + (end - start) * stage / stages        # stage s of n: start + (end - start) s / n
    value = int(math.floor(value / multiple)) * multiple
    return max(multiple, min(max(start, end), value))


__all__ = ["qk_norm", "ramp", "relu_squared", "softcap", "unet_forward", "unet_skip_weights",
           "zero_output_projections"]
