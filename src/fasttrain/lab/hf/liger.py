"""liger-kernel on a transformers model: its family patches (which families, apply, undo) and its fused linear
cross-entropy on the head of any causal LM (:func:`apply_fused_linear_cross_entropy`).

Which one a run gets (:func:`apply_liger`):

- the fused cross-entropy, on every family whose loss is the plain cross-entropy of its output Linear over its
  last hidden state (GPT-2, Llama, Qwen2, Mistral, GPT-NeoX, ...): the lab's own forward on that one instance. It
  runs the base model to the last hidden state and hands that, the head's weight and bias and the shifted labels
  to liger's kernel, so the (N, V) logits never exist; checked on the instance before any training to be the model's
  own loss, and nothing outside the instance changes: a model built later in the process runs its class's forward;
- the layer kernels (RMSNorm, RoPE, SwiGLU) of a family in liger's own table, with ``kernels="all"``: liger's
  patch, which rebinds module-level names that :func:`undo_liger_patches` puts back;
- a family of liger's table whose forward does more than ``lm_head(hidden)`` (Gemma 2's soft-capped logits, a
  mixture of experts' auxiliary loss): liger's own patch for the fused cross-entropy too, which writes that family's
  forward; any other such model is refused.

Why the lab's head and not liger's patched forward where both would run: under autocast with fp32 weights, liger's
forward hands the kernel the fp32 head weight, and each chunk's ``input @ weight.t()`` casts the whole v x h weight
to bf16 again (a transposed view's cast is not cached): N / n_c casts a micro-batch. On a 151,936-token vocabulary
that was 5% of the step (Qwen2.5-0.5B's tune pick on an H200: 256 casts of 136M weights, 48 of 993 ms), and with
the Trainer's micro-batch of 8 it made liger slower than no liger at all. The lab's head casts once per
micro-batch. It also keeps the kernel out of a whole compiled model's graph, which liger's patched forward cannot
(dynamo fails inside it).
"""

from __future__ import annotations

import contextlib
import types

from fasttrain.errors import FasttrainError
from fasttrain.lab.config import liger_switches, missing_extra


def _liger_version() -> str:
    try:
        from importlib.metadata import version

        return version("liger-kernel")
    except Exception:
        return "(not installed)"


def liger_families() -> set[str]:
    try:
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
    except ImportError as exc:
        raise missing_extra("liger-kernel (--use-liger-kernel)", exc) from None
    return set(MODEL_TYPE_TO_APPLY_LIGER_FN)


# What liger-kernel changed in transformers' modeling modules, to put back when the run ends: its patch of an
# instance also rebinds module-level names (the RoPE function, the RMSNorm and MLP classes), so without an undo
# every model of that family built later in the process (the next row of a table) runs liger's kernels too.
_LIGER_UNDO: list[tuple[object, str, object]] = []
_ABSENT = object()


def _modeling_state(family: str) -> dict:
    """The names of every loaded transformers modeling module of ``family`` and of the classes defined there."""
    import sys

    state = {}
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith("transformers.models.") or f"modeling_{family}" not in name:
            continue
        state[module] = dict(vars(module))
        for value in list(vars(module).values()):
            if isinstance(value, type) and value.__module__ == name:
                state[value] = dict(vars(value))
    return state


def apply_liger(model, kernels: str = "all") -> None:
    """liger-kernel on this instance: its fused linear cross-entropy (the lab's head, whenever the model is given
    labels in training) and, with ``kernels="all"``, the family's RMSNorm, RoPE and SwiGLU patches, whose
    module-level names are recorded for :func:`undo_liger_patches`. A family whose loss is more than its head's
    cross-entropy gets liger's own forward for it (its patch), or is refused where liger has none; a family liger
    has no patch for gets the fused cross-entropy alone."""
    try:
        from liger_kernel.transformers.monkey_patch import _apply_liger_kernel_to_instance
    except ImportError as exc:
        raise missing_extra("liger-kernel (--use-liger-kernel)", exc) from None
    family = getattr(getattr(model, "config", None), "model_type", "") or ""
    patched = family in liger_families()
    if not patched and kernels != "fused_linear_cross_entropy":
        raise FasttrainError(f"liger-kernel {_liger_version()} has no patches for model_type {family!r}: only "
                             f"its fused linear cross-entropy applies (--liger-kernels fused_linear_cross_entropy)")
    switches = liger_switches(kernels)
    try:
        # the head first, checked on the model as built; liger's layer kernels (its forward left alone) after
        apply_fused_linear_cross_entropy(model)
    except FasttrainError:
        if not patched:
            raise
        # liger's forward for this family computes what its own loss does
        _patch_family(model, family, switches, _apply_liger_kernel_to_instance)
        return
    if kernels != "fused_linear_cross_entropy":
        _patch_family(model, family, dict(switches, fused_linear_cross_entropy=False, cross_entropy=False),
                      _apply_liger_kernel_to_instance)


