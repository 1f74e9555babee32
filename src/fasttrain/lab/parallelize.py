"""Every technique that acts on a built model, applied in one place and in one order.

:func:`parallelize` turns a built :class:`~fasttrain.lab.models.LabModel` into what the trainer
trains (the module as trained, the module itself, the optimizer), in this order:

1. ``kernels``: model-intrinsic kernels -- the attention implementation, liger's kernels, the
   fused loss head. ``build.py`` (the lab's GPT: its config) and ``hf/`` (a transformers model:
   ``attn_implementation`` at load, liger's patches) apply them when the model is built, because
   they are part of the module's code; here they are checked and recorded.
2. ``adapters``: the soft prompt (the base frozen) and LoRA (peft), on the plain modules, before
   anything splits or wraps them.
3. ``tensor_parallel``: the family's plan on the tp dimension of the mesh (``--strategy tp``: every
   rank; ``--strategy fsdp --tp M``: groups of M consecutive ranks).
4. ``activation_checkpointing``: per block (the lab's GPT by its config; a transformers model through
   its own ``gradient_checkpointing_enable``), so the recomputed region holds the TP collectives.
5. ``compile_blocks``: ``torch.compile`` of each block in place (``--torch-compile-scope blocks``),
   before FSDP so that FSDP's hooks stay outside the compiled graphs.
6. ``float8`` then ``data_parallel``: torchao's ``convert_to_float8_training`` on the Linear layers
   (``--float8-all-gather``: under FSDP with per-tensor scaling their weights all-gathered in float8,
   the scale of each weight from its whole amax), then FSDP2 ``fully_shard`` per block and on the
   root over the dp dimension (HSDP: the 2-D replicate x shard mesh; ``--offload-optimizer``:
   CPUOffloadPolicy), or DDP. A model built on the meta device (a model trained from scratch under
   FSDP) gets its weights here, once sharded.
7. ``compile_model``: ``torch.compile`` of the whole (wrapped) model, when asked instead of 5.
8. ``optimizer``: over what the steps above left trainable; ZeRO-1 wraps it for ``zero1``.

This order is torchtitan's (TP, AC, compile, FSDP): TP first because FSDP shards the TP-split
parameters again over dp (a 2-D DTensor); AC and per-block compile before FSDP so that each block's
all-gather and reduce-scatter hooks wrap the checkpointed, compiled block; float8 before FSDP so that
FSDP shards the float8 layers' weights. ``ORDER`` names the steps; ``Parallelized.applied`` records
what each did, in order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fasttrain.errors import FasttrainError

ORDER = ("kernels", "adapters", "tensor_parallel", "activation_checkpointing", "compile_blocks", "float8",
         "data_parallel", "compile_model", "optimizer")
FLOAT8 = ("none", "tensorwise", "rowwise")


@dataclass
class Parallelized:
    """What the trainer trains."""

    train_model: Any            # the module as trained: DDP's wrapper, the compiled module, or the module
    module: Any                 # the module itself (evaluation, saving, counting parameters)
    optimizer: Any
    autocast: bool = True       # False: FSDP's mixed-precision policy computes in bf16 itself
    applied: list = field(default_factory=list)     # [(step, what it did)], in ORDER
    # run after every optimizer step (float8 all-gather: every weight's scale for the next gathers, at once)
    after_optimizer_step: Any = None


def parallelize(lab_model, cfg, world=None) -> Parallelized:
    """Apply every technique ``cfg`` asks for to ``lab_model`` in :data:`ORDER` (module docstring)."""
    from fasttrain.lab.parallel.distributed import World

    world = world or World()
    applied: list = []
    module = lab_model.module
    apply_kernels(lab_model, cfg, module, applied)
    module = apply_adapters(lab_model, cfg, module, applied)
    apply_tensor_parallel(lab_model, module, world, applied)
    apply_activation_checkpointing(lab_model, cfg, module, applied)
    compile_blocks(lab_model, cfg, module, applied)
    float8_gather = apply_float8(lab_model, cfg, module, applied, world)
    wrapped = apply_data_parallel(lab_model, cfg, module, world, applied)
    train_model = compile_model(cfg, wrapped, applied)
    optimizer = build_optimizer_for(cfg, wrapped, world, applied)
    mixed_by_fsdp = world.fsdp and cfg.bf16
    after = None
    if float8_gather:
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        # the amax of every float8 weight in one all-reduce after the step, instead of one per weight at its gather
        def after():
            precompute_float8_dynamic_scale_for_fsdp(module)
    return Parallelized(train_model=train_model, module=module, optimizer=optimizer, autocast=not mixed_by_fsdp,
                        applied=applied, after_optimizer_step=after)


# --- 1. model-intrinsic kernels ---------------------------------------------------------------------

def apply_kernels(lab_model, cfg, module, applied: list) -> None:
    """The kernels the module was built with (they live in its code): checked against ``cfg``."""
    if lab_model.name == "gpt":
        c = module.config
        if (c.attention, c.liger) != (cfg.attn_implementation, cfg.use_liger_kernel):
            raise FasttrainError(f"the model was built with attention {c.attention} and liger {c.liger}, but the "
                                 f"configuration asks for {cfg.attn_implementation} and {cfg.use_liger_kernel}; "
                                 f"build it from the same configuration")
        what = f"attention {c.attention}" + (", liger (norms, SwiGLU, fused linear cross-entropy)" if c.liger else "")
        applied.append(("kernels", what))
        return
    config = getattr(module, "config", None)
    attention = getattr(config, "_attn_implementation", None)
    if attention is not None:
        applied.append(("kernels", f"attention {attention}" + (", liger" if cfg.use_liger_kernel else "")))


# --- 2. soft prompt, LoRA ---------------------------------------------------------------------------

def apply_adapters(lab_model, cfg, module, applied: list):
    """Freeze the base for prompt tuning, or wrap it with LoRA (peft); returns the module."""
    # a transformers model's soft prompt is peft's, attached when it was built (lab/hf)
    if cfg.prompt_tuning_tokens and getattr(module, "peft_config", None) is None:
        if not any(name == "prompt" for name, _ in module.named_parameters()):
            raise FasttrainError(f"--prompt-tuning-tokens: {lab_model.name} has no soft prompt of the lab's kind; "
                                 f"use --lora-r to fine-tune it with few parameters")
        from fasttrain.lab.adapters import freeze_for_prompt_tuning

        freeze_for_prompt_tuning(module)
        applied.append(("adapters", f"soft prompt of {cfg.prompt_tuning_tokens} tokens, base frozen"))
    if cfg.lora_r:
        from fasttrain.lab.adapters import apply_lora
        from fasttrain.lab.config import lora_targets_for

        targets = lora_targets_for(cfg, lab_model.lora_targets if lab_model.name != "gpt" else ())
        module = apply_lora(cfg, module, targets=targets)
        applied.append(("adapters", f"LoRA r={cfg.lora_r} on {', '.join(targets)}"))
    return module


# --- 3. tensor parallelism --------------------------------------------------------------------------

def apply_tensor_parallel(lab_model, module, world, applied: list) -> None:
    if world.tp == 1:
        return
    from fasttrain.lab.hf import apply_hf_tensor_parallel, is_hf_module

    if is_hf_module(module):
        apply_hf_tensor_parallel(module, world.tp_mesh)        # the family's own plan
    elif lab_model.name == "gpt":
        from fasttrain.lab.parallel.distributed import apply_tensor_parallel as split_gpt

        split_gpt(module, world)
    else:
        raise FasttrainError(f"tensor parallelism: {lab_model.name} has no tensor-parallel plan; use --strategy "
                             f"ddp, zero1 or fsdp without --tp")
    applied.append(("tensor_parallel", f"tp {world.tp}"))


# --- 4. activation checkpointing --------------------------------------------------------------------

def apply_activation_checkpointing(lab_model, cfg, module, applied: list) -> None:
    if cfg.gradient_checkpointing == "none":
        return
    if lab_model.name == "gpt":
        # the lab's GPT recomputes by its config (built in): recorded
        applied.append(("activation_checkpointing", f"{cfg.gradient_checkpointing} (the GPT's own)"
                        + (f", the first {cfg.checkpoint_blocks} blocks" if cfg.checkpoint_blocks else "")))
        return
    # any other model through its own switch (transformers 5.2x renamed gradient_checkpointing_enable
    # to activation_checkpointing_enable)
    enable = getattr(module, "activation_checkpointing_enable", None)
    kwargs = {"activation_checkpointing_kwargs": {"use_reentrant": False}}
    if enable is None:
        enable = getattr(module, "gradient_checkpointing_enable", None)
        kwargs = {"gradient_checkpointing_kwargs": {"use_reentrant": False}}
    if enable is None or cfg.gradient_checkpointing != "full":
        raise FasttrainError(f"--gradient-checkpointing {cfg.gradient_checkpointing}: {lab_model.name} "
                             + ("has no gradient_checkpointing_enable()" if enable is None
                                else "recomputes whole layers only; use --gradient-checkpointing full"))
    enable(**kwargs)
    if cfg.checkpoint_blocks:
        # the first k blocks recompute; each later one keeps its activations (transformers reads the layer's own
        # gradient_checkpointing flag at every call). The backward meets the kept blocks first and frees them
        # before the first recomputation, so the peak is the end of the forward's
        blocks = lab_model.blocks(module) if lab_model.blocks is not None else None
        if blocks is None or not all(hasattr(b, "gradient_checkpointing") for b in blocks):
            raise FasttrainError(f"--checkpoint-blocks: {lab_model.name} does not say which are its blocks or "
                                 f"does not checkpoint them one by one; use --gradient-checkpointing full alone")
        if cfg.checkpoint_blocks > len(blocks):
            raise FasttrainError(f"--checkpoint-blocks {cfg.checkpoint_blocks}: the model has {len(blocks)} blocks; "
                                 f"give at most {len(blocks)} (0: every block)")
        for block in blocks[cfg.checkpoint_blocks:]:
            block.gradient_checkpointing = False
        applied.append(("activation_checkpointing", f"full, the first {cfg.checkpoint_blocks} of {len(blocks)} "
                                                    f"blocks (the model's gradient_checkpointing_enable)"))
        return
    applied.append(("activation_checkpointing", "full (the model's gradient_checkpointing_enable)"))


# --- 5. / 7. torch.compile --------------------------------------------------------------------------

def _compile_options(cfg) -> dict:
    mode = None if cfg.torch_compile_mode == "default" else cfg.torch_compile_mode
    backend = cfg.torch_compile_backend
    # cudagraphs: AOT autograd's forward and backward captured as CUDA graphs, no inductor code generation
    return {"mode": mode} if backend == "inductor" else {"backend": backend}


def compile_blocks(lab_model, cfg, module, applied: list) -> None:
    if not cfg.torch_compile or cfg.torch_compile_scope != "blocks":
        return
    if lab_model.blocks is None:
        raise FasttrainError(f"--torch-compile-scope blocks: {lab_model.name} does not say which are its blocks; "
                             f"compile the whole model")
    blocks = lab_model.blocks(module)
    for block in blocks:
        block.compile(**_compile_options(cfg))      # in place: the block's forward becomes the compiled one
    applied.append(("compile_blocks", f"{len(blocks)} blocks"))


def compile_model(cfg, wrapped, applied: list):
    if not cfg.torch_compile or cfg.torch_compile_scope == "blocks":
        return wrapped
    import torch

    applied.append(("compile_model", "the whole model"))
    return torch.compile(wrapped, **_compile_options(cfg))


# --- 6. float8, then FSDP or DDP --------------------------------------------------------------------

OUTPUT_LAYERS = ("head", "lm_head")


def float8_filter(module, name: str) -> bool:
    """Whether torchao converts the Linear ``name``: not the output layer (its logits want the
    precision, and its vocabulary rarely divides by 16), and only layers whose in and out features
    are multiples of 16 (float8 GEMMs on tensor cores need them)."""
    import torch.nn as nn

    if not isinstance(module, nn.Linear) or name.rsplit(".", 1)[-1] in OUTPUT_LAYERS:
        return False
    return module.in_features % 16 == 0 and module.out_features % 16 == 0


def check_float8(cfg, device) -> None:
    """``--float8``: torchao on a Hopper-or-newer GPU; one line before any work."""
    recipe = cfg.float8
    if recipe not in FLOAT8:
        raise FasttrainError(f"unknown --float8 {recipe!r}; use one of {', '.join(FLOAT8)}")
    if recipe == "none":
        return
    if getattr(device, "type", str(device).split(":")[0]) != "cuda":
        raise FasttrainError("--float8 trains float8 GEMMs on a CUDA GPU (compute capability 8.9 or newer); "
                             "drop it on the CPU")
    try:
        import torchao.float8  # noqa: F401
    except ImportError as exc:
        from fasttrain.lab.config import missing_extra

        raise missing_extra("torchao (--float8)", exc) from None
    import torch

    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        raise FasttrainError(f"--float8 needs float8 tensor cores (compute capability 8.9: Ada, Hopper or newer); "
                             f"{torch.cuda.get_device_name(device)} has {major}.{minor}: drop --float8")


def float8_all_gather(recipe: str, fsdp: bool, asked: bool) -> bool:
    """Whether FSDP all-gathers the float8 layers' weights in float8 (``--float8-all-gather``, asked): with
    per-tensor scaling only (a weight's one scale is what its float8 copy needs, so the cast before the gather is
    the cast the GEMM would make); per-row scales are taken along the GEMM's own axis, so rowwise gathers in bf16."""
    return asked and fsdp and recipe == "tensorwise"


