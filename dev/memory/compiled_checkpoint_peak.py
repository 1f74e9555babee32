"""What a whole-model compiled transformers GPT-2 with full recomputation holds at its step's peak, on the CPU.

    python3 dev/memory/compiled_checkpoint_peak.py [--layers 4 --seq 128 --batch 4 --heads 3 --hidden 48
        --ffn 160 --vocab 72] [--attention eager|sdpa] [--fp32] [--scope model|blocks|none] [--no-checkpointing]

The lab's ``--torch-compile --torch-compile-scope model --gradient-checkpointing full --attn-implementation eager
--bf16``: transformers' ``gradient_checkpointing_enable`` (non-reentrant), then ``torch.compile`` (inductor) of the
whole model, one training step under bf16 autocast (AdamW foreach) after a compiling one. The step is measured at
the CPU allocator (the profiler's memory events, as ``tracker.allocator_peak_step``: inductor's kernels' buffers
too), and the allocations alive at the peak are listed by size (an allocation and a free of the same size pair up,
so the count of each size alive is exact); the default shape makes the step's tensors' sizes tell them apart
(a s^2 b scores fp32 / bf16 / bool, b s^2 masks, N h, N f, N v). Prints the estimator's peak and moments beside.
``--scale-to a,b,s,h,f,v`` replays the measured timeline with every named allocation at that shape (the schedule
is the small model's; a v of 0 leaves the logits out, to see the layers' own peak). ``--device cuda`` records the
CUDA allocator's history instead.

What it found (torch 2.13 CPU, transformers 5.24; GPT-2 of 12 layers, h 48, 3 heads, f 176, v 3120, s 256, b 2,
bf16 autocast; the ratios a s / h = 16 and v / h = 65 of GPT-2 124M at s 1024): the step's peak is the loss's
backward, the two bf16 logits-sized tensors beside the 12 fp32 checkpoints, 13.79 MB measured against 13.91 MB
estimated (+0.9%). Scaled to GPT-2 124M at b 256 x s 1024, the layers' own peak (in the body's backward graph)
holds one fp32 and two bf16 a s^2 b tensors, the fp32 additive mask (b s^2, once), 3 N f bf16, 11 N h bf16 and
15 N h fp32: 45,985 MiB above the parameters and optimizer state, under the estimator's recompute moment (49,137
MiB in all); one recomputed layer's scores at a time, not every layer's. So on this CPU the estimator's 62,211 MiB
for the tune grid's 256x2 row is the right order, and what ran out of memory on the H100 (torch 2.11) is not
reproduced here.

On a GPU (an H200, torch 2.11, transformers 5.17; `compiled-checkpoint-h200/`, the default shape, --device cuda):
b 32 measured 25,347,152 bytes against 25,188,608 estimated (-0.6%), b 128 94,599,760 against 96,606,464 (+2.1%),
both at the estimator's own moment (the last layer's recomputation). At this shape the GPU's code generation keeps
what the estimator says; the H100's out-of-memory at GPT-2 124M's full shape is still not reproduced at a small one.

At GPT-2 124M's full shape on an H200 (`dev/device/recompute_peaks.sh`, `results/memory/recompute-peaks/`, b 64 and
128) it is: compiled whole, the peak moves into block 12's recomputed attention with d(logits) (one N v bf16) still
alive, 5.6% and 5.5% above the loss's backward the estimator chose; compiled per block, the loss's backward as
estimated (+0.0%). The estimator's moment for it is D27.
"""

from __future__ import annotations

import argparse
from collections import Counter


def build(args):
    import torch
    import transformers

    torch._dynamo.reset()
    torch.manual_seed(0)
    cfg = dict(model_type="gpt2", n_embd=args.hidden, n_layer=args.layers, n_head=args.heads, n_inner=args.ffn,
               vocab_size=args.vocab, n_positions=args.seq, embd_pdrop=0.0, attn_pdrop=0.0, resid_pdrop=0.0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**cfg),
                                                          attn_implementation=args.attention)
    model.train()
    if args.checkpointing:
        (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)(
            **({"gradient_checkpointing_kwargs": {"use_reentrant": False}}
               if not hasattr(model, "activation_checkpointing_enable")
               else {"activation_checkpointing_kwargs": {"use_reentrant": False}}))
    run = model
    if args.scope == "model":
        run = torch.compile(model)
    elif args.scope == "blocks":
        for layer in model.transformer.h:
            layer.compile()
    return cfg, model, run


