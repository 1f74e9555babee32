"""The lab's training loop: plain PyTorch, one file, every technique a flag.

``run(cfg)`` trains ``fasttrain.lab.model`` on Tiny Shakespeare and returns a run record:

- timing: the first ``timing_warmup_steps`` steps (compilation, autotuning, the allocator's
  growth) are timed apart; every other step is timed from a device synchronization before it to
  one after it (data loading included: it is one of the techniques measured), and reported as
  p20/p50/p80/mean ms and tokens/s. Validation is timed apart and excluded from both.
- memory: ``torch.cuda.max_memory_allocated`` / ``max_memory_reserved`` over the training steps
  (validation excluded: the peak is read before and reset after each validation); memory by kind
  is measured tensor by tensor -- parameters, gradients (one per trainable parameter, as they
  exist at the end of backward), optimizer state (every tensor in ``optimizer.state``, quantized
  ones through their inner tensors) and buffers -- and activations are the peak minus those
  (so they include the step's temporaries and the cuBLAS workspaces);
- the memory estimator's ``precise`` prediction for the same setup (:func:`lab_setup`) beside the
  measured peak;
- the loss curve, and the validation loss over the whole validation split (or ``eval_tokens``)
  every ``eval_interval`` steps and after the last.
"""

from __future__ import annotations

import gc
import json
import math
import os
import shutil
import tempfile
import time
from contextlib import contextmanager, nullcontext
from dataclasses import replace
from pathlib import Path

from fasttrain.errors import FasttrainError
from fasttrain.lab.config import LabConfig, validate

LAB_EXTRA = 'pip install -e ".[lab]"'


# --- configuration -> model, memory setup ------------------------------------------------------

def resolve_device(cfg: LabConfig):
    import torch

    if cfg.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(cfg.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise FasttrainError(f"--device {cfg.device}: no CUDA GPU here (torch {torch.__version__}); use --device cpu")
    return dev


def model_config(cfg: LabConfig, vocab: int):
    """The model ``cfg`` describes, for a corpus of ``vocab`` characters."""
    from fasttrain.lab.model import GPTConfig

    llama = cfg.style == "llama"
    return GPTConfig(
        layers=cfg.layers, heads=cfg.heads, hidden=cfg.width, ffn=cfg.ffn_width,
        vocab=cfg.padded_vocab(cfg.vocab_size or vocab), seq=cfg.context,
        kv_heads=cfg.kv_heads if llama else None, norm="rms" if llama else "layer", pos="rope" if llama else "learned",
        ffn_act="swiglu" if llama else "gelu", tied=not llama, bias=cfg.bias, dropout=cfg.dropout,
        attention=cfg.attn_implementation, recompute=cfg.gradient_checkpointing, liger=cfg.use_liger_kernel,
        prompt_tokens=cfg.prompt_tuning_tokens)


def config_from_model(cfg: LabConfig, mc) -> LabConfig:
    """``cfg`` with the model shape of a checkpoint's model (fine-tuning keeps the pretrained shape)."""
    llama = mc.norm == "rms"
    return cfg.with_(style="llama" if llama else "gpt2", layers=mc.layers, heads=mc.heads,
                     kv_heads=mc.kv_heads if llama else None, width=mc.hidden, ffn=mc.ffn, context=mc.seq,
                     vocab_size=mc.vocab, pad_vocab_to_multiple_of=0, bias=mc.bias)


# bytes of optimizer state per trainable parameter as the estimator takes it (k in its formulas)
OPT_BYTES = {"adamw_torch": 8, "adamw_torch_fused": 8, "adamw_8bit": 2, "adafactor": 0, "sgd": 0, "muon": 4}
# the memory estimator's optimizer kinds (its Setup.optim) for the lab's --optim names; Muon keeps
# one fp32 momentum per hidden-matrix entry, which the estimator counts as SGD with momentum (the
# AdamW-trained embeddings and norms, a few percent of the parameters, are counted the same way)
SETUP_OPTIM = {"adamw_torch": "adamw", "adamw_torch_fused": "adamw", "adamw_8bit": "adamw_8bit",
               "adafactor": "adafactor", "sgd": "sgd", "muon": "sgd_momentum"}


def lab_setup(cfg: LabConfig, vocab: int = 65, batch: int | None = None):
    """The memory estimator's :class:`~fasttrain.memory.config.Setup` for one lab run.

    Maps the model shape, micro-batch, precision (fp32/tf32 -> fp32; fp16/bf16 autocast ->
    ``amp``), checkpointing, attention kernel, dropout and optimizer. Gradient accumulation keeps
    the gradients alive across micro-batches (``grad_buffers``). What the Setup cannot yet say is
    listed in :func:`estimate_notes` (liger's fused cross-entropy, torch.compile). Optimizer kind,
    LoRA's frozen base and the soft prompt are modelled.
    """
    from fasttrain.memory.config import Setup

    mc = model_config(cfg, vocab)
    return Setup(
        heads=mc.heads, kv_heads=mc.kv_heads, micro_batch=batch or cfg.per_device_train_batch_size, hidden=mc.hidden,
        ffn=mc.ffn, layers=mc.layers, seq=mc.seq, vocab=mc.vocab, tp=1, dp=1, opt_bytes=8,
        optim=SETUP_OPTIM[cfg.optim], lora_rank=cfg.lora_r, lora_targets=tuple(cfg.lora_target_modules),
        lora_dropout=float(cfg.lora_dropout), prompt_tokens=cfg.prompt_tuning_tokens,
        precision="amp" if (cfg.bf16 or cfg.fp16) else "fp32", recompute=cfg.gradient_checkpointing, zero=0,
        ffn_act=mc.ffn_act, norm=mc.norm, pos=mc.pos, tied=mc.tied, bias=mc.bias, dropout=mc.dropout > 0,
        attention="flash" if cfg.attn_implementation == "sdpa" else "eager",
        optimizer="fused" if cfg.optim == "adamw_torch_fused" else "foreach",
        grad_buffers=cfg.gradient_accumulation_steps > 1)


def estimate_notes(cfg: LabConfig) -> list[str]:
    notes = []
    if cfg.optim == "adamw_8bit":
        notes.append("adamw_8bit: state counted as torchao's AdamW8bit (bitsandbytes differs slightly)")
    if cfg.optim == "muon":
        notes.append("muon: state counted as one fp32 momentum per parameter (the AdamW part's second moment "
                     "on embeddings and norms is not counted)")
    if cfg.use_liger_kernel:
        notes.append("liger: the fused linear cross-entropy never materializes the logits (not modelled)")
    if cfg.torch_compile:
        notes.append("torch.compile: fused kernels keep other tensors than eager PyTorch (not modelled)")
    if cfg.fp16:
        notes.append("fp16 counted as bf16 autocast (same bytes)")
    return notes


# --- optimizer, PEFT, checkpoints --------------------------------------------------------------

def _missing(library: str, exc: ImportError) -> FasttrainError:
    return FasttrainError(f"{library} is not installed ({exc.name} missing); install the lab extra: {LAB_EXTRA}")


def build_optimizer(cfg: LabConfig, model, lr: float | None = None, world=None):
    """``cfg.optim`` over the trainable parameters; weight decay on matrices (dim >= 2) only."""
    import torch

    lr = cfg.learning_rate if lr is None else lr
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    rest = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": rest, "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    if world is not None and world.strategy == "tp":
        from fasttrain.lab.distributed import split_param_groups

        groups = split_param_groups(groups)
    betas = (cfg.adam_beta1, cfg.adam_beta2)
    if cfg.optim == "adamw_torch":
        return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=cfg.adam_epsilon)
    if cfg.optim == "adamw_torch_fused":
        return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=cfg.adam_epsilon, fused=True)
    if cfg.optim == "adafactor":
        # torch's Adafactor: factored second moment (a row and a column vector per matrix), no
        # first moment; lr caps the relative step size
        return torch.optim.Adafactor(groups, lr=lr)
    if cfg.optim == "sgd":
        return torch.optim.SGD(groups, lr=lr)        # no momentum (as TrainingArguments' "sgd"): no state
    if cfg.optim == "muon":
        return build_muon(cfg, model, lr)
    # adamw_8bit: block-wise quantized moments (2 x 1 byte + one fp32 scale per block of 256)
    try:
        from torchao.optim import AdamW8bit
    except ImportError as exc:
        try:
            import bitsandbytes as bnb
        except ImportError:
            raise _missing("torchao (or bitsandbytes) for --optim adamw_8bit", exc) from None
        return bnb.optim.AdamW8bit(groups, lr=lr, betas=betas, eps=cfg.adam_epsilon)
    return AdamW8bit(groups, lr=lr, betas=betas, eps=cfg.adam_epsilon)


