"""Prediction and probes through the lab's trainer: what the search is given on a real device."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Callable

from fasttrain.errors import FasttrainError
from fasttrain.lab.config import LabConfig, validate
from fasttrain.lab.tune.space import Probe, ScaleConfig


# --- the lab: prediction and probes through its trainer -------------------------------------------

def model_of(cfg: LabConfig) -> tuple[str, dict | None]:
    """(the model's name, its Hugging Face config as a dict or None for the lab's own GPT)."""
    from fasttrain.lab.hf.config import is_hf, source_of
    from fasttrain.memory.hf_config import read_config_json

    spec = cfg.model or "gpt"
    if not is_hf(spec):
        return "gpt", None
    path = Path(source_of(spec)).expanduser()
    config_file = path / "config.json" if path.is_dir() else path
    if not config_file.is_file():
        return spec, None          # a hub name: the lab resolves it; the estimator cannot read it here
    return spec, read_config_json(config_file, flag=f"--model {spec}")


def model_refusal(hf_config: dict | None, device) -> Callable[[LabConfig], str | None]:
    """``refuse(cfg)``: the one line with which the lab's check of a transformers model (run before any weights
    are built) refuses ``cfg`` on ``device`` -- liger's fused cross-entropy under a whole-model compile, say --
    or None where the model runs it. The lab's own GPT refuses nothing here (``validate`` judged it)."""
    if hf_config is None:
        return lambda cfg: None
    from fasttrain.lab import hf

    config = hf.config_from_dict(hf_config)

    def refuse(cfg: LabConfig) -> str | None:
        try:
            hf.check_hf_setup(cfg, config, None, device)
        except FasttrainError as exc:
            return str(exc)
        return None
    return refuse


def lab_predictor(vocab: int, hf_config: dict | None = None, cpu: bool = False) -> Callable:
    """``predict(cfg) -> bytes``: the memory estimator's ``precise`` peak of ``cfg`` -- the lab's GPT
    (:func:`~fasttrain.lab.estimate.lab_setup`) or a transformers model from its config (the lab's own mapping,
    ``fasttrain.lab.hf.memory_setup_for``: torch.compile, its CUDA graphs, liger-kernel, GPT-2's fused
    cross-entropy head, LoRA); None where the estimator cannot describe it (then nothing is pruned and the probe
    finds out). ``cpu``: no cuBLAS workspaces (the estimator's 65 MiB are a GPU's)."""
    from fasttrain.memory import estimate

    setup_of = None
    if hf_config is not None:
        from fasttrain.lab.hf import memory_setup_for

        setup_of = memory_setup_for(hf_config)

    def predict(cfg: LabConfig) -> int | None:
        if setup_of is not None:
            setup = setup_of(cfg, cfg.per_device_train_batch_size)
            if setup is None and cfg.use_liger_kernel:
                # liger where the estimator does not model it: the model without it, which counts the logits the
                # fused loss never makes (errs high, prunes safely)
                setup = setup_of(cfg.with_(use_liger_kernel=False), cfg.per_device_train_batch_size)
            if setup is None:
                return None
        else:
            from fasttrain.lab.estimate import lab_setup

            setup = lab_setup(cfg, vocab)
        if cpu:
            setup = setup.with_(workspace_mib=0.0)
        try:
            # over several ranks: per GPU, the strategy's shards (the prediction a lab run records)
            return int(estimate(parallel_setup(cfg, setup), "precise").total)
        except FasttrainError:
            return None
    return predict


def probe_config(cfg: LabConfig, steps: int, warmup: int) -> LabConfig:
    """A probe's run: ``warmup`` untimed steps then ``steps`` timed ones, a constant learning rate (so that
    losses compare across probes of any length), no validation but the smallest, nothing saved."""
    return cfg.with_(max_steps=warmup + steps, timing_warmup_steps=warmup, warmup_steps=0,
                     min_lr=cfg.learning_rate, eval_interval=0, eval_tokens=max(cfg.context, 64), log_interval=1,
                     save=None, auto_find_batch_size=False)


def load_corpus_for(cfg: LabConfig):
    """The corpus ``cfg`` names (Tiny Shakespeare, or the user's text or token files where the lab reads them)."""
    from fasttrain.lab import data

    if hasattr(data, "corpus_for"):
        return data.corpus_for(cfg)
    return data.load_corpus(cfg.data_dir)


# forward/backward calls run before a probe's timing starts: the first compiles, the second and third are
# CUDA graphs' warm-up and recording (reduce-overhead); after them every call is a steady-state one
WARM_MICRO_STEPS = 3


