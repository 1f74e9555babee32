"""The lab past one GPU, measured: every strategy against one GPU of the same machine.

The experiment's rows are :func:`plan` (a preset's runs, each the lab's flags), its runner
``sweep``, its report ``lab/scaling_report.py``. ``sweep`` runs, for each preset, one lab run per line of :func:`plan` -- each in its own process
(``python -m fasttrain lab ... --out RUN.json``; the several-GPU ones through torchrun), so that no
run inherits another's allocator state -- and ``report`` turns the run records into:

- ``scaling.csv`` (long format: one row per run and metric; timings with p20/p50/p80);
- ``scaling.md``: per strategy, the per-GPU peak memory beside the estimator's prediction, the
  world's tokens/s and the scaling efficiency, and how far the loss curve strays from one GPU's;
- ``memory.png``, ``throughput.png``, ``loss.png``.

Definitions.
- Same global batch (``strong``): N GPUs train B sequences per step, B/N each, against one GPU at
  B. The loss curves must agree up to the order of floating-point sums (dropout is set to 0 so
  that no random mask differs). Scaling efficiency = tokens/s(N GPUs) / (N x tokens/s(1 GPU)).
- Same per-GPU batch (``weak``, DDP): N GPUs at B each (global N B) against one GPU at B: the
  usual data-parallel throughput; efficiency defined the same way.
- Per-GPU peak memory: ``torch.cuda.max_memory_allocated`` of each rank over the training steps;
  the estimator's ``precise`` prediction for the strategy (d = N, ZeRO stage by strategy, t = N
  for tensor parallelism) at the per-GPU micro-batch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from fasttrain.errors import FasttrainError
from fasttrain.files import atomic_write_text
from fasttrain.lab.scaling_report import load_runs, markdown, plots, report, rows, write_csv  # noqa: F401 - the report beside it


STRATEGY_FLAGS = {
    "ddp": ["--strategy", "ddp"],
    "zero1": ["--strategy", "zero1"],
    "fsdp-zero2": ["--strategy", "fsdp", "--no-reshard-after-forward"],
    "fsdp-zero3": ["--strategy", "fsdp"],
    "tp": ["--strategy", "tp"],
}


@dataclass
class Planned:
    name: str                 # file stem: <preset>.<label>
    preset: str
    label: str                # 1gpu, ddp, zero1, fsdp-zero2, fsdp-zero3, tp, ddp-weak, 1gpu-bf16, ...
    nproc: int
    args: list[str] = field(default_factory=list)


def plan(presets: list[str], nproc: int, steps: int, strategies: list[str], bf16: bool = True,
         extra: list[str] | None = None) -> list[Planned]:
    """The runs of one sweep. Every run of a preset shares the global batch of the preset's
    per-device batch (so 1 GPU and N GPUs train the same function), dropout 0 and the step count."""
    from fasttrain.lab.config import preset as lab_preset

    out = []
    for name in presets:
        cfg = lab_preset(name)
        b = cfg.per_device_train_batch_size
        common = ["--preset", name, "--max-steps", str(steps), "--dropout", "0", "--eval-interval", "0",
                  "--log-interval", "1", "--timing-warmup-steps", "5", "--quiet", *(extra or [])]
        if cfg.eval_tokens is None:
            common += ["--eval-tokens", "65536"]
        out.append(Planned(f"{name}.1gpu", name, "1gpu", 1, [*common, "--per-device-train-batch-size", str(b)]))
        for label in strategies:
            if label not in STRATEGY_FLAGS:
                raise FasttrainError(f"unknown strategy {label!r}; use some of {', '.join(STRATEGY_FLAGS)}")
            if b % nproc and label != "tp":
                raise FasttrainError(f"preset {name}: batch {b} does not split over {nproc} GPUs")
            out.append(Planned(f"{name}.{label}", name, label, nproc,
                               [*common, *STRATEGY_FLAGS[label], "--global-batch-size", str(b)]))
        if "ddp" in strategies:
            # the same per-GPU batch: the usual data-parallel throughput (global batch N b)
            out.append(Planned(f"{name}.ddp-weak", name, "ddp-weak", nproc,
                               [*common, "--strategy", "ddp", "--per-device-train-batch-size", str(b)]))
        if bf16:
            out.append(Planned(f"{name}.1gpu-bf16", name, "1gpu-bf16", 1,
                               [*common, "--bf16", "--per-device-train-batch-size", str(b)]))
            out.append(Planned(f"{name}.fsdp-zero3-bf16", name, "fsdp-zero3-bf16", nproc,
                               [*common, "--bf16", *STRATEGY_FLAGS["fsdp-zero3"], "--global-batch-size", str(b)]))
    return out


def command_line(run: Planned, out_dir: Path) -> list[str]:
    argv = [sys.executable, "-m", "fasttrain", "lab", *run.args, "--out", str(out_dir / f"{run.name}.json")]
    if run.nproc > 1:
        argv += ["--nproc-per-node", str(run.nproc)]
    return argv


def sweep(runs: list[Planned], out_dir, *, log=print, timeout_s: float = 900) -> list[dict]:
    """Run every planned run in its own process; a failed run is recorded (its last error line)
    and the sweep goes on."""
    from fasttrain.lab.distributed import multicast_off

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    env = multicast_off(dict(os.environ))
    status = []
    for i, run in enumerate(runs, 1):
        argv = command_line(run, out_dir)
        log(f"[{i}/{len(runs)}] {run.name}: {' '.join(argv[1:])}")
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout_s)
            code, tail = proc.returncode, (proc.stderr.strip().splitlines() or [""])[-1]
            atomic_write_text(out_dir / f"{run.name}.log", proc.stdout + proc.stderr)
        except subprocess.TimeoutExpired:
            code, tail = 124, f"timed out after {timeout_s:.0f} s"
        row = {"name": run.name, "preset": run.preset, "label": run.label, "nproc": run.nproc, "exit": code,
               "seconds": round(time.perf_counter() - t0, 1), "argv": argv[1:], "error": tail if code else None}
        status.append(row)
        log(f"    {'ok' if code == 0 else 'FAILED: ' + tail} ({row['seconds']} s)")
    atomic_write_text(out_dir / "sweep.json", json.dumps(status, indent=1))
    return status
