"""One of tune's configurations measured on a larger card with the CUDA caching allocator capped at a smaller card's
memory: does a configuration that ran out of memory on that card still do so at today's code?

The cap is ``torch.cuda.set_per_process_memory_fraction``: the allocator refuses a new segment once its reserved
bytes would pass ``fraction x total``, frees its cache and retries, then raises out of memory -- what it does on a
card of that size (the other card's CUDA context, outside the allocator, is taken off: ``--cap-mib`` is the
allocator's room there, ``total_mib - context_mib`` of that card's search record). Prints one JSON line: the peak
allocated and reserved (MiB), out of memory or not, and the estimator's prediction.

    python3 dev/memory/capped_point.py /tmp/tune-work --model gpt2-124m --cap-mib 80552 \\
        --set '{"per_device_train_batch_size": 256, "gradient_accumulation_steps": 2, "attn_implementation": "eager",
                "torch_compile": true, "gradient_checkpointing": "full", ...}'

The work folder is ``dev/tune/bench_tune.py``'s (``tune_bench.sh prepare MODEL`` first); the configuration is the
grid's: the lab's base for that model with the overrides of ``--set``. ``--cap-mib`` is optional: without it the point
runs on the whole card. ``--snapshot DIR``: the CUDA allocator's history over the probe's last step, its pickle in DIR,
and what was alive at the step's peak, by size, named after the model's shape (N h, N f, N kv, N v, a s^2 b, in
bf16 or fp32; N = micro-batch x context): where a measured peak the estimator misses comes from.

    python3 dev/memory/capped_point.py /tmp/tune-work --model llama-1b --snapshot $OUT/llama-64x1 \
        --set '{"per_device_train_batch_size": 64, "gradient_accumulation_steps": 1, "torch_compile": true, ...}'
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "dev" / "tune"))
sys.path.insert(0, str(ROOT / "dev" / "memory"))

MIB = 2**20


def capped_fraction(cap_mib: float, total_bytes: int) -> float:
    """The allocator's fraction of this card's memory that is ``cap_mib`` (refused above this card's own)."""
    fraction = cap_mib * MIB / total_bytes
    if not 0 < fraction <= 1:
        raise SystemExit(f"--cap-mib {cap_mib:,.0f}: this card has {total_bytes / MIB:,.0f} MiB; give a cap below it")
    return fraction


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("work", type=Path, help="bench_tune's work folder (prepared)")
    ap.add_argument("--model", required=True)
    ap.add_argument("--set", required=True, help="the configuration's overrides, a JSON object (a grid point's)")
    ap.add_argument("--cap-mib", type=float, default=None, help="the allocator's room on the smaller card")
    ap.add_argument("--snapshot", type=Path, default=None,
                    help="a folder: the allocator's history of the last step there, what is alive at its peak printed")
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args(argv)
    try:
        overrides = json.loads(args.set)
    except ValueError as exc:
        ap.error(f"--set: not JSON ({exc})")
    if not isinstance(overrides, dict):
        ap.error("--set: give a JSON object of the configuration's fields")

    import torch

    import bench_tune as B
    from fasttrain.lab import tune as T
    from fasttrain.lab.build import resolve_device
    from fasttrain.lab.config import validate
    from fasttrain.lab.measure import free_memory

    if args.model not in B.MODELS:
        ap.error(f"--model {args.model}: one of {', '.join(B.MODELS)}")
    if not torch.cuda.is_available():
        raise SystemExit("capped_point.py needs a CUDA GPU: the cap is the CUDA caching allocator's")
    cfg = validate(B.lab_base(args.work, args.model, True).with_(**overrides))
    device = resolve_device(cfg)
    fraction = None
    if args.cap_mib is not None:
        fraction = capped_fraction(args.cap_mib, torch.cuda.get_device_properties(device).total_memory)
        # the cap is per device index ("cuda" alone names none)
        torch.cuda.set_per_process_memory_fraction(fraction, device.index if device.index is not None
                                                   else torch.cuda.current_device())
    _, hf_config = T.model_of(cfg)
    predicted = T.lab_predictor(0, hf_config)(cfg)
    if args.snapshot:
        args.snapshot.mkdir(parents=True, exist_ok=True)
        # the history of the last step alone: the earlier ones compile and warm up (their frees come back too)
        recording = last_step_recorder(torch, T.warmup_steps_for(cfg) + args.steps)
    probe = T.run_probe(T.lab_measure(None), cfg, args.steps, None, lambda: free_memory(device))
    if args.snapshot:
        alive = recording.finish(args.snapshot, shape_names(cfg, hf_config))
    print(json.dumps({
        "model": args.model, "overrides": overrides, "cap_mib": args.cap_mib, "fraction": fraction,
        "oom": bool(probe.oom), "error": probe.error, "tokens_per_s": probe.tokens_per_s,
        "peak_mib": (probe.peak_bytes or 0) / MIB or None,
        "peak_reserved_mib": torch.cuda.max_memory_reserved(device) / MIB,
        "predicted_mib": predicted / MIB if predicted else None,
        **({"alive_at_peak": alive} if args.snapshot else {})}))
    return 0


def shape_names(cfg, hf_config: dict) -> dict[int, list[str]]:
    """Byte sizes of the step's named tensors at ``cfg``'s micro-batch and context: {bytes: ["N h bf16", ...]}
    (a size two names share lists both)."""
    h = hf_config.get("hidden_size") or hf_config.get("n_embd")
    heads = hf_config.get("num_attention_heads") or hf_config.get("n_head")
    f = hf_config.get("intermediate_size") or hf_config.get("n_inner") or 4 * h
    kv = (hf_config.get("num_key_value_heads") or heads) * (hf_config.get("head_dim") or h // heads)
    v, s = hf_config.get("vocab_size"), cfg.context
    n = cfg.per_device_train_batch_size * s
    kinds = {"N h": n * h, "N f": n * f, "N kv": n * kv, "N v": n * v, "a s^2 b": heads * s * n,
             "N": n, "v h": v * h}
    out: dict[int, list[str]] = {}
    for what, elements in kinds.items():
        for dtype, size in (("fp32", 4), ("bf16", 2)):
            out.setdefault(elements * size, []).append(f"{what} {dtype}")
    return out


def alive_by_name(events: list[tuple[int, int]], names: dict[int, list[str]], top: int = 12) -> dict:
    """From (index, +-bytes) allocator events: the peak above what was allocated when they start, and what of the
    events' own allocations was alive there by name ("N f bf16": count), the rest by size, largest first."""
    from compiled_checkpoint_peak import peak_of

    peak, _, sizes = peak_of(events)
    named = {}
    for size, count in sorted(sizes.items(), key=lambda kv: -kv[0] * kv[1]):
        if count <= 0:
            continue
        label = " / ".join(names.get(size, [])) or f"{size:,} B"
        named[label] = named.get(label, 0) + count
        if len(named) >= top:
            break
    return {"peak_above_start_mib": peak / MIB, "alive": named}


class last_step_recorder:
    """Records the CUDA allocator's history from the start of the probe's last step (counted by the lab trainer's
    step calls) and, at ``finish``, writes its pickle and answers :func:`alive_by_name` over that step's events."""

    def __init__(self, torch, steps: int):
        """``steps``: the probe's optimizer steps in all, its warm-up ones with them."""
        from fasttrain.lab.trainer import Trainer

        self.torch, self.calls, self.steps, self.Trainer = torch, 0, steps, Trainer
        self.original = Trainer.train_step

        def counted(trainer, *args, **kwargs):
            self.calls += 1
            if self.calls == self.steps:
                torch.cuda.synchronize()
                torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
            return self.original(trainer, *args, **kwargs)
        Trainer.train_step = counted

    def finish(self, folder: Path, names: dict) -> dict:
        import pickle

        torch = self.torch
        self.Trainer.train_step = self.original
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        (folder / "snapshot.pickle").write_bytes(pickle.dumps(snap))
        from compiled_checkpoint_peak import trace_events

        return alive_by_name(trace_events(snap)[1], names)


if __name__ == "__main__":
    sys.exit(main())
