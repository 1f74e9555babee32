"""The memory estimator's view of a lab run: the :class:`~fasttrain.memory.config.Setup` a
:class:`~fasttrain.lab.config.LabConfig` describes, and what the estimate does not model."""

from __future__ import annotations

from fasttrain.lab.build import model_config, model_source
from fasttrain.lab.config import LabConfig, compiled_scope, cuda_graphs_of


# the memory estimator's optimizer kinds (its Setup.optim) for the lab's --optim names; Muon keeps
# one fp32 momentum per hidden-matrix entry, which the estimator counts as SGD with momentum (the
# AdamW-trained embeddings and norms, a few percent of the parameters, are counted the same way)
SETUP_OPTIM = {"adamw_torch": "adamw", "adamw_torch_fused": "adamw", "adamw_8bit": "adamw_8bit",
               "adafactor": "adafactor", "sgd": "sgd", "muon": "sgd_momentum"}


def lab_setup(cfg: LabConfig, vocab: int = 65):
    """The memory estimator's :class:`~fasttrain.memory.config.Setup` for one lab run.

    Maps the model shape, micro-batch, precision (fp32/tf32 -> fp32; fp16/bf16 autocast ->
    ``amp``), checkpointing, attention kernel, dropout and optimizer. Gradient accumulation keeps
    the gradients alive across micro-batches (``grad_buffers``). What the Setup cannot yet say is
    listed in :func:`estimate_notes` (liger's kernels in the lab's GPT; a transformers model's are
    modelled, lab/hf.py). Optimizer kind, LoRA's frozen base and the soft prompt are modelled.
    ``compiled`` records the torch.compile scope; the estimator leaves the lab's GPT as eager (its
    compiled runs measure within about 1% of that); ``cuda_graphs``, CUDA graphs' pool (memory.precise D20).
    ``vocab_split`` empty: the GPT's tensor parallelism (``parallel/distributed.py``) splits the blocks only, its
    embedding, output layer and loss stay whole on every rank (memory.precise D23).
    """
    from fasttrain.memory.config import Setup

    mc = model_config(cfg, vocab)
    return Setup(
        heads=mc.heads, kv_heads=mc.kv_heads, micro_batch=cfg.per_device_train_batch_size, hidden=mc.hidden,
        ffn=mc.ffn, layers=mc.layers, seq=mc.seq, vocab=mc.vocab, tp=1, dp=1, opt_bytes=8,
        optim=SETUP_OPTIM[cfg.optim], lora_rank=cfg.lora_r, lora_targets=tuple(cfg.lora_target_modules),
        lora_dropout=float(cfg.lora_dropout), prompt_tokens=cfg.prompt_tuning_tokens,
        precision="amp" if (cfg.bf16 or cfg.fp16) else "fp32", recompute=cfg.gradient_checkpointing, zero=0,
        recompute_layers=cfg.checkpoint_blocks,
        ffn_act=mc.ffn_act, norm=mc.norm, pos=mc.pos, tied=mc.tied, bias=mc.bias, dropout=mc.dropout > 0,
        attention="flash" if cfg.attn_implementation == "sdpa" else "eager",
        optimizer="fused" if cfg.optim == "adamw_torch_fused" else "foreach",
        grad_buffers=cfg.gradient_accumulation_steps > 1, compiled=compiled_scope(cfg),
        cuda_graphs=cuda_graphs_of(cfg), vocab_split=())


def estimate_notes(cfg: LabConfig) -> list[str]:
    notes = []
    if cfg.optim == "adamw_8bit":
        notes.append("adamw_8bit: state counted as torchao's AdamW8bit (bitsandbytes differs slightly)")
    if cfg.optim == "muon":
        notes.append("muon: state counted as one fp32 momentum per parameter (the AdamW part's second moment "
                     "on embeddings and norms is not counted)")
    if cfg.use_liger_kernel and model_source(cfg) == "gpt":
        # a transformers model's liger patches are modelled (Setup.liger, lab/hf.py memory_setup_for)
        notes.append("liger: the fused linear cross-entropy never materializes the logits (not modelled)")
    if cfg.torch_compile and model_source(cfg) == "gpt":
        notes.append("torch.compile: the lab's GPT counted as eager (its compiled runs measure within about 1%)")
    if cfg.float8 != "none" and model_source(cfg) == "gpt":
        # a transformers model's float8 layers are modelled (Setup.float8, memory.precise D24)
        notes.append("float8: the lab's GPT counted as bf16 (torchao's float8 layers not modelled for it)")
    if cfg.fp16:
        notes.append("fp16 counted as bf16 autocast (same bytes)")
    return notes
