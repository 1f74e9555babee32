"""What a transformers model's folder says: one reader of ``config.json`` (local folder or hub name),
the checks a lab run makes against it, and the estimator's view of it."""

from __future__ import annotations

import os
import re
import socket
from pathlib import Path

from fasttrain.errors import FasttrainError
from fasttrain.lab.config import HF_PREFIX, is_hf, LabConfig, missing_extra
from fasttrain.memory.hf_config import DEFAULT_LORA_TARGETS, read_config_json
from fasttrain.lab.hf.liger import _liger_version, liger_families, loss_beyond_the_head


# LoRA's default targets per model_type, in each family's own module names: the estimator's table (it
# counts what the lab adapts)
LORA_TARGETS = DEFAULT_LORA_TARGETS

# files whose presence means "this folder holds weights": from_pretrained, not from_config
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")

# a hub repository id: "name" or "namespace/name" of letters, digits, '-', '_', '.'
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


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
        # the one reader of config.json (the estimator's): JSON, an object, every size field checked
        raw = read_config_json(path, flag=f"--model hf:{source}")
        if "model_type" not in raw:
            raise FasttrainError(f"{path / 'config.json'} names no model_type; it is not a transformers config")
        try:
            config = tf.AutoConfig.from_pretrained(str(path))
        except Exception as exc:            # noqa: BLE001 - huggingface_hub's strict field validation among them
            if not isinstance(exc, (ValueError, KeyError, TypeError)) and "Validation" not in type(exc).__name__:
                raise
            if isinstance(exc, (ValueError, KeyError)) and ("model type" in str(exc) or isinstance(exc, KeyError)):
                raise FasttrainError(f"{path / 'config.json'}: unknown model_type {raw.get('model_type')!r} for "
                                     f"transformers {tf.__version__}; use a causal LM family it knows (llama, "
                                     f"gpt2, qwen2, mistral, gemma, phi3, ...) or upgrade transformers") from None
            detail = " ".join(str(exc).split())[:200]
            raise FasttrainError(f"{path / 'config.json'}: transformers cannot read it ({detail}); fix the "
                                 f"config.json") from None
        check_causal(config, path / "config.json")
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
    check_causal(config, f"--model hf:{source}")
    return config, None


def check_hf_folder(spec: str) -> None:
    """A local ``--model hf:FOLDER`` checked whole before any work: its config.json (fields, an encoder)
    and its weights against it (a hub name is checked when it is loaded)."""
    source = source_of(spec)
    if not Path(source).expanduser().exists():
        return
    config, folder = load_hf_config(spec)
    check_weights(config, folder, f"--model {spec}")


def check_causal(config, where) -> None:
    """Refuse an encoder (BERT and its kin): transformers builds its "causal LM" head only as a
    decoder (``is_decoder``); without it the attention is bidirectional and every position sees the
    tokens it is asked to predict. An encoder-decoder is refused in :func:`check_hf_setup`."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

    family = config.model_type
    if family in MODEL_FOR_MASKED_LM_MAPPING_NAMES and not getattr(config, "is_encoder_decoder", False) \
            and not getattr(config, "is_decoder", False):
        raise FasttrainError(f"{where}: model_type {family!r} is an encoder (bidirectional attention: trained as a "
                             f"causal LM it sees the tokens it predicts); give a decoder-only causal LM (llama, "
                             f"gpt2, qwen2, ...)")


def check_weights(config, folder: Path | None, where: str) -> None:
    """Before ``from_pretrained``: the folder's ``model.safetensors`` is a readable safetensors file
    whose tensors have the names and shapes the config's model has (built on the meta device: no
    memory, no time). One line naming the file or the first tensor that differs."""
    if folder is None or not (folder / "model.safetensors").is_file():
        return
    import torch

    weights = folder / "model.safetensors"
    try:
        from safetensors import safe_open

        with safe_open(str(weights), framework="pt") as f:
            shapes = {name: list(f.get_slice(name).get_shape()) for name in f.keys()}
    except ImportError as exc:
        raise missing_extra("safetensors (a model folder's weights)", exc) from None
    except Exception as exc:            # noqa: BLE001 - safetensors' own error types for a damaged header
        detail = " ".join(str(exc).split())[:120]
        raise FasttrainError(f"{weights}: not a readable safetensors file ({detail}: truncated, empty or another "
                             f"kind of file); save the model again (save_pretrained or fasttrain lab --save)") from None
    with torch.device("meta"):
        model = _transformers().AutoModelForCausalLM.from_config(config)
    expected = {name: list(t.shape) for name, t in model.state_dict().items()}
    tied = {name for name in expected if name not in shapes and _ties(model, name)}
    for name, shape in expected.items():
        if name in shapes and shapes[name] != shape:
            raise FasttrainError(f"{weights}: tensor {name} has shape {shapes[name]}, {where}'s config.json makes "
                                 f"{shape}; config.json does not match the weights")
    missing = sorted(set(expected) - set(shapes) - tied)
    if missing:
        raise FasttrainError(f"{weights} has no tensor {missing[0]} (of {len(missing)} missing), which {where}'s "
                             f"config.json needs; config.json does not match the weights")


def _ties(model, name: str) -> bool:
    """Whether the parameter ``name`` is the same tensor as another one of ``model`` (tied embeddings:
    saved once)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    target = params.get(name)
    return target is not None and any(other is target for key, other in params.items() if key != name)