def warmup_steps_for(cfg: LabConfig) -> int:
    """Untimed optimizer steps before a probe's timed ones: enough for :data:`WARM_MICRO_STEPS` micro-batches.
    At a realistic global batch a step is many micro-batches (0.5M tokens of 1024 are 512 sequences: 16 of
    32), so one step warms up and the probe's time goes to measuring, not to repeating the warm-up."""
    return max(1, math.ceil(WARM_MICRO_STEPS / max(1, cfg.gradient_accumulation_steps)))


def lab_measure(corpus=None, warmup: int | None = None) -> Callable:
    """``measure(cfg, steps) -> Probe``: one probe through the lab's trainer (``make_trainer`` builds the
    model ``cfg`` names; ``Trainer.train`` is the loop; ``Metrics`` times each step between device
    synchronizations, the first ``warmup`` apart, and reads the peaks less what was held before). An
    out-of-memory error is caught, the frames holding the probe's tensors are left, and the cache is
    emptied before the probe is answered as out of memory (no batch search: the tuner chooses)."""
    loaded: dict = {}

    def measure(cfg: LabConfig, steps: int, time_allowed_s: float | None = None) -> Probe:
        import torch

        from fasttrain.lab.build import make_trainer, resolve_device
        from fasttrain.lab.measure import free_memory, held_before, oom_types, release_run_state, tf32_matmuls
        from fasttrain.lab.trainer import Metrics

        pc = validate(probe_config(cfg, steps, warmup_steps_for(cfg) if warmup is None else warmup))
        device = resolve_device(pc)
        data = corpus if corpus is not None else loaded.get("corpus")
        if data is None:
            data = loaded["corpus"] = load_corpus_for(pc)
        cuda = device.type == "cuda"
        free_memory(device)
        held = held_before(device)
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        oom = stopped = False
        metrics = Metrics(pc, device, held=held, curve=True)
        t_start = time.perf_counter()

        def past_its_time(_: int) -> None:
            # checked after every micro-batch: a probe ends at most one micro-batch after its time
            if time.perf_counter() - t_start > time_allowed_s:
                raise ProbeStopped()

        with tf32_matmuls(pc.tf32):
            try:
                trainer = make_trainer(pc, data, device)
                if time_allowed_s is not None:
                    trainer.after_micro_batch = past_its_time
                trainer.train(metrics=metrics, evaluate=False)
            except oom_types():
                oom = True          # answered below, once the exception (and its frames' tensors) is gone
            except ProbeStopped:
                stopped = True
            finally:
                # the next probe must not run this one's liger patches nor find its CUDA-graph pool held, and
                # compiled probes must not pile up in dynamo's cache (past its limit it runs eager, unsaid)
                release_run_state(pc)
        if oom:
            trainer = None
            free_memory(device)
            return Probe(steps=steps, oom=True, error="out of memory",
                         compile_s=metrics.warmup_ms[0] / 1e3 if metrics.warmup_ms else 0.0)
        if stopped:
            trainer = None
            free_memory(device)
            done = len(metrics.warmup_ms) + len(metrics.step_ms)
            return Probe(steps=steps, stopped=True,
                         error=f"stopped after {time.perf_counter() - t_start:.0f} s, {done} of {pc.max_steps} "
                               f"steps done, past the {time_allowed_s:.0f} s allowed",
                         compile_s=metrics.warmup_ms[0] / 1e3 if metrics.warmup_ms else 0.0)
        del trainer
        free_memory(device)
        timed = metrics.step_ms
        tokens = pc.per_device_train_batch_size * pc.gradient_accumulation_steps * pc.context
        return Probe(steps=steps, tokens_per_s=tokens / (sum(timed) / len(timed) / 1e3) if timed else None,
                     peak_bytes=metrics.train_peak if cuda else None,
                     reserved_bytes=metrics.reserved_peak if cuda else None,
                     compile_s=metrics.warmup_ms[0] / 1e3 if metrics.warmup_ms else 0.0,
                     warmup_s=sum(metrics.warmup_ms[1:]) / 1e3,
                     losses=[p["loss"] for p in metrics.loss_curve])
    return measure


class ProbeStopped(Exception):
    """Raised between a probe's micro-batches once it has run longer than it was allowed."""


def parallel_setup(cfg: LabConfig, setup):
    """The estimator's ``Setup`` of ``cfg`` per GPU: its strategy's fields over its ranks (as the lab's run record
    predicts it: ``train._estimate``); a one-process configuration as it is."""
    if not isinstance(cfg, ScaleConfig) or cfg.strategy == "none":
        return setup
    from fasttrain.lab.parallel.distributed import estimator_parallelism

    fields_ = estimator_parallelism(cfg.world(), cfg.bf16, cfg.reduce_dtype)
    return setup.with_(**{**fields_, "grad_buffers": setup.grad_buffers or fields_.get("grad_buffers", False)})
