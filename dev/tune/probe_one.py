"""One tune probe of a model of ``bench_tune.py`` at given overrides, through the lab's trainer: tokens/s, the
measured and predicted peak. For a look at one configuration before a whole benchmark.

    python3 dev/tune/probe_one.py WORK --model gpt2-124m --set attn_implementation=sdpa,torch_compile=true \
        --set per_device_train_batch_size=32,gradient_accumulation_steps=16,bf16=true --steps 3
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main(argv=None) -> int:
    import bench_tune as B
    from fasttrain.lab import tune as T
    from fasttrain.lab.overrides import parse_assignments

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("work", type=Path)
    ap.add_argument("--model", default="gpt2-124m", choices=tuple(B.MODELS))
    ap.add_argument("--set", action="append", default=[], help="a LabConfig override, name=value (repeatable)")
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args(argv)
    if not (B.model_dir(args.work, args.model) / "train.bin").exists():
        B.prepare(args.work, args.model)
    import torch

    base = B.lab_base(args.work, args.model, torch.cuda.is_available())
    cfg = T.validate(base.with_(**parse_assignments(",".join(args.set))))
    probe = T.lab_measure(None)(cfg, args.steps)
    _, hf_config = T.model_of(cfg)
    predicted = T.lab_predictor(0, hf_config, cpu=not torch.cuda.is_available())(cfg)
    print(json.dumps({"overrides": args.set, **probe.to_dict(), "predicted_mib": predicted / 2**20 if predicted else None,
                      "peak_mib": probe.peak_bytes / 2**20 if probe.peak_bytes else None}, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
