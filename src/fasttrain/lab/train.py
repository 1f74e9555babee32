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

import math
import os
import time
from contextlib import nullcontext
from dataclasses import replace

from fasttrain.errors import FasttrainError
from fasttrain.timing import summarize
from fasttrain.lab.adapters import apply_lora, freeze_for_prompt_tuning, merge_lora
from fasttrain.lab.batchsize import find_batch_size, probe_batch
from fasttrain.lab.checkpoint import eval_settings, load_weights, read_checkpoint, save_checkpoint
from fasttrain.lab.config import LabConfig, missing_extra, validate
from fasttrain.lab.measure import free_memory, gpu_name, held_before, memory_by_kind, oom_types, sync, tf32_matmuls
from fasttrain.lab.optim import build_optimizer, lr_at


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


# --- the step ------------------------------------------------------------------------------------

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

    def __init__(self, cfg: LabConfig, corpus, device, *, batch: int | None = None, wrap=None, world=None, log=None):
        import torch

        from fasttrain.lab import distributed as D
        from fasttrain.lab.model import GPTConfig, build

        self.world = world = world or D.World()
        self.cfg, self.device, self.corpus = cfg, device, corpus
        self.batch = batch or cfg.per_device_train_batch_size
        self.checkpoint_meta = None
        self.lab_model = None
        if cfg.model != "gpt":
            from fasttrain.lab import hf

            # a transformers model: its own attention, checkpointing, liger patches and peft
            # adapters are applied as it is built; it is called as the lab's GPT is
            self.lab_model = hf.build_hf_model(cfg.model, cfg, corpus.vocab_size, device, log=log)
            self.model_config = None
            model = hf.calling_convention(self.lab_model)
        elif cfg.init_from:
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
        if self.lab_model is None:
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
        if self.lab_model is not None:
            raise FasttrainError("Trainer.reset restarts the lab's GPT only; build a new Trainer for --model hf:...")
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
        if cfg.model != "gpt":
            from fasttrain.lab.hf import check_hf_parallel

            check_hf_parallel(world.strategy)
        else:
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
            raise missing_extra("liger-kernel (--use-liger-kernel)", exc) from None
    if cfg.lora_r:
        try:
            import peft  # noqa: F401
        except ImportError as exc:
            raise missing_extra("peft (LoRA)", exc) from None
    if cfg.save or cfg.init_from:                   # fail before training, not after it
        try:
            import safetensors.torch  # noqa: F401
        except ImportError as exc:
            raise missing_extra("safetensors (--save, --init-from)", exc) from None
    corpus = corpus or load_corpus(cfg.data_dir)
    if cfg.init_from:
        meta = read_checkpoint(cfg.init_from)
        from fasttrain.lab.model import GPTConfig

        cfg = config_from_model(cfg, GPTConfig.from_dict(meta["model"]))
        from fasttrain.lab.distributed import check_model_fits

        check_model_fits(cfg, world.world_size, world.strategy)
    with tf32_matmuls(cfg.tf32):
        return _run(cfg, corpus, device, log, progress, wall0, environment, world)


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
            raise FasttrainError(f"not even a batch of 1 fits on {gpu_name(device)}; try --gradient-checkpointing "
                                 f"full, --bf16 or a smaller model")
        auto = {"requested": batch, "found": found, "search_ms": 1e3 * (time.perf_counter() - t0)}
        log(f"auto-find-batch-size: {found} (from {batch})")
        batch = found
    held = 0
    if cuda:
        free_memory(device)
        held = held_before(device)
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    trainer = Trainer(cfg, corpus, device, batch=batch, world=world, log=log)
    sync(device)
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
            sync(device)
            train_peak = max(train_peak, torch.cuda.max_memory_allocated(device) - held)
            reserved_peak = max(reserved_peak, torch.cuda.max_memory_reserved(device))
        t = time.perf_counter()
        val, n = trainer.evaluate()
        sync(device)
        ms = 1e3 * (time.perf_counter() - t)
        eval_ms_total += ms
        record_eval.append({"step": step, "val_loss": val, "tokens": n, "ms": ms})
        log(f"step {step:>6}  val loss {val:.4f}  ({n} tokens, {ms:.0f} ms)")
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)

    try:
        batches = trainer.batches(cfg.max_steps)
        for i in range(cfg.max_steps):
            sync(device)
            t = time.perf_counter()
            x, y = next(batches)        # loading is inside the timed step: preload vs DataLoader is measured
            loss = trainer.step(x, y)
            sync(device)
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
    except oom_types():
        oom = True                  # handled below, once the exception (and its frames' tensors) is gone
    else:
        oom = False
    if oom:
        del trainer
        x = y = loss = None
        free_memory(device)
        if world.distributed:
            raise FasttrainError(f"rank {world.rank}: a per-device batch of {batch} does not fit on "
                                 f"{gpu_name(device)} under --strategy {world.strategy}; lower "
                                 f"--per-device-train-batch-size (find the largest on one GPU with "
                                 f"--auto-find-batch-size)") from None
        largest = find_batch_size(max(1, batch // 2), lambda b: probe_batch(cfg, corpus, device, b))
        hint = (f"the largest that fits is {largest} (found by trying): use --per-device-train-batch-size {largest} "
                f"or --auto-find-batch-size") if largest else "not even 1 fits: try --gradient-checkpointing full or --bf16"
        raise FasttrainError(f"a per-device batch of {batch} does not fit on {gpu_name(device)}; {hint}")
    do_eval(cfg.max_steps)
    peak = train_peak if cuda else None
    kinds = dict(mem_kinds)
    record_memory = {
        "peak_allocated_bytes": peak, "peak_reserved_bytes": reserved_peak if cuda else None,
        "held_before_bytes": held if cuda else None,
        "by_kind": kinds,
        "method": "parameters, gradients (trainable params), optimizer state and buffers: bytes of the tensors "
                  "themselves; activations = peak allocated minus those four (includes the step's temporaries "
                  "and cuBLAS workspaces); peaks over training steps only (validation excluded), less what the process held "
                  "before the run (held_before_bytes)",
    }
    if cuda:
        kinds["activations"] = peak - sum(kinds.values())
    if trainer.lab_model is None:
        estimate = _estimate(cfg, corpus.vocab_size, batch, peak,
                             parallel=D.estimator_parallelism(world, cfg.bf16) if world.distributed else None)
    else:
        estimate = _estimate_hf(trainer.lab_model, cfg, batch, peak)

    model = trainer.model
    if cfg.save and trainer.lab_model is not None:
        from fasttrain.lab.hf import save_hf

        extra = {"val_loss": record_eval[-1]["val_loss"], "val_tokens": record_eval[-1]["tokens"],
                 "eval_batch_size": cfg.eval_batch_size or batch, "step": cfg.max_steps,
                 "eval": eval_settings(cfg, batch, device), "chars": corpus.chars}
        if world.distributed:
            state = D.full_state_dict(trainer.train_model, world)
            if world.is_main:
                model.load_state_dict(state)
                save_hf(model.inner, cfg.save, lab=cfg.to_dict(), extra=extra)
            D.barrier(world)
        else:
            save_hf(model.inner, cfg.save, lab=cfg.to_dict(), extra=extra)
    elif cfg.save:
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
    steps = summarize(step_ms)
    distributed = None
    tokens_per_s = tokens_per_step / (steps["mean"] / 1e3) if steps["mean"] else None
    if world.distributed:
        ranks = D.gather({"rank": world.rank, "device": gpu_name(device), "peak_allocated_bytes": peak,
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
    if trainer.lab_model is not None:
        notes.append(f"{trainer.lab_model.name}: the model's shape, dropout and vocabulary come from its config.json; "
                     f"--style, --layers, --heads, --width, --ffn, --dropout and --bias do not apply")
    if cfg.use_liger_kernel and trainer.lab_model is not None:
        notes.append(f"liger: liger-kernel's patches for {trainer.lab_model.family} (its norms, RoPE, MLP and the "
                     f"fused linear cross-entropy)")
    elif cfg.use_liger_kernel:
        notes.append("liger: RMSNorm or LayerNorm, RoPE (llama), SwiGLU (llama) and the fused linear cross-entropy")
    record = {
        "kind": "lab-run",
        "schema": 1,
        "config": cfg.to_dict(),
        "model": trainer.model_config.to_dict() if trainer.lab_model is None else
                 {"source": trainer.lab_model.name, "family": trainer.lab_model.family, **trainer.lab_model.config},
        "environment": environment(),
        "device": gpu_name(device),
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
    free_memory(device)
    return record


def _estimate_hf(lab_model, cfg: LabConfig, batch: int, measured) -> dict:
    """The estimator's prediction for a HF model, through its ``memory_setup`` hook (None: no mapping yet)."""
    if lab_model.memory_setup is None:
        return {"precise_bytes": None, "error": f"no memory estimate for {lab_model.family} models yet"}
    from fasttrain.memory import estimate

    try:
        setup = lab_model.memory_setup(cfg, batch)
        est = estimate(setup, "precise")
    except FasttrainError as exc:
        return {"precise_bytes": None, "error": str(exc)}
    out = {"precise_bytes": est.total, "peak_at": est.extra.get("peak_moment"), "setup": setup.to_dict(),
           "notes": estimate_notes(cfg)}
    if measured:
        out["error_pct"] = 100.0 * (est.total - measured) / measured
    return out


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