def _patch_family(model, family: str, switches: dict, patch) -> None:
    """liger's patch of the instance (``patch``: its ``_apply_liger_kernel_to_instance``), every module-level name
    it rebinds recorded."""
    before = _modeling_state(family)
    patch(model=model, **switches)
    _LIGER_UNDO.extend(_rebound_since(before))


def _rebound_since(before: dict) -> list[tuple[object, str, object]]:
    """(owner, name, value before) of every name rebound, added or removed since :func:`_modeling_state` gave
    ``before`` (an added one's value before is ``_ABSENT``)."""
    changed = []
    for owner, names in before.items():
        now = vars(owner)
        for name in set(names) | set(now):
            old = names.get(name, _ABSENT)
            if old is not now.get(name, _ABSENT):
                changed.append((owner, name, old))
    return changed


def _put_back(owner, name: str, old) -> None:
    if old is _ABSENT:
        try:
            delattr(owner, name)
        except AttributeError:
            pass
    else:
        setattr(owner, name, old)


@contextlib.contextmanager
def modeling_modules_restored(family: str):
    """Whatever the block rebinds in ``family``'s transformers modeling modules and their classes (liger's patch
    through the HF Trainer's ``use_liger_kernel``: the family's RMSNorm and MLP classes, its RoPE function and its
    causal LM's forward) is put back when it ends: a model built after it in the same process is transformers' own.
    Names the block adds are removed. The family's modeling module is imported first (a model built inside the
    block would import it there, after the state was taken, and keep liger's patches)."""
    import importlib

    module = family.replace("-", "_")
    try:
        importlib.import_module(f"transformers.models.{module}.modeling_{module}")
    except ImportError:
        pass                    # a family transformers does not ship (remote code): its module is the block's own
    before = _modeling_state(family)
    try:
        yield
    finally:
        for change in _rebound_since(before):
            _put_back(*change)


def liger_patched_names(family: str) -> list[str]:
    """``module.name`` of every object of liger-kernel bound in ``family``'s loaded transformers modeling modules and
    their classes (empty where none is patched)."""
    found = []
    for owner, names in _modeling_state(family).items():
        for name, value in names.items():
            if (getattr(value, "__module__", None) or "").startswith("liger_kernel"):
                found.append(f"{getattr(owner, '__name__', owner)}.{name}")
    return sorted(found)


def undo_liger_patches() -> int:
    """Put back what :func:`apply_liger` changed in transformers' modules (newest first); the patched instances
    keep their kernels. Returns how many names were restored."""
    count = 0
    while _LIGER_UNDO:
        _put_back(*_LIGER_UNDO.pop())
        count += 1
    return count


# --- the fused linear cross-entropy on any causal LM's head ----------------------------------------------------

def fused_linear_cross_entropy_kernel():
    """liger's ``liger_fused_linear_cross_entropy(input, weight, target, bias=, ignore_index=, reduction=)``,
    imported on first use."""
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy
    except ImportError as exc:
        raise missing_extra("liger-kernel (--use-liger-kernel)", exc) from None
    return liger_fused_linear_cross_entropy


