"""reduce-overhead with gradient accumulation, step by step: the CUDA graphs each step records, its time, its peak and
its loss, with the trainer's gradients kept out of the graphs' pool (``keep_grads``, the trainer's rule) and without
(the behaviour before it), beside default compile. On the H100 reduce-overhead at 16 micro-batches a step ran 8-24x
slower than default compile (dev/tune/README.md); this says whether graphs are recorded again every step, and
whether keeping the gradients stops it.

    python3 dev/tune/cudagraph_accumulation.py WORK --model gpt2-124m --batch 16 --accumulation 8 --steps 4
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def run(cfg, keep_grads: bool | None, captures: list) -> dict:
    """``cfg`` trained ``max_steps`` steps; ``keep_grads`` None: the trainer's own rule."""
    import torch

    from fasttrain.lab import tune as T
    from fasttrain.lab.build import make_trainer, resolve_device
    from fasttrain.lab.measure import free_memory, release_run_state

    device = resolve_device(cfg)
    cuda = device.type == "cuda"
    free_memory(device)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    trainer = make_trainer(cfg, T.load_corpus_for(cfg), device)
    if keep_grads is not None:
        trainer.keep_grads = keep_grads
    rows = []

    def after(step: int) -> None:
        if cuda:
            torch.cuda.synchronize()
        now = time.perf_counter()
        rows.append({"step": step, "s": now - after.t, "graphs_recorded": len(captures) - after.n,
                     "peak_mib": torch.cuda.max_memory_allocated(device) / 2 ** 20 if cuda else None})
        after.t, after.n = now, len(captures)

    if cuda:
        torch.cuda.synchronize()
    after.t, after.n = time.perf_counter(), len(captures)
    from fasttrain.lab.trainer import Metrics

    metrics = Metrics(cfg, device, curve=True)
    trainer.train(metrics=metrics, evaluate=False, on_step=after)
    for row, point in zip(rows, metrics.loss_curve):
        row["loss"] = point["loss"]
    out = {"keep_grads": trainer.keep_grads, "steps": rows}
    del trainer
    release_run_state(cfg)
    free_memory(device)
    return out


def main(argv=None) -> int:
    import bench_tune as B
    import torch

    from fasttrain.lab import tune as T

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("work", type=Path)
    ap.add_argument("--model", default="gpt2-124m", choices=tuple(B.MODELS))
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--accumulation", type=int, default=8)
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("CUDA graphs need a CUDA GPU: run this on the device machine")
    if not (B.model_dir(args.work, args.model) / "train.bin").exists():
        B.prepare(args.work, args.model)
    captures: list = []
    real_end = torch.cuda.CUDAGraph.capture_end

    def counted(self):
        captures.append(1)
        return real_end(self)

    torch.cuda.CUDAGraph.capture_end = counted
    base = T.validate(B.lab_base(args.work, args.model, True).with_(
        per_device_train_batch_size=args.batch, gradient_accumulation_steps=args.accumulation, bf16=True,
        attn_implementation="sdpa", torch_compile=True, max_steps=args.steps, log_interval=1,
        timing_warmup_steps=1, save=None))
    for mode, keep in (("default", None), ("reduce-overhead", False), ("reduce-overhead", True)):
        result = run(base.with_(torch_compile_mode=mode), keep, captures)
        print(json.dumps({"mode": mode, "batch": args.batch, "accumulation": args.accumulation, **result}), flush=True)
        torch._dynamo.reset()
    return 0


if __name__ == "__main__":
    sys.exit(main())