class OptimizerGroup:
    """Several optimizers stepped as one: ``param_groups`` and ``state`` are their union, so the
    learning-rate schedule and the state count see a single optimizer."""

    def __init__(self, *optimizers):
        self.optimizers = optimizers

    @property
    def param_groups(self) -> list:
        return [g for opt in self.optimizers for g in opt.param_groups]

    @property
    def state(self) -> dict:
        merged = {}
        for opt in self.optimizers:
            merged.update(opt.state)
        return merged

    def step(self) -> None:
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {"optimizers": [opt.state_dict() for opt in self.optimizers]}

    def load_state_dict(self, state: dict) -> None:
        for opt, s in zip(self.optimizers, state["optimizers"]):
            opt.load_state_dict(s)


def build_muon(cfg: LabConfig, model, lr: float):
    """Muon for the blocks' 2-D weight matrices, AdamW for the rest (embeddings, norms, biases).

    Muon: momentum M <- mu M + G, update O = NewtonSchulz5(G + mu M) (Nesterov), the nearest
    semi-orthogonal matrix to it; ``match_rms_adamw`` scales O by 0.2 sqrt(max(rows, cols)) so
    its RMS matches AdamW's and one learning rate (and schedule) serves both optimizers."""
    import torch

    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    hidden = [p for n, p in named if p.dim() == 2 and ".blocks." in f".{n}"]
    hidden_ids = {id(p) for p in hidden}
    rest = [p for _, p in named if id(p) not in hidden_ids]
    if not hidden:
        raise FasttrainError("--optim muon found no trainable 2-D matrices in the transformer blocks")
    muon = torch.optim.Muon(hidden, lr=lr, weight_decay=cfg.weight_decay, momentum=0.95,
                            adjust_lr_fn="match_rms_adamw")
    decay = [p for p in rest if p.dim() >= 2]
    other = [p for p in rest if p.dim() < 2]
    groups = [g for g in ({"params": decay, "weight_decay": cfg.weight_decay}, {"params": other, "weight_decay": 0.0})
              if g["params"]]
    if not groups:
        return OptimizerGroup(muon)
    fused = all(p.device.type == "cuda" for p in rest)
    adamw = torch.optim.AdamW(groups, lr=lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_epsilon,
                              fused=fused or None)
    return OptimizerGroup(muon, adamw)


def _leaves(t):
    """The plain tensors holding ``t``'s data (tensor subclasses such as torchao's quantized
    optimizer state through their inner tensors; a DTensor -- FSDP, tensor parallelism --
    through this rank's shard)."""
    if hasattr(t, "to_local") and hasattr(t, "placements"):
        yield from _leaves(t.to_local())
        return
    if hasattr(t, "__tensor_flatten__") and type(t).__name__ != "Parameter":
        names, _ = t.__tensor_flatten__()
        for n in names:
            yield from _leaves(getattr(t, n))
    else:
        yield t


