"""Tensor parallelism for a transformers model: the family's own plan, checked and applied."""

from __future__ import annotations

import re

from fasttrain.errors import FasttrainError
from fasttrain.lab.hf.config import load_hf_config
from fasttrain.lab.hf.peft import base_model_of


# --- tensor parallelism --------------------------------------------------------------------------
#
# transformers ships, per family, which linear layers split how (``config.base_model_tp_plan``, with
# "layers.*" for every layer, and the causal-LM class's ``_tp_plan`` for ``lm_head``). Its own code
# that applies a plan is built for ``from_pretrained(tp_plan=...)`` and changes between releases
# (5.17's and 5.24's differ; ``shard_and_distribute_module`` now only raises), so the lab takes the
# plan from transformers and applies it with torch's parallel styles (``parallelize_module``), the
# same for every release that ships plans. With t ranks and a Linear y = x W^T (W of shape (out, in)):
#
# - colwise: W split by rows (output features): rank r computes y_r = x W_r^T, its out/t features;
#   q, k, v then hold a/t query heads and g/t key/value heads per rank, and attention runs on them
#   unchanged (the models reshape to (..., -1, head_dim));
# - rowwise: W split by columns (input features): rank r computes x_r W_r^T from its slice of the
#   input, y = sum_r x_r W_r^T by an all-reduce (the bias added once);
# - colwise_gather_output (lm_head): colwise, the slices all-gathered, so every rank holds the whole
#   (B, T, V) logits and the model's own loss is the single-process loss, computed alike on every
#   rank; its backward is a local slice, no communication;
# - rowwise_split_input: rowwise from a replicated input (each rank takes its slice);
# - embedding_rowwise: the embedding's rows (vocabulary) split, each rank looks up the ids it holds,
#   zeros elsewhere, and the ranks' lookups are summed (all-reduce);
# - replicated_with_grad_allreduce (a per-head norm on sharded heads): the weight stays whole on
#   every rank, but each rank's gradient sees only its heads: the gradients are summed over ranks.
#
# Gradients of the parameters no style touches (norms, a tied embedding) come out whole and equal on
# every rank: the backward of a colwise layer's replicated input sums the ranks' partial input
# gradients (an all-reduce). So every rank trains the same function as one process.

# the styles of transformers' plans the lab applies (others, e.g. packed or expert styles, refused)
TP_STYLES = ("colwise", "rowwise", "colwise_gather_output", "colwise_rep", "rowwise_split_input", "rowwise_rep",
             "embedding_rowwise", "replicated_with_grad_allreduce")
# the styles whose output (colwise) or input (rowwise) stays one rank's slice: the split width must
# divide by t, whole heads on every rank
_LOCAL_OUT, _LOCAL_IN = ("colwise",), ("rowwise",)
_ATTENTION_NAMES = ("q_proj", "k_proj", "v_proj", "qkv_proj", "query_key_value", "c_attn")


def tp_plan_of(config) -> dict[str, str]:
    """The family's plan for the base model (``layers.*.self_attn.q_proj`` -> ``colwise``, ...), or {}."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return dict(getattr(text, "base_model_tp_plan", None) or {})


def check_hf_tensor_parallel(config, world_size: int | None) -> None:
    """Whether ``config``'s family can be split over ``world_size`` ranks (None: not known yet)."""
    import transformers

    family = config.model_type
    plan = tp_plan_of(config)
    if not plan:
        raise FasttrainError(f"--strategy tp: the {family} model ships no tensor-parallel plan in transformers "
                             f"{transformers.__version__} (config.base_model_tp_plan is empty); use --strategy "
                             f"ddp, zero1 or fsdp")
    odd = sorted({f"{name}: {style}" for name, style in plan.items() if style not in TP_STYLES})
    if odd:
        raise FasttrainError(f"--strategy tp: the {family} plan uses styles the lab does not apply ({', '.join(odd)}; "
                             f"it applies {', '.join(TP_STYLES)}); use --strategy ddp, zero1 or fsdp")
    if not world_size or world_size == 1:
        return
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(text, "num_attention_heads", None)
    kv = getattr(text, "num_key_value_heads", None) or heads
    ffn = getattr(text, "intermediate_size", None)
    splits_heads = any(style in _LOCAL_OUT and name.rsplit(".", 1)[-1] in _ATTENTION_NAMES
                       for name, style in plan.items())
    splits_mlp = any(style in _LOCAL_OUT and name.rsplit(".", 1)[-1] not in _ATTENTION_NAMES
                     for name, style in plan.items())
    checks = [("attention heads (num_attention_heads)", heads), ("key/value heads (num_key_value_heads)", kv)] \
        if splits_heads else []
    if splits_mlp and ffn:
        checks.append(("the feed-forward width (intermediate_size)", ffn))
    for what, value in checks:
        if isinstance(value, int) and value % world_size:
            raise FasttrainError(f"--strategy tp over {world_size} ranks needs the {family} model's {what} ({value}) "
                                 f"divisible by {world_size}; use a --nproc-per-node that divides it")


def check_hf_parallel(strategy: str | None, spec: str | None = None, world_size: int | None = None) -> None:
    """``--strategy tp`` for the HF model ``spec``: its family's plan and, with ``world_size``, the
    divisibility of its heads and widths; one line before any process group or weights exist."""
    if strategy != "tp" or spec is None:
        return
    config, _ = load_hf_config(spec)
    check_hf_tensor_parallel(config, world_size)


def _tied(base) -> bool:
    out = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    inp = base.get_input_embeddings() if hasattr(base, "get_input_embeddings") else None
    return out is not None and inp is not None and out.weight is inp.weight