def apply_float8(lab_model, cfg, module, applied: list, world=None) -> bool:
    """torchao's float8 training on the Linear layers :func:`float8_filter` keeps; True when FSDP will gather
    their weights in float8 (:func:`float8_all_gather`)."""
    recipe = cfg.float8
    if recipe == "none":
        return False
    if recipe not in FLOAT8:
        raise FasttrainError(f"unknown --float8 {recipe!r}; use one of {', '.join(FLOAT8)}")
    import dataclasses

    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    gather = float8_all_gather(recipe, bool(world is not None and world.fsdp), cfg.float8_all_gather)
    config = Float8LinearConfig.from_recipe_name(recipe)
    if gather:
        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    convert_to_float8_training(module, config=config, module_filter_fn=float8_filter)
    converted = sum(type(m).__name__ == "Float8Linear" for m in module.modules())
    applied.append(("float8", f"{recipe}: {converted} Linear layers"
                    + (", their weights all-gathered in float8" if gather else "")))
    return gather


def bf16_all_reduce(state, bucket):
    """DDP's communication hook for ``--reduce-dtype bf16``: each bucket cast to bf16 and divided by the world
    before the all-reduce, the average cast back into the fp32 bucket -- half the bytes on the wire, each of the
    ring's partial sums rounded to bf16. (torch's own bf16 hook refuses gloo: this one runs on the CPU's tests
    as on NCCL.)"""
    import torch
    import torch.distributed as dist

    buffer = bucket.buffer()
    compressed = buffer.to(torch.bfloat16).div_(dist.get_world_size())
    future = dist.all_reduce(compressed, async_op=True).get_future()

    def decompress(fut):
        buffer.copy_(fut.value()[0])
        return buffer
    return future.then(decompress)


