"""Hugging Face ``transformers`` causal LMs in the lab: ``--model hf:PATH_OR_NAME``.

:func:`build_hf_model` turns a folder holding a ``config.json`` (with weights: ``from_pretrained``;
without: ``from_config`` with its parameters on the meta device, then the model's own
``initialize_weights`` drawing from the seed, whole or -- under FSDP -- shard by shard:
:func:`init_hf_weights`) or a hub name into a :class:`~fasttrain.lab.models.LabModel`.
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
- liger-kernel's patches for the families it knows (its own table), and its fused linear cross-entropy alone
  on the head of any other causal LM (GPT-2: the lab's forward of that instance), CUDA only (here);
- tensor parallelism (``--strategy tp``): the family's own plan (``config.base_model_tp_plan`` and
  the causal-LM class's ``_tp_plan``) applied through ``torch.distributed.tensor.parallel``
  (:func:`apply_hf_tensor_parallel`); a family without a plan is refused (:func:`check_hf_parallel`).

The loss is the model's own loss path: ``model(input_ids=x, labels=x, shift_labels=y)``. With
``shift_labels`` given, ``transformers``' ``ForCausalLMLoss`` skips its own shift and takes
mean_{b,t} CE(logits[b, t], y[b, t]) over every position, the same number as
``F.cross_entropy(logits.view(-1, V), y.view(-1))``; with liger the lab's fused head (:mod:`.liger`) reads the
same ``shift_labels`` and fuses the output projection into the cross-entropy (the (B, T, V) logits
never exist in memory).

The package, one concern a file: :mod:`.config` (the one reader of a model's ``config.json`` and the checks
against it), :mod:`.model` (build, loss, logits, layers), :mod:`.tp_plan` (tensor parallelism), :mod:`.liger`,
:mod:`.peft` (the soft prompt; unwrapping peft), :mod:`.save` (save and load).
"""

from __future__ import annotations

from fasttrain.lab.hf.config import HF_PREFIX, LORA_TARGETS, WEIGHT_FILES, check_causal, check_hf_folder, check_hf_setup, check_weights, config_from_dict, has_weights, is_hf, load_hf_config, max_positions, memory_setup_for, source_of  # noqa: F401
from fasttrain.lab.hf.peft import apply_prompt_tuning, base_model_of, prompt_tokens_of  # noqa: F401
from fasttrain.lab.hf.liger import apply_fused_linear_cross_entropy, apply_liger, check_plain_head, liger_families, liger_patched_names, modeling_modules_restored, undo_liger_patches  # noqa: F401
from fasttrain.lab.hf.save import FASTTRAIN_JSON, HF_CHECKPOINT_FORMAT, PROMPT_FOLDER, fresh_copy, is_hf_checkpoint, load_hf_checkpoint, load_tokenizer, read_hf_checkpoint, save_hf  # noqa: F401
from fasttrain.lab.hf.model import build_hf_model, decoder_layers, hf_logits, hf_loss, init_hf_weights, is_hf_module  # noqa: F401
from fasttrain.lab.hf.tp_plan import TP_STYLES, apply_hf_tensor_parallel, check_hf_parallel, check_hf_tensor_parallel, gather_tp_state_dict, resolved_tp_plan, tp_plan_of  # noqa: F401