def tensor_bytes(t) -> int:
    """Bytes a tensor holds."""
    return sum(leaf.numel() * leaf.element_size() for leaf in _leaves(t))


def optimizer_state_bytes(opt, include_scalars: bool = True) -> int:
    """Bytes of every tensor in ``opt.state``, storage shared between entries counted once
    (torchao's 8-bit states share one 256-entry code table)."""
    import torch

    seen, total = set(), 0
    for state in opt.state.values():
        for v in state.values():
            if not isinstance(v, torch.Tensor) or (not include_scalars and v.dim() == 0):
                continue
            for leaf in _leaves(v):
                key = (leaf.untyped_storage().data_ptr(), leaf.device) if leaf.numel() else None
                if key is not None and key in seen:
                    continue
                seen.add(key)
                total += leaf.numel() * leaf.element_size()
    return total


def apply_lora(cfg: LabConfig, model):
    """LoRA through peft: each target ``nn.Linear`` W (out x in) gains A (r x in) and B (out x r),
    y = W x + (alpha / r) B A x, with W frozen; r (in + out) trainable parameters per target."""
    try:
        from peft import LoraConfig, inject_adapter_in_model
    except ImportError as exc:
        raise _missing("peft (LoRA)", exc) from None
    names = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if type(m).__name__ == "Linear"}
    unknown = [t for t in cfg.lora_target_modules if t not in names]
    if unknown:
        hint = " (a tied model has no separate head)" if "head" in unknown else ""
        raise FasttrainError(f"unknown --lora-target-modules {','.join(unknown)}{hint}; "
                             f"this model has {', '.join(sorted(names))}")
    lora = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                      target_modules=list(cfg.lora_target_modules))
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


def save_checkpoint(model, path, *, chars: str, lab: dict, extra: dict | None = None) -> Path:
    """A folder with ``model.safetensors`` (weights) and ``config.json`` (the model's config, the
    vocabulary, the lab configuration), written to a temporary folder and renamed into place."""
    try:
        from safetensors.torch import save_model
    except ImportError as exc:
        raise _missing("safetensors (--save)", exc) from None
    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=final.name + ".", suffix=".tmp", dir=final.parent))
    try:
        save_model(model, str(tmp / "model.safetensors"))
        meta = {"format": "fasttrain-lab-checkpoint-1", "model": model.config.to_dict(), "chars": chars,
                "lab": lab, **(extra or {})}
        (tmp / "config.json").write_text(json.dumps(meta, indent=1))
        if final.exists():
            old = final.with_name(final.name + ".old")
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def read_checkpoint(path) -> dict:
    p = Path(path)
    cfg_file, weights = p / "config.json", p / "model.safetensors"
    if not cfg_file.exists() or not weights.exists():
        raise FasttrainError(f"{p} is not a lab checkpoint (needs config.json and model.safetensors); "
                             f"write one with: fasttrain lab --save {p}")
    try:
        meta = json.loads(cfg_file.read_text())
        meta["model"]
    except (ValueError, KeyError):
        raise FasttrainError(f"{cfg_file}: not a lab checkpoint config (unreadable JSON)") from None
    return meta


def load_weights(model, path) -> None:
    try:
        from safetensors.torch import load_model
    except ImportError as exc:
        raise _missing("safetensors (--init-from)", exc) from None
    try:
        missing, unexpected = load_model(model, str(Path(path) / "model.safetensors"), strict=False)
    except Exception as exc:
        raise FasttrainError(f"{path}: cannot load the weights ({type(exc).__name__}: {str(exc)[:120]})") from None
    if set(missing) - {"prompt"} or unexpected:
        raise FasttrainError(f"{path}: weights do not match the model (missing {sorted(missing)[:3]}, "
                             f"unexpected {sorted(unexpected)[:3]})")


# --- the step ------------------------------------------------------------------------------------

def lr_at(cfg: LabConfig, step: int) -> float:
    """Linear warm-up to ``learning_rate``, then cosine decay to ``min_lr`` at ``max_steps``."""
    if step < cfg.warmup_steps:
        return cfg.learning_rate * (step + 1) / (cfg.warmup_steps + 1)
    span = max(1, cfg.max_steps - cfg.warmup_steps)
    ratio = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (cfg.learning_rate - cfg.min_lr)


def autocast_for(cfg: LabConfig, device):
    import torch

    if cfg.bf16 or cfg.fp16:
        return lambda: torch.autocast(device.type, dtype=torch.bfloat16 if cfg.bf16 else torch.float16)
    return nullcontext


def accumulate_gradients(model, x, y, micro_batches: int, amp=nullcontext, scaler=None, sync=None):
    """Forward and backward over ``micro_batches`` equal slices of (x, y); the gradients add up to
    those of the mean loss over the whole batch: d/dW mean_all = sum_j (1/k) d/dW mean_j.
    ``sync(last)``: a context around micro-batch j's forward and backward (several processes:
    gradients are reduced over the ranks only on the last); without it a model with ``no_sync``
    (DistributedDataParallel) all-reduces only on the last micro-batch. Returns the mean loss (a
    tensor: no device synchronization)."""
    total = None
    no_sync = getattr(model, "no_sync", None)
    for j, (xm, ym) in enumerate(zip(x.chunk(micro_batches), y.chunk(micro_batches))):
        last = j == micro_batches - 1
        if sync is not None:
            context = sync(last)
        else:
            context = nullcontext() if no_sync is None or last else no_sync()
        with context:
            with amp():
                loss = model(xm, ym) / micro_batches
            (scaler.scale(loss) if scaler is not None else loss).backward()
        total = loss.detach() if total is None else total + loss.detach()
    return total


