"""What the lab's trainer needs of a model: a causal language model over token ids (and how any of them is
built with its parameters on the meta device, for FSDP to shard before they get storage).

Every model the lab trains -- its own GPT (``lab/model.py``), a Hugging Face ``transformers``
model (``lab/hf.py``), or a user's ``nn.Module`` -- reaches the trainer as a :class:`LabModel`:
the module plus what the trainer cannot read off a bare ``nn.Module`` (its vocabulary, its longest
sequence, how to get a loss out of it, which submodules are its repeated blocks). Fields left
``None`` fall back to the plain contract: ``module(x)`` returns logits of shape (B, T, V) -- or an
object with ``.logits``, or a tuple whose first item is the logits -- and the loss is the mean
next-token cross-entropy over them.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable

from fasttrain.errors import FasttrainError

HF_PREFIX = "hf:"       # --model hf:PATH_OR_NAME: a transformers causal LM


def is_hf(spec) -> bool:
    """Whether a ``--model`` value names a transformers model (``hf:PATH_OR_NAME``): the one answer."""
    return isinstance(spec, str) and spec.startswith(HF_PREFIX)


@dataclass
class LabModel:
    module: Any                                 # the torch.nn.Module the optimizer trains
    name: str                                   # "gpt", "hf:<path or name>", or a user module's class name
    vocab_size: int                             # rows of the output layer (>= the tokenizer's vocabulary)
    context: int | None = None                  # the longest sequence it takes; None: no limit known
    config: dict = field(default_factory=dict)  # the model's own configuration (records, checkpoints)
    family: str | None = None                   # the HF model_type ("gpt2", "llama", "qwen2", ...); None otherwise
    loss: Callable | None = None                # (module, x, y) -> mean next-token cross-entropy
    logits: Callable | None = None              # (module, x) -> (B, T, V) logits
    blocks: Callable | None = None              # module -> its repeated blocks (per-block compile, checkpointing)
    save: Callable | None = None                # (module, folder) -> writes weights and config loadable again
    lora_targets: tuple[str, ...] = ()          # the default LoRA target modules, in the module's own names
    memory_setup: Callable | None = None        # (cfg, micro_batch) -> fasttrain.memory.config.Setup, or None


@contextlib.contextmanager
def parameters_on_meta(device):
    """Build a module whose parameters end on the meta device: each submodule is built for real on
    ``device`` (its own initialization draws from the generator as in a plain build) and its
    parameters move to the meta device when it is attached to its parent, so one submodule's
    parameters at a time exist (the lab's GPT, a transformers model alike; buffers stay as built).
    ``state["rng"]``: the generator's state after the last attach, which is where a plain build of the
    lab's GPT starts its ``reset_parameters`` (the draws ``parallelize.materialize`` replays)."""
    import torch
    from torch.nn.modules.module import register_module_module_registration_hook

    state = {}

    def rng_state():
        dev = torch.device(device)
        return torch.cuda.get_rng_state(dev) if dev.type == "cuda" else torch.get_rng_state()

    def to_meta(parent, name, submodule):
        # matrices move; vectors (norm weights: their construction's ones) are small and stay
        for key, p in list(submodule._parameters.items()):
            if p is not None and p.device.type != "meta" and p.dim() >= 2:
                submodule._parameters[key] = torch.nn.Parameter(p.to("meta"), requires_grad=p.requires_grad)
        state["rng"] = rng_state()
    handle = register_module_module_registration_hook(to_meta)
    try:
        yield state
    finally:
        handle.remove()


def empty_storage(module, device) -> None:
    """Storage on ``device`` for a module built under :func:`parameters_on_meta` (FSDP's sharded ones: this
    rank's shards), uninitialized (``to_empty``); its buffers, built for real, kept as they are."""
    buffers = dict(module.named_buffers())
    module.to_empty(device=device)
    for name, tensor in buffers.items():
        owner, _, leaf = name.rpartition(".")
        module.get_submodule(owner)._buffers[leaf] = tensor


def logits_of(output):
    """The logits in what a causal LM's forward returned: a tensor, ``.logits``, or a tuple's first item."""
    logits = getattr(output, "logits", None)
    if logits is not None:
        return logits
    if isinstance(output, (tuple, list)) and output:
        return output[0]
    return output


def forward_logits(model: LabModel, module, x):
    """(B, T, V) logits of ``module`` (the module itself or its wrapped / compiled form) on ids ``x``."""
    if model.logits is not None:
        return model.logits(module, x)
    return logits_of(module(x))


def forward_loss(model: LabModel, module, x, y):
    """Mean next-token cross-entropy of ``module`` on inputs ``x`` and targets ``y`` (both (B, T))."""
    if model.loss is not None:
        return model.loss(module, x, y)
    import torch.nn.functional as F

    logits = forward_logits(model, module, x)
    if logits.dim() != 3 or logits.shape[:2] != x.shape:
        raise FasttrainError(f"{model.name} returned logits of shape {tuple(logits.shape)} for ids of shape "
                             f"{tuple(x.shape)}; a causal LM maps (batch, seq) ids to (batch, seq, vocab) logits")
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
