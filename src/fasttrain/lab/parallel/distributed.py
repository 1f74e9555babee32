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
  ``--bf16`` a ``MixedPrecisionPolicy`` gathers bf16 parameters, computes in bf16 and reduces
  gradients in fp32 (the fp32 shards are the master weights).
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

STRATEGIES = ("none", "ddp", "zero1", "fsdp", "tp")
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

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @property
    def label(self) -> str:
        """A name for tables: ``fsdp`` splits into its two ZeRO stages."""
        if self.strategy == "fsdp":
            return "fsdp-zero3" if self.reshard_after_forward else "fsdp-zero2"
        return self.strategy


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
    return parallel


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
    mesh: object = None
    owns_group: bool = False        # this run created the process group (and destroys it at the end)

    @property
    def distributed(self) -> bool:
        return self.backend is not None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def tp(self) -> int:
        return self.world_size if self.strategy == "tp" else 1

    @property
    def dp(self) -> int:
        return self.world_size // self.tp

    @property
    def dp_rank(self) -> int:
        return self.rank if self.strategy != "tp" else 0

    def rows(self, per_device: int) -> slice:
        """This rank's rows of a global batch of ``per_device * dp`` sequences."""
        start = self.dp_rank * per_device
        return slice(start, start + per_device)

    def describe(self) -> dict:
        return {"strategy": self.strategy, "label": ParallelConfig(self.strategy, self.reshard_after_forward).label,
                "world_size": self.world_size, "dp": self.dp, "tp": self.tp, "backend": self.backend,
                "timeout_s": self.timeout_s}


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


def check_model_fits(cfg, world_size: int, strategy: str) -> None:
    """Tensor parallelism splits heads, key/value heads and the feed-forward width over the ranks
    (the lab GPT's from ``cfg``, a HF model's from its config.json)."""
    if strategy != "tp":
        return
    if _is_hf(cfg):
        from fasttrain.lab.hf import check_hf_parallel

        check_hf_parallel(strategy, cfg.model, world_size)     # the HF config's heads and widths
        return
    kv = cfg.heads if cfg.kv_heads is None else cfg.kv_heads
    for name, value in (("--heads", cfg.heads), ("--kv-heads", kv), ("the feed-forward width", cfg.ffn_width)):
        if value % world_size:
            raise FasttrainError(f"tensor parallelism over {world_size} ranks needs {name} ({value}) divisible by "
                                 f"{world_size}; change the model or the number of processes")


def check_config(cfg, parallel: ParallelConfig) -> None:
    """Techniques that do not combine with a strategy, refused before any process group exists."""
    s = parallel.strategy
    if s == "none":
        return None
    if cfg.auto_find_batch_size:
        raise FasttrainError("--auto-find-batch-size searches on one GPU; run it there without --strategy and "
                             "pass the batch it finds as --per-device-train-batch-size")
    if cfg.fp16 and s in ("fsdp", "tp"):
        raise FasttrainError(f"--fp16 (GradScaler) is not supported with --strategy {s}; use --bf16")
    if s == "tp" and (cfg.lora_r or cfg.prompt_tuning_tokens or cfg.use_liger_kernel):
        # peft wraps the Linear layers the plan splits; liger's fused loss reads lm_head's whole weight
        raise FasttrainError("--strategy tp splits the plain attention and MLP layers; it does not combine with "
                             "LoRA, prompt tuning or --use-liger-kernel: use ddp or fsdp")
    if s == "tp" and _is_hf(cfg):
        from fasttrain.lab.hf import check_hf_parallel

        check_hf_parallel(s, cfg.model)         # the family ships a plan the lab applies
    return None


def _is_hf(cfg) -> bool:
    model = getattr(cfg, "model", None)
    return isinstance(model, str) and model.startswith("hf:")


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
                                 f"add --strategy ddp, zero1, fsdp or tp")
        return World()
    if not launched_by_torchrun(env):
        raise FasttrainError(f"--strategy {parallel.strategy} runs one process per GPU: add --nproc-per-node N "
                             f"(or start it with: torchrun --nproc-per-node N -m fasttrain lab ...)")
    import torch
    import torch.distributed as dist
    from datetime import timedelta

    multicast_off()
    rank, world_size, local_rank = int(env["RANK"]), int(env["WORLD_SIZE"]), int(env["LOCAL_RANK"])
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
    world = World(rank=rank, world_size=world_size, local_rank=local_rank, backend=backend, device=device,
                  strategy=parallel.strategy, reshard_after_forward=parallel.reshard_after_forward,
                  timeout_s=parallel.ddp_timeout, owns_group=owns_group)
    if parallel.strategy in ("fsdp", "tp"):
        from torch.distributed.device_mesh import init_device_mesh

        world.mesh = init_device_mesh(device.split(":")[0], (world_size,))
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
    """Column/row-parallel attention and MLP over ``world.mesh``, in place."""
    import torch
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    t = world.world_size
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
        parallelize_module(block, world.mesh, {"attn.qkv": ColwiseParallel(), "attn.proj": RowwiseParallel(),
                                               "mlp.up": ColwiseParallel(), "mlp.down": RowwiseParallel()})