class Trainer:
    """Model, optimizer and data of one run; ``step()`` is one optimizer step.

    ``wrap(model) -> module``, if given, wraps the model after PEFT and before compilation and the
    optimizer (data or model parallelism); ``self.model`` stays the unwrapped module. ``world``
    (:class:`~fasttrain.lab.distributed.World`): this process's rank and strategy; without ``wrap``
    the strategy wraps the model."""

    def __init__(self, cfg: LabConfig, corpus, device, *, batch: int | None = None, wrap=None, world=None):
        import torch

        from fasttrain.lab import distributed as D
        from fasttrain.lab.model import GPTConfig, build

        self.world = world = world or D.World()
        self.cfg, self.device, self.corpus = cfg, device, corpus
        self.batch = batch or cfg.per_device_train_batch_size
        self.checkpoint_meta = None
        if cfg.init_from:
            meta = read_checkpoint(cfg.init_from)
            if meta.get("chars") not in (None, corpus.chars):
                raise FasttrainError(f"{cfg.init_from} was trained on another vocabulary")
            base = GPTConfig.from_dict(meta["model"])
            self.model_config = replace(base, dropout=cfg.dropout, attention=cfg.attn_implementation,
                                        recompute=cfg.gradient_checkpointing, liger=cfg.use_liger_kernel,
                                        prompt_tokens=cfg.prompt_tuning_tokens)
            self.checkpoint_meta = meta
        else:
            self.model_config = model_config(cfg, corpus.vocab_size)
        model = build(self.model_config, device, seed=cfg.seed)
        if cfg.init_from:
            load_weights(model, cfg.init_from)
            if cfg.prompt_tuning_tokens:
                with torch.no_grad():
                    model.reset_prompt()
        if cfg.prompt_tuning_tokens:
            freeze_for_prompt_tuning(model)
        if cfg.lora_r:
            model = apply_lora(cfg, model)
        # several processes: DDP wraps the model; FSDP and tensor parallelism shard it in place
        # (before the optimizer is built: it must hold the sharded parameters)
        wrapped = wrap(model) if wrap is not None else D.wrap_model(model, world, mixed_bf16=cfg.bf16)
        self.model = model              # the module itself (evaluation, saving, counting)
        self.train_model = torch.compile(wrapped, mode=None if cfg.torch_compile_mode == "default"
                                         else cfg.torch_compile_mode) if cfg.torch_compile else wrapped
        self.optimizer = D.wrap_optimizer(build_optimizer(cfg, wrapped, world=world), world)
        # FSDP's mixed-precision policy computes in bf16 itself: no autocast on top
        self.amp = nullcontext if (world.strategy == "fsdp" and cfg.bf16) else autocast_for(cfg, device)
        self.scaler = torch.amp.GradScaler(device.type) if cfg.fp16 else None
        self.trainable = [p for p in model.parameters() if p.requires_grad]
        self.step_index = 0
        self.cuda_graphs = cfg.torch_compile and cfg.torch_compile_mode == "reduce-overhead" and device.type == "cuda"

    def reset(self, seed: int | None = None) -> None:
        """Back to the start of a run (of ``seed``, default the configured one) without rebuilding:
        the initial weights a fresh Trainer would draw are copied into the same parameter tensors
        (so compiled code and captured CUDA graphs stay valid), a new optimizer, step 0. The global
        generator (dropout) is left as a fresh build leaves it. Runs from scratch only."""
        import torch

        from fasttrain.lab.model import build

        cfg = self.cfg if seed is None else replace(self.cfg, seed=seed)
        if cfg.init_from or cfg.lora_r or cfg.prompt_tuning_tokens:
            raise FasttrainError("Trainer.reset restarts runs from scratch only (no --init-from, LoRA or prompt tuning)")
        fresh = build(self.model_config, self.device, seed=cfg.seed)
        with torch.no_grad():
            self.model.load_state_dict(fresh.state_dict())
        del fresh
        self.cfg = cfg
        self.optimizer = build_optimizer(cfg, self.model)
        self.scaler = torch.amp.GradScaler(self.device.type) if cfg.fp16 else None
        self.step_index = 0

    def batches(self, steps: int, start: int = 0):
        from fasttrain.lab.data import train_batches

        cfg = self.cfg
        k, dp = cfg.gradient_accumulation_steps, self.world.dp
        batches = train_batches(self.corpus.train, seed=cfg.seed, batch=self.batch * k * dp,
                                context=cfg.context, steps=steps, device=self.device, preload=cfg.preload,
                                num_workers=cfg.dataloader_num_workers, pin_memory=cfg.dataloader_pin_memory,
                                prefetch_factor=cfg.dataloader_prefetch_factor, start=start)
        if dp == 1:
            return batches
        # every rank draws the global step (k micro-batches of dp b windows, as one process at
        # batch dp b would) and keeps its b rows of each micro-batch
        rank, b = self.world.dp_rank, self.batch

        def mine(t):
            return t.view(k, dp, b, -1)[:, rank].reshape(k * b, -1)
        return ((mine(x), mine(y)) for x, y in batches)

    def step(self, x, y):
        """One optimizer step on (x, y) (k micro-batches of b); returns the loss tensor (no sync)."""
        import torch

        from fasttrain.lab import distributed as D

        cfg = self.cfg
        if self.cuda_graphs:
            # a new iteration: CUDA-graph outputs of the previous step may now be overwritten
            torch.compiler.cudagraph_mark_step_begin()
        lr = lr_at(cfg, self.step_index)
        for group in self.optimizer.param_groups:
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].fill_(lr)       # torchao's 8-bit AdamW keeps lr as a tensor and refuses a float
            else:
                group["lr"] = lr
        self.train_model.train()
        world = self.world
        sync = None if not world.distributed else (
            lambda last: D.sync_gradients(self.train_model, world, last))
        loss = accumulate_gradients(self.train_model, x, y, cfg.gradient_accumulation_steps, self.amp, self.scaler,
                                    sync)
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        if cfg.max_grad_norm:
            if world.distributed:
                D.clip_grad_norm(self.train_model, cfg.max_grad_norm, world)
            else:
                torch.nn.utils.clip_grad_norm_(self.trainable, cfg.max_grad_norm)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step_index += 1
        if cfg.torch_empty_cache_steps and self.step_index % cfg.torch_empty_cache_steps == 0 \
                and self.device.type == "cuda":
            torch.cuda.empty_cache()
        return loss

    def evaluate(self, tokens: int | None = None) -> tuple[float, int]:
        """Mean cross-entropy (nats per character) over the validation split, in order."""
        import torch
        import torch.nn.functional as F

        from fasttrain.lab.data import eval_windows

        cfg = self.cfg
        ids = torch.from_numpy(self.corpus.val).to(self.device).long()
        wins = eval_windows(self.corpus.val, cfg.context, tokens if tokens is not None else cfg.eval_tokens)
        batch = cfg.eval_batch_size or self.batch
        model = self.model
        was_training = model.training
        model.eval()
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        count = 0
        with torch.no_grad():
            i = 0
            while i < len(wins):
                length = wins[i][1]
                group = [w for w in wins[i:i + batch] if w[1] == length]   # equal lengths batch together
                starts = torch.tensor([s for s, _ in group], device=self.device)
                idx = starts[:, None] + torch.arange(length + 1, device=self.device)
                w = ids[idx]
                with self.amp():
                    logits = model(w[:, :-1])
                v = self.corpus.vocab_size
                total += F.cross_entropy(logits[..., :v].float().reshape(-1, v), w[:, 1:].reshape(-1),
                                         reduction="sum").double()
                count += len(group) * length
                i += len(group)
        model.train(was_training)
        return float(total / count), count


