"""What one training step of a speedrun rung is made of on the GPU: kernel time by kernel, against wall time.

Builds the rung's trainer as the ladder does (``speedrun.build_trainer``: compiled, CUDA graphs, ...), trains
the warm-up steps, then profiles ``--steps`` steps with torch.profiler (CUDA activity; kernels replayed from
CUDA graphs are traced one by one). Prints the wall time per step, the GPU's busy time per step (the sum of
kernel times: what a faster step must cut), and the kernels that take most of it, grouped by family.

    python3 dev/speedrun/profile_step.py --rung cuda-graphs --steps 50 --out /tmp/profile.json
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import sys
import time

# first match wins: cuDNN's attention kernels carry "sm90" like cuBLAS's matmuls, so attention is tried first
FAMILIES = [("attention", r"flash|fmha|attention|sdpa"), ("gemm", r"gemm|cutlass|nvjet|sm90|xmma|matmul|cublas"),
            ("optimizer", r"adam|foreach|multi_tensor|fused_adam"), ("softmax / loss", r"softmax|nll|cross_entropy"),
            ("fused pointwise (inductor)", r"^triton_"), ("copy / cast", r"copy|cast|convert|elementwise_kernel"),
            ("reduction", r"reduce|norm")]


def family(name: str) -> str:
    low = name.lower()
    for fam, pattern in FAMILIES:
        if re.search(pattern, low):
            return fam
    return "other"


def profile_steps(trainer, steps: list, device) -> dict:
    """Profile ``trainer.train_step`` over the given ``(x, y)`` steps (warm-up done by the caller): wall and
    GPU-busy time per step (busy: the sum of kernel times, what a faster step must cut), launches, kernel families
    and the kernels that take most of it."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for step in steps:          # each step the train_step's arguments: (x, y), or (micro_batches,) in the lab
            trainer.train_step(*step)
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    kernels = collections.Counter()
    counts = collections.Counter()
    kind = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
    for e in prof.events():
        if e.device_type == kind and e.device_time_total > 0:
            kernels[e.name] += e.device_time_total
            counts[e.name] += 1
    busy_us = sum(kernels.values())
    by_family = collections.Counter()
    for name, us in kernels.items():
        by_family[family(name)] += us
    n = len(steps)
    return {"steps": n, "wall_ms_per_step": 1e3 * wall / n, "gpu_busy_ms_per_step": busy_us / 1e3 / n,
            "kernel_launches_per_step": sum(counts.values()) / n,
            "by_family_ms_per_step": {f: us / 1e3 / n for f, us in by_family.most_common()},
            "top_kernels": [{"name": k[:160], "ms_per_step": us / 1e3 / n, "calls_per_step": counts[k] / n}
                            for k, us in kernels.most_common(25)]}


def print_profile(title: str, report: dict) -> None:
    print(f"{title}: wall {report['wall_ms_per_step']:.3f} ms/step, GPU busy {report['gpu_busy_ms_per_step']:.3f} "
          f"ms/step ({100 * report['gpu_busy_ms_per_step'] / report['wall_ms_per_step']:.0f}%), "
          f"{report['kernel_launches_per_step']:.0f} kernels/step")
    for fam, ms in report["by_family_ms_per_step"].items():
        print(f"  {fam:28s} {ms:7.3f} ms/step")
    for k in report["top_kernels"][:12]:
        print(f"  {k['ms_per_step']:7.3f} ms  x{k['calls_per_step']:5.1f}  {k['name'][:100]}")


def main(argv=None) -> int:
    import torch

    from fasttrain.lab.experiments import speedrun as sr
    from fasttrain.lab.data import load_corpus

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rung", default="cuda-graphs")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--set", default="", help="FIELD=VALUE,... overrides (as the ladder's --set)")
    ap.add_argument("--preset", default=None, help="the ladder's base preset (tiny: a CPU check of this script)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    sets = dict(kv.split("=", 1) for kv in args.set.split(",") if kv)
    extra = {"base_preset": args.preset} if args.preset else {}
    rows = sr.plan(sr.parse_rungs(args.rung), [0], sets=sets or None, device=args.device, **extra)
    cfg = rows[0].cfg
    corpus = load_corpus(cfg.data_dir)
    device = torch.device(args.device)
    trainer = sr.build_trainer(cfg, corpus, device)
    total = args.warmup + args.steps
    batches = iter(trainer.batches(total))
    for _ in range(args.warmup):
        trainer.train_step(*next(batches))
    report = profile_steps(trainer, [next(batches) for _ in range(args.steps)], device)
    report.update(rung=args.rung, config={"batch": cfg.per_device_train_batch_size, "context": cfg.context,
                                          "layers": cfg.layers, "width": cfg.width, "heads": cfg.heads})
    print_profile(args.rung, report)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
