"""Measuring on the device: synchronization, percentiles, memory by kind, the device's name,
TF32 matmuls, out-of-memory errors and giving cached memory back."""

from __future__ import annotations

import gc
import sys
from contextlib import contextmanager

from fasttrain.lab.optim import optimizer_state_bytes, tensor_bytes


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def memory_by_kind(trainer) -> dict:
    """Bytes of parameters, gradients (one per trainable parameter), optimizer state and buffers,
    measured on the tensors themselves."""
    model = trainer.model
    params = sum(tensor_bytes(p) for p in model.parameters())
    # a gradient has its parameter's shape (and, sharded, its shard: the bytes on this rank)
    grads = sum(tensor_bytes(p) for p in trainer.trainable)
    buffers = sum(tensor_bytes(b) for b in model.buffers())
    from fasttrain.lab.parallel.distributed import local_optimizer

    return {"parameters": params, "gradients": grads,
            "optimizer_state": optimizer_state_bytes(local_optimizer(trainer.optimizer)), "buffers": buffers}


def oom_types():
    import torch

    return (torch.cuda.OutOfMemoryError,) if hasattr(torch.cuda, "OutOfMemoryError") else ()


def free_memory(device) -> None:
    """Collect garbage and give cached blocks back. cuBLAS workspaces left by earlier work in this process are
    dropped too, so that a run allocates its own again, as it would in a fresh process (the estimator counts
    them as the run's)."""
    gc.collect()
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize()
        clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear is not None:
            clear()
        torch.cuda.empty_cache()


def forget_compiled_code() -> None:
    """Drop what this process holds of compiled code, so that the next compilation finds only what the cache
    folders hold: dynamo's code caches (``torch._dynamo.reset``; past their recompile limit a new model would
    run eager, unsaid), inductor's in-memory caches (compiled kernels by source, loaded modules) and the
    CUDA-graph trees with their memory pools (``reduce-overhead`` keeps its pool, tens of GiB for a large
    model, until the trees are reset). Nothing to drop when torch's compiler was never imported."""
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is None:
        return
    dynamo.reset()
    utils = sys.modules.get("torch._inductor.utils")
    clear = getattr(utils, "clear_caches", None) or getattr(utils, "clear_inductor_caches", None)
    if clear is not None:
        clear()
    trees = sys.modules.get("torch._inductor.cudagraph_trees")
    if trees is not None:
        trees.reset_cudagraph_trees()
    gc.collect()


def release_run_state(cfg) -> None:
    """Undo what a run leaves in the process that would change the next run in it (the next row of a table, the
    next probe of a search): liger-kernel's module-level patches of transformers (later models of the family
    would run its kernels) and, after a compiled run, its compiled code (:func:`forget_compiled_code`)."""
    if cfg.use_liger_kernel and "fasttrain.lab.hf" in sys.modules:
        sys.modules["fasttrain.lab.hf"].undo_liger_patches()
    if cfg.torch_compile:
        forget_compiled_code()


def held_before(device) -> int:
    """Bytes this process already holds on the GPU before a run starts (tensors of earlier work still alive):
    not the run's, so they are subtracted from its peak."""
    if device.type != "cuda":
        return 0
    import torch

    return int(torch.cuda.memory_allocated(device))


def gpu_name(device) -> str:
    import torch

    if device.type != "cuda":
        return "cpu"
    props = torch.cuda.get_device_properties(device)
    return f"{props.name} ({props.total_memory / 2**30:.0f} GiB)"


@contextmanager
def tf32_matmuls(enabled: bool):
    """fp32 matmuls (and cuDNN convolutions) on TF32 tensor cores inside, restored on exit.

    PyTorch has two families of switches, the legacy ones (``set_float32_matmul_precision``,
    ``cudnn.allow_tf32``) and the newer ``fp32_precision`` ones, and refuses to read the legacy
    ones once the newer ones were set in the process (the HF Trainer's ``tf32=True`` sets them, so a
    notebook that ran it first would fail here): the family the process already uses is the one set."""
    import torch

    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    try:
        legacy = (torch.get_float32_matmul_precision(), cudnn.allow_tf32)
    except RuntimeError:        # "mix of the legacy and new APIs": the process uses fp32_precision
        legacy = None
    if legacy is not None:
        torch.set_float32_matmul_precision("high" if enabled else "highest")
        cudnn.allow_tf32 = enabled
    else:
        newer = (matmul.fp32_precision, cudnn.fp32_precision)
        matmul.fp32_precision = cudnn.fp32_precision = "tf32" if enabled else "ieee"
    try:
        yield
    finally:
        if legacy is not None:
            torch.set_float32_matmul_precision(legacy[0])
            cudnn.allow_tf32 = legacy[1]
        else:
            matmul.fp32_precision, cudnn.fp32_precision = newer
