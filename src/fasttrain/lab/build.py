"""The model a :class:`~fasttrain.lab.config.LabConfig` names, built as a
:class:`~fasttrain.lab.models.LabModel` for the trainer.

The lab's own GPT (``lab/model.py``) from its shape fields, or from a checkpoint written with
``--save`` (``init_from``: fine-tuning keeps the pretrained shape); a Hugging Face model when the
configuration names one (``model = "hf:..."``, built by ``lab/hf.py``). The checkpoint is read once,
by the caller, and its metadata handed in.

Under FSDP a model trained from scratch (the lab's GPT, or a transformers model whose folder holds no
weights) is built with its parameters on the meta device (:func:`~fasttrain.lab.models.parameters_on_meta`:
no rank ever holds the whole model, an 8B Llama shape included) and given its weights once sharded
(``parallelize.materialize``): the same weights as a one-process build of the same seed.
"""

from __future__ import annotations

from dataclasses import replace

from fasttrain.errors import FasttrainError
from fasttrain.lab.config import LabConfig
from fasttrain.lab.models import LabModel, parameters_on_meta


def resolve_device(cfg: LabConfig):
    import torch

    if cfg.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(cfg.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise FasttrainError(f"--device {cfg.device}: no CUDA GPU here (torch {torch.__version__}); use --device cpu")
    return dev


def model_config(cfg: LabConfig, vocab: int):
    """The GPT ``cfg`` describes, for a corpus of ``vocab`` symbols."""
    from fasttrain.lab.model import GPTConfig

    llama = cfg.style == "llama"
    return GPTConfig(
        layers=cfg.layers, heads=cfg.heads, hidden=cfg.width, ffn=cfg.ffn_width,
        vocab=cfg.padded_vocab(cfg.vocab_size or vocab), seq=cfg.context,
        kv_heads=cfg.kv_heads if llama else None, norm="rms" if llama else "layer", pos="rope" if llama else "learned",
        ffn_act=("swiglu" if llama else "gelu") if cfg.activation == "style" else cfg.activation, tied=not llama,
        bias=cfg.bias, dropout=cfg.dropout,
        attention=cfg.attn_implementation, recompute=cfg.gradient_checkpointing, liger=cfg.use_liger_kernel,
        recompute_blocks=cfg.checkpoint_blocks, prompt_tokens=cfg.prompt_tuning_tokens, qk_norm=cfg.qk_norm, zero_init_proj=cfg.zero_init_proj,
        unet_skips=cfg.unet_skips, logit_softcap=cfg.logit_softcap)


def config_from_model(cfg: LabConfig, mc) -> LabConfig:
    """``cfg`` with the model shape of a checkpoint's model (fine-tuning keeps the pretrained shape)."""
    llama = mc.norm == "rms"
    return cfg.with_(style="llama" if llama else "gpt2", layers=mc.layers, heads=mc.heads,
                     kv_heads=mc.kv_heads if llama else None, width=mc.hidden, ffn=mc.ffn, context=mc.seq,
                     vocab_size=mc.vocab, pad_vocab_to_multiple_of=0, bias=mc.bias)


def model_source(cfg: LabConfig) -> str:
    """"gpt" (the lab's model) or what ``--model`` names (``hf:PATH``)."""
    return cfg.model or "gpt"


def gpt_model(module) -> LabModel:
    """The lab's GPT as the trainer sees it: ``module(x, y)`` is the loss (the logits are not kept),
    ``module(x)`` the logits, ``module.blocks`` its blocks; PEFT targets in its own names."""
    c = module.config
    return LabModel(module=module, name="gpt", vocab_size=c.vocab, context=c.seq, config=c.to_dict(),
                    loss=lambda m, x, y: m(x, y), logits=lambda m, x: m(x), blocks=lambda m: list(m.blocks),
                    lora_targets=("qkv", "proj"))


def gpt_config_for(cfg: LabConfig, vocab: int, checkpoint: dict | None):
    """The GPT's config: from ``cfg``'s shape, or the checkpoint's shape with this run's
    implementation choices (dropout, attention kernel, checkpointing, liger, soft prompt)."""
    if checkpoint is None:
        return model_config(cfg, vocab)
    from fasttrain.lab.model import GPTConfig

    return replace(GPTConfig.from_dict(checkpoint["model"]), dropout=cfg.dropout, attention=cfg.attn_implementation,
                   recompute=cfg.gradient_checkpointing, recompute_blocks=cfg.checkpoint_blocks,
                   liger=cfg.use_liger_kernel,
                   prompt_tokens=cfg.prompt_tuning_tokens)


def meta_build_for(cfg: LabConfig, world) -> bool:
    """Whether the run builds its model with the parameters on the meta device, for FSDP to shard and
    ``parallelize.materialize`` to draw shard by shard: FSDP (without tensor parallelism, whose split needs
    the weights) of a model trained from scratch in full -- the lab's GPT without --init-from, or a
    transformers model whose local folder holds no weights."""
    if world is None or not world.fsdp or world.tp != 1 or cfg.lora_r or cfg.prompt_tuning_tokens:
        return False
    source = model_source(cfg)
    if source == "gpt":
        return not cfg.init_from
    from pathlib import Path

    from fasttrain.lab.hf import has_weights, source_of

    folder = Path(source_of(source)).expanduser()
    folder = folder.parent if folder.name == "config.json" else folder
    return folder.is_dir() and not has_weights(folder)


def build_model(cfg: LabConfig, vocab: int, device, *, checkpoint: dict | None = None, seed: int | None = None,
                log=None, meta: bool = False) -> LabModel:
    """The model of one run, on ``device``: its weights drawn from ``seed`` (default ``cfg.seed``),
    then (``checkpoint``: the metadata of ``cfg.init_from``, read by the caller) loaded from it.
    ``meta``: the model (the lab's GPT, or a transformers model without weights) with its parameters on the
    meta device (:func:`~fasttrain.lab.models.parameters_on_meta`), for FSDP to shard and
    ``parallelize.materialize`` to initialize."""
    source = model_source(cfg)
    if source != "gpt":
        from fasttrain.lab.hf.config import is_hf

        if not is_hf(source):
            raise FasttrainError(f"unknown --model {source!r}; use gpt or hf:PATH_OR_NAME")
        from fasttrain.lab.hf import build_hf_model

        return build_hf_model(source, cfg, vocab, device, log=log, meta=meta)
    import torch

    from fasttrain.lab.model import build

    config = gpt_config_for(cfg, vocab, checkpoint)
    seed = cfg.seed if seed is None else seed
    if meta:
        with parameters_on_meta(device) as state:
            module = build(config, device, seed=seed)
        module._fasttrain_meta_init = state
        return gpt_model(module)
    module = build(config, device, seed=seed)
    if checkpoint is not None:
        from fasttrain.lab.checkpoint import load_weights

        load_weights(module, cfg.init_from)
        if cfg.prompt_tuning_tokens:
            with torch.no_grad():
                module.reset_prompt()
    return gpt_model(module)


def make_trainer(cfg: LabConfig, corpus, device, *, world=None,
                 checkpoint: dict | None = None, log=None):
    """A :class:`~fasttrain.lab.trainer.Trainer` of the model ``cfg`` names, which it can rebuild
    (``Trainer.reset``: the initial weights of another seed)."""
    from fasttrain.lab.trainer import Trainer

    if cfg.cuda_graph_step:
        raise FasttrainError("--cuda-graph-step is a speedrun rung (the step captured with its optimizer): run it "
                             "with fasttrain lab speedrun --rungs graph-step, or drop it here")
    model = build_model(cfg, corpus.vocab_size, device, checkpoint=checkpoint, log=log, meta=meta_build_for(cfg, world))
    rebuild = None
    if model.name == "gpt":
        def rebuild(seed):
            return build_model(cfg, corpus.vocab_size, device, checkpoint=checkpoint, seed=seed).module
    return Trainer(cfg, model, corpus, device, world=world, rebuild=rebuild)
