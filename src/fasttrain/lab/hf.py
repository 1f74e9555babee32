"""Hugging Face ``transformers`` causal LMs in the lab: ``--model hf:PATH_OR_NAME``.

:func:`build_hf_model` turns a folder holding a ``config.json`` (with weights: ``from_pretrained``;
without: ``from_config``, seeded) or a hub name into a :class:`~fasttrain.lab.models.LabModel`.
Every technique of the lab applies to it, the model's own way, here or in the trainer:

- precision (fp16 / bf16 / tf32): the trainer's autocast and TF32 switch; the weights stay fp32
  (master weights), whatever dtype the folder's config names;
- ``attn_implementation`` eager / sdpa: given to ``transformers`` at load (here);
- gradient checkpointing ``full``: the trainer calls the model's ``gradient_checkpointing_enable``
  (non-reentrant), which recomputes each decoder layer in backward; ``selective`` (the lab GPT's
  attention core alone) has no counterpart in ``transformers`` and is refused here;
- ``torch.compile``: the trainer's, of the whole model or per block through the ``blocks`` hook
  (:func:`decoder_layers`);
- LoRA: the trainer's (peft), in the model's own module names, a default per family
  (:data:`LORA_TARGETS`); prompt tuning: peft's ``PromptTuningConfig`` (here);
- liger-kernel's patches for the families it knows (its own table), CUDA only (here);
- tensor parallelism (``--strategy tp``): the family's own plan (``config.base_model_tp_plan`` and
  the causal-LM class's ``_tp_plan``) applied through ``torch.distributed.tensor.parallel``
  (:func:`apply_hf_tensor_parallel`); a family without a plan is refused (:func:`check_hf_parallel`).

The loss is the model's own loss path: ``model(input_ids=x, labels=x, shift_labels=y)``. With
``shift_labels`` given, ``transformers``' ``ForCausalLMLoss`` skips its own shift and takes
mean_{b,t} CE(logits[b, t], y[b, t]) over every position, the same number as
``F.cross_entropy(logits.view(-1, V), y.view(-1))``; liger's patched forward reads the same
``shift_labels`` and fuses the output projection into the cross-entropy (the (B, T, V) logits
never exist in memory).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import tempfile
from pathlib import Path

from fasttrain.errors import FasttrainError
from fasttrain.files import swap_folder
from fasttrain.lab.config import LabConfig, liger_switches, missing_extra
from fasttrain.lab.models import LabModel
from fasttrain.memory.hf_config import DEFAULT_LORA_TARGETS

HF_PREFIX = "hf:"
HF_CHECKPOINT_FORMAT = "fasttrain-lab-hf-1"
FASTTRAIN_JSON = "fasttrain.json"           # beside the HF files of a saved checkpoint: the lab's record
PROMPT_FOLDER = "prompt_tuning"             # a saved soft prompt (peft adapter) inside a checkpoint

# LoRA's default targets per model_type, in each family's own module names: the estimator's table (it
# counts what the lab adapts)
LORA_TARGETS = DEFAULT_LORA_TARGETS

# files whose presence means "this folder holds weights": from_pretrained, not from_config
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "tokenizer.model",
                   "special_tokens_map.json")

# a hub repository id: "name" or "namespace/name" of letters, digits, '-', '_', '.'
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def is_hf(spec: str | None) -> bool:
    return isinstance(spec, str) and spec.startswith(HF_PREFIX)


def _transformers():
    try:
        import transformers
    except ImportError as exc:
        raise missing_extra("transformers (--model hf:...)", exc) from None
    # its loading and saving bars would interleave with the lab's own progress line
    transformers.utils.logging.disable_progress_bar()
    return transformers


def _hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the hub's host answers a TCP connection (a quick probe, so that an offline machine
    gets its one line at once instead of after ``huggingface_hub``'s retries)."""
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        return False
    try:
        from huggingface_hub import constants

        endpoint = constants.ENDPOINT
    except Exception:
        endpoint = "https://huggingface.co"
    host = re.sub(r"^https?://", "", endpoint).split("/")[0]
    host, _, port = host.partition(":")
    try:
        with socket.create_connection((host, int(port or 443)), timeout=timeout):
            return True
    except OSError:
        return False


