"""peft's soft prompt on a transformers model."""

from __future__ import annotations


from fasttrain.lab.config import LabConfig, missing_extra


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