def has_weights(folder: Path | None) -> bool:
    return folder is None or any((folder / name).is_file() for name in WEIGHT_FILES)


def layer_count(config) -> int | None:
    """A transformers config's decoder layers (an object, or config.json's dict), under the family's name for them."""
    for name in ("num_hidden_layers", "n_layer", "num_layers"):
        value = config.get(name) if isinstance(config, dict) else getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


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
    layers = layer_count(config)
    if cfg.checkpoint_blocks and layers and cfg.checkpoint_blocks > layers:
        raise FasttrainError(f"--checkpoint-blocks {cfg.checkpoint_blocks}: {where} has {layers} decoder layers; "
                             f"give at most {layers} (0: every layer)")
    if cfg.use_liger_kernel:
        dev = torch.device(device)
        if dev.type != "cuda":
            raise FasttrainError("--use-liger-kernel needs a CUDA GPU (liger-kernel's kernels are Triton); "
                                 "drop it on the CPU")
        supported = liger_families()
        if family not in supported and cfg.liger_kernels != "fused_linear_cross_entropy":
            raise FasttrainError(f"liger-kernel {_liger_version()} has no patches for model_type {family!r} "
                                 f"(it patches {', '.join(sorted(f for f in supported if f))}); add --liger-kernels "
                                 f"fused_linear_cross_entropy (its fused loss on the model's head) or drop "
                                 f"--use-liger-kernel")
        # the fused cross-entropy alone is the lab's head, its kernel outside the compiled graph (lab/hf/liger.py),
        # unless the family's loss is more than the head's cross-entropy: then it is liger's own forward, which
        # dynamo cannot trace (measured, H100, torch 2.11, liger-kernel 0.8.5: its addmm with out_dtype fails on
        # fake tensors); liger's layer kernels are not run inside a whole compiled model
        own_head = cfg.liger_kernels == "fused_linear_cross_entropy" and not loss_beyond_the_head(config)
        if family in supported and cfg.torch_compile and cfg.torch_compile_scope == "model" and not own_head:
            raise FasttrainError("--use-liger-kernel with --torch-compile: liger's kernels do not trace under a "
                                 "whole-model torch.compile; add --torch-compile-scope blocks (the decoder layers "
                                 "compiled, the loss eager), --liger-kernels fused_linear_cross_entropy (the fused "
                                 "loss alone, outside the graph) or drop one of them")
    if cfg.lora_r:
        targets = cfg.lora_target_modules
        if tuple(targets) == LabConfig.lora_target_modules and family not in LORA_TARGETS:
            raise FasttrainError(f"no default LoRA targets for model_type {family!r}; name its linear layers "
                                 f"with --lora-target-modules (e.g. q_proj,v_proj)")


def memory_setup_for(hf_config: dict):
    """The estimator's view of a run of this HF model: ``(cfg, micro_batch) -> Setup | None`` through
    ``fasttrain.memory.hf_config.setup_from_hf_config`` (the estimator's mapping of a transformers config).
    A setting the estimator does not model (it raises) gives None: the run records no estimate, no error."""
    from fasttrain.lab.config import compiled_scope, cuda_graphs_of, liger_of, lora_targets_for
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
                                        recompute_layers=cfg.checkpoint_blocks,
                                        optim=cfg.optim, compiled=compiled_scope(cfg),
                                        cuda_graphs=cuda_graphs_of(cfg), liger=liger_of(cfg),
                                        float8=cfg.float8, float8_all_gather=cfg.float8_all_gather, **extra)
        except FasttrainError:
            return None
    return setup
