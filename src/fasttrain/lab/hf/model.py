"""Build a transformers causal LM as a :class:`~fasttrain.lab.models.LabModel`: its layers, loss and logits."""

from __future__ import annotations


from fasttrain.errors import FasttrainError
from fasttrain.lab.config import LabConfig
from fasttrain.lab.models import LabModel, empty_storage, parameters_on_meta
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


# torch.nn.init's functions that draw random numbers (transformers' initializers call them through
# transformers.initialization.TORCH_INIT_FUNCTIONS)
RANDOM_INITS = ("uniform_", "normal_", "trunc_normal_", "xavier_uniform_", "xavier_normal_", "kaiming_uniform_",
                "kaiming_normal_", "orthogonal_", "sparse_")


def init_hf_weights(module, device, seed: int, storage=None) -> None:
    """Give a transformers model built under :func:`~fasttrain.lab.models.parameters_on_meta` -- sharded by FSDP or
    whole -- its weights: storage on ``storage`` (default ``device``; FSDP's offloaded shards: the host), the
    buffers kept, then the model's own ``initialize_weights`` (its ``_init_weights`` on every module, in
    transformers' order) drawing from ``seed`` on ``device``. A sharded parameter's every random draw is made on
    its full tensor and cut to this rank's shard (:func:`_drawn_whole`), so one process and N processes get the
    same weights. Every parameter is checked to have been written (the empty storage is filled with NaN first)."""
    import torch
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor
    from transformers import PreTrainedModel
    from transformers import initialization as hf_init

    device = torch.device(device)
    empty_storage(module, storage if storage is not None else device)
    base = base_model_of(module)
    base.tie_weights()                  # to_empty gives each of two tied modules a tensor of its own
    local = [p.to_local() if isinstance(p, DTensor) else p for p in module.parameters()]
    with torch.no_grad():
        for p in local:
            p.fill_(float("nan"))
    for m in module.modules():          # initialize_weights skips a module its construction marked done
        m.__dict__.pop("_is_hf_initialized", None)
    originals = {name: f for name, f in hf_init.TORCH_INIT_FUNCTIONS.items() if name in RANDOM_INITS}
    models = [m for m in module.modules() if isinstance(m, PreTrainedModel)]
    # fully_shard made the model's class a subclass of FSDP's, defined outside transformers, which transformers
    # then takes for remote code (and skips the modules without parameters of their own: GPT-2's scaled
    # c_proj draws): it is asked of the model's own class
    own = next(c for c in type(base).__mro__ if not issubclass(c, FSDPModule))
    base.is_custom_code = own.is_custom_code
    for m in models:
        m._init_weights = _padding_row_on_its_shard(m._init_weights, device)
    torch.manual_seed(seed)
    hf_init.TORCH_INIT_FUNCTIONS.update({name: _drawn_whole(f, device) for name, f in originals.items()})
    try:
        base.initialize_weights()
    finally:
        hf_init.TORCH_INIT_FUNCTIONS.update(originals)
        del base.is_custom_code
        for m in models:
            del m._init_weights
    left = [name for (name, _), p in zip(module.named_parameters(), local) if torch.isnan(p).any()]
    if left:
        raise FasttrainError(f"{type(base).__name__}'s initialize_weights leaves {', '.join(left[:3])}"
                             f"{' and more' if len(left) > 3 else ''} unwritten (its _init_weights does not cover "
                             f"them): give --model a folder holding weights (save_pretrained)")


def _drawn_whole(draw, device):
    """``torch.nn.init``'s ``draw`` (normal_, uniform_, ...) such that a sharded parameter (a DTensor) gets this
    rank's shard of the full tensor drawn on ``device``: the same values a one-process model draws."""
    import torch
    from torch.distributed.tensor import DTensor, distribute_tensor

    def init(tensor, *args, **kwargs):
        if not isinstance(tensor, DTensor):
            return draw(tensor, *args, **kwargs)
        full = torch.empty(tensor.shape, dtype=tensor.dtype, device=device)
        draw(full, *args, **kwargs)
        tensor.to_local().copy_(distribute_tensor(full, tensor.device_mesh, tensor.placements,
                                                  src_data_rank=None).to_local())
        return tensor
    return init


def _padding_row_on_its_shard(init_weights, device):
    """A model's ``_init_weights`` that zeroes a sharded embedding's padding row on the shard holding it:
    transformers writes ``weight[padding_idx]``, which on a DTensor sharded by rows gathers the whole matrix into a
    copy and zeroes that."""
    import torch
    from torch.distributed.tensor import DTensor, distribute_tensor

    def init(module):
        pad = module.padding_idx if isinstance(module, torch.nn.Embedding) and isinstance(module.weight, DTensor) \
            else None
        if pad is None:
            return init_weights(module)
        module.padding_idx = None
        try:
            init_weights(module)
        finally:
            module.padding_idx = pad
        keep = torch.ones((module.weight.shape[0], 1), dtype=module.weight.dtype, device=device)
        keep[pad] = 0
        local = module.weight.to_local()            # (in host memory when FSDP offloads its shards)
        with torch.no_grad():
            local.mul_(distribute_tensor(keep, module.weight.device_mesh, module.weight.placements,
                                         src_data_rank=None).to_local().to(local.device))
    return init


def build_hf_model(spec: str, cfg: LabConfig, vocab_size: int | None, device, *, log=None,
                   meta: bool = False) -> LabModel:
    """The ``transformers`` causal LM ``spec`` (``hf:PATH_OR_NAME``) on ``device``, every technique
    of ``cfg`` that belongs to the model applied (attention kernel, checkpointing, liger, peft);
    ``vocab_size``: the corpus' vocabulary (checked to fit), or None. Weights from the folder when
    it holds some; else built with its parameters on the meta device and drawn by the model's own
    ``initialize_weights`` from ``cfg.seed`` (:func:`init_hf_weights`: the same seed gives the same
    weights on the same kind of device, in one process or sharded over N). ``meta``: left on the meta
    device, for FSDP to shard and ``parallelize.materialize`` to draw shard by shard."""
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
            with parameters_on_meta(device), device:
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
        if meta:
            module._fasttrain_meta_init = {"kind": "hf", "seed": cfg.seed}
        else:
            init_hf_weights(module, device, cfg.seed)
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