def apply_data_parallel(lab_model, cfg, module, world, applied: list):
    """DDP's wrapper (ddp, zero1) or FSDP2 in place (fsdp, hsdp); the module as the strategy trains it."""
    if world.strategy in ("ddp", "zero1"):
        import inspect

        from torch.nn.parallel import DistributedDataParallel as DDP

        ids = [world.local_rank] if world.device.startswith("cuda") else None
        # buffers (causal mask, RoPE tables) are constants: nothing to broadcast each forward;
        # gradients as views of the all-reduce buckets: no second copy of the gradients
        # (newer torch names the switch forward_sync_buffers; older ones broadcast_buffers)
        sync = "forward_sync_buffers" if "forward_sync_buffers" in inspect.signature(DDP).parameters \
            else "broadcast_buffers"
        ddp = DDP(module, device_ids=ids, gradient_as_bucket_view=True, **{sync: False})
        if cfg.reduce_dtype == "bf16":
            ddp.register_comm_hook(state=None, hook=bf16_all_reduce)
        applied.append(("data_parallel", f"DDP over {world.dp}, gradients reduced in {cfg.reduce_dtype}"))
        return ddp
    if not world.fsdp:
        return module
    import torch
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    # bf16: gather bf16 parameters and compute in bf16 (the fp32 shards are the master weights); the gradients
    # are reduced in --reduce-dtype (fp32: each rank's bf16 gradient cast up and summed in fp32; bf16: half
    # the bytes, every partial sum rounded to bf16) and land in fp32 shards either way
    reduce_dtype = torch.bfloat16 if cfg.reduce_dtype == "bf16" else torch.float32
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if cfg.bf16 else None, reduce_dtype=reduce_dtype)
    offload = CPUOffloadPolicy(pin_memory=world.device.startswith("cuda")) if world.offload_optimizer \
        else OffloadPolicy()
    mesh = world.dp_mesh
    blocks = lab_model.blocks(module) if lab_model.blocks is not None else list(module.blocks)
    for block in blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=world.reshard_after_forward, mp_policy=policy,
                    offload_policy=offload)
    # the root group holds the embedding, final norm and output layer; its parameters are needed
    # right away by the backward, so it is never resharded after the forward
    fully_shard(module, mesh=mesh, reshard_after_forward=False, mp_policy=policy, offload_policy=offload)
    if getattr(module, "_fasttrain_meta_init", None) is not None:
        materialize(module, world)
        applied.append(("data_parallel", "weights initialized shard by shard (meta-device build)"))
    shape = " x ".join(f"{n} {s}" for n, s in zip(mesh.mesh_dim_names, mesh.mesh.shape))
    applied.append(("data_parallel", f"{world.label} over {shape}, gradients reduced in {cfg.reduce_dtype}"))
    return module


