"""The decoder-only transformer of the lab, which is also the model whose training memory the
estimator's ``precise`` mode counts (``fasttrain.memory.validate`` trains it on a GPU to check the
count against ``torch.cuda.max_memory_allocated``).

Two styles from one module: Llama (RMSNorm, RoPE, SwiGLU, grouped-query attention, untied output)
and GPT-2 (LayerNorm, learned positions, GELU, tied input/output embedding). Choices that decide
what autograd keeps (the estimator counts exactly these; change them only together with
``fasttrain.memory.precise``):

- token embedding, then (``pos='learned'``) + learned position embedding, then dropout;
- pre-norm blocks ``x + attn(norm1(x))``, ``x + mlp(norm2(x))``; RMSNorm is one autograd
  Function that keeps its input and the fp32 row statistic (as the fused kernels of Apex,
  Transformer Engine or PyTorch do); LayerNorm is ``F.layer_norm`` (keeps input, mean, rstd);
- one fused QKV projection whose output is split into views; rotary embeddings with cached
  cos/sin tables (nothing new kept); eager attention ``softmax(mask(q k^T * scale)) v`` with
  K and V repeated to all heads for grouped-query attention, or
  ``F.scaled_dot_product_attention(is_causal=True)`` (``sdpa``: flash attention on a GPU);
- MLP: fused gate/up projection split into views for SwiGLU (``silu(g) * u``), else
  ``down(act(up(x)))``; dropout after the attention and MLP output projections;
- final norm, output projection (``tied``: the embedding matrix), ``F.cross_entropy`` on the
  logits inside ``forward``, which returns only the loss (the logits are not kept alive);
  without targets ``forward`` returns the logits (evaluation, generation);
- recomputation: ``full`` checkpoints every block, ``selective`` only the attention core
  (``torch.utils.checkpoint``, non-reentrant).

Module names are the PEFT target names: ``attn.qkv``, ``attn.proj``, ``mlp.up``, ``mlp.down`` and
(untied only) ``head``. Optional parts, off by default so the counted model stays as above:
``liger`` swaps in liger-kernel's Triton kernels (RMSNorm or LayerNorm, SwiGLU, RoPE and the fused
linear cross-entropy, which never materializes the logits); ``prompt_tokens`` adds a trainable
soft prompt (``prompt``: P x h vectors prepended to every sequence after the embedding; they
get no learned position, and with RoPE the real tokens sit at positions P.. so their relative
positions are unchanged; the loss covers the real tokens only).

The classes sit at module level, in the order a reader meets them (nanoGPT's ``model.py``): the norms,
attention, the MLP, a block, the GPT. Importing this module imports torch.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint
from torch.utils.checkpoint import checkpoint

from fasttrain.errors import FasttrainError
from fasttrain.lab.model_options import (qk_norm, relu_squared, softcap, unet_forward, unet_skip_weights,
                                         zero_output_projections)


@dataclass(frozen=True)


class GPTConfig:
    """The model's shape and its memory-relevant implementation choices (a checkpoint's config.json)."""

    layers: int
    heads: int
    hidden: int
    ffn: int
    vocab: int
    seq: int                      # the longest sequence (position table, causal mask, RoPE tables)
    kv_heads: int | None = None
    norm: str = "rms"             # rms | layer
    pos: str = "rope"             # rope | learned
    ffn_act: str = "swiglu"       # swiglu | gelu | relu | relu2 (relu(x)^2)
    tied: bool = False
    bias: bool = False
    dropout: float = 0.0
    attention: str = "eager"      # eager | sdpa
    recompute: str = "none"       # none | selective | full
    recompute_blocks: int = 0     # full: the first this many blocks recompute, the rest keep theirs (0: all)
    liger: bool = False
    prompt_tokens: int = 0
    # the speedrun's options (lab/model_options.py), off by default: the counted model is unchanged
    qk_norm: bool = False         # queries and keys RMS-normalized per head before attention
    zero_init_proj: bool = False  # attention's and the MLP's output projections start at zero
    unet_skips: bool = False      # block i's output feeds block L-1-i (a learned scalar each)
    logit_softcap: float = 0.0    # logits -> cap tanh(logits / cap); 0: off

    @property
    def g(self) -> int:
        return self.heads if self.kv_heads is None else self.kv_heads

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "GPTConfig":
        names = {f.name for f in fields(cls)}
        unknown = set(data) - names
        if unknown:
            raise FasttrainError(f"model config has unknown field(s) {sorted(unknown)}")
        return cls(**data)

    @classmethod
    def from_setup(cls, setup) -> "GPTConfig":
        """The model a :class:`fasttrain.memory.config.Setup` describes (tp = 1); dropout p = 0.1."""
        return cls(layers=setup.layers, heads=setup.heads, hidden=setup.hidden, ffn=setup.ffn, vocab=setup.vocab,
                   seq=setup.seq, kv_heads=setup.kv_heads, norm=setup.norm, pos=setup.pos, ffn_act=setup.ffn_act,
                   tied=setup.tied, bias=setup.bias, dropout=0.1 if setup.dropout else 0.0,
                   attention="sdpa" if setup.attention == "flash" else "eager", recompute=setup.recompute,
                   recompute_blocks=setup.recompute_layers)


def _liger(what: str):
    """liger-kernel's functions, imported on first use."""
    try:
        if what == "rms_norm":
            from liger_kernel.ops.rms_norm import LigerRMSNormFunction as fn
        elif what == "layer_norm":
            from liger_kernel.ops.layer_norm import LigerLayerNormFunction as fn
        elif what == "swiglu":
            from liger_kernel.ops.swiglu import LigerSiLUMulFunction as fn
        elif what == "rope":
            from liger_kernel.transformers.rope import liger_rotary_pos_emb as fn
        else:
            from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy as fn
    except ImportError as exc:
        raise FasttrainError(f"--use-liger-kernel needs liger-kernel ({exc.name} is missing); "
                             f'install the lab extra: pip install -e ".[lab]"') from None
    return fn