# --- measuring ---------------------------------------------------------------------------------

def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def percentiles(values: list[float]) -> dict:
    import numpy as np

    if not values:
        return {"p20": None, "p50": None, "p80": None, "mean": None, "n": 0}
    a = np.asarray(values, dtype=float)
    return {"p20": float(np.percentile(a, 20)), "p50": float(np.percentile(a, 50)),
            "p80": float(np.percentile(a, 80)), "mean": float(a.mean()), "n": len(values)}


def memory_by_kind(trainer: Trainer) -> dict:
    """Bytes of parameters, gradients (one per trainable parameter), optimizer state and buffers,
    measured on the tensors themselves."""
    model = trainer.model
    params = sum(tensor_bytes(p) for p in model.parameters())
    # a gradient has its parameter's shape (and, sharded, its shard: the bytes on this rank)
    grads = sum(tensor_bytes(p) for p in trainer.trainable)
    buffers = sum(tensor_bytes(b) for b in model.buffers())
    from fasttrain.lab.distributed import local_optimizer

    return {"parameters": params, "gradients": grads,
            "optimizer_state": optimizer_state_bytes(local_optimizer(trainer.optimizer)), "buffers": buffers}


def _oom_types():
    import torch

    return (torch.cuda.OutOfMemoryError,) if hasattr(torch.cuda, "OutOfMemoryError") else ()


def find_batch_size(start: int, fits) -> int:
    """The largest batch <= ``start`` for which ``fits(batch)`` holds: halve until one fits, then
    bisect between it and the smallest batch known not to fit. 0 when not even 1 fits."""
    hi_fail = None
    b = start
    while b >= 1 and not fits(b):
        hi_fail, b = b, b // 2
    if b < 1:
        return 0
    lo = b
    if hi_fail is None:
        return lo
    while hi_fail - lo > 1:
        mid = (lo + hi_fail) // 2
        if fits(mid):
            lo = mid
        else:
            hi_fail = mid
    return lo


def _free(device) -> None:
    gc.collect()
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _steps_fit(cfg: LabConfig, corpus, device, batch: int) -> bool:
    try:
        trainer = Trainer(cfg, corpus, device, batch=batch)
        for x, y in trainer.batches(2):
            trainer.step(x, y)
        _sync(device)
        return True
    except _oom_types():
        return False


def probe_batch(cfg: LabConfig, corpus, device, batch: int) -> bool:
    """Does training at micro-batch ``batch`` fit? (a fresh model, two steps so that the optimizer
    state exists). Out-of-memory is caught in a frame that is gone, with its tensors, before the
    cache is emptied."""
    fits = _steps_fit(cfg, corpus, device, batch)
    _free(device)
    return fits


def _gpu_name(device) -> str:
    import torch

    if device.type != "cuda":
        return "cpu"
    props = torch.cuda.get_device_properties(device)
    return f"{props.name} ({props.total_memory / 2**30:.0f} GiB)"


# --- the run -------------------------------------------------------------------------------------

def run(cfg: LabConfig, *, log=None, progress=None, corpus=None, parallel=None) -> dict:
    """Train ``cfg`` and return the run record (see the module docstring).

    ``log(str)``: progress lines; ``progress(step, total)``: called after each step.
    ``parallel`` (:class:`~fasttrain.lab.distributed.ParallelConfig`): the strategy when this
    process is one of several started by torchrun; every rank returns the same record."""
    import torch

    from fasttrain.environment import environment
    from fasttrain.lab import distributed as D
    from fasttrain.lab.data import load_corpus

    validate(cfg)
    log = log or (lambda s: None)
    wall0 = time.perf_counter()
    parallel = D.validate_parallel(parallel or D.ParallelConfig())
    D.check_config(cfg, parallel)
    world = D.init_world(parallel, cfg.device)
    try:
        device = torch.device(world.device) if world.distributed else resolve_device(cfg)
        cfg = D.resolve_batch(cfg, parallel, world.dp)
        D.check_model_fits(cfg, world.world_size, world.strategy)
        with D.collective_errors(world):
            return _run_on(cfg, device, log, progress, corpus, wall0, environment, world)
    finally:
        D.shutdown(world)


