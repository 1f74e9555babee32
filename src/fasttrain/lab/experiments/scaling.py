"""The lab past one GPU, measured: every strategy against one GPU of the same machine.

The experiment's rows are :func:`plan` (a preset's runs, each an :class:`~fasttrain.lab.experiments.experiment.Experiment`:
overrides of the preset, run as the lab's flags), its runner ``sweep``, its report ``lab/experiments/scaling_report.py``.
``sweep`` runs, for each preset, one lab run per line of :func:`plan` -- each in its own process
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
from dataclasses import dataclass
from pathlib import Path

from fasttrain.errors import FasttrainError
from fasttrain.files import atomic_write_text
from fasttrain.lab.experiments import experiment
from fasttrain.lab.experiments.experiment import Experiment
from fasttrain.lab.overrides import flags
from fasttrain.lab.experiments.scaling_report import load_runs, markdown, plots, report, rows, write_csv  # noqa: F401 - the report beside it


STRATEGY_FLAGS = {
    "ddp": ["--strategy", "ddp"],
    "zero1": ["--strategy", "zero1"],
    "fsdp-zero2": ["--strategy", "fsdp", "--no-reshard-after-forward"],
    "fsdp-zero3": ["--strategy", "fsdp"],
    "tp": ["--strategy", "tp"],
}


@dataclass(frozen=True)
class Planned(Experiment):
    """One run of the sweep: ``label`` 1gpu, ddp, zero1, fsdp-zero2, fsdp-zero3, tp, ddp-weak, 1gpu-bf16, ...;
    ``overrides`` of the preset (LabConfig fields, passed as the lab's flags); ``compared_with`` the preset's
    one-GPU run of its precision. ``nproc``: its processes; ``launch``: the launcher's flags (the strategy, the
    global batch: not LabConfig fields); ``extra``: the caller's flags, passed to every run as given."""

    preset: str
    nproc: int
    launch: tuple[str, ...] = ()
    extra: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        """The records' file stem: <preset>.<label>."""
        return f"{self.preset}.{self.label}"

    def shown(self) -> str:
        return self.name


def run_config(run: Planned):
    """The run's LabConfig: its preset with its overrides (the launcher's flags aside)."""
    from fasttrain.lab.config import preset as lab_preset

    return run.config(lab_preset(run.preset))


def check_sweep(presets: str, strategies: str, nproc: int, steps: int) -> tuple[list[str], list[str]]:
    """The sweep's comma lists parsed and every input checked before any run (or dry run)."""
    from fasttrain.lab.config import PRESETS

    preset_list = [p.strip() for p in presets.split(",") if p.strip()]
    strategy_list = [s.strip() for s in strategies.split(",") if s.strip()]
    if not preset_list:
        raise FasttrainError(f"--presets is empty; name at least one of {', '.join(PRESETS)}")
    for name in preset_list:
        if name not in PRESETS:
            raise FasttrainError(f"--presets: unknown preset {name!r}; use some of {', '.join(PRESETS)}")
    if not strategy_list:
        raise FasttrainError(f"--strategies is empty; name at least one of {', '.join(STRATEGY_FLAGS)}")
    for label in strategy_list:
        if label not in STRATEGY_FLAGS:
            raise FasttrainError(f"--strategies: unknown strategy {label!r}; use some of {', '.join(STRATEGY_FLAGS)}")
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 2:
        raise FasttrainError(f"--nproc-per-node must be at least 2 (the sweep compares N processes with one), "
                             f"got {nproc!r}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise FasttrainError(f"--max-steps must be a positive integer (every run trains that many steps), got {steps!r}")
    return preset_list, strategy_list


def plan(presets: list[str], nproc: int, steps: int, strategies: list[str], bf16: bool = True,
         extra: list[str] | None = None) -> list[Planned]:
    """The runs of one sweep. Every run of a preset shares the global batch of the preset's
    per-device batch (so 1 GPU and N GPUs train the same function), dropout 0 and the step count."""
    from fasttrain.lab.config import preset as lab_preset

    out = []
    for name in presets:
        cfg = lab_preset(name)
        b = cfg.per_device_train_batch_size
        common = dict(max_steps=steps, dropout=0, eval_interval=0, log_interval=1, timing_warmup_steps=5)
        if cfg.eval_tokens is None:
            common["eval_tokens"] = 65536

        def run(label: str, nproc: int, overrides: dict, launch=()) -> Planned:
            one_gpu = "1gpu-bf16" if label.endswith("bf16") else "1gpu"
            return Planned(label, name, nproc, tuple(launch), tuple(extra or ()), overrides={**common, **overrides},
                           compared_with=None if label == one_gpu else one_gpu)

        out.append(run("1gpu", 1, {"per_device_train_batch_size": b}))
        for label in strategies:
            if label not in STRATEGY_FLAGS:
                raise FasttrainError(f"unknown strategy {label!r}; use some of {', '.join(STRATEGY_FLAGS)}")
            if b % nproc and label != "tp":
                raise FasttrainError(f"preset {name}: batch {b} does not split over {nproc} GPUs")
            out.append(run(label, nproc, {}, [*STRATEGY_FLAGS[label], "--global-batch-size", str(b)]))
        if "ddp" in strategies:
            # the same per-GPU batch: the usual data-parallel throughput (global batch N b)
            out.append(run("ddp-weak", nproc, {"per_device_train_batch_size": b}, ["--strategy", "ddp"]))
        if bf16:
            out.append(run("1gpu-bf16", 1, {"bf16": True, "per_device_train_batch_size": b}))
            out.append(run("fsdp-zero3-bf16", nproc, {"bf16": True},
                           [*STRATEGY_FLAGS["fsdp-zero3"], "--global-batch-size", str(b)]))
    experiment.prepare(out, config=run_config)     # every run's configuration checked now, a dry run's too
    return out


def command_line(run: Planned, out_dir: Path) -> list[str]:
    argv = [sys.executable, "-m", "fasttrain", "lab", "--preset", run.preset, *flags(run.overrides), *run.launch,
            "--quiet", *run.extra, "--out", str(out_dir / f"{run.name}.json")]
    if run.nproc > 1:
        argv += ["--nproc-per-node", str(run.nproc)]
    return argv


def sweep(runs: list[Planned], out_dir, *, log=print, timeout_s: float = 900) -> list[dict]:
    """Run every planned run in its own process; a failed run is recorded (its last error line)
    and the sweep goes on."""
    from fasttrain.lab.parallel.distributed import multicast_off

    prepared = experiment.prepare(runs, config=run_config)     # every run's configuration, before any process
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    env = multicast_off(dict(os.environ))
    status = []

    def launch(run: Planned, cfg) -> dict:
        argv = command_line(run, out_dir)
        log(f"[{len(status) + 1}/{len(runs)}] {run.name}: {' '.join(argv[1:])}")
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout_s)
            code, tail = proc.returncode, (proc.stderr.strip().splitlines() or [""])[-1]
            atomic_write_text(out_dir / f"{run.name}.log", proc.stdout + proc.stderr)
        except subprocess.TimeoutExpired:
            code, tail = 124, f"timed out after {timeout_s:.0f} s"
        return {"name": run.name, "preset": run.preset, "label": run.label, "nproc": run.nproc, "exit": code,
                "seconds": round(time.perf_counter() - t0, 1), "argv": argv[1:], "error": tail if code else None}

    def finished(run: Planned, row: dict) -> None:
        status.append(row)
        log(f"    {'ok' if row['exit'] == 0 else 'FAILED: ' + row['error']} ({row['seconds']} s)")
        atomic_write_text(out_dir / "sweep.json", json.dumps(status, indent=1))     # a sweep cut short keeps its runs

    experiment.run(prepared, launch, on_row=finished)
    atomic_write_text(out_dir / "sweep.json", json.dumps(status, indent=1))
    return status


