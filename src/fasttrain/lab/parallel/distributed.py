"""The lab on several GPUs (or CPU processes) through ``torch.distributed``.

One process per GPU, started by torchrun (``torchrun --nproc-per-node N -m fasttrain lab ...``, or
``fasttrain lab --nproc-per-node N ...``, which calls torchrun's own launcher). The process group
comes from torchrun's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``...):
NCCL on GPUs, gloo on the CPU, with a timeout, so that a rank that dies or stalls makes the others
stop with an error instead of waiting forever.

Strategies (``--strategy``):

- ``ddp``: ``DistributedDataParallel``. Every rank holds the whole model and optimizer; gradients
  are averaged by an all-reduce in buckets during backward. With gradient accumulation the
  all-reduce runs only on the last micro-batch (``no_sync`` on the others): k-1 of k backward
  passes then cost no communication.
- ``zero1``: DDP plus ``ZeroRedundancyOptimizer``: each rank keeps the optimizer state of 1/N of
  the parameters, steps them, and broadcasts them to the others (ZeRO stage 1).
- ``fsdp``: FSDP2 ``fully_shard`` on every block and on the whole model. Parameters, gradients and
  optimizer state are sharded 1/N; a block's parameters are all-gathered before its forward and
  backward and gradients reduce-scattered after. ``reshard_after_forward=True`` frees the gathered
  parameters after the forward (ZeRO-3); ``False`` keeps them until the backward (ZeRO-2). With
  ``--bf16`` a ``MixedPrecisionPolicy`` gathers bf16 parameters and computes in bf16 (the fp32 shards
  are the master weights); gradients are reduced in ``--reduce-dtype`` (fp32, or bf16: half the
  bytes, each partial sum rounded to bf16) and land in fp32 shards.
- ``hsdp``: FSDP2 on a 2-D (replicate, shard) mesh: ``--dp-replicate R`` groups of N/R ranks, the
  model sharded inside each group and replicated across the groups (gradients reduce-scattered in
  the group, then all-reduced across groups). Across nodes the shard group stays on the fast links.
- ``fsdp --tp M`` (or ``hsdp --tp M``): the 2-D mesh ("dp", "tp") of N/M x M ranks: tensor
  parallelism inside each group of M consecutive ranks (one node's fast links), FSDP2 over the N/M
  data-parallel groups (torchtitan's layout: TP applied first, then ``fully_shard`` on the dp
  sub-mesh). ``--offload-optimizer``: FSDP2's ``CPUOffloadPolicy`` (the fp32 shards, their gradients
  and the optimizer state in host memory; the optimizer steps on the CPU).
- ``tp``: tensor parallelism over all N ranks (``torch.distributed.tensor.parallel``): the fused
  QKV and the MLP's up projection are column-parallel (each rank computes a/N of the heads and
  h_ff/N of the hidden units), the attention output and the MLP's down projection row-parallel
  (partial sums all-reduced). Embedding, norms and output layer stay replicated. Every rank sees
  the whole batch (no data parallelism). A Hugging Face model is split by its family's own plan
  (``config.base_model_tp_plan``: q, k, v, gate and up column-parallel, o and down row-parallel;
  the output layer column-parallel with its logits gathered, the embedding vocabulary-parallel
  unless tied to it): :func:`fasttrain.lab.hf.apply_hf_tensor_parallel`.

The global batch. ``per_device_train_batch_size`` keeps its Hugging Face meaning (sequences per
data-parallel rank and micro-batch); the global batch per optimizer step is that times the
data-parallel size times ``gradient_accumulation_steps``. Every rank draws the *global* batch
from the same seeded stream and keeps its own rows, ``rows [r b, (r + 1) b)``: N ranks at global
batch B see exactly the batches that one process at batch B sees, and since every rank's loss is
a mean over its b rows and DDP/FSDP average the gradients over N ranks,

    grad = 1/N sum_r (1/b sum_{i in rank r} grad l_i) = 1/B sum_i grad l_i,

the same function as one process, up to the order of the floating-point sums. (Dropout draws
its masks from each rank's own generator, so with dropout > 0 the runs agree in distribution,
not bit for bit.) ``--global-batch-size B`` sets ``per_device_train_batch_size = B / (N k)``.

NVLink multicast (NVLS) stays off everywhere: :data:`MULTICAST_OFF` is set in this process and in
the environment torchrun passes to its workers.

This module is what every process runs (its place in the world, the strategies, the collectives);
starting the processes, the command-line options and ``fasttrain lab dist`` are in
:mod:`fasttrain.lab.parallel.launch`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from dataclasses import dataclass

from fasttrain.errors import FasttrainError
from fasttrain.lab.config import is_hf
from fasttrain.memory.fit import parallel_fields

STRATEGIES = ("none", "ddp", "zero1", "fsdp", "hsdp", "tp")
FSDP_STRATEGIES = ("fsdp", "hsdp")
BACKENDS = ("nccl", "gloo")

# NVLink SHARP / multicast objects off in NCCL, in PyTorch's symmetric memory and in NVSHMEM.
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}

# What torchrun puts in every worker's environment.
_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def multicast_off(env: dict | None = None) -> dict:
    """Set the NVLink-multicast-off variables in ``env`` (default: this process), in place."""
    env = os.environ if env is None else env
    env.update(MULTICAST_OFF)
    return env


@dataclass
class ParallelConfig:
    """How one lab run spreads over processes. Names follow ``TrainingArguments`` where it has one."""

    strategy: str = "none"
    reshard_after_forward: bool = True          # fsdp: True = ZeRO-3, False = ZeRO-2
    global_batch_size: int | None = None        # sequences per optimizer step over all ranks
    ddp_backend: str | None = None              # None: nccl on GPUs, gloo on the CPU
    ddp_timeout: float = 1800.0                 # seconds a collective may wait for the other ranks
    tp: int = 1                                 # tensor-parallel degree (fsdp, hsdp: the 2-D mesh; tp: all ranks)
    dp: int | None = None                       # data-parallel size; None: world / tp
    dp_replicate: int = 1                       # hsdp: replicate groups (the model sharded inside each)
    offload_optimizer: bool = False             # fsdp, hsdp: CPUOffloadPolicy (shards + optimizer state on the host)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def flags(self) -> list[str]:
        """``fasttrain lab``'s flags for this strategy and its shape (not the batch, backend or timeout)."""
        flags = ["--strategy", self.strategy]
        if self.strategy in FSDP_STRATEGIES and not self.reshard_after_forward:
            flags.append("--no-reshard-after-forward")
        if self.strategy != "tp" and self.tp > 1:
            flags += ["--tp", str(self.tp)]
        if self.strategy == "hsdp":
            flags += ["--dp-replicate", str(self.dp_replicate)]
        if self.offload_optimizer:
            flags.append("--offload-optimizer")
        return flags

    @property
    def label(self) -> str:
        return strategy_label(self.strategy, self.reshard_after_forward, self.tp, self.dp_replicate,
                              self.offload_optimizer)