def _run_on(cfg, device, log, progress, corpus, wall0, environment, world) -> dict:
    import torch

    from fasttrain.lab.data import load_corpus

    if cfg.use_liger_kernel and device.type != "cuda":
        raise FasttrainError("--use-liger-kernel needs a CUDA GPU (liger-kernel's kernels are Triton); drop it on the CPU")
    if cfg.use_liger_kernel:
        try:
            import liger_kernel  # noqa: F401
        except ImportError as exc:
            raise _missing("liger-kernel (--use-liger-kernel)", exc) from None
    if cfg.lora_r:
        try:
            import peft  # noqa: F401
        except ImportError as exc:
            raise _missing("peft (LoRA)", exc) from None
    if cfg.save or cfg.init_from:                   # fail before training, not after it
        try:
            import safetensors.torch  # noqa: F401
        except ImportError as exc:
            raise _missing("safetensors (--save, --init-from)", exc) from None
    corpus = corpus or load_corpus(cfg.data_dir)
    if cfg.init_from:
        meta = read_checkpoint(cfg.init_from)
        from fasttrain.lab.model import GPTConfig

        cfg = config_from_model(cfg, GPTConfig.from_dict(meta["model"]))
        from fasttrain.lab.distributed import check_model_fits

        check_model_fits(cfg, world.world_size, world.strategy)
    with tf32_matmuls(cfg.tf32):
        return _run(cfg, corpus, device, log, progress, wall0, environment, world)


@contextmanager
def tf32_matmuls(enabled: bool):
    """fp32 matmuls (and cuDNN convolutions) on TF32 tensor cores inside, restored on exit."""
    import torch

    matmul_precision = torch.get_float32_matmul_precision()
    cudnn_tf32 = torch.backends.cudnn.allow_tf32
    torch.set_float32_matmul_precision("high" if enabled else "highest")
    torch.backends.cudnn.allow_tf32 = enabled
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(matmul_precision)
        torch.backends.cudnn.allow_tf32 = cudnn_tf32


def eval_settings(cfg: LabConfig, batch: int, device) -> dict:
    """What an evaluation's numbers depend on, stored with a checkpoint so that ``lab eval``
    forms the same sums in the same order and dtype: the validation batch (windows per forward),
    the token budget, autocast, TF32 and the device it ran on."""
    return {"eval_batch_size": cfg.eval_batch_size or batch, "eval_tokens": cfg.eval_tokens, "bf16": cfg.bf16,
            "fp16": cfg.fp16, "tf32": cfg.tf32, "device_type": device.type, "device": _gpu_name(device),
            "attn_implementation": cfg.attn_implementation}