def apply_fused_linear_cross_entropy(model, kernel=None) -> None:
    """Give this one instance a forward whose loss, in training with labels, is ``kernel`` (liger's fused linear
    cross-entropy) over its last hidden state and its output layer's weight and bias: the logits are never
    materialized. Eval mode, or no labels: the class's own forward (logits as usual). ``kernel`` is given by
    tests (a reference cross-entropy); it is called outside any ``torch.compile`` graph (a whole compiled model
    breaks its graph there: dynamo cannot trace liger's kernel, and compiling the head and loss would make the
    logits the kernel avoids). Refused in one line where the model's head is not a Linear on the base model's last
    hidden state or its loss is more than their cross-entropy (:func:`check_plain_head`)."""
    import torch

    kernel = kernel or fused_linear_cross_entropy_kernel()
    check_plain_head(model)
    model._fasttrain_fused_loss = torch.compiler.disable(kernel)
    # a method bound to this instance (a deep copy binds it to the copy); the class is untouched
    model.forward = types.MethodType(_fused_forward, model)


def _family(model) -> str:
    return getattr(getattr(model, "config", None), "model_type", None) or type(model).__name__


def loss_beyond_the_head(config) -> str | None:
    """What a model's config says its loss adds to the head's cross-entropy, or None. What a check on a few tokens
    of a fresh model cannot tell: a soft cap c tanh(l / c) is l itself while the logits are small, and a mixture of
    experts' auxiliary loss is added only when asked for."""
    if getattr(config, "final_logit_softcapping", None):
        return "soft-caps its logits"
    if getattr(config, "output_router_logits", False):
        return "adds its routers' auxiliary loss"
    return None


