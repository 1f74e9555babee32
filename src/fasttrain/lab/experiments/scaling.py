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
- Same per-GPU batch (``weak``: DDP by default, ``--weak`` names others): N GPUs at B each (global N B)
  against one GPU at B: the usual data-parallel throughput; efficiency defined the same way.
- A base is a preset, or lab flags after ``--`` (a transformers model: ``--model hf:FOLDER`` with its token
  files); several GPU counts (``--nproc-per-node 2,4``) plan every row per count, labelled ``2gpu-ddp``.
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
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from fasttrain.errors import FasttrainError
from fasttrain.files import atomic_write_text
from fasttrain.lab.experiments import experiment
from fasttrain.lab.experiments.experiment import Experiment
from fasttrain.lab.overrides import flags
from fasttrain.lab.experiments.scaling_report import load_runs, markdown, plots, report, rows, write_csv  # noqa: F401 - the report beside it


# each strategy of the sweep: its ParallelConfig fields (its launch flags, and the launch's own checks before
# any run starts)
STRATEGY_PARALLEL = {"ddp": dict(strategy="ddp"), "zero1": dict(strategy="zero1"),
                     "fsdp-zero2": dict(strategy="fsdp", reshard_after_forward=False),
                     "fsdp-zero3": dict(strategy="fsdp"), "tp": dict(strategy="tp"),
                     "ddp-reduce-bf16": dict(strategy="ddp"), "hsdp-r2": dict(strategy="hsdp", dp_replicate=2),
                     "fsdp-tp2": dict(strategy="fsdp", tp=2)}
# a strategy's own settings beside its launch flags (LabConfig fields, so the checks and the estimate see them)
STRATEGY_OVERRIDES = {"ddp-reduce-bf16": {"reduce_dtype": "bf16"}}
WEAK = "-weak"                  # the label's suffix of a run at the same per-GPU batch


@dataclass(frozen=True)
class Planned(Experiment):
    """One run of the sweep: ``label`` 1gpu, ddp, zero1, fsdp-zero2, fsdp-zero3, tp, ddp-weak, 1gpu-bf16, ...
    (with several GPU counts prefixed by the count: 2gpu-ddp, 4gpu-ddp-weak); ``preset`` the base's name (a
    preset's, or the sweep's ``--name`` for a base of lab flags); ``overrides`` of the base (LabConfig fields,
    passed as the lab's flags); ``compared_with`` the base's one-GPU run of its precision. ``nproc``: its
    processes; ``strategy`` (a key of STRATEGY_PARALLEL) and ``global_batch`` give the launcher's flags (not
    LabConfig fields); ``extra``: the caller's flags, passed to every run as given; ``base``: the settings of
    the lab flags the sweep was given (``--model hf:...`` and its data: no preset then)."""

    preset: str
    nproc: int
    strategy: str | None = None
    global_batch: int | None = None
    extra: tuple[str, ...] = ()
    base: Mapping[str, object] = field(default_factory=dict)

    @property
    def name(self) -> str:
        """The records' file stem: <preset>.<label>."""
        return f"{self.preset}.{self.label}"

    @property
    def from_preset(self) -> bool:
        """Whether the base is the lab's GPT (a preset), not a model the base flags name."""
        return self.base.get("model", "gpt") == "gpt"

    @property
    def launch(self) -> tuple[str, ...]:
        """The launcher's flags: the strategy and, at the same global batch, that batch."""
        if self.strategy is None:
            return ()
        size = ("--global-batch-size", str(self.global_batch)) if self.global_batch is not None else ()
        return (*self.parallel().flags(), *size)

    def parallel(self):
        """The run's ParallelConfig (the checks a launch makes, made before the sweep starts any run)."""
        from fasttrain.lab.parallel.distributed import ParallelConfig

        return ParallelConfig(**STRATEGY_PARALLEL[self.strategy], global_batch_size=self.global_batch)

    def shown(self) -> str:
        return self.name


def base_config(preset: str | None, base: Mapping[str, object]):
    """The configuration the sweep's base resolves to, as ``fasttrain lab [--preset P] FLAGS`` would: a preset's
    values, or a transformers model's own defaults (context, schedule) under the flags given."""
    from fasttrain.lab.settings import resolve_settings

    return resolve_settings(preset, dict(base)).cfg


