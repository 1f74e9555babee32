"""tune's search on a modelled GPU: what it would measure, in what order, and what it would pick, within a budget
(no GPU: a fake clock and a speed model). Used to plan a device run and to check a change to the search before
spending device time on it.

The model is the Llama 1B case of bench_tune.py (seq 2048, 131,072 tokens a step) on an H100, its figures those
the committed run's tune measured (one timed step each in its screen, dev/tune/README.md): sdpa 8 x 8 51,305 tokens/s
(2.55 s a step), 4 x 16 48,083 (small micro-batches slower: 1 + 0.55 / b); eager attention 2.4x slower (2 x 32:
18,088); whole-model compile 0.80x the step time (64,071), reduce-overhead the same (64,031: the trainer's kept
gradients replay its graphs), per-block compile 0.70x (73,006); full checkpointing 1.27x (32 x 2: 42,451); liger
0.77x (66,321) eager, but 1.10x inside per-block compiled layers (block + liger 66,219: its kernels replace what
the compiled layer fuses), and failing under whole-model compile (the HF Trainer's compile + liger); fused AdamW and
preloading 1.0x; liger's fused cross-entropy alone (``--liger-kernels fused_linear_cross_entropy``) is assumed
0.95x with or without compiled layers (``FUSED_CE``; not measured). A build 6 s; a whole-model compile 50 s cold, a per-block one 6 s, 10 s for a graph compiled
before. ``--slow-reduce-overhead``: reduce-overhead with accumulation 25x slower (as measured before the trainer's
gradient fix).

    python3 dev/tune/simulate_search.py --budget 8m [--slow-reduce-overhead]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

MIB = 2 ** 20
# assumed, not measured: liger's fused linear cross-entropy alone (no logits made, the layers as they are) 0.95x the
# step time, compiled layers or not (the eager head's fp32 logits and their log-softmax are a few % of a step)
FUSED_CE = 0.95


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budget", default="8m")
    ap.add_argument("--slow-reduce-overhead", action="store_true")
    ap.add_argument("--max-candidates", type=int, default=8)
    args = ap.parse_args(argv)

    import bench_tune as B
    from fasttrain.lab import tune as T

    class Clock:
        now = 0.0

        def __call__(self):
            return self.now

    clock, compiled = Clock(), set()

    def step_s(cfg) -> float:
        t = 2.555 / 1.069 * cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps / 64
        t *= 1.0 + 0.55 / cfg.per_device_train_batch_size          # small micro-batches slower
        t *= 2.38 if cfg.attn_implementation == "eager" else 1.0
        blocks = cfg.torch_compile and cfg.torch_compile_scope == "blocks"
        if cfg.torch_compile:
            t *= 0.703 if blocks else 0.80
            if args.slow_reduce_overhead and cfg.torch_compile_mode == "reduce-overhead" \
                    and cfg.gradient_accumulation_steps > 1:
                t *= 25
        t *= 1.27 if cfg.gradient_checkpointing == "full" else 1.0
        if cfg.use_liger_kernel and cfg.liger_kernels == "fused_linear_cross_entropy":
            t *= FUSED_CE
        elif cfg.use_liger_kernel:
            t *= 1.10 if blocks else 0.774
        return t

    def measure(cfg, steps, time_allowed_s=None):
        start = clock.now
        clock.now += 6
        if cfg.torch_compile:
            graph = (cfg.attn_implementation, cfg.torch_compile_mode, cfg.torch_compile_scope,
                     cfg.gradient_checkpointing, cfg.use_liger_kernel, cfg.per_device_train_batch_size)
            clock.now += 10 if graph in compiled else 6 if cfg.torch_compile_scope == "blocks" else 50
            compiled.add(graph)
            if cfg.use_liger_kernel and cfg.torch_compile_scope != "blocks":
                raise RuntimeError("TorchRuntimeError: RuntimeError when making fake tensor call")
        clock.now += (steps + T.warmup_steps_for(cfg)) * step_s(cfg)
        if time_allowed_s is not None and clock.now - start > time_allowed_s:
            clock.now = start + time_allowed_s
            return T.Probe(steps=steps, stopped=True, error=f"stopped after {time_allowed_s:.0f} s")
        tokens = cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps * cfg.context
        return T.Probe(steps=steps, tokens_per_s=tokens / step_s(cfg))

    with tempfile.TemporaryDirectory() as work:
        B.prepare(Path(work), "llama-1b", n_tokens=300_000)
        base = B.lab_base(Path(work), "llama-1b", False).with_(device="cuda")
        _, hf = T.model_of(base)
        memory = T.DeviceMemory("H100 (modelled)", 81079 * MIB, context_bytes=527 * MIB, reserve=0.17)
        result = T.search(base, seq=2048, global_batch_tokens=131072, measure=measure,
                          predict=T.lab_predictor(hf["vocab_size"], hf), memory=memory, family="llama",
                          budget_s=T.parse_budget(args.budget), clock=clock, steps=3,
                          max_candidates=args.max_candidates, log=lambda line: print(f"{clock.now:6.0f} s  {line}"),
                          liger_reason=None, hf=True)
        runs = [e for e in result.entries if memory.fits(e.predicted_bytes)]

        def modelled(e):
            o = base.with_(**e.candidate.overrides_dict())
            fails = o.torch_compile and o.use_liger_kernel and o.torch_compile_scope != "blocks"
            return 0.0 if fails else 131072 / step_s(o)

        best = max(runs, key=modelled)
        pick = result.pick
        print(f"pick: {pick.candidate.label if pick else None}, {pick.last.tokens_per_s if pick else 0:,.0f} tokens/s "
              f"in {result.tune_s:.0f} s; the model's best that fits: {best.candidate.label}, {modelled(best):,.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
