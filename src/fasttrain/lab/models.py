"""What the lab's trainer needs of a model: a causal language model over token ids.

Every model the lab trains -- its own GPT (``lab/model.py``), a Hugging Face ``transformers``
model (``lab/hf.py``), or a user's ``nn.Module`` -- reaches the trainer as a :class:`LabModel`:
the module plus what the trainer cannot read off a bare ``nn.Module`` (its vocabulary, its longest
sequence, how to get a loss out of it, which submodules are its repeated blocks). Fields left
``None`` fall back to the plain contract: ``module(x)`` returns logits of shape (B, T, V) -- or an
object with ``.logits``, or a tuple whose first item is the logits -- and the loss is the mean
next-token cross-entropy over them.
"""

from __future__ import annotations

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