def source_of(spec: str) -> str:
    source = spec[len(HF_PREFIX):] if is_hf(spec) else spec
    if not source:
        raise FasttrainError("--model hf: needs a folder or a hub name after 'hf:' (e.g. --model hf:./my-llama)")
    return source


def load_hf_config(spec: str):
    """``(config, folder)``: the ``transformers`` config of ``hf:PATH_OR_NAME``; ``folder`` is the
    local folder (None for a hub name). Every way it can fail is one line."""
    tf = _transformers()
    source = source_of(spec)
    path = Path(source).expanduser()
    if path.exists():
        if not path.is_dir():
            if path.name == "config.json":
                path = path.parent
            else:
                raise FasttrainError(f"--model hf:{source}: not a folder; give the folder holding config.json")
        if not (path / "config.json").is_file():
            raise FasttrainError(f"--model hf:{source}: the folder has no config.json; give a folder written by "
                                 f"save_pretrained (or holding a model's config.json)")
        try:
            raw = json.loads((path / "config.json").read_text())
        except ValueError as exc:
            raise FasttrainError(f"{path / 'config.json'}: not JSON ({exc})") from None
        if not isinstance(raw, dict) or "model_type" not in raw:
            raise FasttrainError(f"{path / 'config.json'} names no model_type; it is not a transformers config")
        try:
            config = tf.AutoConfig.from_pretrained(str(path))
        except (ValueError, KeyError) as exc:
            if "model type" in str(exc) or isinstance(exc, KeyError):
                raise FasttrainError(f"{path / 'config.json'}: unknown model_type {raw.get('model_type')!r} for "
                                     f"transformers {tf.__version__}; use a causal LM family it knows (llama, "
                                     f"gpt2, qwen2, mistral, gemma, phi3, ...) or upgrade transformers") from None
            raise FasttrainError(f"{path / 'config.json'}: {str(exc).splitlines()[0]}") from None
        return config, path
    looks_local = source.startswith(("/", ".", "~")) or source.count("/") > 1 or not _HUB_ID.match(source)
    if looks_local:
        raise FasttrainError(f"--model hf:{source}: no such folder; give a folder holding config.json")
    if not _hub_reachable():
        raise FasttrainError(f"--model hf:{source}: no such folder here, and the Hugging Face hub cannot be "
                             f"reached (offline?); download the model elsewhere and pass its local folder "
                             f"(hf:PATH holding config.json)")
    try:
        config = tf.AutoConfig.from_pretrained(source)
    except (OSError, ValueError) as exc:
        raise FasttrainError(f"--model hf:{source}: not found as a folder or on the hub "
                             f"({str(exc).splitlines()[0][:160]})") from None
    return config, None


def has_weights(folder: Path | None) -> bool:
    return folder is None or any((folder / name).is_file() for name in WEIGHT_FILES)


def max_positions(config) -> int | None:
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def config_from_dict(values: dict):
    """A transformers config from its ``config.json`` contents (``model_type`` picks the class)."""
    values = dict(values)
    return _transformers().AutoConfig.for_model(values.pop("model_type"), **values)


