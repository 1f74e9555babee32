"""``fasttrain tune --nproc-per-node N``: the search over N processes (GPUs, or gloo processes on the CPU).

The single-GPU space (:mod:`.space`) gains the strategy axis -- how one configuration spreads over the N ranks:

- ``fsdp`` (FSDP2, ZeRO-3: the plain choice, what a Trainer user runs), ``fsdp-zero2`` (not resharded after
  the forward), ``ddp``, ``zero1``; ``hsdp-rR`` (R replicas, the model sharded inside each; N >= 4);
  ``fsdp-tpM`` (the 2-D mesh: FSDP over N/M, tensor parallelism over M) for each M dividing N; ``tp`` over all
  ranks; ``fsdp-offload`` (the optimizer state on the host) only where nothing else is predicted to fit;
- with ``--allow float8``: torchao's float8 training of the Linear layers (tensorwise, rowwise);
- the reduce axis: the data-parallel gradients reduced in fp32 or bf16 (``--reduce-dtype``; the HF
  Trainer's FSDP reduces in its training precision, so the answer says when the pick's cannot be written there).

A configuration is a :class:`ScaleConfig`: the lab's configuration and its strategy. Its micro-batch is per
data-parallel rank: ``b k dp seq = T`` (``dp = N / tp``). A shape the model cannot take (tp not dividing the
heads, a family without a tensor-parallel plan) is refused before any prediction with the lab's own line
(:func:`scale_refusal`); the estimator predicts every survivor per GPU
(:func:`fasttrain.lab.parallel.distributed.estimator_parallelism`), and the device's memory prunes it.

The probes are processes: every probe is ``fasttrain lab --nproc-per-node N ... --out probe.json`` in a
subprocess of its own session (:func:`torchrun_measure`), so every probe gets a process group of its own and a
probe that hangs or dies is stopped at its time (SIGTERM to its session, SIGKILL 10 s later), recorded, and
the search goes on.

The answer (:func:`answer`): the ``fasttrain lab ... --nproc-per-node N`` line, the ``torchrun`` line, the HF
Trainer's ``TrainingArguments`` (``fsdp`` / ``fsdp_config``) and an ``accelerate`` config file, and one line
for what the Trainer cannot express.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable

from fasttrain.errors import FasttrainError
from fasttrain.lab.config import LabConfig
from fasttrain.lab.parallel.launch import KILL_GRACE_S, run_bounded  # noqa: F401 - tune's probes are bounded runs
from fasttrain.lab.tune.space import Probe, ScaleConfig

# what a probe may take at most when the search gives it no time (no budget, nothing measured yet)
PROBE_CEILING_S = 900.0
# the class a Trainer's FSDP wraps one unit of, per family (the fsdp_config and the accelerate file name it)
LAYER_CLASSES = {"llama": "LlamaDecoderLayer", "gpt2": "GPT2Block", "mistral": "MistralDecoderLayer",
                 "qwen2": "Qwen2DecoderLayer", "qwen3": "Qwen3DecoderLayer", "gemma": "GemmaDecoderLayer",
                 "gemma2": "Gemma2DecoderLayer", "phi3": "Phi3DecoderLayer", "olmo2": "Olmo2DecoderLayer"}


def scale_refusal(device_type: str = "cuda") -> Callable[[LabConfig], str | None]:
    """``refuse(cfg)``: the lab's own one line for a shape it cannot run -- a tp that does not divide the heads,
    the key/value heads or the feed-forward width, a family without a tensor-parallel plan, a technique the
    strategy does not take -- checked before any weights, as ``fasttrain lab --nproc-per-node N`` checks it."""
    from fasttrain.lab.parallel import distributed as D

    def refuse(cfg: LabConfig) -> str | None:
        if not isinstance(cfg, ScaleConfig) or cfg.strategy == "none":
            return None
        try:
            parallel = D.validate_parallel(cfg.parallel())
            lab = cfg.lab_config()
            D.check_config(lab, parallel)
            D.mesh_shape(parallel, cfg.nproc_per_node)
            D.check_model_fits(lab, cfg.nproc_per_node, cfg.strategy, tp=cfg.tp_size)
        except FasttrainError as exc:
            return str(exc)
        return None
    return refuse


def device_memory_apart(limit_bytes: int | None = None):
    """:func:`~fasttrain.lab.tune.device.device_memory` of GPU 0 measured in a process of its own: the searching
    process holds no CUDA context on a GPU its probes' ranks need (the context measured is one rank's own)."""
    from fasttrain.lab.tune.device import DeviceMemory

    code = ("import json, dataclasses, torch; from fasttrain.lab.tune.device import device_memory; "
            f"print(json.dumps(dataclasses.asdict(device_memory(torch.device('cuda:0'), {limit_bytes!r}))))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise FasttrainError("could not read the GPU's memory: " + _error_line(done.stderr or done.stdout,
                                                                                 done.returncode))
    return DeviceMemory(**json.loads(done.stdout.strip().splitlines()[-1]))


# --- the probe: one process group per probe ------------------------------------------------------------

def lab_argv(cfg: ScaleConfig) -> list[str]:
    """``fasttrain lab`` arguments that run ``cfg`` on its ranks (without ``--nproc-per-node``): the settings
    :func:`fasttrain.lab.overrides.settings_of` gives (a transformers model takes no preset), then the strategy."""
    from fasttrain.lab.overrides import flags, settings_of

    preset, settings = settings_of(cfg.lab_config())
    settings = {k: v for k, v in settings.items() if k not in ("save", "auto_find_batch_size")}
    return ["lab", *(["--preset", preset] if preset else []), *flags(settings), *cfg.parallel_flags()]


def _error_line(output: str, code: int | None) -> str:
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    if errors:
        return errors[-1][len("error:"):].strip()[:300]
    return f"exited with code {code}" + (f": {lines[-1][:200]}" if lines else "")


def probe_from_record(record: dict, steps: int) -> Probe:
    """A probe's measurement from the run record rank 0 wrote: tokens/s of the world, the largest rank's peak."""
    d = record.get("distributed") or {}
    ranks = d.get("per_rank") or []
    peaks = [r.get("peak_allocated_bytes") for r in ranks if r.get("peak_allocated_bytes")]
    reserved = [r.get("peak_reserved_bytes") for r in ranks if r.get("peak_reserved_bytes")]
    warm = record.get("warmup_ms") or []
    return Probe(steps=steps, tokens_per_s=record.get("tokens_per_s"),
                 peak_bytes=max(peaks) if peaks else None, reserved_bytes=max(reserved) if reserved else None,
                 predicted_bytes=(record.get("estimate") or {}).get("precise_bytes"),
                 compile_s=warm[0] / 1e3 if warm else 0.0, warmup_s=sum(warm[1:]) / 1e3,
                 losses=[p["loss"] for p in record.get("loss_curve") or [] if "loss" in p])


def torchrun_measure(*, python: str = sys.executable, env: dict | None = None, ceiling_s: float = PROBE_CEILING_S,
                     warmup: int | None = None, log: Callable | None = None) -> Callable:
    """``measure(cfg, steps, time_allowed_s) -> Probe``: ``cfg``'s probe as ``fasttrain lab --nproc-per-node N``
    (torchrun's launcher) in a subprocess; the record it writes is the measurement. Out of memory on any rank
    is the probe's ``oom``; a failure its error line; a probe past its time is stopped (:func:`run_bounded`)."""
    from fasttrain.lab.tune.probes import probe_config, warmup_steps_for

    def measure(cfg: ScaleConfig, steps: int, time_allowed_s: float | None = None) -> Probe:
        warm = warmup_steps_for(cfg) if warmup is None else warmup
        pc = probe_config(cfg, steps, warm)
        limit = min(time_allowed_s or ceiling_s, ceiling_s)
        with tempfile.TemporaryDirectory(prefix="fasttrain-probe-") as tmp:
            out = Path(tmp) / "probe.json"
            # a rank that stalls ends the others by the collective timeout, not after the default half hour
            argv = [python, "-m", "fasttrain", *lab_argv(pc), "--nproc-per-node", str(cfg.nproc_per_node),
                    "--ddp-timeout", str(int(max(60, limit))), "--out", str(out), "--quiet"]
            if log:
                log("probe: " + shlex.join(argv[2:]))
            code, output, _, took = run_bounded(argv, limit, env=env)
            if code is None:
                return Probe(steps=steps, stopped=True, wall_s=took,
                             error=f"stopped after {took:.0f} s, past the {limit:.0f} s allowed")
            text = output.lower()
            if code != 0:
                oom = "out of memory" in text or "does not fit on" in text
                return Probe(steps=steps, oom=oom, wall_s=took,
                             error="out of memory" if oom else _error_line(output, code))
            try:
                record = json.loads(out.read_text())
            except (OSError, ValueError) as exc:
                return Probe(steps=steps, wall_s=took, error=f"the probe wrote no run record ({exc})")
        probe = probe_from_record(record, steps)
        probe.wall_s = took
        return probe
    return measure


# --- the answer --------------------------------------------------------------------------------------

def layer_class(family: str | None) -> str | None:
    return LAYER_CLASSES.get(family or "")


def trainer_fsdp(cfg: ScaleConfig, family: str | None) -> tuple[dict, dict | None, list[str]]:
    """The HF Trainer's equivalent of ``cfg``'s strategy: (TrainingArguments fields, accelerate's
    parallelism sizes or None, what it cannot express)."""
    args: dict = {}
    cannot: list[str] = []
    sizes = None
    s = cfg.strategy
    if s in ("fsdp", "hsdp"):
        mode = "full_shard" if cfg.reshard_after_forward else "shard_grad_op"
        args["fsdp"] = f"{mode} auto_wrap" + (" offload" if cfg.offload_optimizer else "")
        fsdp_config = {"version": 2, "reshard_after_forward": cfg.reshard_after_forward,
                       "activation_checkpointing": cfg.gradient_checkpointing == "full"}
        cls = layer_class(family)
        if cls:
            fsdp_config["transformer_layer_cls_to_wrap"] = [cls]
        if cfg.offload_optimizer:
            fsdp_config["cpu_offload"] = True
        args["fsdp_config"] = fsdp_config
        # FSDP's own checkpointing, not the Trainer's (which gathers every layer a second time)
        args["gradient_checkpointing"] = False
        if s == "hsdp" or cfg.tp > 1:
            shard = cfg.dp // cfg.dp_replicate if s == "hsdp" else cfg.dp
            sizes = {"dp_replicate_size": cfg.dp_replicate if s == "hsdp" else 1, "dp_shard_size": shard,
                     "tp_size": cfg.tp}
        if cfg.gradient_checkpointing == "selective":
            cannot.append("selective checkpointing (the attention core only)")
        # accelerate's FSDP2 plugin reduces in the training's precision (bf16=True: param and reduce dtype
        # bf16); neither fsdp_config nor accelerate's config file names a mixed-precision policy
        compute = "bf16" if cfg.bf16 else "fp32"
        if cfg.reduce_dtype != compute:
            dtype = {"bf16": "torch.bfloat16", "fp32": "torch.float32"}
            cannot.append(f"FSDP's gradient reduction in {cfg.reduce_dtype} under {compute} training (with "
                          f"{'bf16=True' if cfg.bf16 else 'fp32'} accelerate reduces in {compute}; only an Accelerator "
                          f"of your own takes FullyShardedDataParallelPlugin(mixed_precision_policy={{'param_dtype': "
                          f"{dtype[compute]}, 'reduce_dtype': {dtype[cfg.reduce_dtype]}, 'output_dtype': "
                          f"{dtype[compute]}}}))")
    elif s == "zero1":
        cannot.append("ZeRO-1 (only through DeepSpeed: deepspeed={'zero_optimization': {'stage': 1}})")
    elif s == "tp":
        sizes = {"dp_replicate_size": 1, "dp_shard_size": 1, "tp_size": cfg.nproc_per_node}
    if s in ("ddp", "zero1") and cfg.reduce_dtype == "bf16":
        cannot.append("DDP's all-reduce in bf16 (TrainingArguments has no comm hook; an Accelerator of your own "
                      "takes DistributedDataParallelKwargs(comm_hook=DDPCommunicationHookType.BF16))")
    if cfg.checkpoint_blocks:
        cannot.append(f"checkpointing the first {cfg.checkpoint_blocks} blocks only (the Trainer's checkpointing "
                      f"recomputes every block)")
    if cfg.torch_compile_scope == "blocks" and cfg.torch_compile:
        cannot.append("per-block compile (torch_compile compiles the whole model)")
    if cfg.float8 != "none":
        cannot.append(f"float8 {cfg.float8} as a TrainingArguments flag (accelerate's mixed_precision fp8 with its "
                      "AO backend is the nearest)")
    if family is None:
        cannot.append("the lab's own GPT (the Trainer trains transformers models)")
    return args, sizes, cannot


def accelerate_yaml(cfg: ScaleConfig, family: str | None) -> str:
    """An ``accelerate`` config file (``accelerate launch --config_file F train.py``) for ``cfg``'s strategy."""
    n = cfg.nproc_per_node
    lines = ["compute_environment: LOCAL_MACHINE", "machine_rank: 0", "num_machines: 1", f"num_processes: {n}",
             "main_training_function: main", f"mixed_precision: {'bf16' if cfg.bf16 else 'no'}",
             "rdzv_backend: static", "same_network: true", f"use_cpu: {str(cfg.device == 'cpu').lower()}"]
    args, sizes, _ = trainer_fsdp(cfg, family)
    if "fsdp" in args:
        fc = args["fsdp_config"]
        lines += ["distributed_type: FSDP", "fsdp_config:",
                  f"  fsdp_activation_checkpointing: {str(fc['activation_checkpointing']).lower()}",
                  "  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP",
                  f"  fsdp_offload_params: {str(cfg.offload_optimizer).lower()}",
                  f"  fsdp_reshard_after_forward: {str(cfg.reshard_after_forward).lower()}",
                  "  fsdp_state_dict_type: SHARDED_STATE_DICT"]
        if "transformer_layer_cls_to_wrap" in fc:
            lines.append(f"  fsdp_transformer_layer_cls_to_wrap: {fc['transformer_layer_cls_to_wrap'][0]}")
        lines.append("  fsdp_version: 2")
    else:
        lines.append("distributed_type: MULTI_GPU")
    if sizes:
        lines += ["parallelism_config:"] + [f"  parallelism_config_{k}: {v}" for k, v in sizes.items()]
    return "\n".join(lines) + "\n"


def answer(cfg: ScaleConfig, model_id: str, family: str | None, lab_command: str, training_arguments: dict,
           notes: list[str]) -> dict:
    """The pick as every launcher takes it: ``fasttrain lab ... --nproc-per-node N``, ``torchrun``,
    ``TrainingArguments`` with ``fsdp``/``fsdp_config``, an accelerate config file, and what the Trainer cannot
    express (one line, or None)."""
    n = cfg.nproc_per_node
    lab_line = f"{lab_command} {shlex.join(cfg.parallel_flags())} --nproc-per-node {n}"
    rest = lab_line.split(" ", 2)[2] if lab_line.startswith("fasttrain lab ") else lab_line
    torchrun_line = f"torchrun --standalone --nproc-per-node {n} -m fasttrain lab {rest.replace(f' --nproc-per-node {n}', '')}"
    fsdp_args, sizes, cannot = trainer_fsdp(cfg, family)
    args = {**training_arguments, **fsdp_args}
    if sizes:
        args["parallelism_config"] = "accelerate.parallelism_config.ParallelismConfig(" + ", ".join(
            f"{k}={v}" for k, v in sizes.items()) + ")"
    cannot_line = None
    if cannot:
        cannot_line = "the HF Trainer cannot express: " + "; ".join(cannot)
    return {"strategy": cfg.label, "nproc_per_node": n, "lab_command": lab_line, "torchrun_command": torchrun_line,
            "training_arguments": args, "accelerate_config": accelerate_yaml(cfg, family),
            "trainer_cannot": cannot_line, "training_arguments_notes": notes}