def run_config(run: Planned):
    """The run's LabConfig: its base (preset or flags) with its overrides (the launcher's flags aside), validated
    by ``experiment.prepare`` with the other rows (a bad override is one line naming every row it spoils)."""
    try:
        base = base_config(run.preset if run.from_preset else None, run.base)
    except FasttrainError as exc:
        raise FasttrainError(f"{run.shown()}: {exc}") from None
    return run.config(base)


def parse_counts(nproc) -> list[int]:
    """``--nproc-per-node``: one count or a comma list (``2,4``), each at least 2, in the order given."""
    text = str(nproc)
    try:
        counts = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise FasttrainError(f"--nproc-per-node must be a count of processes or a comma list of them (2,4), "
                             f"got {text!r}") from None
    if isinstance(nproc, bool) or not counts or any(n < 2 for n in counts):
        raise FasttrainError(f"--nproc-per-node must be at least 2 (the sweep compares N processes with one), "
                             f"got {nproc!r}")
    if len(set(counts)) != len(counts):
        raise FasttrainError(f"--nproc-per-node {text}: a count is named twice")
    return counts


def check_sweep(presets: str, strategies: str, nproc, steps: int, weak: str | None = None
                ) -> tuple[list[str], list[str], list[int], list[str]]:
    """The sweep's comma lists parsed and every input checked before any run (or dry run): the presets, the
    strategies, the GPU counts and the strategies also run at the same per-GPU batch (``all``, ``none``; not
    given: ddp where it is among the strategies)."""
    from fasttrain.lab.config import PRESETS

    preset_list = [p.strip() for p in presets.split(",") if p.strip()]
    strategy_list = [s.strip() for s in strategies.split(",") if s.strip()]
    if not preset_list:
        raise FasttrainError(f"--presets is empty; name at least one of {', '.join(PRESETS)}")
    for name in preset_list:
        if name not in PRESETS:
            raise FasttrainError(f"--presets: unknown preset {name!r}; use some of {', '.join(PRESETS)}")
    if not strategy_list:
        raise FasttrainError(f"--strategies is empty; name at least one of {', '.join(STRATEGY_PARALLEL)}")
    for label in strategy_list:
        if label not in STRATEGY_PARALLEL:
            raise FasttrainError(f"--strategies: unknown strategy {label!r}; use some of {', '.join(STRATEGY_PARALLEL)}")
    counts = parse_counts(nproc)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise FasttrainError(f"--max-steps must be a positive integer (every run trains that many steps), got {steps!r}")
    weak = ("ddp" if "ddp" in strategy_list else "none") if weak is None else weak.strip()
    weak_list = strategy_list if weak == "all" else [] if weak == "none" else [w.strip() for w in weak.split(",")
                                                                                if w.strip()]
    for label in weak_list:
        if label not in strategy_list:
            raise FasttrainError(f"--weak: {label!r} is not among --strategies ({', '.join(strategy_list)}); "
                                 f"name some of them, all or none")
    # tensor parallelism shares each micro-batch between its ranks (tp alone: one data-parallel rank, its per-GPU
    # batch the global batch, its one run both): no run at the same per-GPU batch for tp or the 2-D mesh
    return preset_list, strategy_list, counts, [w for w in weak_list
                                                if w != "tp" and STRATEGY_PARALLEL[w].get("tp", 1) == 1]