def strategy_label(strategy: str, reshard_after_forward: bool = True, tp: int = 1, dp_replicate: int = 1,
                   offload: bool = False) -> str:
    """A name for tables: ``fsdp`` splits into its two ZeRO stages; the 2-D mesh adds ``-tpM``."""
    name = strategy
    if strategy in FSDP_STRATEGIES:
        name = f"{strategy}-{'zero3' if reshard_after_forward else 'zero2'}"
        if strategy == "hsdp":
            name += f"-r{dp_replicate}"
        if tp > 1:
            name += f"-tp{tp}"
        if offload:
            name += "-offload"
    return name


def launched_by_torchrun(env: dict | None = None) -> bool:
    env = os.environ if env is None else env
    return all(name in env for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def validate_parallel(parallel: ParallelConfig) -> ParallelConfig:
    if parallel.strategy not in STRATEGIES:
        raise FasttrainError(f"unknown --strategy {parallel.strategy!r}; use one of {', '.join(STRATEGIES)}")
    if parallel.ddp_backend is not None and parallel.ddp_backend not in BACKENDS:
        raise FasttrainError(f"unknown --ddp-backend {parallel.ddp_backend!r}; use nccl (GPUs) or gloo (CPU)")
    if not parallel.ddp_timeout > 0:
        raise FasttrainError(f"--ddp-timeout must be > 0 seconds, got {parallel.ddp_timeout!r}")
    gb = parallel.global_batch_size
    if gb is not None and (isinstance(gb, bool) or not isinstance(gb, int) or gb <= 0):
        raise FasttrainError(f"--global-batch-size must be a positive integer, got {gb!r}")
    for flag, value, optional in (("--tp", parallel.tp, False), ("--dp", parallel.dp, True),
                                  ("--dp-replicate", parallel.dp_replicate, False)):
        if optional and value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise FasttrainError(f"{flag} must be a positive integer, got {value!r}")
    s = parallel.strategy
    if parallel.tp > 1 and s not in ("fsdp", "hsdp", "tp"):
        raise FasttrainError(f"--tp {parallel.tp} goes with --strategy fsdp or hsdp (the 2-D mesh: FSDP over dp, "
                             f"TP inside) or --strategy tp (every rank TP); not with --strategy {s}")
    if parallel.dp_replicate > 1 and s != "hsdp":
        raise FasttrainError(f"--dp-replicate {parallel.dp_replicate} is HSDP's: use --strategy hsdp")
    if s == "hsdp" and parallel.dp_replicate < 2:
        raise FasttrainError("--strategy hsdp needs --dp-replicate R >= 2 (R replicas, the model sharded inside "
                             "each); with R = 1 it is --strategy fsdp")
    if parallel.offload_optimizer and s not in FSDP_STRATEGIES:
        raise FasttrainError(f"--offload-optimizer is FSDP2's CPUOffloadPolicy: use --strategy fsdp or hsdp, "
                             f"not {s}")
    if s == "tp" and parallel.dp not in (None, 1):
        raise FasttrainError(f"--strategy tp puts every rank in one tensor-parallel group (dp 1); for "
                             f"--dp {parallel.dp} with --tp use --strategy fsdp --tp M")
    return parallel


def mesh_shape(parallel: ParallelConfig, world_size: int) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """The device mesh's dimension names and sizes for ``parallel`` over ``world_size`` ranks, or a
    one-line error when the shape does not divide the world (``()`` for ddp and zero1: no mesh).

    Rank r sits at mesh coordinates in row-major order, so the tp dimension (last) groups
    consecutive ranks: rank = dp_rank * tp + tp_rank."""
    s = parallel.strategy
    if s in ("none", "ddp", "zero1"):
        if parallel.dp not in (None, world_size):
            raise FasttrainError(f"--dp {parallel.dp} with --strategy {s} over {world_size} ranks: data parallelism "
                                 f"takes every rank (dp {world_size}); drop --dp")
        return (), ()
    tp = world_size if s == "tp" and parallel.tp == 1 else parallel.tp
    if s == "tp" and tp != world_size:
        raise FasttrainError(f"--strategy tp --tp {tp} over {world_size} ranks: tp alone spans every rank; use "
                             f"--strategy fsdp --tp {tp} for FSDP over {world_size // tp if world_size % tp == 0 else 'the'} "
                             f"data-parallel groups")
    if world_size % tp:
        raise FasttrainError(f"--tp {tp} does not divide the {world_size} ranks; use a --tp that divides "
                             f"--nproc-per-node x --nnodes")
    dp = world_size // tp if parallel.dp is None else parallel.dp
    if dp * tp != world_size:
        raise FasttrainError(f"--dp {dp} x --tp {tp} = {dp * tp} ranks, but the world has {world_size}; "
                             f"make dp x tp = {world_size}")
    if s == "tp":
        return ("tp",), (tp,)
    if s == "hsdp":
        r = parallel.dp_replicate
        if dp % r:
            raise FasttrainError(f"--dp-replicate {r} does not divide the {dp} data-parallel ranks; use a divisor of {dp}")
        names, sizes = ("dp_replicate", "dp_shard"), (r, dp // r)
    else:
        names, sizes = ("dp",), (dp,)
    if tp > 1:
        names, sizes = names + ("tp",), sizes + (tp,)
    return names, sizes


@dataclass
class World:
    """This process's place in the run. ``World()`` is one process with no process group."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    backend: str | None = None
    device: str = "cpu"
    strategy: str = "none"
    reshard_after_forward: bool = True
    timeout_s: float = 1800.0
    mesh: object = None             # a DeviceMesh with named dims (mesh_shape), None for ddp and zero1
    owns_group: bool = False        # this run created the process group (and destroys it at the end)
    tp_size: int = 0                # tensor-parallel degree; 0: every rank for strategy tp, else 1
    dp_replicate: int = 1           # hsdp: replicate groups
    offload_optimizer: bool = False

    @property
    def distributed(self) -> bool:
        return self.backend is not None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def tp(self) -> int:
        if self.tp_size:
            return self.tp_size
        return self.world_size if self.strategy == "tp" else 1

    @property
    def dp(self) -> int:
        return self.world_size // self.tp

    @property
    def dp_rank(self) -> int:
        # row-major mesh, tp last: rank = dp_rank * tp + tp_rank
        return self.rank // self.tp

    @property
    def fsdp(self) -> bool:
        return self.strategy in FSDP_STRATEGIES

    @property
    def tp_mesh(self):
        """The tensor-parallel sub-mesh (None without tensor parallelism)."""
        if self.mesh is None or self.tp == 1:
            return None
        return self.mesh["tp"] if self.mesh.ndim > 1 else self.mesh

    @property
    def dp_mesh(self):
        """The mesh FSDP shards over: 1-D ("dp"), or 2-D ("dp_replicate", "dp_shard") for HSDP."""
        if self.mesh is None or not self.fsdp:
            return None
        if self.strategy == "hsdp":
            return self.mesh["dp_replicate", "dp_shard"]
        return self.mesh["dp"] if self.mesh.ndim > 1 else self.mesh

    @property
    def label(self) -> str:
        return strategy_label(self.strategy, self.reshard_after_forward, self.tp, self.dp_replicate,
                              self.offload_optimizer)

    def rows(self, per_device: int) -> slice:
        """This rank's rows of a global batch of ``per_device * dp`` sequences."""
        start = self.dp_rank * per_device
        return slice(start, start + per_device)

    def describe(self) -> dict:
        return {"strategy": self.strategy, "label": self.label, "world_size": self.world_size, "dp": self.dp,
                "tp": self.tp, "dp_replicate": self.dp_replicate, "offload_optimizer": self.offload_optimizer,
                "backend": self.backend, "timeout_s": self.timeout_s}


# --- bad input, before anything starts -----------------------------------------------------------

def resolve_batch(cfg, parallel: ParallelConfig, dp: int):
    """``cfg`` with the per-device batch that the global batch asks for (one line if it cannot)."""
    if parallel.global_batch_size is None:
        return cfg
    per_step = dp * cfg.gradient_accumulation_steps
    if parallel.global_batch_size % per_step:
        raise FasttrainError(f"--global-batch-size {parallel.global_batch_size} does not split over {dp} "
                             f"data-parallel rank(s) x {cfg.gradient_accumulation_steps} accumulation step(s); "
                             f"use a multiple of {per_step}")
    return cfg.with_(per_device_train_batch_size=parallel.global_batch_size // per_step)


def check_batch_flags(cfg, parallel: ParallelConfig, dp: int) -> None:
    """``--per-device-train-batch-size`` given beside ``--global-batch-size``: they must agree (b k dp = G), or
    the run would silently train another micro-batch than the one asked for; one line naming both."""
    g = parallel.global_batch_size
    b, k = cfg.per_device_train_batch_size, cfg.gradient_accumulation_steps
    if g is None or b * k * dp == g:
        return
    fix = (f"the global batch alone sets the micro-batch to {g // (k * dp)}" if g % (k * dp) == 0
           else f"a global batch that {k * dp} divides")
    raise FasttrainError(f"--per-device-train-batch-size {b} x {k} accumulation step(s) x {dp} data-parallel "
                         f"rank(s) is {b * k * dp} sequences a step, not --global-batch-size {g}: give one of the "
                         f"two ({fix})")


def check_model_fits(cfg, world_size: int, strategy: str, tp: int | None = None) -> None:
    """Tensor parallelism splits heads, key/value heads and the feed-forward width over the ``tp``
    ranks of a group (default: every rank under ``--strategy tp``, else 1); the lab GPT's from
    ``cfg``, a HF model's from its config.json."""
    tp = (world_size if strategy == "tp" else 1) if tp is None else tp
    if tp == 1:
        return
    if is_hf(cfg.model):
        from fasttrain.lab.hf import check_hf_parallel

        check_hf_parallel("tp", cfg.model, tp)      # the HF config's heads and widths
        return
    kv = cfg.heads if cfg.kv_heads is None else cfg.kv_heads
    for name, value in (("--heads", cfg.heads), ("--kv-heads", kv), ("the feed-forward width", cfg.ffn_width)):
        if value % tp:
            raise FasttrainError(f"tensor parallelism over {tp} ranks needs {name} ({value}) divisible by "
                                 f"{tp}; change the model or the number of processes (--tp)")


def check_config(cfg, parallel: ParallelConfig) -> None:
    """Techniques that do not combine with a strategy, refused before any process group exists."""
    s = parallel.strategy
    if cfg.reduce_dtype != "fp32" and s not in (*FSDP_STRATEGIES, "ddp", "zero1"):
        raise FasttrainError(f"--reduce-dtype {cfg.reduce_dtype} is data parallelism's gradient reduction: it goes "
                             f"with --strategy ddp, zero1, fsdp or hsdp, not "
                             + ("one process" if s == "none" else f"--strategy {s}"))
    if s == "none":
        return None
    tp = parallel.tp > 1 or s == "tp"
    if cfg.auto_find_batch_size:
        raise FasttrainError("--auto-find-batch-size searches on one GPU; run it there without --strategy and "
                             "pass the batch it finds as --per-device-train-batch-size")
    if cfg.fp16 and (s in FSDP_STRATEGIES or tp):
        raise FasttrainError(f"--fp16 (GradScaler) is not supported with --strategy {s}; use --bf16")
    if tp and (cfg.lora_r or cfg.prompt_tuning_tokens or cfg.use_liger_kernel):
        # peft wraps the Linear layers the plan splits; liger's fused loss reads lm_head's whole weight
        raise FasttrainError("tensor parallelism splits the plain attention and MLP layers; it does not combine with "
                             "LoRA, prompt tuning or --use-liger-kernel: use ddp or fsdp without --tp")
    if tp and cfg.float8 != "none":
        raise FasttrainError("--float8 with tensor parallelism is not wired in the lab (torchao's float8 TP styles); "
                             "use --strategy fsdp without --tp")
    if tp and is_hf(cfg.model):
        from fasttrain.lab.hf import check_hf_parallel

        check_hf_parallel("tp", cfg.model)      # the family ships a plan the lab applies
    return None


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


# --- the process group -----------------------------------------------------------------------------

def _backend_for(device: str, wanted: str | None) -> str:
    import torch.distributed as dist

    if not dist.is_available():
        raise FasttrainError("this PyTorch build has no torch.distributed; install a build with it "
                             "(the CUDA or CPU wheels from pytorch.org have it)")
    backend = wanted or ("nccl" if device.startswith("cuda") else "gloo")
    if backend == "nccl":
        if not device.startswith("cuda"):
            raise FasttrainError("--ddp-backend nccl needs CUDA GPUs; on the CPU use --ddp-backend gloo")
        if not dist.is_nccl_available():
            raise FasttrainError("the NCCL backend is not available in this PyTorch build; install a CUDA build "
                                 "of torch or use --ddp-backend gloo")
    elif backend == "gloo":
        if not dist.is_gloo_available():
            raise FasttrainError("the gloo backend is not available in this PyTorch build; "
                                 "use --ddp-backend nccl on GPUs")
        if device.startswith("cuda") and wanted == "gloo":
            raise FasttrainError("--ddp-backend gloo runs on the CPU here; add --device cpu, or use nccl on GPUs")
    return backend


def init_world(parallel: ParallelConfig, device: str = "auto", env: dict | None = None) -> World:
    """Join the process group torchrun described in ``env``; ``World()`` without a strategy.

    ``device``: ``auto`` takes GPU ``LOCAL_RANK`` when CUDA is there, else the CPU."""
    validate_parallel(parallel)
    env = os.environ if env is None else env
    if parallel.strategy == "none":
        if launched_by_torchrun(env) and int(env["WORLD_SIZE"]) > 1:
            raise FasttrainError(f"started as one of {env['WORLD_SIZE']} processes but no --strategy given; "
                                 f"add --strategy ddp, zero1, fsdp, hsdp or tp")
        return World()
    if not launched_by_torchrun(env):
        raise FasttrainError(f"--strategy {parallel.strategy} runs one process per GPU: add --nproc-per-node N "
                             f"(or start it with: torchrun --nproc-per-node N -m fasttrain lab ...)")
    import torch
    import torch.distributed as dist
    from datetime import timedelta

    multicast_off()
    rank, world_size, local_rank = int(env["RANK"]), int(env["WORLD_SIZE"]), int(env["LOCAL_RANK"])
    mesh_shape(parallel, world_size)            # a shape that does not divide the world: before joining
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" or device.startswith("cuda:"):
        gpus = gpu_count()
        if local_rank >= gpus:
            raise FasttrainError(f"rank {rank}: local rank {local_rank} needs GPU {local_rank} but this machine has "
                                 f"{gpus}; start at most {gpus} process(es) per node, or use --device cpu")
        device = f"cuda:{local_rank}"
        torch.cuda.set_device(local_rank)
    backend = _backend_for(device, parallel.ddp_backend)
    owns_group = not dist.is_initialized()
    if owns_group:
        kwargs = {"device_id": torch.device(device)} if backend == "nccl" else {}
        try:
            dist.init_process_group(backend, timeout=timedelta(seconds=parallel.ddp_timeout), **kwargs)
        except (RuntimeError, ValueError) as exc:
            raise FasttrainError(f"rank {rank}: could not join the process group ({_first_line(exc)}); check "
                                 f"MASTER_ADDR/MASTER_PORT and that all {world_size} processes started") from None
    names, sizes = mesh_shape(parallel, world_size)
    world = World(rank=rank, world_size=world_size, local_rank=local_rank, backend=backend, device=device,
                  strategy=parallel.strategy, reshard_after_forward=parallel.reshard_after_forward,
                  timeout_s=parallel.ddp_timeout, owns_group=owns_group,
                  tp_size=sizes[names.index("tp")] if "tp" in names else 1, dp_replicate=parallel.dp_replicate,
                  offload_optimizer=parallel.offload_optimizer)
    if names:
        from torch.distributed.device_mesh import init_device_mesh

        world.mesh = init_device_mesh(device.split(":")[0], sizes, mesh_dim_names=names)
    return world


def shutdown(world: World) -> None:
    import torch.distributed as dist

    if world.owns_group and dist.is_initialized():
        dist.destroy_process_group()


def _first_line(exc: BaseException, limit: int = 200) -> str:
    text = " ".join(str(exc).split())
    # gloo prefixes its messages with the source location: "[.../pair.cc:553] Connection closed ..."
    if text.startswith("[") and "] " in text:
        text = text.split("] ", 1)[1]
    return text[:limit] + ("..." if len(text) > limit else "")


_COLLECTIVE_WORDS = ("gloo", "nccl", "connection closed", "timed out", "timeout", "processgroup", "collective",
                     "connection reset", "broken pipe", "watchdog")


@contextlib.contextmanager
def collective_errors(world: World):
    """Turn a failed collective (a rank died, or stalled past the timeout) into one error line."""
    if not world.distributed:
        yield
        return
    import torch.distributed as dist

    try:
        yield
    except FasttrainError:
        raise
    except RuntimeError as exc:
        dist_error = getattr(dist, "DistError", ())
        text = str(exc).lower()
        if not (isinstance(exc, dist_error) or any(word in text for word in _COLLECTIVE_WORDS)):
            raise
        raise FasttrainError(f"rank {world.rank}: lost the other ranks in a collective ({_first_line(exc)}); "
                             f"another rank died or stalled past the {world.timeout_s:g} s timeout "
                             f"(--ddp-timeout): see its error") from None


# --- strategies ---------------------------------------------------------------------------------

def _blocks(model):
    return list(model.blocks)


def _permute_rows(weight, sizes, t: int):
    """Reorder the rows of a fused projection so that each of t contiguous shards holds its own
    part of every piece: [q | k | v] -> [q_0 k_0 v_0 | q_1 k_1 v_1 | ...] (a column-parallel
    split of the reordered matrix gives rank r exactly its heads of q, k and v)."""
    import torch

    pieces = weight.split(sizes)
    return torch.cat([piece.chunk(t)[r] for r in range(t) for piece in pieces])


def apply_tensor_parallel(model, world: World) -> None:
    """Column/row-parallel attention and MLP of the lab's GPT over ``world.tp_mesh``, in place."""
    import torch
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    t = world.tp
    for block in _blocks(model):
        attn, mlp = block.attn, block.mlp
        c = attn.c
        a, g, d = c.heads, c.g, c.hidden // c.heads
        with torch.no_grad():
            attn.qkv.weight.copy_(_permute_rows(attn.qkv.weight, [a * d, g * d, g * d], t))
            if attn.qkv.bias is not None:
                attn.qkv.bias.copy_(_permute_rows(attn.qkv.bias, [a * d, g * d, g * d], t))
            if c.ffn_act == "swiglu":                       # fused [gate | up]
                mlp.up.weight.copy_(_permute_rows(mlp.up.weight, [c.ffn, c.ffn], t))
                if mlp.up.bias is not None:
                    mlp.up.bias.copy_(_permute_rows(mlp.up.bias, [c.ffn, c.ffn], t))
        # the attention of one rank sees a/t query heads, g/t key/value heads, width h/t
        attn.c = dataclasses.replace(c, heads=a // t, kv_heads=g // t, hidden=c.hidden // t)
        parallelize_module(block, world.tp_mesh, {"attn.qkv": ColwiseParallel(), "attn.proj": RowwiseParallel(),
                                               "mlp.up": ColwiseParallel(), "mlp.down": RowwiseParallel()})


def unwrap(model):
    """The module itself (DDP keeps it as ``.module``)."""
    return getattr(model, "module", model)


def _mesh_key(p):
    """Plain tensors: None; a DTensor: its mesh's dimension names (1-D dp, 2-D dp x tp, tp)."""
    mesh = getattr(p, "device_mesh", None)
    return None if mesh is None else tuple(mesh.mesh_dim_names or ()) + (mesh.ndim,)


def split_param_groups(groups: list[dict]) -> list[dict]:
    """Tensor parallelism leaves sharded parameters (DTensor) beside replicated plain tensors, and on
    the 2-D mesh FSDP makes 2-D DTensors of the split ones beside 1-D ones of the rest; foreach
    optimizer kernels take one kind (one mesh) per list, so each group is split by mesh."""
    out = []
    for group in groups:
        kinds: dict = {}
        for p in group["params"]:
            kinds.setdefault(_mesh_key(p), []).append(p)
        out.extend({**group, "params": chosen} for chosen in kinds.values())
    return out


def wrap_optimizer(optimizer, world: World):
    """``zero1``: the same optimizer class and settings, its state sharded over the ranks."""
    if world.strategy != "zero1":
        return optimizer
    from torch.distributed.optim import ZeroRedundancyOptimizer

    import inspect

    # defaults may hold keys the constructor does not take (AdamW: decoupled_weight_decay)
    accepted = inspect.signature(type(optimizer).__init__).parameters
    defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    groups = [{k: v for k, v in g.items() if k == "params" or (k in accepted and defaults.get(k, object()) != v)}
              for g in optimizer.param_groups]
    first, rest = groups[0], groups[1:]
    zero = ZeroRedundancyOptimizer(first["params"], optimizer_class=type(optimizer), **{**defaults, **{
        k: v for k, v in first.items() if k != "params"}})
    for group in rest:
        zero.add_param_group(group)
    return zero


def local_optimizer(optimizer):
    """The optimizer whose state lives on this rank (ZeRO keeps its shard's in ``.optim``)."""
    return getattr(optimizer, "optim", optimizer)


def sync_gradients(model, world: World, last_micro_batch: bool):
    """A context for one micro-batch's backward: gradients are reduced only on the last one."""
    if world.strategy in ("ddp", "zero1") and not last_micro_batch:
        return model.no_sync()
    if world.fsdp:
        model.set_requires_gradient_sync(last_micro_batch)
    return contextlib.nullcontext()


def clip_grad_norm(model, max_norm: float, world: World):
    """``clip_grad_norm_`` over all parameters of every strategy; returns the total norm as a float.

    Gradients are grouped by their mesh and placements (plain tensors; FSDP's shards on dp; TP's
    slices on tp; both on the 2-D mesh). A group's squared norm over this rank's pieces is summed
    over the mesh dimensions its gradients are sharded on (disjoint pieces) and not over those they
    are replicated on (the same piece counted once): |g|^2 = sum over groups of sum_shards |g_piece|^2;
    then every gradient is scaled by min(1, max / |g|). (By hand rather than through DTensor's
    ``full_tensor``: offloaded gradients live on the CPU while the collectives run on the GPUs.)"""
    import torch
    import torch.distributed as dist

    grads = [p.grad for p in model.parameters() if p.grad is not None]
    groups: dict = {}
    for g in grads:
        groups.setdefault((_mesh_key(g), tuple(getattr(g, "placements", ()))), []).append(g)
    total_sq = 0.0
    for (_, placements), same in groups.items():
        local = [g.to_local() if hasattr(g, "to_local") else g for g in same]
        sq = torch.nn.utils.get_total_norm(local, 2.0).double() ** 2
        if placements:
            mesh = same[0].device_mesh
            sq = sq.to(mesh.device_type)
            for dim, placement in enumerate(placements):
                # Shard and FSDP's _StridedShard on a TP-split dim alike (the latter is no is_shard())
                if not placement.is_replicate():
                    dist.all_reduce(sq, group=mesh.get_group(dim))
        total_sq += float(sq)
    total = total_sq ** 0.5
    coef = min(1.0, max_norm / (total + 1e-6))
    if coef < 1.0:
        for same in groups.values():
            torch._foreach_mul_([g.to_local() if hasattr(g, "to_local") else g for g in same], coef)
    return total


def all_mean(value: float, world: World) -> float:
    """The mean of a number over the data-parallel ranks (the loss of the global batch)."""
    if not world.distributed or world.dp == 1:
        return value
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(value)], dtype=torch.float64, device=world.device)
    dist.all_reduce(t)
    return float(t.item()) / world.world_size


def gather(obj, world: World) -> list:
    """Every rank's ``obj`` (any picklable value), on every rank, in rank order."""
    if not world.distributed:
        return [obj]
    import torch.distributed as dist

    out = [None] * world.world_size
    dist.all_gather_object(out, obj)
    return out


def barrier(world: World) -> None:
    if world.distributed:
        import torch.distributed as dist

        dist.barrier()


def full_state_dict(model, world: World) -> dict:
    """The whole model's weights on every rank (FSDP shards gathered), as plain CPU tensors."""
    if world.tp > 1:
        raise FasttrainError("--save with tensor parallelism is not supported (the QKV rows are reordered per rank); "
                             "save from a ddp, zero1 or fsdp run without --tp")
    if world.strategy in ("none", "ddp", "zero1"):
        return {k: v.detach().cpu() for k, v in unwrap(model).state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


# --- the estimator's view of a strategy ------------------------------------------------------------

def estimator_parallelism(world: World, bf16: bool = False, reduce_dtype: str = "fp32") -> dict:
    """The memory estimator's ``Setup`` fields for this run's strategy, per GPU, FSDP's gradients reduced in
    ``reduce_dtype`` (``--reduce-dtype``) (:func:`fasttrain.memory.fit.parallel_fields`: the one mapping,
    which ``fasttrain memory --strategy`` uses too)."""
    return parallel_fields(world.strategy, dp=world.dp, tp=world.tp, replicas=world.dp_replicate,
                           reshard_after_forward=world.reshard_after_forward, offload=world.offload_optimizer,
                           bf16=bf16, reduce_dtype=reduce_dtype)

