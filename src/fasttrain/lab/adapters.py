"""Parameter-efficient fine-tuning: LoRA through peft, and the soft prompt's freezing."""

from __future__ import annotations

from fasttrain.errors import FasttrainError
from fasttrain.lab.config import LabConfig, missing_extra


def apply_lora(cfg: LabConfig, model, targets: tuple[str, ...] | None = None):
    """LoRA through peft: each target ``nn.Linear`` W (out x in) gains A (r x in) and B (out x r),
    y = W x + (alpha / r) B A x, with W frozen; r (in + out) trainable parameters per target.
    ``targets``: module names (default ``cfg.lora_target_modules``), in the model's own names
    (a Hugging Face GPT-2's ``Conv1D`` layers count as linear: peft adapts them too)."""
    try:
        from peft import LoraConfig, inject_adapter_in_model
    except ImportError as exc:
        raise missing_extra("peft (LoRA)", exc) from None
    targets = tuple(cfg.lora_target_modules if targets is None else targets)
    names = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if type(m).__name__ in ("Linear", "Conv1D")}
    unknown = [t for t in targets if t not in names]
    if unknown:
        hint = " (a tied model has no separate head)" if "head" in unknown else ""
        raise FasttrainError(f"unknown --lora-target-modules {','.join(unknown)}{hint}; "
                             f"this model has {', '.join(sorted(names))}")
    lora = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                      target_modules=list(targets))
    return inject_adapter_in_model(lora, model)


def merge_lora(model):
    """Fold every LoRA adapter into its base weight (W += (alpha / r) B A) and drop the wrappers."""
    for name, module in list(model.named_modules()):
        if hasattr(module, "base_layer") and hasattr(module, "merge"):
            module.merge()
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, child, module.base_layer)
    return model


def freeze_for_prompt_tuning(model) -> None:
    for name, p in model.named_parameters():
        p.requires_grad_(name == "prompt")
