"""Speedrun research probe (one GPU call, many recipes): time to validation loss <= 1.47 on Tiny
Shakespeare (char level, first 90% train, last 10% val, whole val split scored).

usage: python dev/speedrun/probe.py CORPUS '[{"name": ..., overrides...}, ...]'
Each recipe trains until the target, a step limit or a training-time limit; eval time is kept apart.
"""
import json, math, sys, time
import torch, torch.nn as nn, torch.nn.functional as F

TARGET = 1.47
text = open(sys.argv[1], "rb").read().decode()
chars = sorted(set(text)); V = len(chars)
lut = {c: i for i, c in enumerate(chars)}
data = torch.tensor([lut[c] for c in text], dtype=torch.uint8)
n = int(0.9 * len(data)); train_cpu, val_cpu = data[:n], data[n:]
dev = "cuda"
train, val = train_cpu.to(dev).long(), val_cpu.to(dev).long()


class Block(nn.Module):
    def __init__(s, h, nh, p, bias):
        super().__init__()
        s.ln1, s.ln2 = nn.LayerNorm(h, bias=bias), nn.LayerNorm(h, bias=bias)
        s.qkv, s.proj = nn.Linear(h, 3 * h, bias=bias), nn.Linear(h, h, bias=bias)
        s.fc, s.fc2 = nn.Linear(h, 4 * h, bias=bias), nn.Linear(4 * h, h, bias=bias)
        s.nh, s.p = nh, p

    def forward(s, x):
        B, T, C = x.shape
        q, k, v = s.qkv(s.ln1(x)).split(C, 2)
        q, k, v = [t.view(B, T, s.nh, C // s.nh).transpose(1, 2) for t in (q, k, v)]
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=s.p if s.training else 0.0)
        x = x + F.dropout(s.proj(y.transpose(1, 2).reshape(B, T, C)), s.p, s.training)
        return x + F.dropout(s.fc2(F.gelu(s.fc(s.ln2(x)))), s.p, s.training)


class GPT(nn.Module):
    def __init__(s, L, h, nh, T, p, bias):
        super().__init__()
        s.tok, s.pos = nn.Embedding(V, h), nn.Embedding(T, h)
        s.blocks = nn.ModuleList(Block(h, nh, p, bias) for _ in range(L))
        s.ln, s.p = nn.LayerNorm(h, bias=bias), p
        s.apply(s._init)
        for name, prm in s.named_parameters():
            if name.endswith(("proj.weight", "fc2.weight")):
                nn.init.normal_(prm, 0.0, 0.02 / math.sqrt(2 * L))

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, 0.0, 0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(s, idx, tgt):
        x = F.dropout(s.tok(idx) + s.pos.weight[: idx.shape[1]], s.p, s.training)
        for b in s.blocks:
            x = b(x)
        logits = F.linear(s.ln(x), s.tok.weight)
        return F.cross_entropy(logits.float().reshape(-1, V), tgt.reshape(-1), reduction="sum")


def run(r):
    cfg = dict(L=6, h=384, nh=6, T=256, p=0.2, bias=True, B=64, lr=1e-3, b2=0.99, wd=0.1, warm=100, steps=5000,
               min_lr=1e-4, opt="adamw", muon_lr=0.02, bf16=True, compile=True, cmode="default", eval_every=250,
               max_s=30.0, seed=0, clip=1.0)
    cfg.update(r)
    torch.manual_seed(cfg["seed"])
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = cfg.get("tf32", False)
    m = GPT(cfg["L"], cfg["h"], cfg["nh"], cfg["T"], cfg["p"], cfg["bias"]).to(dev)
    decay = [p for p in m.parameters() if p.dim() >= 2]
    other = [p for p in m.parameters() if p.dim() < 2]
    opts = []
    if cfg["opt"] == "muon":
        hidden = [p for n_, p in m.named_parameters() if p.dim() == 2 and "blocks" in n_]
        rest = [p for n_, p in m.named_parameters() if not (p.dim() == 2 and "blocks" in n_)]
        opts.append(torch.optim.Muon(hidden, lr=cfg["muon_lr"], momentum=0.95, weight_decay=0.0,
                                     adjust_lr_fn="match_rms_adamw"))
        opts.append(torch.optim.AdamW(rest, lr=cfg["lr"], betas=(0.9, cfg["b2"]), weight_decay=0.0, fused=True))
    else:
        opts.append(torch.optim.AdamW([{"params": decay, "weight_decay": cfg["wd"]}, {"params": other, "weight_decay": 0.0}],
                                      lr=cfg["lr"], betas=(0.9, cfg["b2"]), fused=True))
    for o in opts:
        for g in o.param_groups:
            g["base_lr"] = g["lr"]
    f = torch.compile(m, mode=cfg["cmode"]) if cfg["compile"] else m
    T, B = cfg["T"], cfg["B"]
    gen = torch.Generator(device=dev); gen.manual_seed(cfg["seed"])
    ar = torch.arange(T + 1, device=dev)

    def batch():
        off = torch.randint(0, n - T - 1, (B,), device=dev, generator=gen)
        w = train[off[:, None] + ar]
        return w[:, :-1], w[:, 1:]

    nval = (len(val) - 1) // T
    vx = val[: nval * T].view(nval, T); vy = val[1: nval * T + 1].view(nval, T)
    tail = len(val) - 1 - nval * T

    @torch.no_grad()
    def evaluate():
        m.eval(); tot = 0.0
        with torch.autocast("cuda", torch.bfloat16, enabled=cfg["bf16"]):
            for i in range(0, nval, 256):
                tot += float(m(vx[i:i + 256], vy[i:i + 256]))
            if tail:
                tot += float(m(val[nval * T: nval * T + tail][None], val[nval * T + 1:][None]))
        m.train()
        return tot / (len(val) - 1)

    def lr_at(it):
        if it < cfg["warm"]:
            return (it + 1) / cfg["warm"]
        frac = min(1.0, (it - cfg["warm"]) / max(1, cfg["steps"] - cfg["warm"]))
        mr = cfg["min_lr"] / cfg["lr"]
        return mr + 0.5 * (1 - mr) * (1 + math.cos(math.pi * frac))

    def step(it):
        s = lr_at(it)
        for o in opts:
            for g in o.param_groups:
                g["lr"] = g["base_lr"] * s
        x, y = batch()
        with torch.autocast("cuda", torch.bfloat16, enabled=cfg["bf16"]):
            loss = f(x, y) / (B * T)
        loss.backward()
        if cfg["clip"]:
            torch.nn.utils.clip_grad_norm_(m.parameters(), cfg["clip"])
        for o in opts:
            o.step(); o.zero_grad(set_to_none=True)

    # warm-up / compile on throwaway copies of state is complex: time it and subtract (steps do train)
    t0 = time.perf_counter()
    state = {k: v.clone() for k, v in m.state_dict().items()}
    ostate = [o.state_dict() for o in opts]
    for i in range(3):
        step(0)
    evaluate()
    torch.cuda.synchronize()
    setup = time.perf_counter() - t0
    m.load_state_dict(state)
    for o, s_ in zip(opts, ostate):
        o.load_state_dict(s_)
    gen.manual_seed(cfg["seed"])
    train_s = eval_s = 0.0; hit = None; best = 9.9; curve = []
    for it in range(cfg["steps"]):
        t1 = time.perf_counter()
        step(it)
        if (it + 1) % cfg["eval_every"] == 0 or it + 1 == cfg["steps"]:
            torch.cuda.synchronize(); train_s += time.perf_counter() - t1
            t2 = time.perf_counter(); vl = evaluate(); eval_s += time.perf_counter() - t2
            best = min(best, vl); curve.append((it + 1, round(train_s, 2), round(vl, 4)))
            if vl <= TARGET:
                hit = (it + 1, train_s); break
            if train_s > cfg["max_s"]:
                break
        else:
            train_s += time.perf_counter() - t1
    print(json.dumps(dict(name=cfg.get("name"), hit=hit, best=round(best, 4), train_s=round(train_s, 2),
                          eval_s=round(eval_s, 2), setup_s=round(setup, 1),
                          ms_step=round(1e3 * train_s / curve[-1][0], 2), curve=curve[-6:])), flush=True)


for r in json.loads(sys.argv[2]):
    try:
        run(r)
    except Exception as e:
        print(json.dumps(dict(name=r.get("name"), error=f"{type(e).__name__}: {e}"[:300])), flush=True)
    torch.cuda.empty_cache()