def plan(presets: list[str], nproc, steps: int, strategies: list[str], bf16: bool = True,
         extra: list[str] | None = None, *, weak=("ddp",), strong: bool = True, base: Mapping | None = None,
         name: str | None = None, warmup: int = 5) -> list[Planned]:
    """The runs of one sweep, for every base (each preset, or the one model the ``base`` flags name, called
    ``name``) and every GPU count of ``nproc`` (an int or a list). Each base's batch B (per-device batch x
    accumulation) is the one-GPU run's; with ``strong``, every strategy runs at that global batch (B/N a GPU: the
    same function as one GPU, so the loss curves compare); each strategy of ``weak`` also runs at the one-GPU
    run's per-device batch on every GPU (global N B: the usual data-parallel throughput). Every run shares dropout
    0 and the step count. A run that cannot launch (a batch that does not split over N, heads that do not split
    over a tensor-parallel group, a technique its strategy refuses) is one line naming it, before any starts."""
    from fasttrain.lab.parallel.distributed import check_config, check_model_fits, mesh_shape, resolve_batch

    counts = [nproc] if isinstance(nproc, int) else list(nproc)
    several = len(counts) > 1
    base = dict(base or {})
    hf_base = base.get("model", "gpt") != "gpt"
    if hf_base and not name:
        raise FasttrainError("a sweep of --model hf:... needs --name (the records' file stem)")
    bases = [(name, None)] if hf_base else [(p, p) for p in presets]
    for label in strategies:
        if label not in STRATEGY_PARALLEL:
            raise FasttrainError(f"unknown strategy {label!r}; use some of {', '.join(STRATEGY_PARALLEL)}")
    out = []
    for shown, preset_name in bases:
        try:
            cfg = base_config(preset_name, base)
        except FasttrainError as exc:
            raise FasttrainError(f"{shown}: {exc}") from None
        b, k = cfg.per_device_train_batch_size, cfg.gradient_accumulation_steps
        common = dict(max_steps=steps, dropout=0, eval_interval=0, log_interval=1, timing_warmup_steps=warmup)
        if cfg.eval_tokens is None:
            common["eval_tokens"] = 65536

        def run(label: str, n: int, overrides: dict, strategy=None, global_batch=None) -> Planned:
            one_gpu = "1gpu-bf16" if label.endswith("bf16") else "1gpu"
            label = f"{n}gpu-{label}" if several and n > 1 else label
            return Planned(label, shown, n, strategy, global_batch, tuple(extra or ()), base,
                           overrides={**common, **STRATEGY_OVERRIDES.get(strategy, {}), **overrides},
                           compared_with=None if label == one_gpu else one_gpu)

        out.append(run("1gpu", 1, {"per_device_train_batch_size": b}))
        for n in counts:
            if strong:
                out += [run(s, n, {}, s, b * k) for s in strategies]
            out += [run(s + WEAK, n, {"per_device_train_batch_size": b}, s) for s in strategies if s in weak]
        if bf16 and not cfg.bf16:
            out.append(run("1gpu-bf16", 1, {"bf16": True, "per_device_train_batch_size": b}))
            out += [run("fsdp-zero3-bf16", n, {"bf16": True}, "fsdp-zero3", b * k) for n in counts]
    # every run's configuration checked now, a dry run's too; then what its launch would refuse
    for p in experiment.prepare(out, config=run_config):
        row = p.experiment
        if row.nproc < 2:
            continue
        try:
            parallel = row.parallel()
            check_config(p.config, parallel)
            names, sizes = mesh_shape(parallel, row.nproc)
            tp = sizes[names.index("tp")] if "tp" in names else 1
            check_model_fits(p.config, row.nproc, parallel.strategy, tp=tp)
            resolve_batch(p.config, parallel, row.nproc // tp)
        except FasttrainError as exc:
            raise FasttrainError(f"{row.shown()}: {exc}") from None
    return out


def command_line(run: Planned, out_dir: Path) -> list[str]:
    preset = ["--preset", run.preset] if run.from_preset else []
    settings = {**run.base, **run.overrides}
    if run.global_batch is not None:
        # at the same global batch the launcher sets each rank's micro-batch (b k dp = G): the base's own
        # micro-batch beside it would be refused as a contradiction
        settings.pop("per_device_train_batch_size", None)
    argv = [sys.executable, "-m", "fasttrain", "lab", *preset, *flags(settings), *run.launch,
            "--quiet", *run.extra, "--out", str(out_dir / f"{run.name}.json")]
    if run.nproc > 1:
        argv += ["--nproc-per-node", str(run.nproc)]
    return argv


def run_in_session(argv: list[str], env: dict, timeout_s: float) -> tuple[int, str, str]:
    """``argv`` in a session of its own: (exit code, stdout, stderr); past ``timeout_s`` the whole session --
    torchrun's agent and every worker it started -- is stopped (the launcher's bounded run) and TimeoutExpired
    raised."""
    from fasttrain.lab.parallel.launch import run_bounded

    code, stdout, stderr, _ = run_bounded(argv, timeout_s, env=env, merge_stderr=False)
    if code is None:
        raise subprocess.TimeoutExpired(argv, timeout_s, output=stdout, stderr=stderr)
    return code, stdout, stderr


def _finished_record(path: Path) -> bool:
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return record.get("kind") == "lab-run" and bool(record.get("tokens_per_s"))


def sweep(runs: list[Planned], out_dir, *, log=print, timeout_s: float = 900, time_limit_s: float | None = None,
          skip_done: bool = False) -> list[dict]:
    """Run every planned run in its own process; a failed run is recorded (its last error line)
    and the sweep goes on. ``time_limit_s``: the sweep's own time; a run is started only while the time left
    holds the longest run so far of its process count (any count before one finished), and no run outlives
    the limit. ``skip_done``: a run whose record is already in ``out_dir`` is kept, not run again (a sweep cut
    short continues; several sweeps share one folder and its one-GPU runs)."""
    from fasttrain.lab.parallel.distributed import multicast_off

    prepared = experiment.prepare(runs, config=run_config)     # every run's configuration, before any process
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    env = multicast_off(dict(os.environ))
    deadline = None if time_limit_s is None else time.monotonic() + time_limit_s
    status = []

    def longest(nproc: int) -> float:
        took = [s["seconds"] for s in status if s["exit"] is not None and not s.get("kept")]
        mine = [s["seconds"] for s in status if s["nproc"] == nproc and s["exit"] is not None and not s.get("kept")]
        return max(mine or took or [0.0])

    def launch(run: Planned, cfg) -> dict:
        argv = command_line(run, out_dir)
        row = {"name": run.name, "preset": run.preset, "label": run.label, "nproc": run.nproc, "exit": 0,
               "seconds": 0.0, "argv": argv[1:], "error": None}
        if skip_done and _finished_record(out_dir / f"{run.name}.json"):
            log(f"[{len(status) + 1}/{len(runs)}] {run.name}: its record is there (--skip-done)")
            return {**row, "kept": True}
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and (left < longest(run.nproc) or left < 5):
            log(f"[{len(status) + 1}/{len(runs)}] {run.name}: not started, {left:.0f} s left of --time-limit")
            return {**row, "exit": None, "skipped": f"{max(left, 0):.0f} s left of the time limit; the longest "
                                                    f"run of {run.nproc} process(es) took {longest(run.nproc):.0f} s"}
        log(f"[{len(status) + 1}/{len(runs)}] {run.name}: {' '.join(argv[1:])}")
        limit = timeout_s if left is None else min(timeout_s, left)
        t0 = time.monotonic()          # the time limit's clock
        try:
            code, stdout, stderr = run_in_session(argv, env, limit)
            tail = (stderr.strip().splitlines() or [""])[-1]
            atomic_write_text(out_dir / f"{run.name}.log", stdout + stderr)
        except subprocess.TimeoutExpired as exc:
            code, tail = 124, f"timed out after {limit:.0f} s"
            atomic_write_text(out_dir / f"{run.name}.log", (exc.output or "") + (exc.stderr or "") + tail + "\n")
        return {**row, "exit": code, "seconds": round(time.monotonic() - t0, 1), "error": tail if code else None}

    def finished(run: Planned, row: dict) -> None:
        status.append(row)
        if row.get("kept") or row["exit"] is None:
            return
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
    @click.option("--presets", default="shakespeare-char,char-100m", show_default=True,
                  help="Comma-separated (not with --model hf:... among the lab flags).")
    @click.option("--nproc-per-node", "nproc", default="2", show_default=True,
                  help="GPUs of the N-GPU runs: a count or a comma list (2,4: the 2-GPU runs on the first 2).")
    @click.option("--strategies", default="ddp,zero1,fsdp-zero2,fsdp-zero3,tp", show_default=True,
                  help="Comma-separated: " + ", ".join(STRATEGY_PARALLEL) + ".")
    @click.option("--weak", default=None, show_default="ddp",
                  help="Strategies also run at the one-GPU run's per-device batch on every GPU (the same per-GPU "
                       "batch): a comma list of --strategies, all or none.")
    @click.option("--strong/--no-strong", default=True, show_default=True,
                  help="Every strategy at the one-GPU run's global batch (the loss curves compare).")
    @click.option("--max-steps", type=int, default=60, show_default=True, help="Steps of every run.")
    @click.option("--timing-warmup-steps", "warmup", type=int, default=5, show_default=True,
                  help="Steps of every run left out of its timing.")
    @click.option("--bf16/--no-bf16", default=True, show_default=True,
                  help="Also 1 GPU and fsdp-zero3 in bf16 (where the base is not bf16 already).")
    @click.option("--name", default=None, help="The model's name in the records' files (a sweep of --model hf:...; "
                                               "default: its folder's name).")
    @click.option("--data-dir", default=None, help="Data root (holds tinyshakespeare/input.txt).")
    @click.option("--device", type=click.Choice(["cuda", "cpu"]), default="cuda", show_default=True,
                  help="cpu: gloo processes (a smoke test of the sweep; timings mean nothing).")
    @click.option("--time-limit", "time_limit", type=float, default=None,
                  help="Seconds for the whole sweep: a run starts only while the time left holds the longest run "
                       "so far of its GPU count; the rest are recorded as not started.")
    @click.option("--skip-done", is_flag=True, help="Keep runs whose record is in --out already (not run again).")
    @click.option("--dry-run", is_flag=True, help="Print the command lines only.")
    @click.argument("lab_flags", nargs=-1, type=click.UNPROCESSED, metavar="[-- LAB FLAGS]")
    @click.pass_context
    def sweep_cmd(ctx, out_dir, presets, nproc, strategies, weak, strong, max_steps, warmup, bf16, name, data_dir,
                  device, time_limit, skip_done, dry_run, lab_flags) -> None:
        """Every strategy on N GPUs and the same base on 1 GPU, one process tree per run. The base: each preset,
        or the lab flags after ``--`` (e.g. ``-- --model hf:FOLDER --train-bin T --val-bin V --bin-dtype uint16
        --context 2048 --per-device-train-batch-size 4 --bf16``), whose batch is the one-GPU run's."""
        from fasttrain.lab.overrides import settings_from_flags

        # the sweep's own inputs are checked for a dry run too: it prints what a real run would start
        preset_list, strategy_list, counts, weak_list = check_sweep(presets, strategies, nproc, max_steps, weak)
        base = settings_from_flags(lab_flags)
        for own in ("max_steps", "timing_warmup_steps"):
            if own in base:
                raise FasttrainError(f"--{own.replace('_', '-')} is the sweep's own option: give it before --")
        if base.get("model", "gpt") != "gpt":
            if ctx.get_parameter_source("presets").name != "DEFAULT":
                raise FasttrainError("--presets and --model hf:... name the sweep's base twice; give one")
            if name is None:
                folder = Path(str(base["model"]).split(":", 1)[1].rstrip("/"))
                name = folder.parent.name if folder.name == "model" else folder.name
        if name is not None and (not name or not all(c.isalnum() or c in "-_" for c in name)):
            raise FasttrainError(f"--name {name!r}: letters, digits, - and _ only (it names the record files)")
        if time_limit is not None and not time_limit > 0:
            raise FasttrainError(f"--time-limit must be a positive number of seconds, got {time_limit!r}")
        if not dry_run:
            check_launch(max(counts), device, "ddp")
        warning = cpu_oversubscription(max(counts), device)
        if warning:
            click.echo(warning, err=True)
        extra = (["--data-dir", data_dir] if data_dir else []) + ["--device", device]
        runs = plan(preset_list, counts, max_steps, strategy_list, bf16=bf16, extra=extra, weak=weak_list,
                    strong=strong, base=base, name=name, warmup=warmup)
        if dry_run:
            for run in runs:
                click.echo(" ".join(command_line(run, Path(out_dir).expanduser())[1:]))
            click.echo(f"dry run: {len(runs)} runs planned, none started", err=True)
            return
        out_dir = str(Path(out_dir).expanduser())
        status = sweep(runs, out_dir, log=lambda line: click.echo(line, err=True), time_limit_s=time_limit,
                       skip_done=skip_done)
        result = report(out_dir)
        click.echo(result["markdown"].read_text())
        unstarted = [s["name"] for s in status if s["exit"] is None]
        if unstarted:
            click.echo(f"{len(unstarted)} run(s) not started within --time-limit: {', '.join(unstarted)}", err=True)
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