def wrap_model(model, world: World, mixed_bf16: bool = False, blocks=None):
    """The model as the strategy trains it (the same object for ``none`` and ``tp``). ``blocks``:
    ``module -> its repeated blocks`` (a LabModel's hook; default ``module.blocks``), FSDP's units."""
    if world.strategy == "none":
        return model
    import torch

    if world.strategy in ("ddp", "zero1"):
        from torch.nn.parallel import DistributedDataParallel as DDP

        ids = [world.local_rank] if world.device.startswith("cuda") else None
        # buffers (causal mask, RoPE tables) are constants: nothing to broadcast each forward;
        # gradients as views of the all-reduce buckets: no second copy of the gradients
        import inspect

        # (newer torch names the switch forward_sync_buffers; older ones broadcast_buffers)
        sync = "forward_sync_buffers" if "forward_sync_buffers" in inspect.signature(DDP).parameters \
            else "broadcast_buffers"
        return DDP(model, device_ids=ids, gradient_as_bucket_view=True, **{sync: False})
    if world.strategy == "fsdp":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed_bf16 \
            else MixedPrecisionPolicy()
        for block in (blocks(model) if blocks is not None else _blocks(model)):
            fully_shard(block, mesh=world.mesh, reshard_after_forward=world.reshard_after_forward, mp_policy=policy)
        # the root group holds the embedding, final norm and output layer; its parameters are
        # needed right away by the backward, so it is never resharded after the forward
        fully_shard(model, mesh=world.mesh, reshard_after_forward=False, mp_policy=policy)
        return model
    if world.strategy == "tp":
        from fasttrain.lab.hf import apply_hf_tensor_parallel, is_hf_module

        if is_hf_module(model):
            apply_hf_tensor_parallel(model, world.mesh)     # the family's own plan (lab/hf.py)
        else:
            apply_tensor_parallel(model, world)
        return model
    raise FasttrainError(f"unknown strategy {world.strategy!r}")


def unwrap(model):
    """The module itself (DDP keeps it as ``.module``)."""
    return getattr(model, "module", model)


def split_param_groups(groups: list[dict]) -> list[dict]:
    """Tensor parallelism leaves sharded parameters (DTensor) beside replicated plain tensors;
    foreach optimizer kernels take one kind per list, so each group is split in two."""
    from torch.distributed.tensor import DTensor

    out = []
    for group in groups:
        params = list(group["params"])
        for keep in (lambda p: isinstance(p, DTensor), lambda p: not isinstance(p, DTensor)):
            chosen = [p for p in params if keep(p)]
            if chosen:
                out.append({**group, "params": chosen})
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
    if world.strategy == "fsdp":
        model.set_requires_gradient_sync(last_micro_batch)
    return contextlib.nullcontext()


def clip_grad_norm(model, max_norm: float, world: World):
    """``clip_grad_norm_`` over all parameters; returns the total norm as a float.

    Tensor parallelism: sharded gradients count each shard once (a sum over the ranks), replicated
    ones (plain tensors and replicated DTensors) once: |g|^2 = sum_r |g_sharded,r|^2 + |g_replicated|^2."""
    import torch

    params = [p for p in model.parameters() if p.grad is not None]
    if world.strategy != "tp":
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        full = getattr(norm, "full_tensor", None)
        return float(full() if full else norm)
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in params]
    # a row-parallel bias is a DTensor too, but replicated: its square counts once, not per rank
    sharded = [g.to_local() for g in grads if isinstance(g, DTensor) and any(pl.is_shard() for pl in g.placements)]
    plain = [g.to_local() if isinstance(g, DTensor) else g for g in grads
             if not (isinstance(g, DTensor) and any(pl.is_shard() for pl in g.placements))]
    device = (sharded or plain)[0].device
    sq_sharded = sum((g.float().pow(2).sum() for g in sharded), torch.zeros((), device=device))
    dist.all_reduce(sq_sharded)
    sq = sq_sharded + sum((g.float().pow(2).sum() for g in plain), torch.zeros((), device=device))
    total = sq.sqrt()
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for g in sharded + plain:
        g.mul_(coef.to(g.dtype))
    return float(total)


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
    if world.strategy == "tp":
        raise FasttrainError("--save with --strategy tp is not supported (the QKV rows are reordered per rank); "
                             "save from a ddp, zero1 or fsdp run")
    if world.strategy in ("none", "ddp", "zero1"):
        return {k: v.detach().cpu() for k, v in unwrap(model).state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


# --- the estimator's view of a strategy ------------------------------------------------------------

def estimator_parallelism(world: World, bf16: bool = False) -> dict:
    """The memory estimator's ``Setup`` fields for this strategy: data parallelism d, ZeRO stage,
    tensor parallelism t, and whether gradients persist between steps.

    ddp: d = N, ZeRO 0, gradients in DDP's buckets for the whole run (``grad_buffers``);
    zero1: the same with the optimizer state / N; fsdp: ZeRO-3 (resharded after forward) or
    ZeRO-2, gradients / N; with bf16 the FSDP mixed-precision policy is the estimator's ``mixed``
    (bf16 compute copies of the weights and gradients, fp32 shards = master weights);
    tp: t = N."""
    s = world.strategy
    if s == "none":
        return {"dp": 1, "zero": 0, "tp": 1}
    if s == "ddp":
        return {"dp": world.dp, "zero": 0, "tp": 1, "grad_buffers": True}
    if s == "zero1":
        return {"dp": world.dp, "zero": 1, "tp": 1, "grad_buffers": True}
    if s == "fsdp":
        out = {"dp": world.dp, "zero": 3 if world.reshard_after_forward else 2, "tp": 1}
        if bf16:
            out["precision"] = "mixed"
        return out
    return {"dp": 1, "zero": 0, "tp": world.tp}

