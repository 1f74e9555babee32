"""The reference GPT whose training memory the ``precise`` mode models, in plain PyTorch.

``precise`` counts the tensors that *this* implementation keeps (it follows common practice:
nanoGPT / Hugging Face Llama), and ``fasttrain.memory.validate`` trains it on a GPU to check
the count against ``torch.cuda.max_memory_allocated``. Choices that decide what autograd keeps:

- token embedding, then (``pos='learned'``) + learned position embedding, then dropout;
- pre-norm blocks ``x + attn(norm1(x))``, ``x + mlp(norm2(x))``; RMSNorm is one autograd
  Function that keeps its input and the fp32 row statistic (as the fused kernels of Apex,
  Transformer Engine or PyTorch do); LayerNorm is ``F.layer_norm`` (keeps input, mean, rstd);
- one fused QKV projection whose output is split into views; rotary embeddings with cached
  cos/sin tables (nothing new kept); eager attention ``softmax(mask(q k^T * scale)) v`` with
  K and V repeated to all heads for grouped-query attention (HF ``repeat_kv``), or
  ``F.scaled_dot_product_attention(is_causal=True)`` ("flash");
- MLP: fused gate/up projection split into views for SwiGLU (``silu(g) * u``), else
  ``fc2(act(fc1(x)))``; dropout after the attention and MLP output projections;
- final norm, output projection (``tied``: the embedding matrix), ``F.cross_entropy`` on the
  logits inside ``forward``, which returns only the loss (the logits are not kept alive);
- recomputation: ``full`` checkpoints every block, ``selective`` only the attention core
  (``torch.utils.checkpoint``, non-reentrant).

torch is imported inside the functions, so importing this module stays cheap.
"""

from __future__ import annotations

import math

from fasttrain.memory.config import Setup


