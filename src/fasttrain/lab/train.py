"""A lab run: ``run(cfg)`` trains the model ``cfg`` names (or a given one) through the one trainer
(:mod:`fasttrain.lab.trainer`) and returns its run record:

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
  every ``eval_interval`` steps and after the last;
- what reruns it (:mod:`fasttrain.lab.record`): the command line, the libraries' versions, the
  model's source and configuration, the corpus' SHA-256.

This module orchestrates (checks, the world of processes, the batch search, out-of-memory, saving,
the record); the loop itself is :meth:`fasttrain.lab.trainer.Trainer.train`.
"""

from __future__ import annotations

import contextlib
import os
import time

from fasttrain.errors import FasttrainError
from fasttrain.timing import summarize
from fasttrain.lab.adapters import merge_lora
from fasttrain.lab.batchsize import auto_find, largest_fitting
from fasttrain.lab.build import config_from_model, make_trainer, model_config, resolve_device
from fasttrain.lab.checkpoint import eval_settings, read_checkpoint, save_checkpoint
from fasttrain.lab.config import HF_PREFIX, LabConfig, is_hf, missing_extra
from fasttrain.lab.estimate import SETUP_OPTIM, estimate_notes, lab_setup
from fasttrain.lab.measure import free_memory, gpu_name, held_before, oom_types, release_run_state, sync, tf32_matmuls
from fasttrain.lab.trainer import Metrics, Trainer, accumulate_gradients, autocast_for

__all__ = ["run", "execute", "lab_setup", "estimate_notes", "model_config", "config_from_model", "resolve_device",
           "Trainer", "accumulate_gradients", "autocast_for", "SETUP_OPTIM"]


# --- the run -------------------------------------------------------------------------------------

def run(cfg: LabConfig, *, log=None, progress=None, corpus=None, parallel=None, model=None, fit_context: bool = False,
        sources: dict | None = None, announce=None, record_path=None) -> dict:
    """Train ``cfg`` and return the run record (see the module docstring).

    ``log(str)``: progress lines; ``progress(step, total)``: called after each step.
    ``parallel`` (:class:`~fasttrain.lab.parallel.distributed.ParallelConfig`): the strategy when this
    process is one of several started by torchrun; every rank returns the same record.
    ``model``: a built :class:`~fasttrain.lab.models.LabModel` to train instead of the one ``cfg`` names.
    ``fit_context``: the context is the model's own, lowered to what the corpus allows.
    ``sources``: where each setting came from (:class:`fasttrain.lab.settings.Resolved`), kept in the record.
    ``announce(cfg)``: called once every check has passed and the model is built, before the first step.
    ``record_path``: the run record's file (``--out``): rewritten at each ``--save-steps`` checkpoint, the
    loggers' files beside it (:mod:`fasttrain.lab.loggers`); the caller writes the final record."""
    record, _ = execute(cfg, log=log, progress=progress, corpus=corpus, parallel=parallel, model=model,
                        fit_context=fit_context, sources=sources, announce=announce, record_path=record_path)
    return record


def execute(cfg: LabConfig, *, log=None, progress=None, corpus=None, parallel=None, model=None,
            keep_model: bool = False, fit_context: bool = False, sources: dict | None = None, announce=None,
            record_path=None):
    """:func:`run`, returning ``(record, trained module or None)``: the module when ``keep_model``."""
    from fasttrain.lab.preflight import check_run, hold_outputs

    # validate, output paths, the device: before any work. The output folders are held for the whole
    # run (a second run on them is refused) and checked again once held (a run that just finished
    # may have written them); under torchrun rank 0 holds them for all
    held = hold_outputs(cfg) if int(os.environ.get("RANK", "0")) == 0 else contextlib.nullcontext()
    with held:
        check_run(cfg)
        return _execute(cfg, log=log, progress=progress, corpus=corpus, parallel=parallel, model=model,
                        keep_model=keep_model, fit_context=fit_context, sources=sources, announce=announce,
                        record_path=record_path)