# --- `fasttrain lab dist`: the sweep and its report -------------------------------------------------

def _dist_group():
    import click

    from fasttrain.lab.parallel.launch import check_launch, cpu_oversubscription

    @click.group("dist")
    def group() -> None:
        """The lab on several GPUs: the strategy sweep and its report (tables, plots)."""

    @group.command("sweep")
    @click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False), help="Folder for the records.")
    @click.option("--presets", default="shakespeare-char,char-100m", show_default=True, help="Comma-separated.")
    @click.option("--nproc-per-node", "nproc", type=int, default=2, show_default=True, help="GPUs of the N-GPU runs.")
    @click.option("--strategies", default="ddp,zero1,fsdp-zero2,fsdp-zero3,tp", show_default=True,
                  help="Comma-separated: ddp, zero1, fsdp-zero2, fsdp-zero3, tp.")
    @click.option("--max-steps", type=int, default=60, show_default=True, help="Steps of every run.")
    @click.option("--bf16/--no-bf16", default=True, show_default=True, help="Also 1 GPU and fsdp-zero3 in bf16.")
    @click.option("--data-dir", default=None, help="Data root (holds tinyshakespeare/input.txt).")
    @click.option("--device", type=click.Choice(["cuda", "cpu"]), default="cuda", show_default=True,
                  help="cpu: gloo processes (a smoke test of the sweep; timings mean nothing).")
    @click.option("--dry-run", is_flag=True, help="Print the command lines only.")
    def sweep_cmd(out_dir, presets, nproc, strategies, max_steps, bf16, data_dir, device, dry_run) -> None:
        """Every strategy on N GPUs and the same preset on 1 GPU, one process tree per run."""
        # the sweep's own inputs are checked for a dry run too: it prints what a real run would start
        preset_list, strategy_list = check_sweep(presets, strategies, nproc, max_steps)
        if not dry_run:
            check_launch(nproc, device, "ddp")
        warning = cpu_oversubscription(nproc, device)
        if warning:
            click.echo(warning, err=True)
        extra = (["--data-dir", data_dir] if data_dir else []) + ["--device", device]
        runs = plan(preset_list, nproc, max_steps, strategy_list, bf16=bf16, extra=extra)
        if dry_run:
            for run in runs:
                click.echo(" ".join(command_line(run, Path(out_dir).expanduser())[1:]))
            click.echo(f"dry run: {len(runs)} runs planned, none started", err=True)
            return
        out_dir = str(Path(out_dir).expanduser())
        status = sweep(runs, out_dir, log=lambda line: click.echo(line, err=True))
        result = report(out_dir)
        click.echo(result["markdown"].read_text())
        failed = [s["name"] for s in status if s["exit"]]
        if failed:
            raise FasttrainError(f"{len(failed)} of {len(status)} runs failed ({', '.join(failed)}); their logs are "
                                 f"in {out_dir}")

    @group.command("report")
    @click.argument("folder", type=click.Path(file_okay=False))
    @click.option("--out", "out_dir", type=click.Path(file_okay=False), help="Where to write (default: FOLDER).")
    def report_cmd(folder, out_dir) -> None:
        """scaling.csv, scaling.md and plots from a folder of run records."""
        result = report(folder, out_dir)
        click.echo(result["markdown"].read_text())

    return group


def __getattr__(name):
    # ``command`` (``fasttrain lab dist``) is built on first access: click stays unimported otherwise
    if name == "command":
        return _dist_group()
    raise AttributeError(name)