class RMSNormFn(torch.autograd.Function):
    # y = x * rstd * w, rstd = 1 / sqrt(mean(x^2) + eps); keeps x and rstd (fp32, one per row).
    @staticmethod
    def forward(ctx, x, weight, eps):
        rstd = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return (x.float() * rstd).to(x.dtype) * weight

    @staticmethod
    def backward(ctx, dy):
        # xhat = x * rstd; dw = sum(dy * xhat); dx = rstd * (dy*w - xhat * mean(dy*w*xhat))
        x, weight, rstd = ctx.saved_tensors
        xhat = x.float() * rstd
        dxhat = dy.float() * weight
        dw = (dy.float() * xhat).sum(dim=tuple(range(dy.dim() - 1)))
        mean = (dxhat * xhat).mean(-1, keepdim=True)
        dx = (dxhat - xhat * mean) * rstd
        return dx.to(x.dtype), dw.to(weight.dtype), None


class RMSNorm(nn.Module):
    def __init__(self, h, liger=False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(h))
        self.liger = liger

    def forward(self, x):
        if self.liger:
            # liger's kernel: fp32 statistics ("llama" casting), keeps x and rstd like ours
            return _liger("rms_norm").apply(x, self.weight, 1e-5, 0.0, "llama", False)
        return RMSNormFn.apply(x, self.weight, 1e-5)


class LigerLayerNorm(nn.LayerNorm):
    def forward(self, x):
        bias = self.bias if self.bias is not None else torch.zeros_like(self.weight)
        return _liger("layer_norm").apply(x, self.weight, bias, self.eps)


def make_norm(c: GPTConfig):
    if c.norm == "rms":
        return RMSNorm(c.hidden, c.liger)
    return (LigerLayerNorm if c.liger else nn.LayerNorm)(c.hidden, bias=c.bias)


