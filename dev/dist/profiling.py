"""A few training steps under ``torch.profiler``, summarized by what the GPU spent its time on.

One helper for both sides of the scale-out benchmark's profile (the lab's FSDP step and the HF Trainer's):
``StepProfiler.step()`` is called after every optimizer step; the schedule skips ``wait`` steps (compilation,
the allocator's first growth), warms the profiler up for one and records ``active``. Each rank writes
``profile-<name>-rank<r>.json``:

- ``per_step_ms``: device time per step by kind of kernel -- ``gemm``, ``attention``, ``all_gather``,
  ``reduce_scatter``, ``all_reduce``, ``other`` (norms, activations, the optimizer, copies);
- ``collectives``: every NCCL kernel's name with its time; the names carry the reduction's dtype
  (``ReduceScatter_Sum_f32`` against ``_bf16``): what the gradients cross the wire as;
- ``exposed_ms``: step wall time minus the compute kernels' time: communication the compute did not hide,
  plus idle gaps (launches, the host);
- ``top``: the 25 kernels of largest device time.

Rank 0 also writes the Chrome trace (gzipped) of the active steps.
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import time
from pathlib import Path

KINDS = ("gemm", "attention", "all_gather", "reduce_scatter", "all_reduce", "other")


def kind_of(name: str) -> str:
    n = name.lower()
    if "nccl" in n:
        for k in ("allgather", "reducescatter", "allreduce"):
            if k in n:
                return {"allgather": "all_gather", "reducescatter": "reduce_scatter", "allreduce": "all_reduce"}[k]
        return "all_reduce"
    if "flash" in n or "fmha" in n or "attention" in n or "sdpa" in n:
        return "attention"
    if "gemm" in n or "nvjet" in n or "xmma" in n or "cutlass" in n or "matmul" in n:
        return "gemm"
    return "other"


def summarize(events, active: int, step_wall_ms: list[float]) -> dict:
    """``events``: ``prof.key_averages()``; device time per step by kind, the collectives, the top kernels."""
    by_kind = dict.fromkeys(KINDS, 0.0)
    collectives, kernels = {}, []
    for e in events:
        us = getattr(e, "self_device_time_total", None)
        if us is None:
            us = getattr(e, "self_cuda_time_total", 0.0)
        if not us or str(getattr(e, "device_type", "")).split(".")[-1] != "CUDA":
            continue
        kind = kind_of(e.key)
        by_kind[kind] += us / 1e3
        kernels.append((e.key, us / 1e3, e.count))
        if kind in ("all_gather", "reduce_scatter", "all_reduce"):
            collectives[e.key[:120]] = round(us / 1e3 / active, 3)
    per_step = {k: round(v / active, 3) for k, v in by_kind.items()}
    compute = per_step["gemm"] + per_step["attention"] + per_step["other"]
    wall = sorted(step_wall_ms)[len(step_wall_ms) // 2] if step_wall_ms else None
    kernels.sort(key=lambda k: -k[1])
    return {"active_steps": active, "per_step_ms": per_step, "compute_ms": round(compute, 3),
            "step_wall_ms": wall, "exposed_ms": None if wall is None else round(wall - compute, 3),
            "collectives": collectives,
            "top": [{"name": n[:160], "ms_per_step": round(t / active, 3), "calls": c} for n, t, c in kernels[:25]]}


class StepProfiler:
    """``step()`` after every optimizer step; the summary is written once the active steps are recorded."""

    def __init__(self, out_dir: str | os.PathLike, name: str, *, wait: int = 3, active: int = 2):
        import torch

        self.out = Path(out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.name, self.active, self.wait = name, active, wait
        self.rank = int(os.environ.get("RANK", "0"))
        self.done = False
        self.steps = 0
        self.wall: list[float] = []
        self.t = None
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.prof = torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(wait=wait, warmup=1, active=active, repeat=1),
            on_trace_ready=self._ready)
        self.prof.start()

    def step(self) -> None:
        import torch

        if self.done:
            return
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        now = time.perf_counter()
        # the wall time of the steps the profiler records (its warm-up step is the one before them)
        if self.t is not None and self.wait + 1 <= self.steps < self.wait + 1 + self.active:
            self.wall.append((now - self.t) * 1e3)
        self.t = now
        self.steps += 1
        self.prof.step()

    def _ready(self, prof) -> None:
        summary = summarize(prof.key_averages(), self.active, self.wall)
        summary.update(name=self.name, rank=self.rank)
        (self.out / f"profile-{self.name}-rank{self.rank}.json").write_text(json.dumps(summary, indent=1))
        if self.rank == 0:
            trace = self.out / f"trace-{self.name}.json"
            prof.export_chrome_trace(str(trace))
            with open(trace, "rb") as src, gzip.open(f"{trace}.gz", "wb") as dst:
                shutil.copyfileobj(src, dst)
            trace.unlink()
        self.done = True

    def close(self) -> None:
        if not self.done:
            self.prof.stop()