def check_hf_setup(cfg: LabConfig, config, vocab_size: int | None, device) -> None:
    """Everything about ``cfg`` that cannot run with this model, as one line, before any weights
    are built."""
    import torch

    family = config.model_type
    where = f"the {family} model"
    if not getattr(config, "is_decoder", True) and getattr(config, "is_encoder_decoder", False):
        raise FasttrainError(f"{where} is an encoder-decoder; the lab trains causal LMs (AutoModelForCausalLM)")
    limit = max_positions(config)
    if limit is not None and cfg.context > limit:
        raise FasttrainError(f"--context {cfg.context} exceeds {where}'s {limit} positions "
                             f"(max_position_embeddings); use --context {limit} or less")
    if vocab_size is not None and vocab_size > config.vocab_size:
        raise FasttrainError(f"the corpus has {vocab_size} symbols but {where} has a vocabulary of "
                             f"{config.vocab_size}; use a tokenizer within it or a config with vocab_size >= "
                             f"{vocab_size}")
    if cfg.gradient_checkpointing == "selective":
        raise FasttrainError("--gradient-checkpointing selective recomputes the lab GPT's attention core; "
                             "transformers checkpoints whole decoder layers only: use --gradient-checkpointing full")
    if cfg.use_liger_kernel:
        dev = torch.device(device)
        if dev.type != "cuda":
            raise FasttrainError("--use-liger-kernel needs a CUDA GPU (liger-kernel's kernels are Triton); "
                                 "drop it on the CPU")
        supported = liger_families()
        if family not in supported:
            raise FasttrainError(f"liger-kernel {_liger_version()} has no patches for model_type {family!r} "
                                 f"(it patches {', '.join(sorted(f for f in supported if f))}); drop "
                                 f"--use-liger-kernel")
        if cfg.torch_compile and cfg.torch_compile_scope == "model":
            # measured (H100, torch 2.11, liger-kernel 0.8.5): dynamo cannot trace liger's fused linear
            # cross-entropy (its addmm with out_dtype fails on fake tensors); compiling the decoder
            # layers alone leaves the loss outside the graph
            raise FasttrainError("--use-liger-kernel with --torch-compile: liger's fused cross-entropy does not "
                                 "trace under torch.compile; add --torch-compile-scope blocks (the decoder layers "
                                 "compiled, the loss eager) or drop one of them")
    if cfg.lora_r:
        targets = cfg.lora_target_modules
        if tuple(targets) == LabConfig.lora_target_modules and family not in LORA_TARGETS:
            raise FasttrainError(f"no default LoRA targets for model_type {family!r}; name its linear layers "
                                 f"with --lora-target-modules (e.g. q_proj,v_proj)")


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


def is_hf_module(module) -> bool:
    """Whether ``module`` is a transformers model (possibly wrapped)."""
    base = base_model_of(module)
    return hasattr(base, "config") and hasattr(base.config, "model_type") and hasattr(base, "base_model_prefix")


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
    """liger-kernel's patches for the instance's family: RMSNorm, RoPE, SwiGLU and the fused linear
    cross-entropy (which the model's loss path then uses whenever it is given labels in training); with
    ``kernels="fused_linear_cross_entropy"`` that one alone. The module-level names it rebinds are recorded;
    :func:`undo_liger_patches` puts them back."""
    try:
        from liger_kernel.transformers.monkey_patch import _apply_liger_kernel_to_instance
    except ImportError as exc:
        raise missing_extra("liger-kernel (--use-liger-kernel)", exc) from None
    family = getattr(getattr(model, "config", None), "model_type", "") or ""
    before = _modeling_state(family)
    _apply_liger_kernel_to_instance(model=model, **liger_switches(kernels))
    for owner, names in before.items():
        now = vars(owner)
        for name in set(names) | set(now):
            old, new = names.get(name, _ABSENT), now.get(name, _ABSENT)
            if old is not new:
                _LIGER_UNDO.append((owner, name, old))


def undo_liger_patches() -> int:
    """Put back what :func:`apply_liger` changed in transformers' modules (newest first); the patched instances
    keep their kernels. Returns how many names were restored."""
    count = 0
    while _LIGER_UNDO:
        owner, name, old = _LIGER_UNDO.pop()
        if old is _ABSENT:
            try:
                delattr(owner, name)
            except AttributeError:
                pass
        else:
            setattr(owner, name, old)
        count += 1
    return count