def rope(x, cos, sin):
    # rotate pairs (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), half-split layout (HF Llama)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, c: GPTConfig, model):
        super().__init__()
        self.c = c
        d = c.hidden // c.heads
        self.qkv = nn.Linear(c.hidden, (c.heads + 2 * c.g) * d, bias=c.bias)
        self.proj = nn.Linear(c.hidden, c.hidden, bias=c.bias)
        self.model = [model]    # not a submodule: gives the shared mask and rope tables

    def repeat_kv(self, x):
        b_, g_, s_, d_ = x.shape
        a = self.c.heads
        if g_ == a:
            return x
        return x[:, :, None].expand(b_, g_, a // g_, s_, d_).reshape(b_, a, s_, d_)

    def core(self, q, k, v):
        c = self.c
        b_, _, s_, d = q.shape
        if c.attention == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=c.dropout if self.training else 0.0,
                                               is_causal=True, enable_gqa=c.g != c.heads)
        else:
            k, v = self.repeat_kv(k), self.repeat_kv(v)
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d))
            att = att.masked_fill(self.model[0].causal[:s_, :s_], float("-inf"))
            att = F.softmax(att, dim=-1)
            att = F.dropout(att, c.dropout, self.training)
            y = att @ v
        return y.transpose(1, 2).reshape(b_, s_, c.hidden)

    def forward(self, x, cos, sin):
        c = self.c
        b_, s_, _ = x.shape
        a, g, d = c.heads, c.g, c.hidden // c.heads
        q, k, v = self.qkv(x).split([a * d, g * d, g * d], dim=-1)
        q = q.view(b_, s_, a, d).transpose(1, 2)
        k = k.view(b_, s_, g, d).transpose(1, 2)
        v = v.view(b_, s_, g, d).transpose(1, 2)
        if c.qk_norm:
            q, k = qk_norm(q, k)
        if cos is not None:
            if c.liger:
                q, k = _liger("rope")(q, k, cos[None], sin[None])
            else:
                q, k = rope(q, cos, sin), rope(k, cos, sin)
        if c.recompute == "selective" and c.attention == "eager":   # sdpa keeps no s^2 term to drop
            y = checkpoint(self.core, q, k, v, use_reentrant=False)
        else:
            y = self.core(q, k, v)
        return F.dropout(self.proj(y), c.dropout, self.training)