def _execute(cfg, *, log, progress, corpus, parallel, model, keep_model, fit_context, sources, announce, record_path):
    import torch

    from fasttrain.lab.parallel import distributed as D

    log = log or (lambda s: None)
    wall0 = time.perf_counter()
    parallel = D.validate_parallel(parallel or D.ParallelConfig())
    D.check_config(cfg, parallel)
    world = D.init_world(parallel, cfg.device)
    try:
        device = torch.device(world.device) if world.distributed else resolve_device(cfg)
        cfg = D.resolve_batch(cfg, parallel, world.dp)
        if model is None:
            D.check_model_fits(cfg, world.world_size, world.strategy, tp=world.tp)
        with D.collective_errors(world):
            record, trained = _run_on(cfg, device, world, log=log, progress=progress, corpus=corpus, wall0=wall0,
                                      model=model, keep_model=keep_model, fit_context=fit_context,
                                      announce=announce, record_path=record_path)
            if sources:
                record["config_sources"] = {k: v for k, v in sources.items() if k in record["config"]}
            return record, trained
    finally:
        release_run_state(cfg)
        D.shutdown(world)


def check_libraries(cfg: LabConfig, device, record_path=None) -> None:
    """Every optional library the run needs, before any work (a launcher on the CPU asks too, before torchrun starts
    the ranks that would each refuse alike)."""
    from fasttrain.lab.loggers import check_loggers
    from fasttrain.lab.parallelize import check_float8

    check_loggers(cfg, record_path)                 # --report-to's libraries and folder
    check_float8(cfg, device)
    if cfg.use_liger_kernel and device.type != "cuda":
        raise FasttrainError("--use-liger-kernel needs a CUDA GPU (liger-kernel's kernels are Triton); drop it on the CPU")
    needs = []
    if cfg.use_liger_kernel:
        needs.append(("liger_kernel", "liger-kernel (--use-liger-kernel)"))
    if cfg.lora_r:
        needs.append(("peft", "peft (LoRA)"))
    if cfg.save or cfg.init_from:                   # fail before training, not after it
        needs.append(("safetensors.torch", "safetensors (--save, --init-from)"))
    import importlib

    for module, what in needs:
        try:
            importlib.import_module(module.split(".")[0])      # (a package blocked in sys.modules fails here)
            importlib.import_module(module)
        except ImportError as exc:
            raise missing_extra(what, exc) from None


def _run_on(cfg, device, world, *, log, progress, corpus, wall0, model, keep_model, fit_context=False, announce=None,
            record_path=None):
    from fasttrain.lab.data import corpus_for

    check_libraries(cfg, device, record_path)
    if cfg.save_steps:
        from fasttrain.files import check_new_folder

        check_new_folder(cfg.output_dir, "--output-dir")        # before training, not at the first save
    if cfg.resume:
        from fasttrain.lab.resume import find_checkpoint

        find_checkpoint(cfg.resume)
    if corpus is None:
        # a Hugging Face model folder that ships a tokenizer: it is the default --tokenizer
        from fasttrain.lab.tokenizer import model_tokenizer

        spec = cfg.model[len(HF_PREFIX):] if is_hf(cfg.model) else None
        corpus = corpus_for(cfg, default_tokenizer=model_tokenizer(spec) if spec else None)
    if fit_context:
        from fasttrain.lab.defaults import fit_context as fit

        cfg = fit(cfg, len(corpus.train), log)
    checkpoint = None
    if cfg.init_from and model is None:
        from fasttrain.lab.parallel.distributed import check_model_fits
        from fasttrain.lab.model import GPTConfig

        checkpoint = read_checkpoint(cfg.init_from)        # read once: the shape here, the weights in the build
        if checkpoint.get("chars") not in (None, getattr(corpus, "chars", None)):
            raise FasttrainError(f"{cfg.init_from} was trained on another vocabulary")
        cfg = config_from_model(cfg, GPTConfig.from_dict(checkpoint["model"]))
        check_model_fits(cfg, world.world_size, world.strategy, tp=world.tp)
    if cfg.save and model is not None and model.name != "gpt" and model.save is None:
        raise FasttrainError(f"--save: {model.name} has no save hook; save record.model yourself "
                             f"(e.g. safetensors.torch.save_model)")
    if cfg.resume:
        from fasttrain.lab.resume import check_resume_data

        check_resume_data(cfg.resume, corpus, cfg.model)           # the data it was saved with, before the model is built
    from fasttrain.lab.preflight import check_ready

    check_ready(cfg, corpus, device, world.world_size)   # the vocabulary, the memory it will need
    if world.distributed and device.type == "cuda" and model is None:
        from fasttrain.lab.fit import check_fits_some_strategy
        from fasttrain.lab.preflight import device_memory

        free, _, _ = device_memory(device)
        check_fits_some_strategy(cfg, corpus.vocab_size, world, int(1.05 * free))   # 5%: the estimator's error
    with tf32_matmuls(cfg.tf32):
        return _train(cfg, corpus, device, world, log=log, progress=progress, wall0=wall0, model=model,
                      checkpoint=checkpoint, keep_model=keep_model, announce=announce, record_path=record_path)