def apply_prompt_tuning(model, cfg: LabConfig):
    """Prompt tuning through ``peft`` (``PromptTuningConfig``, ``get_peft_model``): n trainable
    vectors prepended to every sequence's embeddings, the model frozen. (LoRA is applied by the
    trainer, as for every model, in the model's own module names: :data:`LORA_TARGETS`.)"""
    if not cfg.prompt_tuning_tokens:
        return model
    try:
        import peft
    except ImportError as exc:
        raise missing_extra("peft (prompt tuning)", exc) from None
    config = peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=cfg.prompt_tuning_tokens)
    return peft.get_peft_model(model, config)


def prompt_tokens_of(module) -> int:
    """Soft-prompt vectors ``peft`` prepends to every sequence (0 without prompt tuning)."""
    config = getattr(module, "peft_config", None)
    if not config:
        return 0
    active = config.get(getattr(module, "active_adapter", "default")) or next(iter(config.values()))
    return int(getattr(active, "num_virtual_tokens", 0) or 0) if getattr(active, "is_prompt_learning", False) else 0


def base_model_of(module):
    """The ``transformers`` model inside ``module`` (a PeftModel, a compiled or DDP wrapper)."""
    seen = 0
    while seen < 8:
        seen += 1
        if hasattr(module, "get_base_model"):
            module = module.get_base_model()
        elif hasattr(module, "_orig_mod"):
            module = module._orig_mod
        elif hasattr(module, "module") and not hasattr(module, "config"):
            module = module.module
        else:
            break
    return module


def decoder_layers(module):
    """The repeated decoder layers (an ``nn.ModuleList``): ``model.layers`` for Llama-likes,
    ``transformer.h`` for GPT-2, else the first module list as long as ``num_hidden_layers``."""
    import torch.nn as nn

    base = base_model_of(module)
    for path in ("model.layers", "transformer.h", "gpt_neox.layers", "model.decoder.layers"):
        obj = base
        for part in path.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                break
        if isinstance(obj, nn.ModuleList):
            return obj
    n = getattr(base.config, "num_hidden_layers", None)
    for sub in base.modules():
        if isinstance(sub, nn.ModuleList) and len(sub) == n:
            return sub
    raise FasttrainError(f"cannot find the decoder layers of {type(base).__name__} (per-block compile needs them)")


def hf_loss(module, x, y):
    """Mean next-token cross-entropy through the model's own loss path (liger's fused one when
    patched): ``labels`` switches the loss on, ``shift_labels`` (already shifted targets, one per
    input position) replaces the internal shift. A soft prompt of n vectors adds n leading
    positions, whose targets are ignored (-100)."""
    import torch

    n = prompt_tokens_of(module)
    y = y.contiguous()              # transformers views the targets flat: a sliced batch must be copied
    targets = y if not n else torch.cat((torch.full((y.shape[0], n), -100, dtype=y.dtype, device=y.device), y), 1)
    return module(input_ids=x, labels=x, shift_labels=targets, use_cache=False).loss


def hf_logits(module, x):
    """(B, T, V) logits; a soft prompt's leading positions cut off."""
    logits = module(input_ids=x, use_cache=False).logits
    n = prompt_tokens_of(module)
    return logits[:, n:] if n else logits


def memory_setup_for(hf_config: dict):
    """The estimator's view of a run of this HF model: ``(cfg, micro_batch) -> Setup | None`` through
    ``fasttrain.memory.hf_config.setup_from_hf_config`` (the estimator's mapping of a transformers config).
    A setting the estimator does not model (it raises) gives None: the run records no estimate, no error."""
    from fasttrain.lab.config import compiled_scope, liger_of, lora_targets_for
    from fasttrain.memory.hf_config import setup_from_hf_config

    def setup(cfg: LabConfig, micro_batch: int):
        extra = {"grad_buffers": True} if cfg.gradient_accumulation_steps > 1 else {}
        if cfg.prompt_tuning_tokens:
            extra["prompt_tokens"] = cfg.prompt_tuning_tokens
        if cfg.lora_r:
            # the modules the trainer adapts (the same rule as Trainer.lora_targets)
            targets = lora_targets_for(cfg, LORA_TARGETS.get(hf_config.get("model_type"), ()))
            extra.update(lora_rank=cfg.lora_r, lora_targets=targets, lora_dropout=float(cfg.lora_dropout))
        try:
            return setup_from_hf_config(hf_config, micro_batch=micro_batch, seq=cfg.context,
                                        precision="amp" if (cfg.bf16 or cfg.fp16) else "fp32",
                                        recompute=cfg.gradient_checkpointing, attention=cfg.attn_implementation,
                                        optim=cfg.optim, compiled=compiled_scope(cfg),
                                        liger=liger_of(cfg), **extra)
        except FasttrainError:
            return None
    return setup