def materialize(module, world) -> None:
    """Give a model built on the meta device (``models.parameters_on_meta``), once sharded (FSDP), its
    weights, storage for this rank's shards only (the buffers, built for real, kept): a transformers model
    by its own ``initialize_weights`` drawing from the seed, each draw made on the full tensor and cut to this
    rank's shard (``hf.init_hf_weights``); the lab's GPT by its own initialization one parameter at a time
    from the generator state a plain build starts it at, each full tensor cut likewise. Either way the same
    weights as a one-process build of the same seed."""
    import torch
    from torch.distributed.tensor import DTensor, distribute_tensor

    from fasttrain.lab.models import empty_storage

    info = module._fasttrain_meta_init
    device = torch.device(world.device)
    # offloaded shards live in host memory (FSDP's CPUOffloadPolicy); the draws stay on the run's device
    storage = "cpu" if world.offload_optimizer else device
    if info.get("kind") == "hf":
        from fasttrain.lab.hf import init_hf_weights

        init_hf_weights(module, device, info["seed"], storage=storage)
        del module._fasttrain_meta_init
        return
    built = {name: p.detach().clone() for name, p in module.named_parameters() if p.device.type != "meta"}
    empty_storage(module, storage)
    if device.type == "cuda":
        torch.cuda.set_rng_state(info["rng"], device)
    else:
        torch.set_rng_state(info["rng"])
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name in built:               # a vector built for real: its values, then the init's rule
                p.copy_(built[name])
                module.init_parameter(name, p)
                continue
            full = torch.empty(p.shape, dtype=p.dtype, device=device)
            module.init_parameter(name, full)
            if isinstance(p, DTensor):
                full = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None)
            p.copy_(full)
            del full
        module.reset_after_init()
    del module._fasttrain_meta_init


# --- 8. the optimizer -------------------------------------------------------------------------------

def build_optimizer_for(cfg, wrapped, world, applied: list):
    from fasttrain.lab.optim import build_optimizer
    from fasttrain.lab.parallel.distributed import wrap_optimizer

    optimizer = wrap_optimizer(build_optimizer(cfg, wrapped, world=world), world)
    applied.append(("optimizer", f"{cfg.optim}" + (" sharded (ZeRO-1)" if world.strategy == "zero1" else "")
                    + (" on the CPU (offloaded)" if world.offload_optimizer else "")))
    return optimizer


__all__ = ["ORDER", "FLOAT8", "Parallelized", "parallelize", "float8_filter", "check_float8"]