def _copies_of(model, device):
    """``make() -> LabModel``: fresh copies of a given model's initial state (a batch-size probe must
    not train the run's own module)."""
    import copy
    import dataclasses

    initial = copy.deepcopy(model.module).to("cpu")
    return lambda: dataclasses.replace(model, module=copy.deepcopy(initial).to(device))


def _train(cfg, corpus, device, world, *, log, progress, wall0, model, checkpoint, keep_model, announce=None,
           record_path=None):
    """Build, train through the trainer's loop, save and record (one process's part of the run)."""
    import torch

    cuda = device.type == "cuda"
    # probes build the model cfg names afresh, or train copies of a given one
    make = _copies_of(model, device) if model is not None and cfg.auto_find_batch_size and cuda else None
    cfg, auto = auto_find(cfg, corpus, device, make, log)
    held = 0
    if cuda:
        free_memory(device)
        held = held_before(device)
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    if model is None:
        trainer = make_trainer(cfg, corpus, device, world=world, checkpoint=checkpoint, log=log)
    else:
        trainer = Trainer(cfg, model, corpus, device, world=world)
    sync(device)
    setup_ms = 1e3 * (time.perf_counter() - t0)
    from fasttrain.lab.loggers import open_loggers

    loggers = open_loggers(cfg, record_path, log=log) if world.is_main else None      # rank 0 writes
    metrics = Metrics(cfg, device, world, log=log, held=held, loggers=loggers)
    saver = None
    from fasttrain.lab import resume as R

    resumed = R.resume(trainer, metrics, cfg.resume, log=log) if cfg.resume else None
    if cfg.save_steps:
        saver = R.Saver(trainer, metrics, cfg, world, resumed=resumed)
        if record_path:
            saver = _record_at_checkpoints(saver, cfg, record_path, lambda: _record(
                cfg, trainer, metrics, corpus, device, world, auto=auto, setup_ms=setup_ms, wall0=wall0))
    if announce is not None:
        announce(cfg)
    try:
        trainer.train(metrics=metrics, progress=progress, on_step=saver)
    except oom_types():
        oom = True                  # handled below, once the exception (and its frames' tensors) is gone
    else:
        oom = False
    finally:
        if loggers is not None:
            loggers.close()
    if oom:
        del trainer
        free_memory(device)
        _out_of_memory(cfg, corpus, device, world, searchable=model is None)
    record = _record(cfg, trainer, metrics, corpus, device, world, auto=auto, setup_ms=setup_ms, wall0=wall0)
    if loggers is not None and loggers.paths:
        record["logs"] = loggers.paths          # --report-to's files and folders
    if cfg.save:
        _save(cfg, trainer, record, corpus, device, world)
        record["saved"] = str(cfg.save)
    trained = trainer.model if keep_model else None
    del trainer
    free_memory(device)
    return record, trained