def _run(cfg, corpus, device, log, progress, wall0, environment, world) -> dict:
    from fasttrain.lab import distributed as D

    import torch

    cuda = device.type == "cuda"
    batch = cfg.per_device_train_batch_size
    auto = None
    if cfg.auto_find_batch_size and not cuda:
        auto = {"requested": batch, "found": batch, "search_ms": 0.0,
                "note": "no GPU: nothing runs out of memory, the batch is kept"}
        log(f"auto-find-batch-size: no GPU, keeping {batch}")
    if cfg.auto_find_batch_size and cuda:
        t0 = time.perf_counter()
        found = find_batch_size(batch, lambda b: probe_batch(cfg, corpus, device, b))
        if found == 0:
            raise FasttrainError(f"not even a batch of 1 fits on {_gpu_name(device)}; try --gradient-checkpointing "
                                 f"full, --bf16 or a smaller model")
        auto = {"requested": batch, "found": found, "search_ms": 1e3 * (time.perf_counter() - t0)}
        log(f"auto-find-batch-size: {found} (from {batch})")
        batch = found
    if cuda:
        _free(device)
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    trainer = Trainer(cfg, corpus, device, batch=batch, world=world)
    _sync(device)
    setup_ms = 1e3 * (time.perf_counter() - t0)

    record_eval = []
    loss_curve = []
    warmup_ms, step_ms = [], []
    train_peak = reserved_peak = 0
    eval_ms_total = 0.0
    # tokens per optimizer step over all data-parallel ranks (one process: dp = 1)
    tokens_per_step = batch * cfg.gradient_accumulation_steps * cfg.context * world.dp

    def do_eval(step):
        nonlocal train_peak, reserved_peak, eval_ms_total
        if cuda:
            _sync(device)
            train_peak = max(train_peak, torch.cuda.max_memory_allocated(device))
            reserved_peak = max(reserved_peak, torch.cuda.max_memory_reserved(device))
        t = time.perf_counter()
        val, n = trainer.evaluate()
        _sync(device)
        ms = 1e3 * (time.perf_counter() - t)
        eval_ms_total += ms
        record_eval.append({"step": step, "val_loss": val, "tokens": n, "ms": ms})
        log(f"step {step:>6}  val loss {val:.4f}  ({n} tokens, {ms:.0f} ms)")
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)

    try:
        batches = trainer.batches(cfg.max_steps)
        for i in range(cfg.max_steps):
            _sync(device)
            t = time.perf_counter()
            x, y = next(batches)        # loading is inside the timed step: preload vs DataLoader is measured
            loss = trainer.step(x, y)
            _sync(device)
            ms = 1e3 * (time.perf_counter() - t)
            (warmup_ms if i < cfg.timing_warmup_steps else step_ms).append(ms)
            step = i + 1
            if step % cfg.log_interval == 0 or step == cfg.max_steps:
                value = D.all_mean(loss.item(), world)      # the global batch's loss
                if not math.isfinite(value):
                    raise FasttrainError(f"the loss became {value} at step {step}; lower --learning-rate"
                                         + (" or use --bf16 instead of --fp16" if cfg.fp16 else ""))
                loss_curve.append({"step": step, "loss": value, "lr": lr_at(cfg, i), "ms": ms})
            if step == 1:
                mem_kinds = memory_by_kind(trainer)    # optimizer state exists after the first step
            if cfg.eval_interval and step % cfg.eval_interval == 0 and step != cfg.max_steps:
                do_eval(step)
            if progress:
                progress(step, cfg.max_steps)
    except _oom_types():
        oom = True                  # handled below, once the exception (and its frames' tensors) is gone
    else:
        oom = False
    if oom:
        del trainer
        x = y = loss = None
        _free(device)
        if world.distributed:
            raise FasttrainError(f"rank {world.rank}: a per-device batch of {batch} does not fit on "
                                 f"{_gpu_name(device)} under --strategy {world.strategy}; lower "
                                 f"--per-device-train-batch-size (find the largest on one GPU with "
                                 f"--auto-find-batch-size)") from None
        largest = find_batch_size(max(1, batch // 2), lambda b: probe_batch(cfg, corpus, device, b))
        hint = (f"the largest that fits is {largest} (found by trying): use --per-device-train-batch-size {largest} "
                f"or --auto-find-batch-size") if largest else "not even 1 fits: try --gradient-checkpointing full or --bf16"
        raise FasttrainError(f"a per-device batch of {batch} does not fit on {_gpu_name(device)}; {hint}")
    do_eval(cfg.max_steps)
    peak = train_peak if cuda else None
    kinds = dict(mem_kinds)
    record_memory = {
        "peak_allocated_bytes": peak, "peak_reserved_bytes": reserved_peak if cuda else None,
        "by_kind": kinds,
        "method": "parameters, gradients (trainable params), optimizer state and buffers: bytes of the tensors "
                  "themselves; activations = peak allocated minus those four (includes the step's temporaries "
                  "and cuBLAS workspaces); peaks over training steps only (validation excluded)",
    }
    if cuda:
        kinds["activations"] = peak - sum(kinds.values())
    estimate = _estimate(cfg, corpus.vocab_size, batch, peak,
                         parallel=D.estimator_parallelism(world, cfg.bf16) if world.distributed else None)

    model = trainer.model
    if cfg.save:
        if cfg.lora_r:
            merge_lora(model)
        extra = {"val_loss": record_eval[-1]["val_loss"], "val_tokens": record_eval[-1]["tokens"],
                 "eval_batch_size": cfg.eval_batch_size or batch, "step": cfg.max_steps,
                 "eval": eval_settings(cfg, batch, device)}
        if world.distributed:
            # the whole model gathered on every rank (FSDP's shards), written by rank 0 alone
            state = D.full_state_dict(trainer.train_model, world)
            if world.is_main:
                from fasttrain.lab.model import build

                whole = build(trainer.model_config, "cpu", seed=cfg.seed)
                whole.load_state_dict(state)
                save_checkpoint(whole, cfg.save, chars=corpus.chars, lab=cfg.to_dict(), extra=extra)
            D.barrier(world)
        else:
            save_checkpoint(model, cfg.save, chars=corpus.chars, lab=cfg.to_dict(), extra=extra)
    # parameters of the whole model (a sharded DTensor counts its global shape)
    total_params = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in trainer.trainable)
    steps = percentiles(step_ms)
    distributed = None
    tokens_per_s = tokens_per_step / (steps["mean"] / 1e3) if steps["mean"] else None
    if world.distributed:
        ranks = D.gather({"rank": world.rank, "device": _gpu_name(device), "peak_allocated_bytes": peak,
                          "peak_reserved_bytes": reserved_peak if cuda else None, "by_kind": kinds,
                          "step_ms": steps}, world)
        # the world moves at the pace of its slowest rank
        slowest = max((r["step_ms"]["mean"] or 0.0) for r in ranks)
        tokens_per_s = tokens_per_step / (slowest / 1e3) if slowest else None
        distributed = {**world.describe(), "global_batch_size": batch * cfg.gradient_accumulation_steps * world.dp,
                       "per_rank": ranks,
                       "max_peak_allocated_bytes": max((r["peak_allocated_bytes"] or 0) for r in ranks) or None,
                       "tokens_per_s_world": tokens_per_s,
                       "multicast_off": {k: os.environ.get(k) for k in D.MULTICAST_OFF}}
    notes = []
    if cfg.gradient_checkpointing == "selective" and cfg.attn_implementation == "sdpa":
        notes.append("selective checkpointing recomputes the eager attention core; with sdpa (which keeps no "
                     "s^2 scores) it changes nothing")
    if cfg.use_liger_kernel:
        notes.append("liger: RMSNorm or LayerNorm, RoPE (llama), SwiGLU (llama) and the fused linear cross-entropy")
    record = {
        "kind": "lab-run",
        "schema": 1,
        "config": cfg.to_dict(),
        "model": trainer.model_config.to_dict(),
        "environment": environment(),
        "device": _gpu_name(device),
        "precision": cfg.precision,
        "batch": {"per_device_train_batch_size": batch, "gradient_accumulation_steps": cfg.gradient_accumulation_steps,
                  "tokens_per_step": tokens_per_step, "auto_find_batch_size": auto},
        "params": {"total": total_params, "trainable": trainable},
        "setup_ms": setup_ms,
        "warmup_ms": warmup_ms,
        "step_ms": steps,
        "tokens_per_s": tokens_per_s,
        "train_ms": sum(warmup_ms) + sum(step_ms),
        "eval_ms": eval_ms_total,
        "wall_ms": 1e3 * (time.perf_counter() - wall0),
        "memory": record_memory,
        "estimate": estimate,
        "loss_curve": loss_curve,
        "eval": record_eval,
        "final": {"train_loss": loss_curve[-1]["loss"] if loss_curve else None,
                  "val_loss": record_eval[-1]["val_loss"], "val_tokens": record_eval[-1]["tokens"]},
        "notes": notes,
        "timing": "each step (its batch's loading included): device synchronized before and after "
                  "(perf_counter); the first "
                  f"{cfg.timing_warmup_steps} steps (compilation, warm-up) reported apart in warmup_ms; "
                  "validation timed apart (eval_ms)",
    }
    if cfg.save:
        record["saved"] = str(cfg.save)
    if distributed:
        record["distributed"] = distributed
    del trainer, model
    _free(device)
    return record


def _estimate(cfg: LabConfig, vocab: int, batch: int, measured, parallel: dict | None = None) -> dict:
    """The estimator's per-GPU prediction; ``parallel``: the strategy's Setup fields (dp, zero, tp...)."""
    from fasttrain.memory import estimate

    setup = lab_setup(cfg, vocab, batch)
    if parallel:
        setup = setup.with_(**{**parallel, "grad_buffers": setup.grad_buffers or parallel.get("grad_buffers", False)})
    try:
        est = estimate(setup, "precise")
    except FasttrainError as exc:
        return {"precise_bytes": None, "error": str(exc)}
    out = {"precise_bytes": est.total, "peak_at": est.extra.get("peak_moment"), "setup": setup.to_dict(),
           "notes": estimate_notes(cfg)}
    if measured:
        out["error_pct"] = 100.0 * (est.total - measured) / measured
    return out


def evaluate_checkpoint(path, data_dir=None, *, eval_tokens: int | None = None, device: str = "auto",
                        batch: int | None = None, bf16: bool | None = None, tf32: bool | None = None,
                        corpus=None) -> dict:
    """The validation loss of a checkpoint written with ``--save``, from it alone.

    Every setting left ``None`` comes from the checkpoint's record of its own evaluation
    (:func:`eval_settings`): the validation batch, the token budget (default the whole split),
    autocast and TF32. With those the same sums are formed in the same order and dtype, so on the
    same kind of device the recorded loss comes back exactly."""
    from fasttrain.lab.data import load_corpus

    meta = read_checkpoint(path)
    recorded = meta.get("eval") or {}
    batch = batch or recorded.get("eval_batch_size") or meta.get("eval_batch_size") or 64
    eval_tokens = eval_tokens if eval_tokens is not None else recorded.get("eval_tokens")
    bf16 = recorded.get("bf16", False) if bf16 is None else bf16
    fp16 = recorded.get("fp16", False) and not bf16
    tf32 = recorded.get("tf32", False) if tf32 is None else tf32
    corpus = corpus or load_corpus(data_dir)
    model = meta["model"]
    cfg = LabConfig(name="eval", device=device, bf16=bf16, fp16=fp16, tf32=tf32, init_from=str(path),
                    eval_tokens=eval_tokens, eval_batch_size=batch, per_device_train_batch_size=batch, max_steps=1,
                    prompt_tuning_tokens=model.get("prompt_tokens", 0), attn_implementation=model["attention"],
                    dropout=0.0)
    from fasttrain.lab.model import GPTConfig

    cfg = validate(config_from_model(cfg, GPTConfig.from_dict(model)))
    dev = resolve_device(cfg)
    with tf32_matmuls(tf32):
        trainer = Trainer(cfg, corpus, dev)
        if cfg.prompt_tuning_tokens:
            load_weights(trainer.model, path)           # the trained prompt, not a fresh one
        t = time.perf_counter()
        loss, n = trainer.evaluate()
        _sync(dev)
        ms = 1e3 * (time.perf_counter() - t)
    return {"checkpoint": str(path), "val_loss": loss, "tokens": n, "ms": ms,
            "recorded_val_loss": meta.get("val_loss"), "device": _gpu_name(dev),
            "recorded_device": recorded.get("device"),
            "settings": {"eval_batch_size": batch, "eval_tokens": eval_tokens, "bf16": bf16, "fp16": fp16,
                         "tf32": tf32}}


def write_record(record: dict, path) -> Path:
    """JSON written to a temporary file beside ``path`` and renamed into place."""
    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=final.name + ".", suffix=".tmp", dir=final.parent)
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(record, fh, indent=1, default=str)
        os.replace(tmp, final)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return final