class MLP(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.c = c
        self.up = nn.Linear(c.hidden, (2 if c.ffn_act == "swiglu" else 1) * c.ffn, bias=c.bias)
        self.down = nn.Linear(c.ffn, c.hidden, bias=c.bias)

    def forward(self, x):
        c = self.c
        if c.ffn_act == "swiglu":
            gate, up = self.up(x).chunk(2, dim=-1)
            if c.liger:
                z = _liger("swiglu").apply(gate.contiguous(), up.contiguous())
            else:
                z = F.silu(gate) * up
        elif c.ffn_act == "gelu":
            z = F.gelu(self.up(x))
        elif c.ffn_act == "relu2":
            z = relu_squared(self.up(x))
        else:
            z = F.relu(self.up(x))
        return F.dropout(self.down(z), c.dropout, self.training)


class Block(nn.Module):
    def __init__(self, c: GPTConfig, model):
        super().__init__()
        self.norm1, self.attn = make_norm(c), Attention(c, model)
        self.norm2, self.mlp = make_norm(c), MLP(c)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.norm1(x), cos, sin)
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.config = c
        h, S, d = c.hidden, c.seq, c.hidden // c.heads
        S_all = S + c.prompt_tokens
        self.tok = nn.Embedding(c.vocab, h)
        self.pos = nn.Embedding(S, h) if c.pos == "learned" else None
        self.prompt = nn.Parameter(torch.zeros(c.prompt_tokens, h)) if c.prompt_tokens else None
        self.blocks = nn.ModuleList(Block(c, self) for _ in range(c.layers))
        self.norm = make_norm(c)
        self.head = None if c.tied else nn.Linear(h, c.vocab, bias=False)
        if c.unet_skips and c.recompute != "none":
            raise FasttrainError("U-net skips keep the first half's outputs for the second: drop "
                                 "--gradient-checkpointing (or --unet-skips)")
        if c.logit_softcap and c.liger:
            raise FasttrainError("liger's fused cross-entropy never forms the logits to cap: drop --logit-softcap "
                                 "or --use-liger-kernel")
        self.skip_weights = unet_skip_weights(c.layers) if c.unet_skips else None
        if c.attention == "eager":
            # True above the diagonal: the future positions a query may not see (s^2 bytes)
            self.register_buffer("causal", torch.ones(S_all, S_all, dtype=torch.bool).triu(1), persistent=False)
        if c.pos == "rope":
            inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2).float() / d))
            ang = torch.outer(torch.arange(S_all).float(), inv)
            ang = torch.cat((ang, ang), dim=-1)                     # (S, d)
            self.register_buffer("cos", ang.cos(), persistent=False)
            self.register_buffer("sin", ang.sin(), persistent=False)
            self._tables = {}
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self):
        for name, p in self.named_parameters():
            self.init_parameter(name, p)
        self.reset_after_init()

    @torch.no_grad()
    def init_parameter(self, name: str, p):
        # GPT-2's initialization: N(0, 0.02) weights, zero biases, and the projections that
        # write into the residual stream scaled by 1/sqrt(2 L) so its variance stays O(1).
        # (One parameter at a time: a model built on the meta device is initialized shard by shard.)
        if name.endswith("bias"):
            p.zero_()
        elif p.dim() >= 2:
            std = 0.02 / math.sqrt(2 * self.config.layers) if name.endswith(("proj.weight", "down.weight")) else 0.02
            p.normal_(0.0, std)

    @torch.no_grad()
    def reset_after_init(self):
        if self.config.zero_init_proj:
            zero_output_projections(self)
        if self.skip_weights is not None:
            self.skip_weights.fill_(1.0)
        self.reset_prompt()

    @torch.no_grad()
    def reset_prompt(self):
        # the soft prompt starts as the embeddings of random tokens (a plausible input); call
        # again after loading pretrained embeddings
        if self.prompt is not None:
            ids = torch.randint(0, self.config.vocab, (self.config.prompt_tokens,), device=self.tok.weight.device)
            self.prompt.copy_(self.tok.weight[ids])

    def tables(self, dtype):
        # cos/sin in the compute dtype, made once per dtype and reused (nothing new per step)
        if dtype == torch.float32:
            return self.cos, self.sin
        if dtype not in self._tables:
            self._tables[dtype] = (self.cos.to(dtype), self.sin.to(dtype))
        return self._tables[dtype]

    def output_weight(self):
        return self.tok.weight if self.head is None else self.head.weight

    def forward(self, idx, targets=None):
        c = self.config
        b_, s_ = idx.shape
        x = self.tok(idx)
        if self.pos is not None:
            x = x + self.pos(torch.arange(s_, device=idx.device))
        P = c.prompt_tokens
        if P:
            x = torch.cat((self.prompt.to(x.dtype).expand(b_, P, c.hidden), x), dim=1)
        x = F.dropout(x, c.dropout, self.training)
        cos = sin = None
        if c.pos == "rope":
            dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
            cos, sin = self.tables(dtype)
            cos, sin = cos[:s_ + P], sin[:s_ + P]
        if c.recompute == "none" and self.skip_weights is not None:
            x = unet_forward(self.blocks, x, self.skip_weights, cos, sin)
        elif c.recompute == "none":
            # (no recomputation, no context manager: torch.compile traces the forward as one graph)
            for block in self.blocks:
                x = block(x, cos, sin)
        else:
            # Early stop of the recomputation raises from inside the op whose saved tensor
            # completes it; with CUDA's fused dropout last in a block that surfaced as
            # "SystemError: dropout returned NULL" (torch 2.11). Recomputing the whole block
            # keeps the same tensors.
            with torch.utils.checkpoint.set_checkpoint_early_stop(False):
                for i, block in enumerate(self.blocks):
                    if c.recompute == "full" and (not c.recompute_blocks or i < c.recompute_blocks):
                        x = checkpoint(block, x, cos, sin, use_reentrant=False)
                    else:
                        x = block(x, cos, sin)
        x = self.norm(x)
        if P:
            x = x[:, P:]
        if targets is not None and c.liger:
            # loss = CE(x W^T, y) computed chunk by chunk: the (b s) x v logits never exist at once
            w = self.output_weight()
            if torch.is_autocast_enabled(x.device.type):
                dtype = torch.get_autocast_dtype(x.device.type)
                x, w = x.to(dtype), w.to(dtype)
            return _liger("flce")(x.reshape(-1, c.hidden), w, targets.reshape(-1))
        logits = self.head(x) if self.head is not None else F.linear(x, self.tok.weight)
        if c.logit_softcap:
            logits = softcap(logits, c.logit_softcap)
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, c.vocab), targets.reshape(-1))


def build(config, device=None, seed: int = 0) -> "GPT":
    """An ``nn.Module`` for ``config`` (a :class:`GPTConfig` or a memory ``Setup``):
    ``model(idx, targets) -> loss`` and ``model(idx) -> logits``. The weights are drawn from
    ``torch.manual_seed(seed)`` in construction order, so a seed gives the same weights on every call."""
    if not isinstance(config, GPTConfig):
        config = GPTConfig.from_setup(config)
    torch.manual_seed(seed)
    if device is None:
        return GPT(config)
    with torch.device(device):
        return GPT(config)