def _record_at_checkpoints(saver, cfg, record_path, record):
    """``on_step``: the saver, then at each checkpoint the run record so far (``record()``) written
    atomically to ``record_path`` (a crash keeps the record of the last checkpoint)."""
    from fasttrain.lab.checkpoint import write_record

    def on_step(step: int) -> None:
        saver(step)
        if step % cfg.save_steps == 0 and step < cfg.max_steps:         # as the saver decides
            write_record({**record(), "partial": {"step": step, "of": cfg.max_steps}}, record_path)
    return on_step


def _out_of_memory(cfg, corpus, device, world, searchable: bool):
    batch = cfg.per_device_train_batch_size
    if world.distributed:
        raise FasttrainError(f"rank {world.rank}: a per-device batch of {batch} does not fit on "
                             f"{gpu_name(device)} under --strategy {world.strategy}; lower "
                             f"--per-device-train-batch-size (find the largest on one GPU with "
                             f"--auto-find-batch-size)") from None
    if not searchable:          # a given model has trained: no fresh copy of it is left to probe with
        raise FasttrainError(f"a per-device batch of {batch} does not fit on {gpu_name(device)}; lower "
                             f"--per-device-train-batch-size or use --auto-find-batch-size")
    largest = largest_fitting(cfg, corpus, device, max(1, batch // 2))
    hint = (f"the largest that fits is {largest} (found by trying): use --per-device-train-batch-size {largest} "
            f"or --auto-find-batch-size") if largest else "not even 1 fits: try --gradient-checkpointing full or --bf16"
    raise FasttrainError(f"a per-device batch of {batch} does not fit on {gpu_name(device)}; {hint}")


def _save(cfg, trainer, record, corpus, device, world) -> None:
    """The trained model into ``cfg.save``: the lab's GPT as a lab checkpoint (LoRA merged, FSDP's
    shards gathered and written by rank 0), any other model through its own ``save`` hook."""
    from fasttrain.lab.parallel import distributed as D

    model = trainer.model
    if cfg.lora_r:
        merge_lora(model)
    final = record["eval"][-1]
    batch = cfg.per_device_train_batch_size
    extra = {"val_loss": final["val_loss"], "val_tokens": final["tokens"], "eval_batch_size": cfg.eval_batch_size or batch,
             "step": trainer.step_index, "eval": eval_settings(cfg, batch, device)}
    if hasattr(corpus, "describe"):
        extra["data"] = corpus.describe()       # lab eval reads the same text, split and tokenizer again
    chars = getattr(corpus, "chars", None)
    from fasttrain.lab.hf import save_hf

    if trainer.lab_model.save is save_hf:
        # a model lab/hf.py built: a folder from_pretrained loads, with the lab's record of it
        # (fasttrain.json) and the corpus' tokenizer (or its characters), so that lab eval and
        # lab sample need nothing else
        if world.fsdp or world.tp > 1:
            # the whole model gathered from FSDP's shards (or tensor parallelism's slices) on every
            # rank, loaded into a fresh copy on the CPU by rank 0 (ddp and zero1 keep whole weights
            # on every rank)
            if world.strategy == "tp":         # (fsdp with --tp: full_state_dict refuses it)
                from fasttrain.lab.hf import gather_tp_state_dict

                state = gather_tp_state_dict(trainer.model, world.mesh)
            else:
                state = D.full_state_dict(trainer.train_model, world)
            if world.is_main:
                from fasttrain.lab.hf import fresh_copy

                model = fresh_copy(model)
                model.load_state_dict(state)
        if world.is_main:
            save_hf(model, cfg.save, tokenizer=getattr(corpus, "tokenizer", None), lab=cfg.to_dict(),
                    extra={**extra, "chars": chars})
        D.barrier(world)
        return
    if trainer.lab_model.name != "gpt":
        if world.is_main:
            trainer.lab_model.save(model, cfg.save)
        D.barrier(world)
        return
    if world.distributed:
        # the whole model gathered on every rank (FSDP's shards), written by rank 0 alone
        state = D.full_state_dict(trainer.train_model, world)
        if world.is_main:
            from fasttrain.lab.model import build

            whole = build(trainer.model_config, "cpu", seed=cfg.seed)
            whole.load_state_dict(state)
            save_checkpoint(whole, cfg.save, chars=chars, lab=cfg.to_dict(), extra=extra,
                            tokenizer=getattr(corpus, "tokenizer", None))
        D.barrier(world)
    else:
        save_checkpoint(model, cfg.save, chars=chars, lab=cfg.to_dict(), extra=extra,
                        tokenizer=getattr(corpus, "tokenizer", None))


MEMORY_METHOD = ("parameters, gradients (trainable params), optimizer state and buffers: bytes of the tensors "
                 "themselves; activations = peak allocated minus those four (includes the step's temporaries "
                 "and cuBLAS workspaces); peaks over training steps only (validation excluded), less what the "
                 "process held before the run (held_before_bytes)")


def _record(cfg, trainer, metrics, corpus, device, world, *, auto, setup_ms, wall0) -> dict:
    from fasttrain.environment import environment
    from fasttrain.lab.parallel import distributed as D
    from fasttrain.lab.record import provenance

    cuda = device.type == "cuda"
    peak = metrics.train_peak if cuda else None
    kinds = dict(metrics.by_kind or {})
    if cuda:
        kinds["activations"] = peak - sum(kinds.values())
    memory = {"peak_allocated_bytes": peak, "peak_reserved_bytes": metrics.reserved_peak if cuda else None,
              "held_before_bytes": metrics.held if cuda else None, "by_kind": kinds, "method": MEMORY_METHOD}
    batch = cfg.per_device_train_batch_size
    estimate = _estimate_for(cfg, trainer, corpus.vocab_size, peak, world)
    # tokens per optimizer step over all data-parallel ranks (one process: dp = 1)
    tokens_per_step = batch * cfg.gradient_accumulation_steps * cfg.context * world.dp
    steps = summarize(metrics.step_ms)
    tokens_per_s = tokens_per_step / (steps["mean"] / 1e3) if steps["mean"] else None
    distributed = None
    if world.distributed:
        ranks = D.gather({"rank": world.rank, "device": gpu_name(device), "peak_allocated_bytes": peak,
                          "peak_reserved_bytes": memory["peak_reserved_bytes"], "by_kind": kinds,
                          "step_ms": steps}, world)
        # the world moves at the pace of its slowest rank
        slowest = max((r["step_ms"]["mean"] or 0.0) for r in ranks)
        tokens_per_s = tokens_per_step / (slowest / 1e3) if slowest else None
        distributed = {**world.describe(), "global_batch_size": batch * cfg.gradient_accumulation_steps * world.dp,
                       "per_rank": ranks,
                       "max_peak_allocated_bytes": max((r["peak_allocated_bytes"] or 0) for r in ranks) or None,
                       "tokens_per_s_world": tokens_per_s,
                       "multicast_off": {k: os.environ.get(k) for k in D.MULTICAST_OFF}}
        plan = getattr(trainer.model, "_fasttrain_tp_plan", None)
        if plan:
            # a HF model split by its family's plan: the styles applied, layer numbers folded ("layers.*")
            import re

            distributed["tp_plan"] = {re.sub(r"\.\d+\.", ".*.", name): style for name, style in plan.items()}
    notes = []
    if cfg.gradient_checkpointing == "selective" and cfg.attn_implementation == "sdpa":
        notes.append("selective checkpointing recomputes the eager attention core; with sdpa (which keeps no "
                     "s^2 scores) it changes nothing")
    if cfg.use_liger_kernel:
        notes.append("liger: the fused linear cross-entropy alone" if cfg.liger_kernels != "all" else
                     "liger: RMSNorm or LayerNorm, RoPE (llama), SwiGLU (llama) and the fused linear cross-entropy")
    evals = [{k: e[k] for k in ("step", "val_loss", "tokens", "ms")} for e in metrics.evals]
    curve = metrics.loss_curve
    record = {
        "kind": "lab-run",
        "schema": 1,
        "config": cfg.to_dict(),
        "model": trainer.lab_model.config,
        "environment": environment(),
        "device": gpu_name(device),
        "precision": cfg.precision,
        "batch": {"per_device_train_batch_size": batch, "gradient_accumulation_steps": cfg.gradient_accumulation_steps,
                  "tokens_per_step": tokens_per_step, "auto_find_batch_size": auto},
        # parameters of the whole model (a sharded DTensor counts its global shape)
        "params": {"total": sum(p.numel() for p in trainer.model.parameters()),
                   "trainable": sum(p.numel() for p in trainer.trainable)},
        "setup_ms": setup_ms,
        "warmup_ms": metrics.warmup_ms,
        "step_ms": steps,
        "tokens_per_s": tokens_per_s,
        "train_ms": sum(metrics.warmup_ms) + sum(metrics.step_ms),
        "eval_ms": metrics.eval_ms,
        "wall_ms": 1e3 * (time.perf_counter() - wall0),
        "memory": memory,
        "estimate": estimate,
        "loss_curve": curve,
        "eval": evals,
        "final": {"train_loss": curve[-1]["loss"] if curve else None,
                  "val_loss": evals[-1]["val_loss"] if evals else None,
                  "val_tokens": evals[-1]["tokens"] if evals else None},
        "notes": notes,
        # the techniques lab/parallelize.py applied, in its order
        "applied": [[step, what] for step, what in getattr(trainer, "applied", [])],
        "timing": "each step (its batch's loading included): device synchronized before and after "
                  "(perf_counter); the first "
                  f"{cfg.timing_warmup_steps} steps (compilation, warm-up) reported apart in warmup_ms; "
                  "validation timed apart (eval_ms)",
        **provenance(cfg, trainer.lab_model, corpus),
    }
    if distributed:
        record["distributed"] = distributed
    return record


def _estimate_for(cfg, trainer, vocab, peak, world) -> dict:
    from fasttrain.lab.parallel import distributed as D

    lab_model = trainer.lab_model
    parallel = D.estimator_parallelism(world, cfg.bf16, cfg.reduce_dtype) if world.distributed else None
    if lab_model.name == "gpt":
        return _estimate(cfg, vocab, peak, parallel=parallel)
    if lab_model.memory_setup is None:
        return {"precise_bytes": None, "error": f"the estimator has no memory model of {lab_model.name}"}
    setup = lab_model.memory_setup(cfg, cfg.per_device_train_batch_size)
    if setup is None:
        return {"precise_bytes": None, "error": f"the estimator has no memory model of {lab_model.name}"}
    out = _estimate(cfg, vocab, peak, parallel=parallel, setup=setup)
    if world.strategy == "tp" and "notes" in out:
        # lab/hf.py splits by the family's plan, not Megatron's layout; the estimate follows it (Setup.vocab_split)
        out["notes"] = [*out["notes"], "tp of a HF model: lm_head's logits are gathered whole (B, T, V) on every "
                        "rank and a tied embedding stays whole; counted so (vocab_split, memory.precise D23)"]
    return out


def _estimate(cfg: LabConfig, vocab: int, measured, parallel: dict | None = None, setup=None) -> dict:
    """The estimator's per-GPU prediction; ``parallel``: the strategy's Setup fields (dp, zero, tp...);
    ``setup``: the model's own Setup (default: the lab's GPT of ``cfg``)."""
    from fasttrain.memory import estimate

    setup = setup if setup is not None else lab_setup(cfg, vocab)
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