def build_hf_model(spec: str, cfg: LabConfig, vocab_size: int | None, device, *, log=None) -> LabModel:
    """The ``transformers`` causal LM ``spec`` (``hf:PATH_OR_NAME``) on ``device``, every technique
    of ``cfg`` that belongs to the model applied (attention kernel, checkpointing, liger, peft);
    ``vocab_size``: the corpus' vocabulary (checked to fit), or None. Weights from the folder when
    it holds some, else drawn from the config's initializers under ``cfg.seed`` (the same seed
    gives the same weights on the same kind of device)."""
    import torch

    tf = _transformers()
    log = log or (lambda line: None)
    config, folder = load_hf_config(spec)
    check_hf_setup(cfg, config, vocab_size, device)
    family = config.model_type
    device = torch.device(device)
    pretrained = has_weights(folder)
    source = str(folder) if folder is not None else source_of(spec)
    kwargs = dict(attn_implementation=cfg.attn_implementation, dtype=torch.float32)
    torch.manual_seed(cfg.seed)
    try:
        if pretrained:
            module = tf.AutoModelForCausalLM.from_pretrained(source, **kwargs).to(device)
        else:
            with device:
                module = tf.AutoModelForCausalLM.from_config(config, **kwargs)
    except ValueError as exc:
        first = str(exc).strip().splitlines()[0][:200]
        if "attn" in first.lower() or "attention" in first.lower():
            raise FasttrainError(f"the {family} model cannot use --attn-implementation {cfg.attn_implementation} "
                                 f"({first}); use eager") from None
        raise FasttrainError(f"--model {spec}: transformers cannot build a causal LM from it ({first})") from None
    except OSError as exc:
        raise FasttrainError(f"--model {spec}: cannot read the weights ({str(exc).splitlines()[0][:200]})") from None
    if pretrained:
        log(f"{spec}: {family} weights loaded from {source}")
    else:
        log(f"{spec}: no weights in {source}: initialized from config.json (seed {cfg.seed})")
    module.config.use_cache = False
    if cfg.use_liger_kernel:
        apply_liger(module, cfg.liger_kernels)
    # gradient checkpointing (the model's gradient_checkpointing_enable) and LoRA are the trainer's,
    # as for any model; the soft prompt is peft's own for a transformers model
    module = apply_prompt_tuning(module, cfg)
    config_dict = base_model_of(module).config.to_dict()
    return LabModel(
        module=module, name=f"{HF_PREFIX}{source_of(spec)}", vocab_size=int(config.vocab_size),
        context=max_positions(config), config=config_dict, family=family, loss=hf_loss, logits=hf_logits,
        blocks=decoder_layers, save=save_hf, lora_targets=LORA_TARGETS.get(family, ()),
        memory_setup=memory_setup_for(config_dict))


# --- saving ----------------------------------------------------------------------------------------