def resolved_tp_plan(base) -> dict[str, str]:
    """The plan of the built model ``base``, module name -> style, every ``*`` expanded: the base
    model's plan under its prefix, the output layer's (``lm_head``) and, as transformers 5.2x does
    for a model with ``embed_tokens``, the embedding vocabulary-parallel. With tied input and output
    embeddings both stay whole on every rank (one matrix cannot be split two ways)."""
    import torch.nn as nn

    config = base.config
    prefix = getattr(base, "base_model_prefix", "") or ""
    inner = getattr(base, prefix, None) if prefix else None
    patterns = {(f"{prefix}.{k}" if inner is not None else k): v for k, v in tp_plan_of(config).items()}
    tied = _tied(base)
    names = {id(m): n for n, m in base.named_modules()}
    if not tied:
        patterns.update(dict(getattr(type(base), "_tp_plan", None) or {}))
        embedding = base.get_input_embeddings() if hasattr(base, "get_input_embeddings") else None
        if isinstance(embedding, nn.Embedding) and id(embedding) in names \
                and not any(names[id(embedding)] == k for k in patterns):
            patterns[names[id(embedding)]] = "embedding_rowwise"
    else:
        out = base.get_output_embeddings()
        inp = base.get_input_embeddings()
        skip = {names.get(id(out)), names.get(id(inp))}
        patterns = {k: v for k, v in patterns.items() if k not in skip}
    modules = dict(base.named_modules())
    plan = {}
    for pattern, style in patterns.items():
        regex = re.compile(re.escape(pattern).replace(r"\*", r"\d+"))
        hits = [name for name in modules if regex.fullmatch(name)]
        for name in hits:
            plan[name] = style
    return plan


def apply_hf_tensor_parallel(module, mesh) -> dict[str, str]:
    """Split the transformers model ``module`` over ``mesh`` (one dimension of t ranks) by its
    family's plan, in place; returns the plan applied (module name -> style). Every rank must hold
    the same weights (the same seed or folder): each keeps its slices of them."""
    import torch.nn as nn
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    base = base_model_of(module)
    if base is not module or not hasattr(base, "config"):
        raise FasttrainError("--strategy tp splits a plain transformers model (no peft wrapper); drop LoRA and "
                             "prompt tuning, or use ddp or fsdp")
    t = mesh.size()
    check_hf_tensor_parallel(base.config, t)
    plan = resolved_tp_plan(base)
    # the base model's entries must name some of its modules (lm_head alone would split nothing inside)
    planned = {pattern.rsplit(".", 1)[-1] for pattern in tp_plan_of(base.config)}
    if not any(name.rsplit(".", 1)[-1] in planned for name in plan):
        raise FasttrainError(f"--strategy tp: the {base.config.model_type} plan names no module of "
                             f"{type(base).__name__} (its names differ); use --strategy ddp, zero1 or fsdp")
    modules = dict(base.named_modules())
    styles, allreduce_grads = {}, []
    for name, style in plan.items():
        layer = modules[name]
        if style == "replicated_with_grad_allreduce":
            allreduce_grads.append(layer)
            continue
        if style == "embedding_rowwise":
            if not isinstance(layer, nn.Embedding) or layer.padding_idx is not None:
                continue            # padding_idx names a row of the whole table, not of a slice: kept whole
            styles[name] = RowwiseParallel(input_layouts=Replicate())
            continue
        if not isinstance(layer, nn.Linear):
            raise FasttrainError(f"--strategy tp: {name} is a {type(layer).__name__}, not a Linear; the lab splits "
                                 f"Linear layers only; use --strategy ddp, zero1 or fsdp")
        width = layer.out_features if style in _LOCAL_OUT else layer.in_features
        if style in _LOCAL_OUT + _LOCAL_IN and width % t:
            raise FasttrainError(f"--strategy tp over {t} ranks: {name} has {width} "
                                 f"{'output' if style in _LOCAL_OUT else 'input'} features, not divisible by {t}; "
                                 f"use a --nproc-per-node that divides it")
        if style == "colwise":
            styles[name] = ColwiseParallel()
        elif style in ("colwise_gather_output", "colwise_rep"):
            styles[name] = ColwiseParallel(output_layouts=Replicate())
        elif style == "rowwise":
            styles[name] = RowwiseParallel()
        else:                                           # rowwise_split_input, rowwise_rep
            styles[name] = RowwiseParallel(input_layouts=Replicate())
    parallelize_module(base, mesh, styles)
    group = mesh.get_group()

    def summed(grad):
        import torch.distributed as dist

        grad = grad.clone()
        dist.all_reduce(grad, group=group)
        return grad
    for layer in allreduce_grads:
        for p in layer.parameters():
            if p.requires_grad and not hasattr(p, "_fasttrain_tp_hook"):
                p.register_hook(summed)         # this backward's gradient, before it accumulates
                p._fasttrain_tp_hook = True
    applied = {name: style for name, style in plan.items() if name in styles or modules[name] in allreduce_grads}
    base._fasttrain_tp_plan = applied
    return applied


def gather_tp_state_dict(module, mesh) -> dict:
    """The whole model's weights as plain CPU tensors, every slice gathered (``DTensor.full_tensor``,
    through transformers' ``gather_state_dict_for_save``); a collective: every rank must call it."""
    try:
        from transformers.distributed.tensor_parallel import gather_state_dict_for_save
    except ImportError:
        try:
            from transformers.integrations.tensor_parallel import gather_state_dict_for_save
        except ImportError:
            gather_state_dict_for_save = None
    base = base_model_of(module)
    state = base.state_dict()
    if gather_state_dict_for_save is not None:
        return gather_state_dict_for_save(state, getattr(base, "_fasttrain_tp_plan", {}), mesh, mesh.size())
    from torch.distributed.tensor import DTensor

    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu().contiguous() for k, v in state.items()}
