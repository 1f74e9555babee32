"""One-call probe of the GPU machine for the lab: libraries, 8-bit AdamW, liger, and the baby-GPT step time."""
import time, math, sys, importlib
import torch, torch.nn as nn, torch.nn.functional as F

def ver(m):
    try:
        return importlib.import_module(m).__version__
    except Exception as e:
        return f"missing ({type(e).__name__}: {e})"[:120]

for m in ("torch", "triton", "peft", "transformers", "safetensors", "torchao", "liger_kernel", "bitsandbytes"):
    print(f"{m}: {ver(m)}")
print(torch.cuda.get_device_name(), torch.version.cuda)
dev = "cuda"
try:
    from torchao.optim import AdamW8bit
    p = torch.nn.Parameter(torch.randn(4096, 4096, device=dev))
    o = AdamW8bit([p], lr=1e-3)
    p.grad = torch.randn_like(p); o.step(); torch.cuda.synchronize()
    st = o.state[p]
    print("AdamW8bit ok:", {k: (type(v).__name__, getattr(v, 'shape', None)) for k, v in st.items()})
except Exception as e:
    print("AdamW8bit FAILED:", type(e).__name__, str(e)[:300])
try:
    from liger_kernel.transformers import LigerRMSNorm, LigerFusedLinearCrossEntropyLoss, liger_rotary_pos_emb, LigerSwiGLUMLP
    n = LigerRMSNorm(384).to(dev); x = torch.randn(8, 256, 384, device=dev, requires_grad=True)
    n(x).sum().backward(); torch.cuda.synchronize(); print("liger rmsnorm ok")
    lce = LigerFusedLinearCrossEntropyLoss(); w = torch.randn(65, 384, device=dev, requires_grad=True)
    l = lce(w, x.view(-1, 384).detach().requires_grad_(), torch.randint(0, 65, (8 * 256,), device=dev)); l.backward()
    print("liger flce ok", float(l))
except Exception as e:
    print("liger FAILED:", type(e).__name__, str(e)[:300])

# baby GPT (nanoGPT shakespeare-char shape) step time
class Block(nn.Module):
    def __init__(s, h, nh, p):
        super().__init__(); s.ln1 = nn.LayerNorm(h); s.qkv = nn.Linear(h, 3*h); s.proj = nn.Linear(h, h)
        s.ln2 = nn.LayerNorm(h); s.fc = nn.Linear(h, 4*h); s.fc2 = nn.Linear(4*h, h); s.nh = nh; s.p = p
    def forward(s, x):
        B, T, C = x.shape
        q, k, v = s.qkv(s.ln1(x)).split(C, 2)
        q, k, v = [t.view(B, T, s.nh, C // s.nh).transpose(1, 2) for t in (q, k, v)]
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=s.p if s.training else 0)
        x = x + F.dropout(s.proj(y.transpose(1, 2).reshape(B, T, C)), s.p, s.training)
        return x + F.dropout(s.fc2(F.gelu(s.fc(s.ln2(x)))), s.p, s.training)
class GPT(nn.Module):
    def __init__(s, L=6, h=384, nh=6, T=256, V=65, p=0.2):
        super().__init__(); s.tok = nn.Embedding(V, h); s.pos = nn.Embedding(T, h)
        s.blocks = nn.Sequential(*[Block(h, nh, p) for _ in range(L)]); s.ln = nn.LayerNorm(h); s.p = p
    def forward(s, idx, tgt):
        x = F.dropout(s.tok(idx) + s.pos(torch.arange(idx.shape[1], device=idx.device)), s.p, s.training)
        x = s.ln(s.blocks(x)); return F.cross_entropy(F.linear(x, s.tok.weight).view(-1, 65), tgt.view(-1))

def bench(name, B=64, T=256, dtype=None, compile_=False, fused=True, steps=30, L=6, h=384, nh=6):
    torch.manual_seed(0)
    m = GPT(L, h, nh, T).to(dev)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3, betas=(0.9, 0.99), fused=fused)
    f = torch.compile(m) if compile_ else m
    idx = torch.randint(0, 65, (B, T), device=dev); tgt = torch.randint(0, 65, (B, T), device=dev)
    def step():
        with torch.autocast("cuda", dtype=dtype, enabled=dtype is not None):
            loss = f(idx, tgt)
        loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    for _ in range(5): step()
    torch.cuda.synchronize(); warm = time.perf_counter() - t0
    torch.cuda.reset_peak_memory_stats(); t0 = time.perf_counter()
    for _ in range(steps): step()
    torch.cuda.synchronize(); dt = (time.perf_counter() - t0) / steps
    print(f"{name:40s} {dt*1e3:8.2f} ms/step  {B*T/dt/1e6:7.2f} Mtok/s  warm {warm:.1f}s  peak {torch.cuda.max_memory_allocated()/2**20:.0f} MiB")

torch.backends.cuda.matmul.allow_tf32 = False
bench("fp32 eager B64")
bench("bf16 eager B64", dtype=torch.bfloat16)
bench("bf16 compile B64", dtype=torch.bfloat16, compile_=True)
torch.backends.cuda.matmul.allow_tf32 = True
bench("tf32 eager B64")
bench("bf16 compile B256", B=256, dtype=torch.bfloat16, compile_=True)
bench("bf16 compile B64 L4 h256", dtype=torch.bfloat16, compile_=True, L=4, h=256, nh=4)
bench("bf16 compile 100M T1024 B8", B=8, T=1024, dtype=torch.bfloat16, compile_=True, L=16, h=768, nh=12, steps=10)