def build(setup: Setup, device=None):
    """An ``nn.Module`` for ``setup`` (tp = 1): ``model(idx, targets) -> loss``."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    import torch.utils.checkpoint
    from torch.utils.checkpoint import checkpoint

    s = setup
    h, a, g, f, V, S = s.hidden, s.heads, s.g, s.ffn, s.vocab, s.seq
    d = h // a
    p_drop = 0.1 if s.dropout else 0.0

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
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(h, device=device))

        def forward(self, x):
            return RMSNormFn.apply(x, self.weight, 1e-5)

    def make_norm():
        return RMSNorm() if s.norm == "rms" else nn.LayerNorm(h, bias=s.bias, device=device)

    def rope(x, cos, sin):
        # rotate pairs (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), half-split layout (HF Llama)
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin

    def repeat_kv(x):
        b_, g_, s_, d_ = x.shape
        if g_ == a:
            return x
        return x[:, :, None].expand(b_, g_, a // g_, s_, d_).reshape(b_, a, s_, d_)

    class Attention(nn.Module):
        def __init__(self, model):
            super().__init__()
            self.qkv = nn.Linear(h, (a + 2 * g) * d, bias=s.bias, device=device)
            self.proj = nn.Linear(h, h, bias=s.bias, device=device)
            self.model = [model]    # not a submodule: gives the shared mask and rope tables

        def core(self, q, k, v):
            b_, _, s_, _ = q.shape
            if s.attention == "flash":
                y = F.scaled_dot_product_attention(q, k, v, dropout_p=p_drop if self.training else 0.0,
                                                   is_causal=True, enable_gqa=g != a)
            else:
                k, v = repeat_kv(k), repeat_kv(v)
                att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d))
                att = att.masked_fill(self.model[0].causal[:s_, :s_], float("-inf"))
                att = F.softmax(att, dim=-1)
                att = F.dropout(att, p_drop, self.training)
                y = att @ v
            return y.transpose(1, 2).reshape(b_, s_, h)

        def forward(self, x, cos, sin):
            b_, s_, _ = x.shape
            q, k, v = self.qkv(x).split([a * d, g * d, g * d], dim=-1)
            q = q.view(b_, s_, a, d).transpose(1, 2)
            k = k.view(b_, s_, g, d).transpose(1, 2)
            v = v.view(b_, s_, g, d).transpose(1, 2)
            if cos is not None:
                q, k = rope(q, cos, sin), rope(k, cos, sin)
            if s.recompute == "selective" and s.attention == "eager":   # flash keeps no s^2 term to drop
                y = checkpoint(self.core, q, k, v, use_reentrant=False)
            else:
                y = self.core(q, k, v)
            return F.dropout(self.proj(y), p_drop, self.training)

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.up = nn.Linear(h, (2 if s.ffn_act == "swiglu" else 1) * f, bias=s.bias, device=device)
            self.down = nn.Linear(f, h, bias=s.bias, device=device)

        def forward(self, x):
            if s.ffn_act == "swiglu":
                gate, up = self.up(x).chunk(2, dim=-1)
                z = F.silu(gate) * up
            elif s.ffn_act == "gelu":
                z = F.gelu(self.up(x))
            else:
                z = F.relu(self.up(x))
            return F.dropout(self.down(z), p_drop, self.training)

    class Block(nn.Module):
        def __init__(self, model):
            super().__init__()
            self.norm1, self.attn = make_norm(), Attention(model)
            self.norm2, self.mlp = make_norm(), MLP()

        def forward(self, x, cos, sin):
            x = x + self.attn(self.norm1(x), cos, sin)
            return x + self.mlp(self.norm2(x))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = nn.Embedding(V, h, device=device)
            self.pos = nn.Embedding(S, h, device=device) if s.pos == "learned" else None
            self.blocks = nn.ModuleList(Block(self) for _ in range(s.layers))
            self.norm = make_norm()
            self.head = None if s.tied else nn.Linear(h, V, bias=False, device=device)
            if s.attention == "eager":
                # True above the diagonal: the future positions a query may not see (s^2 bytes)
                self.register_buffer("causal", torch.ones(S, S, dtype=torch.bool, device=device).triu(1),
                                     persistent=False)
            if s.pos == "rope":
                inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2, device=device).float() / d))
                ang = torch.outer(torch.arange(S, device=device).float(), inv)
                ang = torch.cat((ang, ang), dim=-1)                     # (S, d)
                self.register_buffer("cos", ang.cos(), persistent=False)
                self.register_buffer("sin", ang.sin(), persistent=False)
                self._tables = {}

        def tables(self, dtype):
            # cos/sin in the compute dtype, made once per dtype and reused (nothing new per step)
            if dtype == torch.float32:
                return self.cos, self.sin
            if dtype not in self._tables:
                self._tables[dtype] = (self.cos.to(dtype), self.sin.to(dtype))
            return self._tables[dtype]

        def forward(self, idx, targets):
            b_, s_ = idx.shape
            x = self.tok(idx)
            if self.pos is not None:
                x = x + self.pos(torch.arange(s_, device=idx.device))
            x = F.dropout(x, p_drop, self.training)
            cos = sin = None
            if s.pos == "rope":
                dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
                cos, sin = self.tables(dtype)
                cos, sin = cos[:s_], sin[:s_]
            # Early stop of the recomputation raises from inside the op whose saved tensor completes
            # it; with CUDA's fused dropout last in a block that surfaced as "SystemError: dropout
            # returned NULL" (torch 2.11). Recomputing the whole block keeps the same tensors.
            with torch.utils.checkpoint.set_checkpoint_early_stop(False):
                for block in self.blocks:
                    if s.recompute == "full":
                        x = checkpoint(block, x, cos, sin, use_reentrant=False)
                    else:
                        x = block(x, cos, sin)
            x = self.norm(x)
            logits = self.head(x) if self.head is not None else F.linear(x, self.tok.weight)
            return F.cross_entropy(logits.view(-1, V), targets.view(-1))

    torch.manual_seed(0)
    return GPT()