def peak_of(events):
    """The largest sum of the (time, +-bytes) events' prefix, its index, and the sizes alive there (size -> count)."""
    live = peak = at = 0
    for i, (_, n) in enumerate(events):
        live += n
        if live > peak:
            peak, at = live, i
    sizes = Counter()
    for _, n in events[:at + 1]:
        sizes[abs(n)] += 1 if n > 0 else -1
    return peak, at, sizes


def measure(args):
    import torch
    from torch.profiler import ProfilerActivity, profile

    cfg, model, run = build(args)
    model.to(args.device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=args.device == "cpu",
                            fused=args.device != "cpu")
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), device=args.device)

    def step():
        opt.zero_grad(set_to_none=True)                # (a step that failed part-way left gradients behind)
        with torch.autocast(args.device, dtype=torch.bfloat16, enabled=not args.fp32):
            loss = run(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        del loss
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    existing = [*model.parameters(), *model.buffers()]
    for state in opt.state.values():
        existing += [v for v in state.values() if isinstance(v, torch.Tensor)]
    baseline = sum(t.untyped_storage().nbytes() for t in {t.untyped_storage().data_ptr(): t for t in existing}.values())
    if args.device == "cuda":
        return (cfg, baseline) + cuda_step(args, step)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    kineto = list(prof.profiler.kineto_results.events())
    events = sorted((e.start_ns(), e.nbytes()) for e in kineto if e.name() == "[memory]")
    # the compiled graphs' calls, to say where the peak is
    spans = sorted((e.start_ns(), e.end_ns(), e.name()) for e in kineto
                   if "Compiled" in e.name() or "CompiledFunction" in e.name() or e.name().startswith("Optimizer"))
    peak, at, sizes = peak_of(events)
    t_peak = events[at][0]
    where = [name for s, e, name in spans if s <= t_peak <= e]
    return cfg, baseline, peak, sizes, where, events, at, spans


def trace_events(snap: dict) -> tuple[list[dict], list[tuple[int, int]]]:
    """A CUDA allocator snapshot's allocations and completed frees of device 0, and as (index, +-bytes) events."""
    trace = [e for e in snap["device_traces"][0] if e["action"] in ("alloc", "free_completed")]
    return trace, [(i, e["size"] if e["action"] == "alloc" else -e["size"]) for i, e in enumerate(trace)]


def cuda_step(args, step):
    """One step under the CUDA allocator's history: (peak above what was allocated before, sizes alive at the
    peak, where (the peak allocation's Python frames), events (time, +-bytes), index, spans)."""
    import pickle

    import torch

    # the history with Python frames only: with the default C++ frames too, GPT-2's per-block compiled layers
    # failed in their recomputation on an H200 (torch 2.11: "SystemError: ... returned NULL without setting an
    # exception" from the compiled block's autograd function); without frames as the last resort
    for recorded in ({"stacks": "python"}, {"context": None}):
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.memory._record_memory_history(max_entries=1_000_000, **recorded)
        try:
            step()
            break
        except SystemError as exc:
            torch.cuda.memory._record_memory_history(enabled=None)
            print(f"cuda: the step failed under the allocator's history {recorded}: {exc}; again with less recorded")
    else:
        raise SystemExit("cuda: the step fails under the allocator's history however little it records")
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    peak_allocated = torch.cuda.max_memory_allocated() - before
    trace, events = trace_events(snap)
    peak, at, sizes = peak_of(events)
    frames = trace[at].get("frames") or []
    where = [f"{f['filename'].split('/')[-1]}:{f['line']} {f['name']}" for f in frames[:6]]
    print(f"cuda: max_memory_allocated - before = {peak_allocated:,}; the trace's peak {peak:,}")
    if args.out:
        with open(f"{args.out}/snapshot-b{args.batch}-{args.attention}-{args.scope}.pickle", "wb") as fh:
            pickle.dump(snap, fh)
    return peak_allocated, sizes, where, events, at, []


def terms(a, b, s, h, f, v):
    """Elements of the step's tensor kinds."""
    N = b * s
    return {"scores a s^2 b": a * b * s * s, "mask b s^2": b * s * s, "N h": N * h, "N f": N * f, "N v": N * v,
            "N 3h": N * 3 * h, "rows a b s": a * b * s, "rows N": N}


def names(args):
    """Byte sizes of the step's tensors, for the measured shape: {bytes: [(kind, dtype bytes), ...]}."""
    out = {}
    for what, n in terms(args.heads, args.batch, args.seq, args.hidden, args.ffn, args.vocab).items():
        for dt, k in (("fp32", 4), ("bf16", 2), ("bool", 1)):
            out.setdefault(n * k, []).append((what, dt, k))
    return out


def scaled_timeline(args, events, dims):
    """The live bytes after every event with each allocation of a named size (unambiguous) counted at ``dims``
    (a, b, s, h, f, v), the others as measured: (peak, index, counts by name at the peak)."""
    label = names(args)
    big = terms(*dims)
    live = peak = 0
    counts, best = Counter(), None
    at = 0
    for i, (_, n) in enumerate(events):
        size = abs(n)
        kinds = label.get(size, [])
        if len(kinds) == 1:
            what, dt, k = kinds[0]
            scaled = big[what] * k
            key = f"{what} {dt}"
        else:
            scaled, key = size, f"other {size}"
        sign = 1 if n > 0 else -1
        live += sign * scaled
        counts[key] += sign
        if live > peak:
            peak, at, best = live, i, Counter(counts)
    return peak, at, best


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--heads", type=int, default=3)
    p.add_argument("--hidden", type=int, default=48)
    p.add_argument("--ffn", type=int, default=160)
    p.add_argument("--vocab", type=int, default=72)
    p.add_argument("--attention", default="eager")
    p.add_argument("--fp32", action="store_true")
    p.add_argument("--scope", default="model")
    p.add_argument("--no-checkpointing", dest="checkpointing", action="store_false")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", default="", help="cuda: write the allocator snapshot here")
    p.add_argument("--scale-to", default="", help="a,b,s,h,f,v: the timeline with each named tensor at that shape")
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    from fasttrain.memory import precise
    from fasttrain.memory.hf_config import setup_from_hf_config

    cfg, baseline, peak, sizes, where, events, at, spans = measure(args)
    setup = setup_from_hf_config(cfg, micro_batch=args.batch, seq=args.seq, precision="fp32" if args.fp32 else "bf16",
                                 attention=args.attention, recompute="full" if args.checkpointing else "none",
                                 workspace_mib=0.0, compiled=args.scope if args.scope != "none" else "none",
                                 optimizer="fused" if args.device == "cuda" else "foreach")
    cuda = args.device == "cuda"
    est = precise.estimate(setup, mask_bytes=1 if cuda else 4, kernel_temps=cuda)
    measured = baseline + peak
    print(f"measured {measured:,} (baseline {baseline:,} + step {peak:,}) at event {at}/{len(events)} in {where}; "
          f"estimated {est.total:,.0f} ({100 * (est.total - measured) / measured:+.1f}%) at {est.extra['peak_moment']}")
    label = names(args)
    print("alive at the peak, by size:")
    for n, c in sorted(sizes.items(), key=lambda kv: -kv[0] * kv[1]):
        if c and n * c >= 0.005 * peak:
            kinds = " | ".join(f"{w} {d}" for w, d, _ in label.get(n, [])) or "?"
            print(f"  {c:4d} x {n:>10,} = {n * c:>12,}  {kinds}")
    if args.scale_to:
        dims = tuple(int(x) for x in args.scale_to.split(","))
        big = terms(*dims)
        top, i, counts = scaled_timeline(args, events, dims)
        t = events[i][0]
        where = [name for s0, e0, name in spans if s0 <= t <= e0]
        print(f"scaled to a, b, s, h, f, v = {dims}: the step's peak {top / 2**20:,.0f} MiB above the baseline, "
              f"event {i} in {where[-1:]}; alive then:")
        for key, c in sorted(counts.items(), key=lambda kv: kv[0]):
            if c and not key.startswith("other"):
                what, dt = key.rsplit(" ", 1)
                k = {"fp32": 4, "bf16": 2, "bool": 1}[dt]
                print(f"  {c:4d} x {key:24s} {c * big[what] * k / 2**20:10,.0f} MiB")
        other = sum(int(k.split()[1]) * c for k, c in counts.items() if k.startswith("other"))
        print(f"  other sizes (unscaled) {other / 2**20:,.1f} MiB")
    print("estimator's moments (bytes above the baseline's params/opt):")
    for m in est.extra["moments"]:
        print(f"  {m['name']:40s} {m['bytes']:>14,.0f} kept {m['kept']:>12,.0f} transient {m['transient']:>12,.0f}")


if __name__ == "__main__":
    main()
