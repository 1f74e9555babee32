"""Starting the lab on several processes, and its command line.

``fasttrain lab --nproc-per-node N --strategy S ...`` refuses what cannot run here before any process
starts (:func:`check_before_launch`), then runs torchrun's own launcher in this process
(:func:`launch`): it starts N copies of the same command (:func:`worker_argv`, without the launcher's
options), each of which joins the process group through :mod:`fasttrain.lab.parallel.distributed`.
Also here: the options ``fasttrain lab`` takes for several processes and the per-rank summary lines.
``fasttrain lab dist`` (the strategy sweep and its report) is the scaling experiment's command
(:mod:`fasttrain.lab.experiments.scaling`): experiments sit above this wing, never below it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import time
from dataclasses import dataclass

from fasttrain.errors import FasttrainError
from fasttrain.lab.parallel.distributed import (BACKENDS, STRATEGIES, ParallelConfig, check_batch_flags,  # noqa: F401
                                                check_config, check_model_fits, gpu_count, launched_by_torchrun,
                                                mesh_shape, multicast_off, resolve_batch, validate_parallel)


# SIGTERM first (torchrun's agent stops its workers), SIGKILL to the whole session this much later
KILL_GRACE_S = 10.0


def run_bounded(argv: list[str], limit_s: float, env: dict | None = None, cwd=None,
                merge_stderr: bool = True) -> tuple[int | None, str, str, float]:
    """Run ``argv`` in a session of its own for at most ``limit_s``: (exit code, or None when it was stopped;
    its stdout; its stderr, or "" when merged into stdout; seconds). Stopped: SIGTERM to the session (torchrun's
    agent stops its workers), SIGKILL to it ``KILL_GRACE_S`` later -- only the processes this call started, and
    none of them left holding a GPU the next run needs."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE, text=True, env=env,
                            cwd=cwd, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=max(1.0, limit_s))
        return proc.returncode, out, err or "", time.perf_counter() - t0
    except subprocess.TimeoutExpired:
        out = err = ""
        for sig, wait in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                out, err = proc.communicate(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue
        return None, out or "", err or "", time.perf_counter() - t0


# --- bad input, before any process starts ----------------------------------------------------------

def check_launch(nproc_per_node: int, device: str, strategy: str) -> None:
    """Refuse a launch that cannot run here (more processes than GPUs, no strategy)."""
    if isinstance(nproc_per_node, bool) or not isinstance(nproc_per_node, int) or nproc_per_node < 1:
        raise FasttrainError(f"--nproc-per-node must be a positive integer, got {nproc_per_node!r}")
    if strategy == "none":
        raise FasttrainError("--nproc-per-node needs --strategy ddp, zero1, fsdp, hsdp or tp")
    if device == "cpu":
        return
    gpus = gpu_count()
    if device in ("cuda",) or (device == "auto" and gpus) or str(device).startswith("cuda:"):
        if nproc_per_node > gpus:
            raise FasttrainError(f"--strategy {strategy} with {nproc_per_node} processes per node needs "
                                 f"{nproc_per_node} GPUs; this machine has {gpus}; use --nproc-per-node {max(gpus, 1)} "
                                 f"or --device cpu (gloo)")


def check_nnodes(text) -> None:
    """torchrun's --nnodes: a machine count N, or MIN:MAX for an elastic run (1 <= MIN <= MAX)."""
    parts = str(text).split(":")
    ok = len(parts) in (1, 2) and all(p.isdigit() and p.isascii() and int(p) >= 1 for p in parts)
    if not ok or int(parts[0]) > int(parts[-1]):
        raise FasttrainError(f"--nnodes must be a number of machines (e.g. 2) or MIN:MAX (e.g. 1:4), got {text!r}")


def cpu_oversubscription(nproc: int, device: str) -> str | None:
    """A warning when CPU processes outnumber the cores: they take turns, and the timings measure
    the turns, not the strategy."""
    if device != "cpu":
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if nproc <= cores:
        return None
    return (f"warning: {nproc} processes on {cores} CPU core{'s' if cores > 1 else ''}: they take turns, so the "
            f"run is slow and its timings measure the sharing; use --nproc-per-node {cores} or fewer")


def data_parallel_ranks(parallel: ParallelConfig, spec: "Launch | None") -> int | None:
    """The data-parallel ranks of a run: 1 in one process; on one machine, its processes over the tp groups;
    None over several machines (this launcher knows its own share only)."""
    if spec is None:
        return 1
    if str(spec.nnodes) != "1":
        return None
    names, sizes = mesh_shape(parallel, spec.nproc_per_node)
    return spec.nproc_per_node // (sizes[names.index("tp")] if "tp" in names else 1)


def check_before_launch(cfg, parallel: ParallelConfig, spec: "Launch") -> None:
    """Everything that can be refused before torchrun starts a process (one machine: the world
    size is known, so the batch and the heads are checked here too)."""
    check_launch(spec.nproc_per_node, cfg.device, parallel.strategy)
    check_config(cfg, parallel)
    if parallel.ddp_backend == "nccl" and cfg.device == "cpu":
        raise FasttrainError("--ddp-backend nccl needs CUDA GPUs; on the CPU use --ddp-backend gloo")
    if str(spec.nnodes) == "1":
        world = spec.nproc_per_node
        names, sizes = mesh_shape(parallel, world)
        tp = sizes[names.index("tp")] if "tp" in names else 1
        check_model_fits(cfg, world, parallel.strategy, tp=tp)
        resolve_batch(cfg, parallel, world // tp)
    # what every rank would refuse alike once torchrun started them (each its own line, interleaved), refused here
    # once: the default corpus's file (the user's own files were checked by validate), missing or damaged (its
    # SHA-256, 1 MB read). (The checkpoints and the libraries a run needs: the lab's CLI, above this floor.)
    if not (cfg.train_file or cfg.train_bin):
        from fasttrain.data.text import load_text

        load_text(data_dir=cfg.data_dir)


# --- the launcher -------------------------------------------------------------------------------

@dataclass
class Launch:
    """torchrun's own flags, as ``fasttrain lab`` passes them on."""

    nproc_per_node: int
    nnodes: str = "1"
    node_rank: int | None = None
    rdzv_endpoint: str | None = None
    rdzv_id: str = "fasttrain-lab"
    max_restarts: int = 0

    def torchrun_args(self) -> list[str]:
        args = ["--nproc-per-node", str(self.nproc_per_node), "--nnodes", str(self.nnodes),
                "--max-restarts", str(self.max_restarts)]
        if self.rdzv_endpoint:
            args += ["--rdzv-backend", "c10d", "--rdzv-endpoint", self.rdzv_endpoint, "--rdzv-id", self.rdzv_id]
        elif str(self.nnodes) == "1":
            args += ["--standalone"]
        else:
            raise FasttrainError("--nnodes > 1 needs --rdzv-endpoint HOST:PORT (the same on every node)")
        if self.node_rank is not None:
            args += ["--node-rank", str(self.node_rank)]
        return args


def launch(spec: Launch, worker_args: list[str]) -> None:
    """Run ``python -m fasttrain <worker_args>`` in ``nproc_per_node`` processes through torchrun's
    launcher (the elastic agent: rendezvous, environment, restart policy), in this process.

    A failed worker stops the others (torchrun's policy); the failure comes back as one line."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    # the workers inherit this process's environment: multicast off there too
    multicast_off()
    os.environ.setdefault("OMP_NUM_THREADS", "1")        # what torchrun sets anyway, without its banner
    args = parse_args([*spec.torchrun_args(), "-m", "fasttrain", *worker_args])
    # the agent logs each failure with a traceback-like report; the line below says it once
    agent_log = logging.getLogger("torch.distributed.elastic")
    level = agent_log.level
    agent_log.setLevel(logging.CRITICAL)
    # the agent's own logger says "Received 2 death signal" on Ctrl-C: the line below says it once
    server_log = logging.getLogger("torch.distributed.elastic.agent.server.api")
    server_level = server_log.level
    server_log.setLevel(logging.CRITICAL)
    from torch.distributed.elastic.multiprocessing.api import SignalException

    try:
        run(args)
    except (SignalException, KeyboardInterrupt) as exc:
        # Ctrl-C (or SIGTERM) reaches the agent, which stops the ranks and raises; one line, no traceback
        what = getattr(exc, "sigval", None)
        name = what.name if what is not None else "SIGINT"
        raise FasttrainError(f"interrupted ({name}): the {spec.nproc_per_node} ranks were stopped; checkpoints "
                             f"written before stay whole (continue with --resume OUTPUT_DIR)") from None
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        how = f"was stopped by {failure.signal_name()}" if failure.exitcode < 0 else \
            f"exited with code {failure.exitcode}"
        raise FasttrainError(f"rank {rank} of the {spec.nproc_per_node}-process run {how} first and torchrun "
                             f"stopped the others; its error is printed above") from None
    finally:
        agent_log.setLevel(level)
        server_log.setLevel(server_level)


def worker_argv(ctx, skip: tuple[str, ...]) -> list[str]:
    """The command line of a click command, rebuilt from its parsed values without ``skip``
    (the launcher's own options): what every worker runs."""
    import click

    names = [ctx.info_name]
    parent = ctx.parent
    while parent is not None and parent.parent is not None:       # up to, not including, the root group
        names.insert(0, parent.info_name)
        parent = parent.parent
    argv = list(names)
    for param in ctx.command.params:
        if not isinstance(param, click.Option) or param.name in skip or param.expose_value is False:
            continue
        value = ctx.params.get(param.name)
        source = ctx.get_parameter_source(param.name)
        if source is not None and source.name == "DEFAULT":
            continue
        if param.is_flag and not param.count:
            if param.secondary_opts:
                argv.append(param.opts[0] if value else param.secondary_opts[0])
            elif value:
                argv.append(param.opts[0])
            continue
        values = value if param.multiple else [value]
        for item in values:
            if item is None:
                continue
            if isinstance(item, (tuple, list)):
                item = ",".join(str(x) for x in item)
            argv += [param.opts[0], str(item)]
    return argv


# --- the command line ---------------------------------------------------------------------------

LAUNCH_OPTIONS = ("nproc_per_node", "nnodes", "node_rank", "rdzv_endpoint")
PARALLEL_OPTIONS = ("strategy", "reshard_after_forward", "global_batch_size", "ddp_backend", "ddp_timeout", "tp", "dp",
                    "dp_replicate", "offload_optimizer")


def parallel_options(fn):
    """``fasttrain lab``'s options for several processes (click decorators)."""
    import click

    decorators = [
        click.option("--strategy", type=click.Choice(STRATEGIES), default="none", show_default=True,
                     help="Several processes: ddp, zero1 (ZeroRedundancyOptimizer), fsdp (FSDP2; with --tp M the "
                          "2-D mesh), hsdp (FSDP2 replicate x shard), tp (tensor parallelism over all ranks)."),
        click.option("--tp", type=int, default=None,
                     help="fsdp/hsdp: tensor-parallel degree inside each group of M ranks (the 2-D mesh dp x tp)."),
        click.option("--dp", type=int, default=None, help="Data-parallel size (default: world / tp)."),
        click.option("--dp-replicate", type=int, default=None,
                     help="hsdp: replicate groups R (the model sharded over dp / R ranks inside each)."),
        click.option("--offload-optimizer", is_flag=True, default=None,
                     help="fsdp/hsdp: the fp32 shards, gradients and optimizer state in host memory (CPUOffloadPolicy)."),
        click.option("--reshard-after-forward/--no-reshard-after-forward", default=True, show_default=True,
                     help="fsdp: free the gathered parameters after the forward (ZeRO-3) or keep them (ZeRO-2)."),
        click.option("--global-batch-size", type=int, default=None,
                     help="Sequences per optimizer step over all ranks (sets --per-device-train-batch-size; "
                          "both given must agree)."),
        click.option("--ddp-backend", type=click.Choice(BACKENDS), default=None,
                     help="Process-group backend (default: nccl on GPUs, gloo on the CPU)."),
        click.option("--ddp-timeout", type=float, default=1800.0, show_default=True,
                     help="Seconds a collective waits for the other ranks before the run stops."),
        click.option("--nproc-per-node", type=int, default=None,
                     help="Start this many processes through torchrun (one per GPU)."),
        click.option("--nnodes", default=None, help="torchrun: number of machines (or MIN:MAX)."),
        click.option("--node-rank", type=int, default=None, help="torchrun: this machine's rank."),
        click.option("--rdzv-endpoint", default=None, help="torchrun: HOST:PORT of the rendezvous (several machines)."),
    ]
    for deco in reversed(decorators):
        fn = deco(fn)
    return fn


def parallel_from_options(options: dict) -> tuple[ParallelConfig, Launch | None]:
    """Take the parallel and launcher options out of ``options`` (in place)."""
    values = {name: options.pop(name, None) for name in PARALLEL_OPTIONS + LAUNCH_OPTIONS}
    parallel = validate_parallel(ParallelConfig(
        strategy=values["strategy"] or "none",
        reshard_after_forward=True if values["reshard_after_forward"] is None else values["reshard_after_forward"],
        global_batch_size=values["global_batch_size"], ddp_backend=values["ddp_backend"],
        ddp_timeout=1800.0 if values["ddp_timeout"] is None else values["ddp_timeout"],
        tp=1 if values["tp"] is None else values["tp"], dp=values["dp"],
        dp_replicate=1 if values["dp_replicate"] is None else values["dp_replicate"],
        offload_optimizer=bool(values["offload_optimizer"])))
    launch_spec = None
    if values["nnodes"] is not None:
        check_nnodes(values["nnodes"])
    if values["node_rank"] is not None and values["node_rank"] < 0:
        raise FasttrainError(f"--node-rank must be an integer >= 0, got {values['node_rank']}")
    if values["nproc_per_node"] is not None:
        launch_spec = Launch(nproc_per_node=values["nproc_per_node"], nnodes=values["nnodes"] or "1",
                             node_rank=values["node_rank"], rdzv_endpoint=values["rdzv_endpoint"])
    elif values["nnodes"] or values["rdzv_endpoint"] or values["node_rank"] is not None:
        raise FasttrainError("--nnodes, --node-rank and --rdzv-endpoint go with --nproc-per-node N")
    return parallel, launch_spec


@contextlib.contextmanager
def rank_prefixed_errors():
    """In one of several processes, an error line says which rank it comes from."""
    try:
        yield
    except FasttrainError as exc:
        if launched_by_torchrun() and int(os.environ.get("WORLD_SIZE", "1")) > 1 and not str(exc).startswith("rank "):
            raise FasttrainError(f"rank {env_rank()}: {exc}") from None
        raise


def env_rank() -> int:
    """This process's rank as torchrun set it (0 when not started by torchrun)."""
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def summary_lines(record: dict) -> list[str]:
    """The per-rank part of a run record, for the terminal."""
    d = record.get("distributed")
    if not d:
        return []
    mib = 2 ** 20
    est = record.get("estimate", {}).get("precise_bytes")
    peaks = ", ".join("-" if r["peak_allocated_bytes"] is None else f"{r['peak_allocated_bytes'] / mib:,.1f}"
                      for r in d["per_rank"])
    lines = [f"{d['label']} over {d['world_size']} processes ({d['backend']}, dp {d['dp']}, tp {d['tp']}): "
             f"global batch {d['global_batch_size']}, {record['tokens_per_s'] or 0:,.0f} tokens/s for the world",
             f"peak MiB per rank: {peaks}" + ("" if est is None else f"; estimator per GPU: {est / mib:,.1f}")]
    return lines