# --- the timing pitfall ------------------------------------------------------------------------

def timing_pitfall(cfg: LabConfig, *, repeats: int = 5, warmup: int = 3, corpus=None) -> dict:
    """One training step timed two ways, ``repeats`` times each after ``warmup`` steps:
    ``perf_counter`` around the step alone (measures how long the CPU took to *enqueue* the GPU's
    work: kernels launch asynchronously) and with ``torch.cuda.synchronize()`` before and after
    (measures the work). On the CPU both are the same: it computes synchronously."""
    from fasttrain.lab.data import load_corpus

    validate(cfg)
    device = resolve_device(cfg)
    corpus = corpus or load_corpus(cfg.data_dir)
    trainer = Trainer(cfg, corpus, device)
    batches = trainer.batches(warmup + 2 * repeats)
    for _ in range(warmup):
        trainer.step(*next(batches))
    _sync(device)
    unsynced, synced = [], []
    for _ in range(repeats):
        x, y = next(batches)
        t = time.perf_counter()
        trainer.step(x, y)                       # no synchronization: the clock stops at the launch
        unsynced.append(1e3 * (time.perf_counter() - t))
        _sync(device)                            # (let the queued work finish before the next case)
        x, y = next(batches)
        _sync(device)
        t = time.perf_counter()
        trainer.step(x, y)
        _sync(device)
        synced.append(1e3 * (time.perf_counter() - t))
    return {"device": _gpu_name(device), "config": cfg.name, "repeats": repeats,
            "without_sync_ms": percentiles(unsynced), "with_sync_ms": percentiles(synced),
            "without_sync_all_ms": unsynced, "with_sync_all_ms": synced}
