"""Build a transformers causal LM as a :class:`~fasttrain.lab.models.LabModel`: its layers, loss and logits."""

from __future__ import annotations


from fasttrain.errors import FasttrainError
from fasttrain.lab.config import LabConfig
from fasttrain.lab.models import LabModel
from fasttrain.lab.hf.config import _transformers, check_hf_setup, check_weights, has_weights, load_hf_config, max_positions, memory_setup_for, source_of
from fasttrain.lab.hf.liger import apply_liger
from fasttrain.lab.hf.peft import apply_prompt_tuning, base_model_of, prompt_tokens_of
from fasttrain.lab.hf.save import save_hf
from fasttrain.lab.hf.config import HF_PREFIX, LORA_TARGETS


def is_hf_module(module) -> bool:
    """Whether ``module`` is a transformers model (possibly wrapped)."""
    base = base_model_of(module)
    return hasattr(base, "config") and hasattr(base.config, "model_type") and hasattr(base, "base_model_prefix")




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
    check_weights(config, folder, f"--model {spec}")
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