def check_plain_head(model) -> None:
    """The model's loss is the cross-entropy of its output Linear over its base model's last hidden state,
    checked on this instance (where its weights are still on the meta device, on a small one of its class:
    :func:`_instance_with_values`): its own forward on a few tokens (eval mode, no gradients, no random draws) against
    ``head(base(ids))`` and their shifted cross-entropy, after the config's soft cap and routers' loss (which a few
    tokens of a fresh model cannot show). A family whose forward scales or caps the logits, or adds to the loss (an
    auxiliary loss), is refused: the fused path would compute another loss."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    family = _family(model)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    base = getattr(model, "base_model", model)
    if not isinstance(head, nn.Linear) or base is model:
        what = f"its output layer is {type(head).__name__}" if not isinstance(head, nn.Linear) \
            else "it has no base model apart from its head"
        raise FasttrainError(f"liger's fused linear cross-entropy needs a Linear output layer over a base model; the "
                             f"{family} model's {what}: drop --use-liger-kernel")
    what = loss_beyond_the_head(getattr(model, "config", None))
    if what:
        raise FasttrainError(f"the {family} model's loss is not the cross-entropy of its output layer over its last "
                             f"hidden state (its forward {what}): liger's fused linear cross-entropy would train "
                             f"another loss; drop --use-liger-kernel")
    probe = _instance_with_values(model)
    head, base = probe.get_output_embeddings(), getattr(probe, "base_model", probe)
    n = 8
    ids = (torch.arange(n, device=head.weight.device) * 7 % head.out_features)[None]
    was_training = probe.training
    probe.eval()
    try:
        with torch.no_grad():
            own = type(probe).forward(probe, input_ids=ids, labels=ids, use_cache=False)
            logits = head(base(input_ids=ids, use_cache=False)[0])
            loss = F.cross_entropy(logits[0, :-1].float(), ids[0, 1:])
    finally:
        probe.train(was_training)
    same = own.logits is not None and own.logits.shape == logits.shape and \
        torch.allclose(own.logits.float(), logits.float(), rtol=1e-4, atol=1e-5) and \
        torch.allclose(own.loss.float(), loss, rtol=1e-4, atol=1e-5)
    if not same:
        raise FasttrainError(f"the {family} model's loss is not the cross-entropy of its output layer over its last "
                             f"hidden state (its forward scales or caps the logits, or adds to the loss): liger's "
                             f"fused linear cross-entropy would train another loss; drop --use-liger-kernel")


def _instance_with_values(model):
    """``model`` itself, or where any of its parameters is on the meta device (a model built to be sharded, drawn
    shard by shard after ``fully_shard``: nothing to compute with yet) a fresh instance of its class on the CPU from
    its config cut to one layer and a vocabulary of 256: what the forward does between the last hidden state and the
    loss is the class's, not the depth's or the vocabulary's. Per-layer lists in the config (``layer_types``...) are
    cut with the depth; a token id the smaller vocabulary has no row for (a padding id) is dropped."""
    import copy

    import torch

    if not any(p.device.type == "meta" for p in model.parameters()):
        return model
    config = copy.deepcopy(model.config)
    depth = config.num_hidden_layers
    for key, value in list(vars(config).items()):
        if isinstance(value, (list, tuple)) and len(value) == depth and depth > 1:
            setattr(config, key, type(value)(value[:1]))
    config.num_hidden_layers = 1
    config.vocab_size = min(config.vocab_size, 256)
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
        if isinstance(getattr(config, key, None), int) and getattr(config, key) >= config.vocab_size:
            setattr(config, key, None)
    try:
        # its draws leave the CPU generator as they found it (a meta build's own draws come after, from it)
        with torch.random.fork_rng(devices=[]), torch.device("cpu"):
            return type(model)._from_config(config, dtype=torch.float32)
    except Exception as exc:  # noqa: BLE001 - any family's constructor: one line, not its traceback
        raise FasttrainError(f"liger's fused linear cross-entropy checks the {_family(model)} model's head on a small "
                             f"instance of its class before FSDP draws the weights, and that instance could not be "
                             f"built ({type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}): "
                             f"drop --use-liger-kernel, or give the model's weights (no meta-device build)") from None


def _autocast_dtype(device_type: str):
    """The dtype autocast computes matmuls in on ``device_type``, or None outside autocast."""
    import torch

    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None


def _fused_forward(self, input_ids=None, labels=None, shift_labels=None, **kwargs):
    """The causal LM's forward with the head and the loss fused (training with labels). The targets are
    transformers': ``shift_labels`` as given, else ``labels`` shifted left one position with ``ignore_index`` at
    the end; the loss is mean_{t: y_t != ignore} CE(W h_t + b, y_t) (with ``num_items_in_batch``: the sum over
    those tokens / that number), the number ``ForCausalLMLoss`` computes from the logits. As there, no
    ``labels``, no loss."""
    if not (self.training and labels is not None):
        extra = {} if shift_labels is None else {"shift_labels": shift_labels}
        return type(self).forward(self, input_ids=input_ids, labels=labels, **extra, **kwargs)
    import torch.nn as nn
    import torch.nn.functional as F
    from transformers.modeling_outputs import CausalLMOutputWithPast

    ignore_index = kwargs.pop("ignore_index", -100)
    items = kwargs.pop("num_items_in_batch", None)
    kwargs.pop("logits_to_keep", None)          # every position has a target here
    return_dict = kwargs.pop("return_dict", None)
    out = self.base_model(input_ids=input_ids, **kwargs)
    hidden = out[0]
    head = self.get_output_embeddings()
    if not isinstance(head, nn.Linear):         # wrapped after the check (LoRA on the head): its weight is not all
        raise FasttrainError(f"liger's fused linear cross-entropy reads the output layer's weight, but it is now "
                             f"{type(head).__name__}: leave the head out of --lora-target-modules")
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    targets = shift_labels.reshape(-1).to(hidden.device)
    x, weight, bias, accum = hidden.reshape(-1, hidden.shape[-1]), head.weight, head.bias, {}
    compute = _autocast_dtype(hidden.device.type)
    if compute is not None:
        # autocast's dtype once for the whole micro-batch (the kernel's chunks would each cast the v x h weight
        # again); d(weight) still sums its chunks in fp32 when the weight is fp32: accum_dtype
        accum = {"accum_dtype": weight.dtype} if weight.dtype != compute else {}
        x, weight = x.to(compute), weight.to(compute)
        bias = bias.to(compute) if bias is not None else None
    loss = self._fasttrain_fused_loss(x, weight, targets, bias=bias, ignore_index=ignore_index,
                                      reduction="mean" if items is None else "sum", **accum)
    if items is not None:
        loss = loss / (items.to(loss.device) if hasattr(items, "to") else items)
    result = CausalLMOutputWithPast(loss=loss, logits=None, hidden_states=getattr(out, "hidden_states", None),
                                    attentions=getattr(out, "attentions", None))
    return result.to_tuple() if return_dict is False else result
