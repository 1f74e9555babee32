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
grid's: the lab's base for that model with the overrides of ``--set``.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "dev" / "tune"))

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
    ap.add_argument("--cap-mib", type=float, required=True, help="the allocator's room on the smaller card")
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
    fraction = capped_fraction(args.cap_mib, torch.cuda.get_device_properties(device).total_memory)
    # the cap is per device index ("cuda" alone names none)
    torch.cuda.set_per_process_memory_fraction(fraction, device.index if device.index is not None
                                               else torch.cuda.current_device())
    _, hf_config = T.model_of(cfg)
    predicted = T.lab_predictor(0, hf_config)(cfg)
    probe = T.run_probe(T.lab_measure(None), cfg, args.steps, None, lambda: free_memory(device))
    print(json.dumps({
        "model": args.model, "overrides": overrides, "cap_mib": args.cap_mib, "fraction": fraction,
        "oom": bool(probe.oom), "error": probe.error, "tokens_per_s": probe.tokens_per_s,
        "peak_mib": (probe.peak_bytes or 0) / MIB or None,
        "peak_reserved_mib": torch.cuda.max_memory_reserved(device) / MIB,
        "predicted_mib": predicted / MIB if predicted else None}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
