"""The scale-out benchmark: the lab on 1, 2 and 4 GPUs (tune's pick) against the HF Trainer with FSDP.

Models (config folders written here, random init, bf16, full training, AdamW), one entry of MODELS each:

- ``llama3-8b``: Meta-Llama-3-8B's shape (hidden 4096, 32 layers, 32 heads over 8 key/value heads,
  SwiGLU 14336, vocabulary 128256, rope theta 500000), seq 8192;
- ``llama-1b``: Llama-3.2-1B's shape with a 32000 vocabulary (as ``dev/tune/bench_tune.py``), seq 2048;
- ``gpt2-124m``: GPT-2 small, seq 1024.

Data: seeded random token ids (``train.bin``; uint32 where the vocabulary passes 65,536): no tokenizer or
download, the same windows for the lab and the Trainer.

Phases (each one command; a work folder keeps the model's config and data)::

    python3 dev/dist/bench_scale.py prepare WORK --model llama3-8b
    torchrun --nproc-per-node 4 dev/dist/bench_scale.py hf WORK --model llama3-8b --steps 8 --out hf.json
    torchrun --nproc-per-node 4 dev/dist/bench_scale.py lab-profile WORK --profile P -- --strategy fsdp ...

    python3 dev/dist/bench_scale.py sweep-flags WORK --model llama-1b --micro-batch 4   # a lab dist sweep's base

The lab's scaling at 1, 2 and 4 GPUs is ``fasttrain lab dist sweep --out OUT/<model>/sweep --name <model>
--nproc-per-node 4,2 ... -- $(sweep-flags)`` (``dev/device/scale_small.sh``); ``report`` reads its records.
``hf`` is the HF Trainer as its users run it on N GPUs (``fsdp="full_shard auto_wrap"``, ``fsdp_config``
version 2 with ``activation_checkpointing``, bf16, micro-batch 1, torchrun), ``--flags`` adds its best
flags (liger, fused AdamW, ``torch_compile``, a micro-batch); ``lab-profile`` is the lab's own command
line under torchrun with the profiler of ``dev/dist/profiling.py`` stepping after each optimizer step.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
MIB = 2 ** 20
LEARNING_RATE = 3e-4

MODELS = {
    "llama3-8b": dict(seq=8192, config=dict(
        model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=False)),
    "llama-1b": dict(seq=2048, config=dict(
        model_type="llama", vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=2048, tie_word_embeddings=True,
        rope_theta=500000.0)),
    "gpt2-124m": dict(seq=1024, config=dict(
        model_type="gpt2", vocab_size=50304, n_positions=1024, n_embd=768, n_layer=12, n_head=12,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
    # the CPU tests' model
    "tiny-llama": dict(seq=32, config=dict(
        model_type="llama", vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)),
}
# the lab's presets whose runs and profiles the report reads too (``<out>/<preset>/``): issue 41's FSDP question
PROFILED_PRESETS = ("char-100m",)
# the class FSDP wraps one unit of, per family (the Trainer's fsdp_config and the accelerate file name it)
LAYER_CLASS = {"llama": "LlamaDecoderLayer", "gpt2": "GPT2Block"}


def log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def bin_dtype(name: str) -> str:
    return "uint32" if MODELS[name]["config"]["vocab_size"] > 65536 else "uint16"


def prepare(work: Path, name: str, n_tokens: int = 4_000_000) -> Path:
    """The model's config folder and ``train.bin`` / ``val.bin`` of seeded random ids."""
    import numpy as np
    import transformers as tf

    spec = MODELS[name]
    folder = work / name
    (folder / "model").mkdir(parents=True, exist_ok=True)
    cfg = dict(spec["config"])
    kind = cfg.pop("model_type")
    (tf.GPT2Config if kind == "gpt2" else tf.LlamaConfig)(**cfg).save_pretrained(folder / "model")
    dtype = np.uint32 if bin_dtype(name) == "uint32" else np.uint16
    rng = np.random.default_rng(1234)
    for split, size in (("train", n_tokens), ("val", max(n_tokens // 20, 4 * spec["seq"] + 2))):
        rng.integers(0, cfg["vocab_size"], size=size, dtype=np.int64).astype(dtype).tofile(folder / f"{split}.bin")
    log(f"{name}: {kind} config and {n_tokens:,} random training tokens -> {folder}")
    return folder


# --- the HF Trainer with FSDP (run under torchrun: one process per GPU) ---------------------------

def hf_training_arguments(name: str, *, micro_batch: int, accumulation: int, steps: int, nproc: int,
                          flags: dict | None = None, output_dir: str = "out") -> dict:
    """``TrainingArguments`` as a user writes them for FSDP2 on ``nproc`` GPUs (a dict: the JSON the report keeps)."""
    family = MODELS[name]["config"]["model_type"]
    args = dict(output_dir=output_dir, max_steps=steps, per_device_train_batch_size=micro_batch,
                gradient_accumulation_steps=accumulation, bf16=True, learning_rate=LEARNING_RATE,
                lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.1, logging_steps=max(1, steps),
                save_strategy="no", report_to="none", seed=0, disable_tqdm=True)
    if nproc > 1:
        args.update(fsdp="full_shard auto_wrap",
                    fsdp_config={"version": 2, "activation_checkpointing": True,
                                 "transformer_layer_cls_to_wrap": [LAYER_CLASS[family]]})
    else:
        args.update(gradient_checkpointing=True)
    args.update(flags or {})
    return args


def hf_worker(work: Path, name: str, *, micro_batch: int, accumulation: int, steps: int, skip: int,
              flags: dict, out: Path | None, profile: Path | None) -> dict:
    """One HF Trainer run on this torchrun world: tokens/s per GPU over the steps after ``skip``, every rank's
    peak. Rank 0 writes ``out``."""
    import numpy as np
    import torch
    import transformers as tf

    spec = MODELS[name]
    seq = spec["seq"]
    folder = work / name
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    ids = np.fromfile(folder / "train.bin", dtype=np.uint32 if bin_dtype(name) == "uint32" else np.uint16)

    prof = None
    if profile is not None:
        sys.path.insert(0, str(HERE))
        from profiling import StepProfiler

        prof = StepProfiler(profile, "hf" + ("-flags" if flags else ""), wait=max(1, skip), active=2)
    sys.path.insert(0, str(HERE.parent / "tune"))
    from bench_tune import step_timer, token_windows

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(local)
    config = tf.AutoConfig.from_pretrained(folder / "model")
    torch.manual_seed(0)
    # built on the GPU (the random init of 8B parameters on the CPU takes minutes a rank); FSDP shards it in place
    with torch.device(f"cuda:{local}" if cuda else "cpu"):
        model = tf.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    model.config.use_cache = False
    timer = step_timer(cuda, after_step=prof.step if prof is not None else None)
    with tempfile.TemporaryDirectory() as tmp:
        args = tf.TrainingArguments(**{**hf_training_arguments(name, micro_batch=micro_batch, accumulation=accumulation,
                                                               steps=steps, nproc=world, flags=flags, output_dir=tmp),
                                       **({} if cuda else {"use_cpu": True, "bf16": False})})
        trainer = tf.Trainer(model=model, args=args, callbacks=[timer],
                             train_dataset=token_windows(ids, seq, steps * micro_batch * accumulation * world * 2))
        t0 = time.perf_counter()
        trainer.train()
        wall = time.perf_counter() - t0
    if prof is not None:
        prof.close()
    peak = torch.cuda.max_memory_allocated() if cuda else 0
    peaks = [peak]
    if world > 1:
        import torch.distributed as dist

        peaks = [None] * world
        dist.all_gather_object(peaks, peak)
    timed = timer.times[skip:]
    step_s = sorted(timed)[len(timed) // 2] if timed else None
    tokens_per_gpu = micro_batch * accumulation * seq
    result = {"model": name, "gpus": world, "micro_batch": micro_batch, "accumulation": accumulation,
              "flags": flags, "tokens_per_s_per_gpu": tokens_per_gpu / step_s if step_s else None,
              "step_s": timer.times, "skip": skip, "peak_mib_per_rank": [p / MIB for p in peaks], "wall_s": wall,
              "training_arguments": hf_training_arguments(name, micro_batch=micro_batch, accumulation=accumulation,
                                                          steps=steps, nproc=world, flags=flags)}
    if int(os.environ.get("RANK", "0")) == 0:
        line = f"hf {name} {world} GPU(s) {flags or 'as users run it'}: {result['tokens_per_s_per_gpu'] or 0:,.0f} " \
               f"tokens/s per GPU, peak {max(peaks) / MIB:,.0f} MiB"
        log(line)
        if out is not None:
            out.write_text(json.dumps(result, indent=1, default=str))
    return result


# --- the lab, profiled --------------------------------------------------------------------------

def lab_args(work: Path, name: str, *, micro_batch: int, accumulation: int, steps: int, extra=()) -> list[str]:
    """``fasttrain lab`` flags for ``name`` on the benchmark's data (the strategy and techniques in ``extra``)."""
    spec = MODELS[name]
    folder = work / name
    return ["lab", "--model", f"hf:{folder / 'model'}", "--train-bin", str(folder / "train.bin"),
            "--val-bin", str(folder / "val.bin"), "--bin-dtype", bin_dtype(name), "--context", str(spec["seq"]),
            "--per-device-train-batch-size", str(micro_batch), "--gradient-accumulation-steps", str(accumulation),
            "--max-steps", str(steps), "--learning-rate", str(LEARNING_RATE), "--min-lr", str(LEARNING_RATE),
            "--warmup-steps", "0", "--weight-decay", "0.1", "--dropout", "0", "--eval-interval", "0",
            "--eval-tokens", str(spec["seq"]), "--log-interval", "1", "--bf16", "--attn-implementation", "sdpa", *extra]


def sweep_flags(work: Path, name: str, *, micro_batch: int, accumulation: int = 1) -> list[str]:
    """The lab flags ``fasttrain lab dist sweep ... --`` takes as its base for ``name``: :func:`lab_args` less
    the command and the steps (the sweep's own option)."""
    args = lab_args(work, name, micro_batch=micro_batch, accumulation=accumulation, steps=1)[1:]
    i = args.index("--max-steps")
    return args[:i] + args[i + 2:]


def lab_profile_worker(profile: Path, argv: list[str], skip: int, side: str = "lab") -> int:
    """The lab's command line in this torchrun worker, the profiler stepping after every optimizer step."""
    sys.path.insert(0, str(HERE))
    from profiling import StepProfiler

    from fasttrain.cli import main
    from fasttrain.lab.trainer import Trainer

    prof = StepProfiler(profile, side, wait=skip, active=2)
    train_step = Trainer.train_step

    def profiled(self, *args, **kwargs):      # whatever the trainer's step takes, passed on
        out = train_step(self, *args, **kwargs)
        prof.step()
        return out

    Trainer.train_step = profiled
    try:
        return main(argv)
    finally:
        prof.close()


def lab_figures(record: dict) -> dict:
    """tokens/s per GPU, the largest rank's peak and the estimator's per-GPU prediction from a lab run record."""
    d = record.get("distributed") or {}
    gpus = d.get("world_size", 1)
    peaks = [r["peak_allocated_bytes"] for r in d.get("per_rank", []) if r.get("peak_allocated_bytes")] \
        or [record.get("memory", {}).get("peak_allocated_bytes") or 0]
    predicted = (record.get("estimate") or {}).get("precise_bytes")
    return {"gpus": gpus, "tokens_per_s_per_gpu": (record.get("tokens_per_s") or 0) / gpus,
            "peak_mib_per_gpu": max(peaks) / MIB if peaks else None,
            "predicted_mib_per_gpu": predicted / MIB if predicted else None}


def profile_table(summaries: dict[str, dict], lab_record: Path | None = None, hf_record: Path | None = None) -> str:
    """The profiles side by side (rank 0's, per step): device ms by kind of kernel, the compute's busy time, the
    communication no compute hid, the idle time; what the gradients are reduced as; the runs' figures."""
    from profiling import KINDS

    lines = ["| side | " + " | ".join(KINDS) + " | compute busy | exposed comm | idle | step wall |",
             "|---" * (len(KINDS) + 5) + "|"]
    for side, p in sorted(summaries.items()):
        ms = p["per_step_ms"]
        lines.append(f"| {side} | " + " | ".join(f"{ms[k]:,.1f}" for k in KINDS)
                     + f" | {p['compute_busy_ms']:,.1f} | {p['exposed_comm_ms']:,.1f} | {p['idle_ms']:,.1f} | "
                     + (f"{p['step_wall_ms']:,.1f} |" if p.get("step_wall_ms") else "- |"))
    lines.append("")
    for side, p in sorted(summaries.items()):
        lines.append(f"- {side} collectives (ms/step): " + "; ".join(f"`{k.split('(')[0]}` {v:,.1f}"
                                                                     for k, v in p["collectives"].items()))
    if lab_record and lab_record.exists():
        f = lab_figures(json.loads(lab_record.read_text()))
        lines.append(f"- lab run record: peak {f['peak_mib_per_gpu'] or 0:,.0f} MiB per GPU (largest rank), "
                     f"predicted {f['predicted_mib_per_gpu'] or 0:,.0f} MiB")
    if hf_record and hf_record.exists():
        h = json.loads(hf_record.read_text())
        lines.append(f"- HF Trainer: peak {max(h['peak_mib_per_rank']):,.0f} MiB per GPU")
    return "\n".join(lines)


def read_summaries(paths: list[Path]) -> dict[str, dict]:
    """``profile-<side>-rank0.json`` files (or a ``.tgz`` of them) -> side -> summary."""
    import tarfile

    out = {}
    for path in paths:
        if path.suffix == ".tgz":
            with tarfile.open(path) as tar:
                for m in tar.getmembers():
                    base = Path(m.name).name
                    if base.startswith("profile-") and base.endswith("-rank0.json"):
                        out[base[len("profile-"):-len("-rank0.json")]] = json.load(tar.extractfile(m))
        else:
            out[path.name[len("profile-"):].split("-rank0")[0].removesuffix(".json")] = json.loads(path.read_text())
    return out


# --- the benchmark's cases and its report ------------------------------------------------------------

CASE_KEYS = ("model", "gpus", "strategy", "precision", "pick", "tokens_per_s_per_gpu", "peak_mib_per_gpu",
             "predicted_mib_per_gpu", "scaling_efficiency", "hf_trainer_tokens_per_s_per_gpu",
             "hf_trainer_flags_tokens_per_s_per_gpu", "tune_s")
README_START, README_END = "<!-- scale-results:start -->", "<!-- scale-results:end -->"
GOALS = {"8b_bf16_tokens_per_s_per_gpu": 7000, "float8_over_bf16": 1.2, "prediction_error": 0.05,
         "pick_over_hf": 1.3, "pick_over_hf_flags": 1.1, "tune_s": 15 * 60, "scaling_1b_4gpu": 0.95}
# the issue's anchor: llm.c trains GPT-2 124M at about 3.7M tokens/s on 8 H100s
LLMC_GPT2_PER_GPU = 460_000


def case(model, gpus, strategy, precision, *, pick=False, tokens_per_s_per_gpu=None, peak_mib_per_gpu=None,
         predicted_mib_per_gpu=None, scaling_efficiency=None, hf=None, hf_flags=None, tune_s=None, **extra) -> dict:
    out = dict(model=model, gpus=gpus, strategy=strategy, precision=precision, pick=pick,
               tokens_per_s_per_gpu=tokens_per_s_per_gpu, peak_mib_per_gpu=peak_mib_per_gpu,
               predicted_mib_per_gpu=predicted_mib_per_gpu, scaling_efficiency=scaling_efficiency,
               hf_trainer_tokens_per_s_per_gpu=hf, hf_trainer_flags_tokens_per_s_per_gpu=hf_flags, tune_s=tune_s)
    assert tuple(out) == CASE_KEYS
    return {**out, **({"extra": extra} if extra else {})}


def _json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def precision_of(settings: dict) -> str:
    """A case's precision from its lab settings (a record's config, or a tune row's overrides, which leave out the
    precision the user fixed: the benchmark's bf16): bf16 or fp32, float8's recipe, and FSDP's gradient reduction
    when it is bf16 (``--reduce-dtype``; fp32 goes unsaid)."""
    precision = "bf16" if settings.get("bf16", True) else "fp32"
    if settings.get("float8", "none") != "none":
        precision = f"float8-{settings['float8']}"
    return precision + (", reduce bf16" if settings.get("reduce_dtype") == "bf16" else "")


def lab_case(model: str, record: dict, **kw) -> dict:
    """A case from a lab run record (one process or several)."""
    f = lab_figures(record)
    d = record.get("distributed") or {}
    cfg = record.get("config") or {}
    precision = precision_of(cfg)
    losses = [p["loss"] for p in record.get("loss_curve") or []]
    return case(model, f["gpus"], d.get("label", "1gpu"), precision, tokens_per_s_per_gpu=f["tokens_per_s_per_gpu"],
                peak_mib_per_gpu=f["peak_mib_per_gpu"], predicted_mib_per_gpu=f["predicted_mib_per_gpu"],
                global_batch=d.get("global_batch_size") or _one_process_batch(record.get("batch") or {}),
                dp=d.get("dp", 1), losses=losses, **kw)


def strategy_label(*args) -> str:
    from fasttrain.lab.parallel.distributed import strategy_label as label

    return label(*args)


def _one_process_batch(batch: dict) -> int | None:
    b = batch.get("per_device_train_batch_size")
    return None if b is None else b * (batch.get("gradient_accumulation_steps") or 1)


def collect(out: Path, model: str) -> list[dict]:
    """Every case one model's files under ``out`` hold: tune's pick (and the rest of its measured strategies),
    the HF Trainer both ways, float8 runs of the pick, and the lab's runs at 1, 2 and 4 GPUs (``lab-<g>gpu-*.json``)."""
    folder = out / model
    cases: list[dict] = []
    hf = _json(folder / "hf-users.json")
    flags = [r for r in (_json(p) for p in sorted(folder.glob("hf-flags-*.json"))) if r and r.get("tokens_per_s_per_gpu")]
    best_flags = max(flags, key=lambda r: r["tokens_per_s_per_gpu"]) if flags else None
    hf_tps = hf["tokens_per_s_per_gpu"] if hf else None
    flags_tps = best_flags["tokens_per_s_per_gpu"] if best_flags else None
    tuned = _json(folder / "tune" / "tune.json")
    pick_tps = None
    if tuned and tuned.get("pick"):
        p = tuned["pick"]
        n = p.get("nproc_per_node", 1)
        pick_tps = p["tokens_per_s"] / n if p.get("tokens_per_s") else None
        cases.append(case(model, n, p.get("strategy", "1gpu"), precision_of(p.get("overrides") or {}), pick=True,
                          tokens_per_s_per_gpu=pick_tps,
                          peak_mib_per_gpu=p.get("peak_mib"), predicted_mib_per_gpu=p.get("predicted_mib"),
                          hf=hf_tps, hf_flags=flags_tps, tune_s=tuned.get("tune_s"), label=p.get("label"),
                          lab_command=p.get("lab_command"), torchrun_command=p.get("torchrun_command"),
                          hf_flags_used=best_flags.get("flags") if best_flags else None,
                          hf_micro_batch=hf.get("micro_batch") if hf else None))
        for row in tuned.get("ranked") or []:
            if row.get("rank") in (None, 1) or not row.get("tokens_per_s"):
                continue
            o = row.get("overrides") or {}
            strategy = strategy_label(o.get("strategy", "none"), o.get("reshard_after_forward", True),
                                      o.get("tp", 1) if o.get("strategy") != "tp" else 1, o.get("dp_replicate", 1),
                                      o.get("offload_optimizer", False)) if o.get("strategy") else "1gpu"
            cases.append(case(model, n, strategy, precision_of(o),
                              tokens_per_s_per_gpu=row["tokens_per_s"] / n, peak_mib_per_gpu=row.get("peak_mib"),
                              predicted_mib_per_gpu=row.get("predicted_mib"), label=row["label"], source="tune probe"))
    elif hf_tps or flags_tps:
        cases.append(case(model, hf["gpus"] if hf else best_flags["gpus"], "hf-trainer-fsdp", "bf16", hf=hf_tps,
                          hf_flags=flags_tps))
    for path in sorted(folder.glob("float8-*.json")):
        record = _json(path)
        if record and record.get("tokens_per_s"):
            cases.append(lab_case(model, record, source=path.name))

    def records(paths, prefix=""):
        return [(prefix + p.name, r) for p in paths
                if p.name != "sweep.json" and (r := _json(p)) and r.get("tokens_per_s")]

    # the lab's own runs and `fasttrain lab dist sweep --out <model>/sweep` (its run records beside its sweep.json)
    # scaled together; each further sweep (`sweep-<what>/`: another call's GPU counts or strategies) against the
    # 1-GPU run of its own call, measured beside it
    groups = [records(sorted(folder.glob("lab-*gpu-*.json")))
              + records(sorted((folder / "sweep").glob("*.json")), "sweep/")]
    groups += [records(sorted(more.glob("*.json")), f"{more.name}/")
               for more in sorted(p for p in folder.glob("sweep-*") if p.is_dir())]
    for runs in groups:
        cases += lab_cases(model, runs)
    return cases


def _loss_deviation(mine: list[float], ref: list[float]) -> dict:
    """The sweep report's comparison of two loss curves (each logged every step from the first)."""
    from fasttrain.lab.experiments.scaling_report import loss_deviation

    most, rel, steps = loss_deviation(dict(enumerate(mine)), dict(enumerate(ref)))
    return {"loss_max_abs_diff": most, "loss_max_rel_diff": rel, "loss_steps": steps}


def lab_cases(model: str, runs: list[tuple[str, dict]]) -> list[dict]:
    """The lab's runs as cases: every 1-GPU run, and one case per GPU count, strategy and precision of the rest.
    A case's figures are its run at the same per-GPU batch as a 1-GPU run (the data-parallel throughput), its
    ``scaling_efficiency`` tokens/s per GPU over that 1-GPU run's; beside it, in ``extra["same_global_batch"]``,
    the run at a 1-GPU run's global batch (the same function): its own efficiency and how far its loss curve
    strays from that 1-GPU run's. A strategy with one data-parallel rank (tp) has one run for both. Without a
    run at the same per-GPU batch the case's figures are the same-global-batch run's."""
    made = [lab_case(model, record, source=name) for name, record in runs]
    ones: dict[tuple[str, int], dict] = {}
    for c in made:
        if c["gpus"] == 1:
            ones.setdefault((c["precision"], c["extra"]["global_batch"]), c)
    out = [c for c in made if c["gpus"] == 1]
    groups: dict[tuple, list[dict]] = {}
    for c in made:
        if c["gpus"] > 1:
            groups.setdefault((c["gpus"], c["strategy"], c["precision"]), []).append(c)
    for (gpus, strategy, precision), group in groups.items():
        # FSDP's bf16 reduction ("bf16, reduce bf16") is measured against one GPU in bf16
        base = precision.split(",")[0]

        def weak_ref(c):
            e = c["extra"]
            per_rank = (e["global_batch"] or 0) // max(e.get("dp") or 1, 1)
            return ones.get((base, per_rank)) if per_rank else None

        def strong_ref(c):
            return ones.get((base, c["extra"]["global_batch"]))

        main = next((c for c in group if weak_ref(c)), group[0])
        strong = next((c for c in group if strong_ref(c)), None)
        ref = weak_ref(main)
        if ref and ref["tokens_per_s_per_gpu"] and main["tokens_per_s_per_gpu"]:
            main["scaling_efficiency"] = main["tokens_per_s_per_gpu"] / ref["tokens_per_s_per_gpu"]
            main["extra"]["per_gpu_batch"] = ref["extra"]["global_batch"]
        if strong is not None:
            one = strong_ref(strong)
            eff = (strong["tokens_per_s_per_gpu"] / one["tokens_per_s_per_gpu"]
                   if one["tokens_per_s_per_gpu"] and strong["tokens_per_s_per_gpu"] else None)
            main["extra"]["same_global_batch"] = {
                "source": strong["extra"]["source"], "global_batch": strong["extra"]["global_batch"],
                "tokens_per_s_per_gpu": strong["tokens_per_s_per_gpu"], "scaling_efficiency": eff,
                "peak_mib_per_gpu": strong["peak_mib_per_gpu"], "predicted_mib_per_gpu": strong["predicted_mib_per_gpu"],
                **_loss_deviation(strong["extra"]["losses"], one["extra"]["losses"]),
                "losses": strong["extra"]["losses"], "one_gpu_losses": one["extra"]["losses"],
                "one_gpu_source": one["extra"]["source"]}
        out.append(main)
        out += [c for c in group if c is not main and c is not strong]     # more runs of the same case: kept
    return out


def goal_lines(cases: list[dict]) -> list[str]:
    """Each goal met or missed, from the cases (nothing typed)."""
    out = []
    pick = next((c for c in cases if c["pick"] and c["model"] == "llama3-8b"), None)
    if pick and pick["tokens_per_s_per_gpu"]:
        t = pick["tokens_per_s_per_gpu"]
        out.append(f"8B bf16 >= {GOALS['8b_bf16_tokens_per_s_per_gpu']:,} tokens/s per GPU: {t:,.0f} "
                   f"({'met' if t >= GOALS['8b_bf16_tokens_per_s_per_gpu'] else 'missed'})")
        for key, name, goal in (("hf_trainer_tokens_per_s_per_gpu", "the HF Trainer as users run it", "pick_over_hf"),
                                ("hf_trainer_flags_tokens_per_s_per_gpu", "the HF Trainer with its best flags",
                                 "pick_over_hf_flags")):
            if pick[key]:
                r = t / pick[key]
                out.append(f"pick >= {GOALS[goal]}x {name}: {r:.2f}x ({'met' if r >= GOALS[goal] else 'missed'})")
        if pick["tune_s"] is not None:
            out.append(f"found within {GOALS['tune_s'] // 60} min: {pick['tune_s']:.0f} s "
                       f"({'met' if pick['tune_s'] <= GOALS['tune_s'] else 'missed'})")
        f8 = [c for c in cases if c["model"] == "llama3-8b" and c["precision"].startswith("float8")
              and c["tokens_per_s_per_gpu"]]
        for c in f8:
            r = c["tokens_per_s_per_gpu"] / t
            out.append(f"{c['precision']} >= {GOALS['float8_over_bf16']}x bf16: {r:.2f}x "
                       f"({'met' if r >= GOALS['float8_over_bf16'] else 'missed'})")
    for c in cases:
        if c["peak_mib_per_gpu"] and c["predicted_mib_per_gpu"]:
            e = (c["predicted_mib_per_gpu"] - c["peak_mib_per_gpu"]) / c["peak_mib_per_gpu"]
            line = (f"{c['model']} {c['gpus']} GPU(s) {c['strategy']} {c['precision']}: predicted {e:+.1%} of the "
                    f"measured peak")
            today = (c.get("extra") or {}).get("predicted_today_mib")
            if today and abs(today - c["predicted_mib_per_gpu"]) > 1e-3 * c["peak_mib_per_gpu"]:
                # the estimator changed since the run: today's figure judged, the run's kept beside it
                e = (today - c["peak_mib_per_gpu"]) / c["peak_mib_per_gpu"]
                line += f" at the run, {e:+.1%} by today's estimator"
            out.append(f"{line} ({'within' if abs(e) <= GOALS['prediction_error'] else 'outside'} 5%)")
    # loss curves of N GPUs against 1 GPU at the same global batch (the same batches: the lab draws the global
    # batch from one seeded stream and gives each rank its rows)
    for c in cases:
        same = (c.get("extra") or {}).get("same_global_batch") or {}
        if c["gpus"] >= 2 and same.get("loss_max_abs_diff") is not None:
            out.append(f"{c['model']} {c['gpus']} GPUs {c['strategy']} against 1 GPU at global batch "
                       f"{same['global_batch']}: loss differs by at most {same['loss_max_abs_diff']:.2e} over "
                       f"{same['loss_steps']} steps")
    for c in cases:
        # the goal is data parallelism's: tensor parallelism (tp, a 2-D mesh's -tp<t>) splits each GPU's batch's work
        tensor_parallel = re.search(r"(^|-)tp\d*$", c["strategy"])
        if c["model"] == "llama-1b" and c["gpus"] == 4 and c["scaling_efficiency"] is not None and not tensor_parallel:
            s = c["scaling_efficiency"]
            how = c["strategy"] + ("" if c["precision"] == "bf16" else f" ({c['precision']})")
            out.append(f"1B {how} scaling at 4 GPUs (same per-GPU batch) >= {GOALS['scaling_1b_4gpu']}: "
                       f"{s:.2f} ({'met' if s >= GOALS['scaling_1b_4gpu'] else 'missed'})")
    # the anchor, not a goal: llm.c's GPT-2 124M on 8 H100s
    for c in cases:
        if c["model"] == "gpt2-124m" and c["tokens_per_s_per_gpu"] and c["scaling_efficiency"] is not None:
            out.append(f"gpt2-124m {c['gpus']} GPUs {c['strategy']}: {c['tokens_per_s_per_gpu']:,.0f} tokens/s per GPU, "
                       f"{c['tokens_per_s_per_gpu'] / LLMC_GPT2_PER_GPU:.2f}x llm.c's ~{LLMC_GPT2_PER_GPU:,} (anchor)")
    return out


def _f(v, spec=",.0f"):
    return "-" if v is None else format(v, spec)


def _same(c: dict) -> dict:
    return (c.get("extra") or {}).get("same_global_batch") or {}


def loss_table(cases: list[dict], rows: int = 8) -> list[str]:
    """Per model, the loss curves of N GPUs against 1 GPU at the same global batch, at a few steps (Markdown)."""
    lines = []
    for model in dict.fromkeys(c["model"] for c in cases):
        runs = [c for c in cases if c["model"] == model and _same(c).get("losses")]
        if not runs:
            continue
        one = _same(runs[0])["one_gpu_losses"]
        steps = sorted({round(i * (len(one) - 1) / max(rows - 1, 1)) for i in range(rows)}) if one else []
        head = ["step", f"1 GPU (batch {_same(runs[0])['global_batch']})",
                *[f"{c['gpus']} x {c['strategy']} ({c['precision']})" for c in runs]]
        lines += ["", f"{model}: training loss at the same global batch", "", "| " + " | ".join(head) + " |",
                  "|---" * len(head) + "|"]
        for i in steps:
            cells = [_f(c_losses[i] if i < len(c_losses) else None, ".4f")
                     for c_losses in [one, *[_same(c)["losses"] for c in runs]]]
            lines.append(f"| {i + 1} | " + " | ".join(cells) + " |")
    return lines


def readme_section(data: dict) -> str:
    """The README block generated from ``scale.json`` (between the markers the integrator includes)."""
    lines = [README_START, f"### Past one GPU: {data['machine']} ({data['device']})", "",
             "| model | GPUs | strategy | precision | tune's pick | tokens/s per GPU | peak MiB per GPU | predicted MiB "
             "| scaling | scaling, same global batch | max loss diff vs 1 GPU | HF Trainer | HF Trainer, best flags "
             "| tune s |", "|---" * 14 + "|"]
    for c in data["cases"]:
        same = _same(c)
        lines.append(f"| {c['model']} | {c['gpus']} | {c['strategy']} | {c['precision']} | {'yes' if c['pick'] else ''} "
                     f"| {_f(c['tokens_per_s_per_gpu'])} | {_f(c['peak_mib_per_gpu'])} | {_f(c['predicted_mib_per_gpu'])} "
                     f"| {_f(c['scaling_efficiency'], '.2f')} | {_f(same.get('scaling_efficiency'), '.2f')} "
                     f"| {_f(same.get('loss_max_abs_diff'), '.2e')} | {_f(c['hf_trainer_tokens_per_s_per_gpu'])} "
                     f"| {_f(c['hf_trainer_flags_tokens_per_s_per_gpu'])} | {_f(c['tune_s'])} |")
    lines += ["", "scaling: tokens/s per GPU over one GPU's at the same per-GPU batch; same global batch: N GPUs at "
              "one GPU's batch (B/N each), the loss difference the largest over the logged steps.",
              *loss_table(data["cases"])]
    lines += ["", "Goals:", *[f"- {g}" for g in data["goals"]]]
    if data.get("gpu_tests"):
        lines += ["", f"GPU tests: `{data['gpu_tests']}`"]
    if data.get("profiles"):
        lines += ["", "Profiles: " + ", ".join(f"`{p}`" for p in data["profiles"])]
    lines += ["", f"Command: `{data['command']}`", README_END]
    return "\n".join(lines)


def add_todays_prediction(out: Path, cases: list[dict]) -> None:
    """Beside each lab run's prediction at measurement time, today's estimator's for the same recorded configuration
    (``dev/memory/heldout.py``'s row, with the rules written since against it): a committed run stays as measured
    while the estimator it checks moves on."""
    spec = importlib.util.spec_from_file_location("heldout", HERE.parent / "memory" / "heldout.py")
    heldout = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(heldout)
    for c in cases:
        source = (c.get("extra") or {}).get("source") or ""
        path = out / c["model"] / source
        # a run with a measured peak only (a CPU run measures none: nothing to judge a prediction against)
        record = _json(path) if source.endswith(".json") and c["peak_mib_per_gpu"] else None
        if not record or record.get("kind") != "lab-run":
            continue
        row = heldout.lab_record_row(record, path, lambda p: str(p))
        if row["prediction"] == "today's estimator" and row["predicted_mib"]:
            c["extra"]["predicted_today_mib"] = row["predicted_mib"]
            c["extra"]["rules_since"] = row["rules"]


def report(out: Path, results: Path, command: str) -> Path:
    """``results/dist/<machine>/scale.json`` and its README from the files a device run wrote under ``out``."""
    env = (out / "env.txt").read_text() if (out / "env.txt").exists() else ""
    gpus = [line.split(",")[1].strip() for line in env.splitlines() if line[:1].isdigit() and "," in line]
    device = f"{len(gpus)} x {gpus[0]}" if gpus else "unknown"
    kind = "h200" if gpus and "H200" in gpus[0] else "h100"
    machine = f"nvidia-{kind}-x{len(gpus)}" if gpus else "unknown"
    cases = [c for model in (*MODELS, *PROFILED_PRESETS) for c in collect(out, model)]
    add_todays_prediction(out, cases)
    tests = out / "gpu-tests.txt"
    passed = [line for line in (tests.read_text().splitlines() if tests.exists() else []) if " passed" in line
              or " failed" in line]
    folder = results / machine
    folder.mkdir(parents=True, exist_ok=True)
    profiles = []
    # the profiled steps of any model or preset (char-100m's sides; the 1B's DDP step)
    for preset in (*MODELS, *PROFILED_PRESETS):
        found = sorted((out / preset).glob("prof*.tgz")) + sorted((out / preset).glob("prof/profile-*-rank0.json"))
        if found:
            sys.path.insert(0, str(HERE))
            table = profile_table(read_summaries(found))
            (folder / f"profile-{preset}.md").write_text(f"# {preset}: one step per side, rank 0\n\n{table}\n")
            profiles.append(f"profile-{preset}.md")
    data = {"kind": "scale", "schema": 1, "machine": machine, "device": device, "cases": cases,
            "goals": goal_lines(cases), "gpu_tests": passed[-1].strip("= ") if passed else None, "command": command,
            "profiles": profiles}
    (folder / "scale.json").write_text(json.dumps(data, indent=1, default=str))
    (folder / "README.md").write_text(f"# The scale-out benchmark on {device}\n\nGenerated by "
                                      f"`python3 dev/dist/bench_scale.py report` from `scale.json` (this folder).\n\n"
                                      + readme_section(data) + "\n")
    log(readme_section(data))
    return folder


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="phase", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("work", type=Path)
    p.add_argument("--model", choices=MODELS, required=True)
    p.add_argument("--tokens", type=int, default=4_000_000)
    for phase in ("hf", "lab-profile"):       # one run of a side: the same shape of arguments
        p = sub.add_parser(phase)
        p.add_argument("work", type=Path)
        p.add_argument("--model", choices=MODELS, required=phase == "hf")
        p.add_argument("--micro-batch", type=int, default=1)
        p.add_argument("--accumulation", type=int, default=1)
        p.add_argument("--steps", type=int, default=8)
        p.add_argument("--skip", type=int, default=3)
        p.add_argument("--out", type=Path)
        p.add_argument("--profile", type=Path, required=phase == "lab-profile")
        if phase == "hf":
            p.add_argument("--flags", default="{}", help="JSON: TrainingArguments added to the users' ones.")
        else:
            p.add_argument("--preset", help="A lab preset instead of --model (its own batch; more flags after --).")
            p.add_argument("--side", default="lab", help="The profile's name: profile-<side>-rank<r>.json.")
    p = sub.add_parser("sweep-flags", help="The lab flags a scaling sweep of --model takes after its --.")
    p.add_argument("work", type=Path)
    p.add_argument("--model", choices=MODELS, required=True)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--accumulation", type=int, default=1)
    p = sub.add_parser("report")
    p.add_argument("out", type=Path, help="the folder a device run wrote (one sub-folder per model)")
    p.add_argument("--results", type=Path, default=Path("results/dist"))
    p.add_argument("--command", default="bash dev/device/scale_case.sh")
    p = sub.add_parser("profile-table")
    p.add_argument("summaries", type=Path, nargs="+", help="profile-<side>-rank0.json files or a .tgz of them")
    p.add_argument("--lab-record", type=Path)
    p.add_argument("--hf-record", type=Path)
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    a = ap.parse_args(argv[:cut])
    a.extra = argv[cut + 1:]           # lab-profile: more `fasttrain lab` flags, after --
    if a.phase == "prepare":
        prepare(a.work, a.model, a.tokens)
    elif a.phase == "profile-table":
        sys.path.insert(0, str(HERE))
        print(profile_table(read_summaries(a.summaries), a.lab_record, a.hf_record))
    elif a.phase == "report":
        report(a.out, a.results, a.command)
    elif a.phase == "hf":
        hf_worker(a.work, a.model, micro_batch=a.micro_batch, accumulation=a.accumulation, steps=a.steps,
                  skip=a.skip, flags=json.loads(a.flags), out=a.out, profile=a.profile)
    elif a.phase == "sweep-flags":
        import shlex

        print(shlex.join(sweep_flags(a.work, a.model, micro_batch=a.micro_batch, accumulation=a.accumulation)))
    elif a.phase == "lab-profile":
        if (a.model is None) == (a.preset is None):
            ap.error("lab-profile: give --model or --preset (one)")
        extra = list(a.extra) + (["--out", str(a.out)] if a.out else [])
        argv = (["lab", "--preset", a.preset, "--max-steps", str(a.steps), *extra] if a.preset else
                lab_args(a.work, a.model, micro_batch=a.micro_batch, accumulation=a.accumulation, steps=a.steps,
                         extra=extra))
        return lab_profile_worker(a.profile, argv, a.skip, a.side)
    return 0


if __name__ == "__main__":
    sys.exit(main())
