"""What is alive at a training step's peak GPU memory, measured, beside the estimator's prediction.

Trains a transformers model built from a config for a few steps (as the estimator's GPU test does:
``model(input_ids, labels, use_cache=False).loss``, AdamW for-each) with the caching allocator's history
recorded, replays the history to the moment of the highest allocated total, and groups the blocks alive
then by the Python line that allocated them. Beside it: the estimator's total and its moments, so a
difference can be traced to the tensors behind it. One JSON per case under OUT.

    python3 dev/memory/peak_anatomy.py OUT                 # every case below
    python3 dev/memory/peak_anatomy.py OUT --only llama-sdpa-bf16
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import sys
from pathlib import Path

GPT2 = dict(model_type="gpt2", n_embd=768, n_layer=6, n_head=12, vocab_size=50257, n_positions=1024)
LLAMA = dict(model_type="llama", hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
             num_attention_heads=16, num_key_value_heads=4, vocab_size=32000, max_position_embeddings=1024)
# the bench lab GPT-2 124M: vocab of the BPE trained on the corpus, the shakespeare-char preset's batch and context
GPT2_124M = dict(model_type="gpt2", n_embd=768, n_layer=12, n_head=12, vocab_size=8192, n_positions=1024)

# name: (config, attention, precision, recompute, compile, batch, seq)
CASES = {
    "gpt2-sdpa-bf16": (GPT2, "sdpa", "bf16", "none", "none", 4, 1024),
    "llama-sdpa-bf16": (LLAMA, "sdpa", "bf16", "none", "none", 4, 1024),
    "llama-eager-bf16": (LLAMA, "eager", "bf16", "none", "none", 4, 1024),
    "llama-eager-fp32": (LLAMA, "eager", "fp32", "none", "none", 4, 1024),
    "llama-sdpa-bf16-batch1": (LLAMA, "sdpa", "bf16", "none", "none", 1, 1024),
    "llama-sdpa-bf16-compiled": (LLAMA, "sdpa", "bf16", "none", "model", 4, 1024),
    "gpt2-124m-eager-fp32": (GPT2_124M, "eager", "fp32", "none", "none", 64, 256),
    "gpt2-124m-eager-fp32-compiled": (GPT2_124M, "eager", "fp32", "none", "model", 64, 256),
    "gpt2-124m-sdpa-bf16-compiled": (GPT2_124M, "sdpa", "bf16", "none", "model", 64, 256),
    # each decoder layer compiled alone, with GPT-2's default dropout (0.1) and without it
    "gpt2-eager-bf16-blocks": (GPT2, "eager", "bf16", "none", "blocks", 4, 1024),
    "gpt2-eager-bf16-blocks-nodropout": (dict(GPT2, embd_pdrop=0.0, attn_pdrop=0.0, resid_pdrop=0.0), "eager", "bf16",
                                         "none", "blocks", 4, 1024),
    # sdpa in fp32 with grouped key/value heads: transformers passes enable_gqa, which of torch's kernels runs?
    "llama-sdpa-fp32": (LLAMA, "sdpa", "fp32", "none", "none", 4, 1024),
}


def frame_of(frames) -> str:
    """The innermost frame in transformers, torch.nn.functional, the optimizer or this script."""
    for f in frames:
        name = f.get("filename", "")
        if any(k in name for k in ("transformers/", "torch/nn/functional", "torch/optim", "peak_anatomy",
                                   "torch/_inductor", "torch/autograd", "torch/_functorch")):
            return f"{name.split('site-packages/')[-1]}:{f.get('line')} {f.get('name')}"
    return "?" if not frames else f"{frames[0].get('filename', '?')}:{frames[0].get('line')}"


def replay_to_peak(trace) -> tuple[int, int, list]:
    """Allocated bytes at the peak, the event index, and the blocks alive there (size, frame): one pass
    finds the highest total, a second stops there for its live set (a copy at every new high is slow)."""
    sizes: dict = {}
    total = best = best_i = 0
    for i, e in enumerate(trace):
        if e["action"] == "alloc":
            sizes[e["addr"]] = e["size"]
            total += e["size"]
            if total > best:
                best, best_i = total, i
        elif e["action"] == "free_requested" and e["addr"] in sizes:
            total -= sizes.pop(e["addr"])
    live: dict = {}
    for e in trace[:best_i + 1]:
        if e["action"] == "alloc":
            live[e["addr"]] = (e["size"], frame_of(e.get("frames", [])))
        elif e["action"] == "free_requested":
            live.pop(e["addr"], None)
    return best, best_i, list(live.values())


def run_case(name, cfg, attention, precision, recompute, compiled, batch, seq, steps=3) -> dict:
    import torch
    import transformers

    from fasttrain.memory.hf_config import setup_from_hf_config
    from fasttrain.memory.precise import estimate

    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**cfg),
                                                          attn_implementation=attention).cuda()
    model.train()
    if recompute == "full":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    run = torch.compile(model) if compiled == "model" else model
    if compiled == "blocks":
        for layer in (model.transformer.h if hasattr(model, "transformer") else model.model.layers):
            layer.compile()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    ids = torch.randint(0, cfg["vocab_size"], (batch, seq), device="cuda")
    for _ in range(steps):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = run(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        del loss
    torch.cuda.synchronize()
    measured = torch.cuda.max_memory_allocated() - before
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    trace = snap["device_traces"][0]
    peak, at, alive = replay_to_peak(trace)
    by_frame = collections.defaultdict(lambda: [0, 0, collections.Counter()])
    for size, frame in alive:
        g = by_frame[frame]
        g[0] += size
        g[1] += 1
        g[2][size] += 1
    groups = sorted(([f, b, n, dict(c.most_common(4))] for f, (b, n, c) in by_frame.items()), key=lambda g: -g[1])
    # the event's neighbourhood: where in the step the peak falls
    around = [frame_of(e.get("frames", [])) for e in trace[max(0, at - 3):at + 1]]
    del model, opt, ids, run
    gc.collect()
    torch.cuda.empty_cache()
    setup = setup_from_hf_config(cfg, micro_batch=batch, seq=seq, precision=precision, attention=attention,
                                 recompute=recompute, optim="adamw_torch", compiled=compiled)
    est = estimate(setup)
    MiB = 2 ** 20
    return {"case": name, "attention": attention, "precision": precision, "recompute": recompute,
            "compiled": compiled, "batch": batch, "seq": seq, "measured_mib": measured / MiB,
            "replayed_peak_mib": peak / MiB, "trace_events": len(trace), "peak_event": at, "peak_near": around,
            "estimate_mib": est.total / MiB,
            "estimate_moments": [(m["name"], m["bytes"] / MiB) for m in est.extra["moments"]],
            "alive_at_peak": [{"frame": f, "mib": b / MiB, "blocks": n, "sizes": s} for f, b, n, s in groups]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--only", default="", help="comma-separated case names")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    names = [n for n in CASES if not args.only or n in args.only.split(",")]
    for name in names:
        try:
            rec = run_case(name, *CASES[name])
        except Exception as exc:        # one case's failure is reported and the others still run
            print(f"{name}: FAILED {type(exc).__name__}: {exc}"[:400], flush=True)
            continue
        (out / f"{name}.json").write_text(json.dumps(rec, indent=1))
        err = 100 * (rec["estimate_mib"] - rec["measured_mib"]) / rec["measured_mib"]
        print(f"{name}: measured {rec['measured_mib']:.1f} MiB (replayed {rec['replayed_peak_mib']:.1f}), "
              f"estimate {rec['estimate_mib']:.1f} ({err:+.1f}%); peak near {rec['peak_near'][-1]}", flush=True)
        for g in rec["alive_at_peak"][:14]:
            print(f"    {g['mib']:9.1f} MiB {g['blocks']:5d} blocks  {g['frame'][:110]}  {g['sizes']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