def save_hf(module, folder, *, tokenizer=None, lab: dict | None = None, extra: dict | None = None) -> Path:
    """A folder ``AutoModelForCausalLM.from_pretrained`` loads: ``save_pretrained`` of the model
    (LoRA merged into its base weights first: W += (alpha / r) B A), the tokenizer if given, and
    ``fasttrain.json`` (the lab configuration, the final validation loss, what ``lab eval`` and
    ``lab sample`` need). A soft prompt cannot be folded into the weights: it is written as a peft
    adapter in ``prompt_tuning/`` beside the base model. Written to a temporary folder and renamed
    into place: the folder is whole or absent."""
    final = Path(folder)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=final.name + ".", suffix=".tmp", dir=final.parent))
    try:
        model = module._orig_mod if hasattr(module, "_orig_mod") else module
        prompt = prompt_tokens_of(model)
        if prompt:
            model.save_pretrained(str(tmp / PROMPT_FOLDER))
            base = model.get_base_model()
        elif hasattr(model, "merge_and_unload"):
            base = model.merge_and_unload()
        else:
            base = model
        base.save_pretrained(str(tmp))
        if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
            tokenizer.save_pretrained(str(tmp))
        elif tokenizer is not None:             # the lab's tokenizer object (lab/tokenizer.py): its files, if any
            from fasttrain.lab.tokenizer import save_tokenizer

            save_tokenizer(tokenizer, tmp)
        meta = {"format": HF_CHECKPOINT_FORMAT, "model_type": base.config.model_type,
                "prompt_tuning_tokens": prompt, "lab": lab or {}, **(extra or {})}
        (tmp / FASTTRAIN_JSON).write_text(json.dumps(meta, indent=1, default=str))
        swap_folder(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def fresh_copy(module):
    """A new model of ``module``'s config on the CPU (FSDP's gathered weights are loaded into it)."""
    import torch

    tf = _transformers()
    base = base_model_of(module)
    return tf.AutoModelForCausalLM.from_config(base.config, dtype=torch.float32)


def is_hf_checkpoint(path) -> bool:
    p = Path(path)
    if not (p / FASTTRAIN_JSON).is_file():
        return False
    try:
        return json.loads((p / FASTTRAIN_JSON).read_text()).get("format") == HF_CHECKPOINT_FORMAT
    except ValueError:
        return False


def read_hf_checkpoint(path) -> dict:
    p = Path(path)
    if not is_hf_checkpoint(p):
        raise FasttrainError(f"{p} is not a lab HF checkpoint (needs {FASTTRAIN_JSON}); write one with "
                             f"fasttrain lab --model hf:... --save {p}")
    return json.loads((p / FASTTRAIN_JSON).read_text())


def load_hf_checkpoint(path, device="cpu", *, attn_implementation: str = "sdpa"):
    """The saved model (its soft prompt re-attached when it has one), in eval mode."""
    import torch

    tf = _transformers()
    p = Path(path)
    meta = read_hf_checkpoint(p)
    model = tf.AutoModelForCausalLM.from_pretrained(str(p), dtype=torch.float32,
                                                    attn_implementation=attn_implementation)
    if meta.get("prompt_tuning_tokens"):
        try:
            from peft import PeftModel
        except ImportError as exc:
            raise missing_extra("peft (a prompt-tuned checkpoint)", exc) from None
        model = PeftModel.from_pretrained(model, str(p / PROMPT_FOLDER))
    return model.to(device).eval(), meta


def load_tokenizer(path):
    """The tokenizer saved in a checkpoint folder, or None when it holds none."""
    p = Path(path)
    if not any((p / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    tf = _transformers()
    try:
        return tf.AutoTokenizer.from_pretrained(str(p))
    except (OSError, ValueError) as exc:
        raise FasttrainError(f"{p}: its tokenizer cannot be loaded ({str(exc).splitlines()[0][:160]})") from None


__all__ = ["HF_PREFIX", "LORA_TARGETS", "TP_STYLES", "apply_hf_tensor_parallel", "build_hf_model", "check_hf_parallel",
           "check_hf_tensor_parallel", "decoder_layers", "fresh_copy", "gather_tp_state_dict", "hf_logits", "hf_loss",
           "is_hf", "is_hf_checkpoint", "is_hf_module", "load_hf_checkpoint", "load_hf_config", "memory_setup_for",
           "read_hf_checkpoint", "save_hf", "undo_liger_patches"]
