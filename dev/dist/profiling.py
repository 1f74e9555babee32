"""A few training steps under ``torch.profiler``, summarized by what the GPU spent its time on.

One helper for both sides of the scale-out benchmark's profile (the lab's FSDP step and the HF Trainer's):
``StepProfiler.step()`` is called after every optimizer step; the schedule skips ``wait`` steps (compilation,
the allocator's first growth), warms the profiler up for one and records ``active``. Each rank writes
``profile-<name>-rank<r>.json``:

- ``per_step_ms``: device time per step by kind of kernel -- ``gemm``, ``attention``, ``all_gather``,
  ``reduce_scatter``, ``all_reduce``, ``other`` (norms, activations, the optimizer, copies);
- ``collectives``: every NCCL kernel's name with its time; the names carry the reduction's dtype
  (``ReduceScatter_Sum_f32`` against ``_bf16``): what the gradients cross the wire as;
- ``exposed_comm_ms``: collective time during which no compute kernel ran; ``idle_ms``: no kernel at all;
- ``top``: the 25 kernels of largest device time.

Rank 0 also writes the Chrome trace (gzipped) of the active steps. ``python3 dev/dist/profiling.py TRACE.json.gz``
summarizes a trace again.
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import sys
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


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _covered(intervals: list[tuple[float, float]], cover: list[tuple[float, float]]) -> float:
    """The part of ``intervals``' total length that lies inside the (disjoint, sorted) ``cover``."""
    import bisect

    starts = [a for a, _ in cover]
    total = 0.0
    for a, b in intervals:
        i = max(0, bisect.bisect_right(starts, a) - 1)
        while i < len(cover) and cover[i][0] < b:
            total += max(0.0, min(b, cover[i][1]) - max(a, cover[i][0]))
            i += 1
    return total


def summarize_trace(trace: dict, active: int, step_wall_ms: list[float]) -> dict:
    """A Chrome trace's kernels (annotations left out), per step: device time by kind, and the overlap --
    ``exposed_comm_ms``: collective time during which no compute kernel ran (the step waited on the wire, or
    the wire ran alone), ``idle_ms``: time in the steps' span with no kernel at all (the host, launches)."""
    kernels = [e for e in trace.get("traceEvents", []) if e.get("cat") == "kernel" and e.get("ph") == "X"]
    by_kind = dict.fromkeys(KINDS, 0.0)
    names: dict = {}
    comm, compute = [], []
    for e in kernels:
        kind = kind_of(e["name"])
        span = (float(e["ts"]), float(e["ts"]) + float(e["dur"]))
        by_kind[kind] += e["dur"] / 1e3
        (comm if kind in ("all_gather", "reduce_scatter", "all_reduce") else compute).append(span)
        t, c = names.get(e["name"], (0.0, 0))
        names[e["name"]] = (t + e["dur"] / 1e3, c + 1)
    busy = _union(compute)
    everything = _union(comm + compute)
    exposed = sum(b - a for a, b in comm) - _covered(comm, busy)
    # the recorded steps' span on the device: the first kernel's start to the last one's end
    span = (everything[-1][1] - everything[0][0]) if everything else 0.0
    idle = span - sum(b - a for a, b in everything)
    per_step = {k: round(v / active, 3) for k, v in by_kind.items()}
    wall = sorted(step_wall_ms)[len(step_wall_ms) // 2] if step_wall_ms else None
    top = sorted(names.items(), key=lambda kv: -kv[1][0])
    return {"active_steps": active, "per_step_ms": per_step,
            "compute_busy_ms": round(sum(b - a for a, b in busy) / 1e3 / active, 3),
            "exposed_comm_ms": round(exposed / 1e3 / active, 3), "idle_ms": round(idle / 1e3 / active, 3),
            "step_wall_ms": wall,
            "collectives": {n[:120]: round(t / active, 3) for n, (t, _) in top if kind_of(n) in
                            ("all_gather", "reduce_scatter", "all_reduce")},
            "top": [{"name": n[:160], "ms_per_step": round(t / active, 3), "calls": c} for n, (t, c) in top[:25]]}


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
        # written at close(), outside the run's timed steps
        self.done = True

    def close(self) -> None:
        """Write the summary (and rank 0's trace); stop the profiler if its steps were not all recorded."""
        if not self.done:
            self.prof.stop()
            return
        trace = self.out / f"trace-{self.name}-rank{self.rank}.json"
        self.prof.export_chrome_trace(str(trace))
        summary = summarize_trace(json.loads(trace.read_text()), self.active, self.wall)
        summary.update(name=self.name, rank=self.rank)
        (self.out / f"profile-{self.name}-rank{self.rank}.json").write_text(json.dumps(summary, indent=1))
        if self.rank == 0:
            with open(trace, "rb") as src, gzip.open(self.out / f"trace-{self.name}.json.gz", "wb") as dst:
                shutil.copyfileobj(src, dst)
        trace.unlink()


def main(argv=None) -> int:
    """``profiling.py TRACE.json.gz [--active 2] [--wall-from OLD_SUMMARY.json] [--out SUMMARY.json]``: summarize
    a trace again (``--wall-from``: the step wall times of the run's own summary)."""
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--active", type=int, default=2)
    ap.add_argument("--wall-from")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    with gzip.open(a.trace) as f:
        trace = json.load(f)
    wall = []
    if a.wall_from:
        old = json.loads(Path(a.wall_from).read_text())
        wall = [old["step_wall_ms"]] if old.get("step_wall_ms") else []
    summary = summarize_trace(trace, a.active, wall)
    text = json.dumps(summary, indent=1)
    if a.out:
        Path(a.out).write_text(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
