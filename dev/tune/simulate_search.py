"""tune's search on a modelled GPU: what it would measure, in what order, and what it would pick, within a budget
(no GPU: a fake clock and a speed model). Used to plan a device run and to check a change to the search before
spending device time on it.

The model is the Llama 1B case of bench_tune.py (seq 2048, 131,072 tokens a step) on an H100:
- measured in the first look (h100-first-look/, dev/tune/README.md): sdpa 8 x 8 2.6 s a step; eager attention
  2.8x slower; torch.compile (whole model) about 0.8x (the HF Trainer's compile 60,398 tokens/s against 50,162);
  liger 0.72x (70,283 against 50,162); liger's fused cross-entropy fails under whole-model compile;
- assumed: per-block compile 0.85x (and liger runs with it: the loss is outside the compiled blocks), full
  checkpointing 1.33x, fused AdamW 0.97x, preloading 1.0x; a build 6 s, a compile 45 s cold and 10 s for a graph
  compiled before; ``--slow-reduce-overhead``: reduce-overhead with accumulation 25x slower (as measured before the
  trainer's gradient fix), else as default compile.

    python3 dev/tune/simulate_search.py --budget 8m [--slow-reduce-overhead]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

MIB = 2 ** 20


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
        t = 2.6 * cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps / 64
        t *= 2.8 if cfg.attn_implementation == "eager" else 1.0
        if cfg.torch_compile:
            t *= 0.85 if cfg.torch_compile_scope == "blocks" else 0.8
            if args.slow_reduce_overhead and cfg.torch_compile_mode == "reduce-overhead" \
                    and cfg.gradient_accumulation_steps > 1:
                t *= 25
        t *= 1.33 if cfg.gradient_checkpointing == "full" else 1.0
        t *= 0.72 if cfg.use_liger_kernel else 1.0
        t *= 0.97 if cfg.optim == "adamw_torch_fused" else 1.0
        return t * (1.0 + 0.16 / cfg.per_device_train_batch_size)     # small micro-batches a little slower

    def measure(cfg, steps, time_allowed_s=None):
        start = clock.now
        clock.now += 6
        if cfg.torch_compile:
            graph = (cfg.attn_implementation, cfg.torch_compile_mode, cfg.torch_compile_scope,
                     cfg.gradient_checkpointing, cfg.use_liger_kernel, cfg.per_device_train_batch_size)
            clock.now += 10 if graph in compiled else 45
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
