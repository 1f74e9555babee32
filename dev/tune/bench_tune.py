"""The GPU benchmark of ``fasttrain tune`` against the Hugging Face Trainer, one model per call sequence.

For one model -- a GPT-2 124M at seq 1024 (a global batch of 524,288 tokens), a Llama of about 1B parameters
at seq 2048 (131,072 tokens) or a Qwen2.5-0.5B shape with its 151,936-token vocabulary at seq 1024 (131,072
tokens; see MODELS), each written here as a config folder (random init), bf16 -- it measures side by side:

(a) ``hf``:       the HF Trainer as its users run it: ``bf16=True``, sdpa, ``auto_find_batch_size=True``
                  from the Trainer's default micro-batch (8), ``gradient_accumulation_steps`` reaching
                  the global batch (re-derived when the finder halves the micro-batch: the Trainer
                  keeps the accumulation, so a user keeps the global batch by rerunning at the found size);
(b) ``hf-flags``: the Trainer searched as a careful user searches it: every micro-batch in powers of two
                  from 8 up to the largest that fits (the global batch kept by the accumulation), for
                  each of its own speed flags apart and together (none, ``torch_compile`` and its
                  ``max-autotune-no-cudagraphs`` mode, ``use_liger_kernel`` where liger has the family's
                  kernels, liger with compile), all over ``optim="adamw_torch_fused"``, ``tf32``,
                  ``logging_nan_inf_filter=False`` and two DataLoader workers; the column is the best
                  point, and every point is kept (``hf_search_points``: a call that runs out of time
                  leaves the rest to the next);
(c) ``tune``:     ``fasttrain tune``'s pick within its budget (``--budget``);
(d) ``grid``:     a grid over tune's space fixed before the search, not derived from it: every
                  configuration that fits (by the estimator) when they are at most ``--grid-size``,
                  else ``--grid-size`` of them chosen to span every choice of every axis (a seeded
                  sample after a greedy cover); measured through tune's probes (one timed step each, or
                  tune's own longer probe of the point where it measured one);
(e) ``confirm``:  the pick trained ``--confirm-steps`` steps through the lab (its measured peak against
                  the estimator's prediction, and whether it runs out of memory).

Every HF figure is timed by a ``TrainerCallback`` (the device synchronized at every optimizer step's
end; the first ``--skip`` steps excluded); the lab's probes by the lab's trainer (the first steps
timed apart). Everything sees the same model (config folder, seed) and the same data: random token
windows of a seeded ``train.bin`` (uint16 ids, uint32 above 65,535), so no tokenizer or download is needed.

Each phase is one command that fits the device's 10-minute limit; the phases of one model share a
work folder (``WORK/<model>/state.json`` holds every phase's figures), so they can run in a row in
one lease::

    python3 dev/tune/bench_tune.py prepare  WORK --model gpt2-124m
    python3 dev/tune/bench_tune.py hf       WORK --model gpt2-124m
    python3 dev/tune/bench_tune.py hf-flags WORK --model gpt2-124m
    python3 dev/tune/bench_tune.py tune     WORK --model gpt2-124m --budget 7m
    python3 dev/tune/bench_tune.py grid     WORK --model gpt2-124m --part 1/3     (2/3, 3/3)
    python3 dev/tune/bench_tune.py confirm  WORK --model gpt2-124m
    python3 dev/tune/bench_tune.py report   WORK --results results/tune

``all`` runs every phase in one process (the CPU test's tiny model; ``--quick`` on a GPU).

A lease of several GPUs of one host runs one lane per GPU side by side, each with its own work folder
(``dev/device/tune_lanes.sh``): ``fix-grid`` fixes the grid in lane A before its search; the other lanes'
``grid --members-from`` measure the same members; ``--claims DIR`` lets the lanes take the grid's points one at
a time (each point measured once, on whichever GPU is free, a point started only where its expected time fits
``--time-left``); ``hf-flags --share k/n`` splits the Trainer's flag variants between lanes; ``merge --from``
folds the other lanes' figures into lane A's state (the Trainer's column summed up again from every point);
``crosscheck`` measures the pick and the grid's best on each GPU, so that figures from several cards compare;
``alone``, run with nothing else on the host after the pick's ``confirm`` on the same GPU, measures the
Trainer's best point and the Trainer as users run it again there: the goals' ratios come from that long run on
one card. Every figure records the GPU it ran on (``CUDA_VISIBLE_DEVICES``).
``report`` writes ``results/tune/<machine>/tune.json`` (``cases``: one entry per model with exactly
the keys of :data:`CASE_KEYS`) and ``README.md`` generated from that folder. ``readme`` writes a committed
folder's ``README.md`` again and, with ``--into results/README.md``, the results index's tune section (every
machine's folder, ``--also``), between the lines of :data:`README_START` and :data:`README_END`::

    python3 dev/tune/bench_tune.py readme results/tune/nvidia-h100-80gb-hbm3 --also results/tune/nvidia-h200 \\
        --into results/README.md
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

CASE_KEYS = ("model", "pick_tokens_per_s", "best_tokens_per_s", "hf_trainer_tokens_per_s",
             "hf_trainer_flags_tokens_per_s", "pick_peak_mib", "pick_predicted_mib", "tune_s",
             "hf_trainer_points", "long_run")
# the libraries whose versions a figure depends on, recorded by every phase where it ran
BENCH_LIBRARIES = ("torch", "transformers", "accelerate", "liger-kernel", "peft", "torchao", "triton")
MIB = 2 ** 20
GLOBAL_TOKENS = 524_288         # 0.5M tokens per optimizer step

MODELS = {
    # GPT-2 small: 12 x 768, 12 heads, 1024 positions, vocabulary 50257 padded to 50304 (a multiple of 64), tied
    "gpt2-124m": dict(seq=1024, tokens=GLOBAL_TOKENS, config=dict(
        model_type="gpt2", vocab_size=50304, n_positions=1024, n_embd=768, n_layer=12, n_head=12,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
    # Llama-3.2-1B's shape with a 32000 vocabulary: 16 x 2048, 32 heads over 8 key/value heads, SwiGLU 8192,
    # tied embeddings: 1.03B parameters. A global batch of 64 sequences (131,072 tokens, a fine-tuning batch): at
    # 0.5M tokens a step is about 8x GPT-2's, and its grid and 200-step confirmation would not fit one lease
    "llama-1b": dict(seq=2048, tokens=64 * 2048, config=dict(
        model_type="llama", vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=2048, tie_word_embeddings=True,
        rope_theta=500000.0)),
    # Qwen2.5-0.5B's shape: 24 x 896, 14 heads over 2 key/value heads, SwiGLU 4864, tied embeddings over a
    # 151,936-token vocabulary (136M of its 494M parameters): the case where the head and the loss dominate and
    # the fused linear cross-entropy with compiled layers (which the Trainer cannot combine) should pay most.
    # 128 sequences of 1024 a step (131,072 tokens, as the Llama case's); ids above 65,535: uint32 token files
    "qwen2.5-0.5b": dict(seq=1024, tokens=128 * 1024, config=dict(
        model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768, tie_word_embeddings=True,
        rope_theta=1000000.0, rms_norm_eps=1e-6)),
    # the CPU test's model: every phase in seconds
    "tiny-gpt2": dict(seq=32, tokens=32 * 8, config=dict(
        model_type="gpt2", vocab_size=256, n_positions=64, n_embd=32, n_layer=2, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
}
README_START, README_END = "<!-- tune-results:start -->", "<!-- tune-results:end -->"
SECTION_LEVEL = 3               # a machine's heading in the results index, under the index's "## fasttrain tune ..."
HF_DEFAULT_BATCH = 8            # TrainingArguments.per_device_train_batch_size's default
LEARNING_RATE = 3e-4


def log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


# --- the work folder -----------------------------------------------------------------------------

def model_dir(work: Path, name: str) -> Path:
    return work / name


def load_state(work: Path, name: str) -> dict:
    path = model_dir(work, name) / "state.json"
    return json.loads(path.read_text()) if path.exists() else {"model": name}


def save_state(work: Path, name: str, state: dict) -> None:
    from fasttrain.files import atomic_write_text

    atomic_write_text(model_dir(work, name) / "state.json", json.dumps(state, indent=2, default=str))


def gpu_slot() -> str | None:
    """Which of the host's GPUs this process measures on (``CUDA_VISIBLE_DEVICES``): recorded beside every
    figure, since a two-GPU lease runs two lanes of phases side by side."""
    return os.environ.get("CUDA_VISIBLE_DEVICES")


def point_seconds(overrides: dict) -> float:
    """A grid point's expected wall time, model built, compiled, warmed up and timed (the H100's Llama 1B case:
    eager attention compiled whole with checkpointing 89-91 s, compiled per block 37 s, not compiled 6 s; the
    Trainer's max-autotune mode benchmarks its GEMMs' choices too): whether a point still fits the time a call has
    left."""
    if not overrides.get("torch_compile"):
        return 25.0
    if str(overrides.get("torch_compile_mode") or "").startswith("max-autotune"):
        return 240.0
    return 55.0 if overrides.get("torch_compile_scope") == "blocks" else 110.0


def point_key(overrides: dict) -> str:
    return json.dumps(sorted(overrides.items()), default=str)


def claim(claims: Path | None, index: int) -> bool:
    """Take grid point ``index`` for this lane (an exclusively created file): False when the other lane has it.
    A claim whose point never finished (its call ran out) is cleared by the lease's script between calls."""
    if claims is None:
        return True
    claims.mkdir(parents=True, exist_ok=True)
    try:
        os.close(os.open(claims / str(index), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def bin_dtype(name: str) -> str:
    """The token files' id type: uint16 holds ids below 65,536, a larger vocabulary needs uint32."""
    return "uint32" if MODELS[name]["config"]["vocab_size"] > 65536 else "uint16"


def prepare(work: Path, name: str, n_tokens: int | None = None) -> Path:
    """The model's config folder and the data: ``train.bin`` / ``val.bin``, seeded random ids (:func:`bin_dtype`)."""
    import numpy as np
    import transformers as tf

    spec = MODELS[name]
    folder = model_dir(work, name)
    (folder / "model").mkdir(parents=True, exist_ok=True)
    cfg = dict(spec["config"])
    kind = cfg.pop("model_type")
    config = tf.AutoConfig.for_model(kind, **cfg)
    config.save_pretrained(folder / "model")
    vocab = cfg["vocab_size"]
    n = n_tokens or max(4 * spec["tokens"], 200_000)
    rng = np.random.default_rng(1234)
    dtype = np.dtype(bin_dtype(name))
    for split, size in (("train", n), ("val", max(n // 10, 4 * spec["seq"] + 2))):
        rng.integers(0, vocab, size=size, dtype=np.int64).astype(dtype).tofile(folder / f"{split}.bin")
    with __import__("torch").device("meta"):
        params = sum(p.numel() for p in tf.AutoModelForCausalLM.from_config(config).parameters())
    state = load_state(work, name)
    state.update({"params": params, "seq": spec["seq"], "global_batch_tokens": spec["tokens"]})
    save_state(work, name, state)
    log(f"{name}: {kind}, {params / 1e6:.1f}M parameters, {n:,} training tokens -> {folder}")
    return folder


# --- (a), (b): the Hugging Face Trainer ------------------------------------------------------------

def hf_trainer_case(work: Path, name: str, *, steps: int, skip: int, cuda: bool) -> dict:
    """(a): the HF Trainer as its users run it: tokens/s over its optimizer steps after the first ``skip``; the
    micro-batch its finder settled on; the peak memory."""
    spec = MODELS[name]
    start = min(HF_DEFAULT_BATCH, spec["tokens"] // spec["seq"])
    notes: list = []
    result = _hf_found_run(work, name, start=start, extra={}, steps=steps, skip=skip, cuda=cuda, notes=notes)
    result["flags"], result["notes"] = {}, notes
    return result


# (b): the flags every point of the search has, and the ones it tries apart and together
TRAINER_FLAGS = dict(optim="adamw_torch_fused", logging_nan_inf_filter=False, dataloader_num_workers=2)


def trainer_micro_batches(sequences: int) -> list[int]:
    """Powers of two from the Trainer's default micro-batch (8) up to the global batch's sequences."""
    out, batch = [], min(HF_DEFAULT_BATCH, sequences)
    while batch <= sequences:
        out.append(batch)
        batch *= 2
    return out


def trainer_variants(model_type: str, cuda: bool) -> tuple[list[dict], list[str]]:
    """The Trainer's own speed flags a careful user tries, apart and together (GPU techniques: none on the CPU)."""
    if not cuda:
        return [{}], ["on the CPU: no torch_compile, tf32 or liger (GPU techniques)"]
    from fasttrain.lab.tune import liger_support

    variants = [{}, {"torch_compile": True},
                {"torch_compile": True, "torch_compile_mode": "max-autotune-no-cudagraphs"}]
    reason = liger_support(model_type)
    if reason:
        return variants, [f"use_liger_kernel off: {reason}"]
    return variants + [{"use_liger_kernel": True}, {"use_liger_kernel": True, "torch_compile": True}], []


def hf_search_case(work: Path, name: str, *, steps: int, skip: int, cuda: bool,
                   time_left: float | None = None, share: tuple[int, int] = (1, 1)) -> dict:
    """(b): the HF Trainer at its best. For each variant of its flags (:func:`trainer_variants` over
    :data:`TRAINER_FLAGS`, tf32 on a GPU), every micro-batch of :func:`trainer_micro_batches`, smallest first, with
    the accumulation that keeps the global batch and the finder off: a point out of memory ends that variant's
    ladder (a larger micro-batch does not fit either), one a library cannot run ends the variant. Every point is
    saved as it is measured (``hf_search_points`` in the state) and read back by the next call; with
    ``time_left`` a point starts only where its expected time (:func:`point_seconds`) fits. ``share`` k/n: this
    lane's variants (those whose index is k-1 modulo n), the others' lanes measuring the rest (``merge`` folds their
    points together). Returns :func:`trainer_search_summary` of the points this state holds."""
    spec = MODELS[name]
    base = dict(TRAINER_FLAGS, **({"tf32": True} if cuda else {}))
    variants, _ = trainer_variants(spec["config"]["model_type"], cuda)
    points = {_trainer_point_key(p["flags"], p["batch"]): p for p in load_state(work, name).get("hf_search_points", [])}
    k, n = share
    t0, out_of_time = time.perf_counter(), False
    for variant in [v for i, v in enumerate(variants) if i % n == k - 1]:
        while (step := _next_trainer_point(dict(base, **variant), spec, points)) is not None:
            flags, batch = step
            if time_left is not None and time.perf_counter() - t0 + point_seconds(variant) > time_left:
                out_of_time = True
                break
            key = _trainer_point_key(flags, batch)
            points[key] = _trainer_point(work, name, batch=batch, flags=flags, steps=steps, skip=skip, cuda=cuda)
            state = load_state(work, name)
            state["hf_search_points"] = list(points.values())
            save_state(work, name, state)
            log(f"trainer {_flags_label(flags)} {batch}: {points[key]['status']} "
                f"{_fmt(points[key].get('tokens_per_s'))} tokens/s")
        if out_of_time:
            break
    summary = trainer_search_summary(name, list(points.values()), cuda)
    summary["share_complete"] = not out_of_time
    return summary


def trainer_search_summary(name: str, points: list[dict], cuda: bool | None = None) -> dict:
    """The Trainer's column from every point measured (one lane's, or the lanes' merged): the best point, every
    point, and whether the search is complete -- every variant's ladder ended (a point that did not fit or did not
    run, or its largest micro-batch measured). Before any point ran the column is empty (``tokens_per_s`` None);
    a complete search where none ran is one line. ``cuda`` None: read from the points (a GPU's search starts every
    ladder with tf32, TRAINER_FLAGS' base there)."""
    if cuda is None:
        cuda = any(p["flags"].get("tf32") for p in points)
    spec = MODELS[name]
    base = dict(TRAINER_FLAGS, **({"tf32": True} if cuda else {}))
    variants, notes = trainer_variants(spec["config"]["model_type"], cuda)
    by_key = {_trainer_point_key(p["flags"], p["batch"]): p for p in points}
    ended = [_next_trainer_point(dict(base, **variant), spec, by_key) is None for variant in variants]
    ran = [p for p in points if p["status"] == "ok"]
    complete = all(ended)
    if not ran and complete:
        raise SystemExit(f"{name}: no point of the HF Trainer's search ran: "
                         + "; ".join(f"{_flags_label(p['flags'])} {p['batch']}: {p['status']}" for p in points))
    best = dict(max(ran, key=lambda p: p["tokens_per_s"])) if ran else {"tokens_per_s": None}
    # a point that did not run with tf32 is tried again without it (_next_trainer_point); without, its variant ended
    failed = sorted({f"{_flags_label(p['flags'])}: {p['error']}" + _known_cause(p["error"])
                     + (" (its ladder goes on without tf32)" if p["flags"].get("tf32") else " (this variant ended)")
                     for p in points if p["status"].startswith("failed")})
    if ran:
        notes = notes + [f"the Trainer's best of {len(ran)} points measured ({len(points) - len(ran)} did not run): "
                         f"{_flags_label(best['flags'])} at micro-batch {best['batch']} x "
                         f"{best['gradient_accumulation_steps']}"]
    notes += failed
    if not complete:
        notes.append(f"the search is not complete ({ended.count(False)} of its {len(variants)} variants' ladders "
                     "unfinished): rerun the phase for the rest")
    best.update(points=sorted(points, key=lambda p: (_flags_label(p["flags"]), p["batch"])),
                complete=complete, notes=notes)
    return best


# why the Trainer's failures seen so far happen (from their tracebacks and the libraries' code), by the error's text
TRAINER_FAILURE_CAUSES = {
    "mix of the legacy and new APIs": "TrainingArguments sets torch's newer fp32 precision switch whenever "
    "torch_compile and bf16 are on (tf32 or not), and inductor's max-autotune reads the legacy one: the Trainer "
    "cannot run max-autotune in bf16 on this torch",
    "when making fake tensor call": "dynamo's fake tensors fail in liger's patched forward when the Trainer compiles "
    "the whole model",
}


def _known_cause(error: str | None) -> str:
    return "".join(f" [{cause}]" for text, cause in TRAINER_FAILURE_CAUSES.items() if text in (error or ""))


def _next_trainer_point(flags: dict, spec: dict, points: dict) -> tuple[dict, int] | None:
    """Where one variant's ladder stands among the ``points`` measured (by :func:`_trainer_point_key`): the flags and
    micro-batch to measure next, or None once the ladder ended -- a point out of memory, one that did not run
    without tf32, or its largest micro-batch measured. A point that does not run with tf32 is tried once without
    it, and the ladder goes on without it, as a careful user would (torch 2.11's inductor refuses the Trainer's
    tf32 switch, its newer precision API, under max-autotune: mixed precision APIs; TrainingArguments throws that
    switch by itself whenever ``torch_compile`` and ``bf16`` are on, so the point without tf32 fails the same way,
    measured in a process of its own -- its failure ends the ladder, said in the column's notes)."""
    for batch in trainer_micro_batches(spec["tokens"] // spec["seq"]):
        point = points.get(_trainer_point_key(flags, batch))
        if point is not None and point["status"].startswith("failed") and flags.get("tf32"):
            flags = {k: v for k, v in flags.items() if k != "tf32"}
            point = points.get(_trainer_point_key(flags, batch))
        if point is None:
            return flags, batch
        if point["status"] != "ok":
            return None
    return None


def _trainer_point_key(flags: dict, batch: int) -> str:
    return f"{point_key(flags)}@{batch}"


def _trainer_point(work: Path, name: str, *, batch: int, flags: dict, steps: int, skip: int, cuda: bool) -> dict:
    """One point of the Trainer's search: ``status`` ok, oom, or failed (a combination a library cannot run)."""
    try:
        # _hf_run's figures carry the micro-batch and the accumulation it ran
        result = _hf_run(work, name, batch=batch, extra=flags, steps=steps, skip=skip, cuda=cuda, find=False)
        return {**result, "flags": dict(flags), "status": "ok", "gpu": gpu_slot()}
    except Exception as exc:  # noqa: BLE001 - out of memory or a library's refusal is this point's result
        _release_failed_run(cuda)
        spec = MODELS[name]
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        oom = type(exc).__name__ == "OutOfMemoryError" or "out of memory" in str(exc).lower()
        return {"batch": batch, "gradient_accumulation_steps": max(1, spec["tokens"] // (batch * spec["seq"])),
                "flags": dict(flags), "tokens_per_s": None, "error": f"{type(exc).__name__}: {first}",
                "status": "oom" if oom else f"failed: {type(exc).__name__}", "gpu": gpu_slot()}


def _flags_label(flags: dict) -> str:
    parts = [k for k, v in flags.items() if v is True]
    if flags.get("torch_compile_mode"):
        parts.append(f"mode={flags['torch_compile_mode']}")
    return "+".join(parts) or "no flags"


def _release_failed_run(cuda: bool) -> None:
    """A failed run's frames hold its model and compiled code: drop them before the next variant."""
    import gc

    import torch

    torch._dynamo.reset()
    gc.collect()
    if cuda and torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _hf_found_run(work: Path, name: str, *, start: int, extra: dict, steps: int, skip: int, cuda: bool,
                  notes: list) -> dict:
    spec = MODELS[name]
    seq, tokens = spec["seq"], spec["tokens"]
    result = _hf_run(work, name, batch=start, extra=extra, steps=steps, skip=skip, cuda=cuda)
    found = result["found_batch"]
    if found != start:
        # the finder halved the micro-batch but kept the accumulation: the global batch shrank by start/found;
        # a user keeping the global batch reruns at the found size with the accumulation re-derived
        notes.append(f"auto_find_batch_size found {found} (from {start}); rerun at {found} x "
                     f"{tokens // (found * seq)} to keep {tokens:,} tokens per step")
        result = _hf_run(work, name, batch=found, extra=extra, steps=steps, skip=skip, cuda=cuda)
    return result


def token_windows(ids, seq: int, count: int, seed: int = 0):
    """A Dataset of ``count`` token windows of ``ids`` at seeded random offsets: ``input_ids`` = ``labels`` (the
    model shifts them). (Also the scale-out benchmark's: ``dev/dist/bench_scale.py``.)"""
    import numpy as np
    import torch

    class Windows(torch.utils.data.Dataset):
        def __init__(self):
            self.offsets = np.random.default_rng(seed).integers(0, len(ids) - seq - 1, size=count)

        def __len__(self):
            return len(self.offsets)

        def __getitem__(self, i):
            w = torch.from_numpy(ids[self.offsets[i]:self.offsets[i] + seq].astype(np.int64))
            return {"input_ids": w, "labels": w}
    return Windows()


def step_timer(cuda: bool, after_step=None):
    """A ``TrainerCallback`` keeping the time of every optimizer step (``.times``): the device synchronized at each
    step's end (and at the start); the finder's retries restart the list. ``after_step()``: called after each."""
    import torch
    import transformers as tf

    class StepTimer(tf.TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            self.times, self.t = [], time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            if cuda:
                torch.cuda.synchronize()
            now = time.perf_counter()
            self.times.append(now - self.t)
            self.t = now
            if after_step is not None:
                after_step()
    return StepTimer()


def _hf_run(work: Path, name: str, *, batch: int, extra: dict, steps: int, skip: int, cuda: bool,
            find: bool = True) -> dict:
    import numpy as np
    import torch
    import transformers as tf

    spec = MODELS[name]
    seq, tokens = spec["seq"], spec["tokens"]
    folder = model_dir(work, name)
    ids = np.fromfile(folder / "train.bin", dtype=np.dtype(bin_dtype(name)))
    accumulation = max(1, tokens // (batch * seq))

    Windows = lambda count: token_windows(ids, seq, count)      # noqa: E731
    timer = step_timer(cuda)

    from fasttrain.lab.hf import liger_patched_names, modeling_modules_restored

    config = tf.AutoConfig.from_pretrained(folder / "model")
    # the Trainer's use_liger_kernel patches the family's modeling module for the whole process (its RMSNorm, MLP,
    # RoPE and the causal LM's forward): each run puts it back, and none measures a model built from a patched one
    patched = liger_patched_names(config.model_type)
    if patched:
        raise SystemExit(f"the HF Trainer's {config.model_type} would be built from liger's patches left by an "
                         f"earlier run in this process ({', '.join(patched[:3])}): run it in a process of its own")
    with tempfile.TemporaryDirectory() as out, precision_switches_kept(), \
            modeling_modules_restored(config.model_type):
        torch.manual_seed(0)
        model = tf.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
        model.config.use_cache = False
        args = tf.TrainingArguments(
            output_dir=out, max_steps=steps, per_device_train_batch_size=batch,
            gradient_accumulation_steps=accumulation, bf16=True, auto_find_batch_size=find,
            learning_rate=LEARNING_RATE, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.1,
            logging_steps=max(1, steps), save_strategy="no", report_to="none", seed=0, use_cpu=not cuda,
            disable_tqdm=True, **extra)
        trainer = tf.Trainer(model=model, args=args, train_dataset=Windows(steps * batch * accumulation * 4),
                             callbacks=[timer])
        t0 = time.perf_counter()
        trainer.train()
        wall = time.perf_counter() - t0
        found = int(getattr(trainer, "_train_batch_size", batch) or batch)
    timed = timer.times[skip:]
    per_step = found * accumulation * seq
    mean = sum(timed) / len(timed) if timed else None
    peak = torch.cuda.max_memory_allocated() if cuda else None
    del trainer, model
    if cuda:
        torch.cuda.empty_cache()
    return {"tokens_per_s": per_step / mean if mean else None, "found_batch": found, "batch": batch,
            "gradient_accumulation_steps": accumulation, "tokens_per_step": per_step, "step_s": timed,
            "first_steps_s": timer.times[:skip], "peak_mib": peak / MIB if peak else None, "wall_s": wall,
            "steps": steps, "skip": skip}


# torch's float32 precision switches, the newer per-backend API (torch.backends.<backend>.fp32_precision)
PRECISION_SWITCHES = ("", "cuda.matmul", "cudnn", "cudnn.conv", "cudnn.rnn", "mkldnn", "mkldnn.matmul", "mkldnn.conv",
                      "mkldnn.rnn")


@contextlib.contextmanager
def precision_switches_kept():
    """Every Trainer run leaves torch's precision switches as it found them. ``tf32=True`` (and ``torch_compile``
    with ``bf16``, whatever ``tf32`` says) sets the newer API (``torch.backends.fp32_precision = "tf32"``) for the rest
    of the process; inductor's max-autotune reads the legacy getter, which refuses the mix: a later point of the
    search in that process would otherwise carry a state the run before it left, not its own flags. transformers
    remembers that it set the switch (``enable_tf32`` is cached): forgotten here too, or the next point asking for
    tf32 would run without it."""
    import torch

    def owner(path):
        obj = torch.backends
        for part in filter(None, path.split(".")):
            obj = getattr(obj, part, None)
        return obj
    kept = {path: owner(path).fp32_precision for path in PRECISION_SWITCHES
            if hasattr(owner(path), "fp32_precision")}
    try:
        yield
    finally:
        for path, value in kept.items():
            owner(path).fp32_precision = value
        from transformers.utils import import_utils

        forget = getattr(getattr(import_utils, "enable_tf32", None), "cache_clear", None)
        if forget is not None:
            forget()


# --- (c), (d), (e): the lab ----------------------------------------------------------------------

def lab_base(work: Path, name: str, cuda: bool):
    """The lab's configuration of the same model and data (the search's fixed part)."""
    from fasttrain.errors import FasttrainError
    from fasttrain.lab.config import LabConfig

    spec = MODELS[name]
    folder = model_dir(work, name)
    try:
        return LabConfig(name="custom").with_(
            model=f"hf:{folder / 'model'}", train_bin=str(folder / "train.bin"), val_bin=str(folder / "val.bin"),
            bin_dtype=bin_dtype(name), context=spec["seq"], learning_rate=LEARNING_RATE, min_lr=LEARNING_RATE,
            warmup_steps=0, weight_decay=0.1, dropout=0.0, device="cuda" if cuda else "cpu", eval_interval=0,
            eval_tokens=spec["seq"], seed=0)
    except FasttrainError as exc:
        raise SystemExit(f"this lab cannot train a transformers model on token files yet ({exc}); "
                         "it needs the lab's --model hf: and --train-bin") from None


def tune_case(work: Path, name: str, *, budget: str, cuda: bool, steps: int | None, max_candidates: int) -> dict:
    from fasttrain.lab.tune import tune

    spec = MODELS[name]
    out = model_dir(work, name) / f"tune-{time.strftime('%Y%m%d-%H%M%S')}"
    t0 = time.perf_counter()
    result = tune(lab_base(work, name, cuda), seq=spec["seq"], global_batch_tokens=spec["tokens"], budget=budget,
                  out=out, cache_path=model_dir(work, name) / "tune-cache.json", steps=steps,
                  max_candidates=max_candidates, log=log)
    wall = time.perf_counter() - t0
    data = json.loads((out / "tune.json").read_text())
    pick = data["pick"] or {}
    return {"pick": pick.get("overrides"), "pick_label": pick.get("label"),
            "pick_tokens_per_s": pick.get("tokens_per_s"), "pick_peak_mib": pick.get("peak_mib"),
            "pick_predicted_mib": pick.get("predicted_mib"), "tune_s": result.tune_s, "wall_s": wall,
            "budget_hit": result.budget_hit, "probes_measured": result.probes_measured,
            "probes_cached": result.probes_cached, "lab_command": pick.get("lab_command"),
            "training_arguments": pick.get("training_arguments"), "folder": str(out)}


def grid_members(work: Path, name: str, cuda: bool, size: int, seed: int = 0) -> list[dict]:
    """The grid, fixed before (and without) the search: tune's space less what the model refuses, pruned by
    the same prediction; per setting the two largest micro-batches that fit; all of them when at most ``size``,
    else a greedy cover of every axis choice and every micro-batch, filled to ``size`` by a seeded sample."""
    from fasttrain.lab import tune as T
    from fasttrain.lab.build import resolve_device

    spec = MODELS[name]
    base = lab_base(work, name, cuda)
    spec_name, hf_config = T.model_of(base)
    axes, _ = T.build_axes(base, cuda=cuda, family=(hf_config or {}).get("model_type"), hf=True)
    device = resolve_device(base)
    memory = T.device_memory(device)
    predict = T.lab_predictor(hf_config.get("vocab_size", 0) if hf_config else 65, hf_config)
    # what the model refuses (liger's fused cross-entropy under a whole-model compile) is no point of the grid
    refuse = T.model_refusal(hf_config, device)
    fitting: dict = {}
    for cand in T.enumerate_space(axes, spec["tokens"] // spec["seq"]):
        cfg = base.with_(**cand.overrides_dict())
        if refuse(cfg) is None and memory.fits(predict(cfg)):
            fitting.setdefault(cand.settings, []).append(cand)
    pool = [c for v in fitting.values() for c in sorted(v, key=lambda c: -c.micro_batch)[:2]]
    if len(pool) <= size:
        chosen = pool
    else:
        rng = random.Random(seed)
        chosen = []
        wanted = {(a, c) for c_ in pool for a, c in c_.settings} | {("batch", c_.micro_batch) for c_ in pool}
        while wanted:
            best = max(pool, key=lambda c: (len(wanted & (set(c.settings) | {("batch", c.micro_batch)})),
                                            rng.random()))
            chosen.append(best)
            wanted -= set(best.settings) | {("batch", best.micro_batch)}
        rest = [c for c in pool if c not in chosen]
        rng.shuffle(rest)
        chosen += rest[:max(0, size - len(chosen))]
    return [c.overrides_dict() for c in chosen]


def fix_grid(work: Path, name: str, cuda: bool, size: int) -> list[dict]:
    """The grid's members, fixed once in the state (before the search, when run before ``tune``)."""
    state = load_state(work, name)
    if state.get("grid_members") is None:
        state["grid_members"] = grid_members(work, name, cuda, size)
        save_state(work, name, state)
    log(f"{name}: the grid's {len(state['grid_members'])} points fixed")
    return state["grid_members"]


def grid_case(work: Path, name: str, *, cuda: bool, size: int, steps: int, part: tuple[int, int],
              stop_after: float | None = None, reuse_steps: tuple[int, ...] = (), claims: Path | None = None,
              members_from: Path | None = None, time_left: float | None = None) -> dict:
    """Measure the grid's points (those of ``part`` k/n), each once, the figures saved after every point.
    A point tune measured already (same model, device, versions, configuration), at ``steps`` or at one of
    ``reuse_steps`` (its rungs' lengths) if longer, is read from tune's probe cache instead of measured
    again: run tune first, so that its search time is its own. ``stop_after``: seconds after which no new
    point starts (the rest waits for the next call). ``time_left``: seconds this call has; a point starts only
    where its expected time (:func:`point_seconds`) fits, the others wait. ``claims``: a folder shared with
    another lane (another GPU's process), through which each point is taken by one lane only.
    ``members_from``: another lane's work folder, whose fixed grid this lane measures."""
    from fasttrain.lab import tune as T
    from fasttrain.lab.config import validate
    from fasttrain.lab.build import resolve_device
    from fasttrain.lab.measure import free_memory

    t_start = time.perf_counter()
    state = load_state(work, name)
    members = state.get("grid_members")
    if members is None and members_from is not None:
        members = load_state(members_from, name).get("grid_members")
        if members is None:
            raise SystemExit(f"{members_from / name / 'state.json'} holds no fixed grid yet: run its fix-grid first")
        state["grid_members"] = members
        save_state(work, name, state)
    if members is None:
        members = grid_members(work, name, cuda, size)
        state["grid_members"] = members
        save_state(work, name, state)
    k, n = part
    mine = [m for i, m in enumerate(members) if i % n == k - 1]
    # the configuration exactly as tune's search builds it, so that the cache's keys agree
    base = validate(lab_base(work, name, cuda))
    device = resolve_device(base)
    model_id, hf_config = T.model_of(base)
    cache = T.probe_cache(model_dir(work, name) / "tune-cache.json", device, T.device_memory(device), model_id,
                          hf_config)
    measure = T.lab_measure(None)
    results = dict(state.get("grid", {}))
    index = {point_key(m): i for i, m in enumerate(members)}
    todo = [(key, m) for key, m in ((point_key(m), m) for m in mine) if key not in results]
    while todo:
        elapsed = time.perf_counter() - t_start
        if stop_after is not None and elapsed > stop_after:
            log(f"grid: --stop-after {stop_after:.0f} s reached, {len(todo)} point(s) left for the next call")
            break
        fits = [(key, m) for key, m in todo if time_left is None or point_seconds(m) <= time_left - elapsed]
        taken = next(((key, m) for key, m in fits if claim(claims, index[key])), None)
        if taken is not None:
            todo.remove(taken)
        if claims is not None:      # the points the other lane took are its own
            todo = [(key, m) for key, m in todo if not (claims / str(index[key])).exists()]
        if taken is None:
            log(f"grid: {len(todo)} point(s) left, none fits the {time_left - elapsed:.0f} s this call has left"
                if todo else "grid: the points left are the other lane's")
            break
        key, overrides = taken
        cfg = base.with_(**overrides)
        t0 = time.perf_counter()
        # tune's longest probe of this configuration, where it measured one at least as long as the grid's
        probe = next((p for n in sorted(set(reuse_steps) | {steps}, reverse=True) if n >= steps
                      for p in [cache.get(cfg, n)] if p is not None), None)
        cached = probe is not None
        if probe is None:
            # a point far slower than the grid's best so far cannot be the best: stopped by tune's own rule
            best = max((r["tokens_per_s"] or 0 for r in results.values()), default=0)
            allowed = T.slow_probe_limit(cfg, steps, best) if best else None
            probe = T.run_probe(measure, cfg, steps, allowed, lambda: free_memory(device))
            cache.put(cfg, steps, probe)
        row = {"tokens_per_s": probe.tokens_per_s, "steps": probe.steps, "peak_mib": (probe.peak_bytes or 0) / MIB or None,
               "compile_s": probe.compile_s, "error": probe.error, "oom": probe.oom, "from_tune_cache": cached,
               "wall_s": time.perf_counter() - t0, "gpu": gpu_slot()}
        results[key] = {**row, "overrides": overrides}
        log(f"grid {index[key] + 1:>3}/{len(members)} {overrides}: {row.get('tokens_per_s')}"
            + (" (tune's probe)" if cached else "") + f" [{row['wall_s']:.0f} s]")
        state["grid"] = results
        save_state(work, name, state)
        if claims is not None:
            (claims / f"{index[key]}.done").touch()
    return results


def confirm_case(work: Path, name: str, *, cuda: bool, steps: int) -> dict:
    """The pick trained ``steps`` steps through the lab: measured peak against the prediction, OOM or not."""
    from fasttrain.lab import tune as T
    from fasttrain.lab.config import validate

    state = load_state(work, name)
    pick = (state.get("tune") or {}).get("pick")
    if not pick:
        raise SystemExit("no pick yet: run the tune phase first")
    cfg = validate(lab_base(work, name, cuda).with_(**pick))
    try:
        probe = T.lab_measure(None, warmup=2)(cfg, steps)
    except Exception as exc:  # noqa: BLE001
        return {"steps": steps, "oom": "out of memory" in str(exc).lower(), "error": str(exc).splitlines()[0][:200]}
    peak = probe.peak_bytes
    _, hf_config = T.model_of(cfg)
    predicted = T.lab_predictor(0, hf_config, cpu=not cuda)(cfg)
    return {"steps": steps, "oom": False, "tokens_per_s": probe.tokens_per_s,
            "peak_mib": peak / MIB if peak else None, "predicted_mib": predicted / MIB if predicted else None,
            "predicted_error_pct": 100.0 * (predicted - peak) / peak if peak and predicted else None}


def crosscheck_case(work: Path, name: str, *, cuda: bool, steps: int, source: Path | None = None) -> list[dict]:
    """The pick and the grid's best measured again on this lane's GPU (``steps`` timed steps each): where the
    figures come from two cards, how far the cards themselves differ. ``source``: the work folder holding the
    pick and the merged grid (lane A's), else this one."""
    from fasttrain.lab import tune as T
    from fasttrain.lab.config import validate
    from fasttrain.lab.build import resolve_device
    from fasttrain.lab.measure import free_memory

    theirs = load_state(source or work, name)
    pick = (theirs.get("tune") or {}).get("pick")
    grid = [g for g in (theirs.get("grid") or {}).values() if g.get("tokens_per_s")]
    targets = ([("pick", pick)] if pick else []) + \
        ([("grid's best", max(grid, key=lambda g: g["tokens_per_s"])["overrides"])] if grid else [])
    if not targets:
        raise SystemExit("crosscheck: no pick and no grid point measured yet: run tune and grid first")
    base = validate(lab_base(work, name, cuda))     # as tune's search builds it (lab_base has the seq)
    device = resolve_device(base)
    state = load_state(work, name)
    rows = list(state.get("crosscheck") or [])
    for what, overrides in targets:
        if what == "grid's best" and overrides == pick:
            continue
        probe = T.run_probe(T.lab_measure(None), base.with_(**overrides), steps, None, lambda: free_memory(device))
        rows.append({"what": what, "overrides": overrides, "gpu": gpu_slot(), "steps": probe.steps,
                     "tokens_per_s": probe.tokens_per_s, "error": probe.error})
        log(f"crosscheck {what} on GPU {gpu_slot()}: {probe.tokens_per_s}")
    return rows


def alone_case(work: Path, name: str, *, cuda: bool, steps: int, users_steps: int, skip: int) -> dict:
    """The goals' denominators measured again on this lane's GPU with nothing else running on the host (the lease
    script runs it once every lane's phases are done, after the pick's 200-step confirmation on the same card):
    the Trainer's best point of its search, ``steps`` timed steps after ``skip``, and the Trainer as its users run
    it at the micro-batch its finder settled on, ``users_steps``. Each figure is saved as it is measured."""
    state = load_state(work, name)
    best, users = state.get("hf_flags"), state.get("hf")
    if not (best or {}).get("tokens_per_s") or not users:
        raise SystemExit("alone: the HF Trainer's runs are not in this state yet: run hf and hf-flags (and merge "
                         "the lanes) first")
    out = {"gpu": gpu_slot()}
    runs = (("hf_flags", dict(batch=best["batch"], extra=best["flags"], steps=skip + steps, find=False)),
            ("hf", dict(batch=users["found_batch"], extra={}, steps=skip + users_steps, find=True)))
    for key, run in runs:
        result = _hf_run(work, name, skip=skip, cuda=cuda, **run)
        out[key] = {**result, "flags": run["extra"]}
        log(f"alone {key} on GPU {gpu_slot()}: {_fmt(result['tokens_per_s'])} tokens/s")
        state = load_state(work, name)
        state["alone"] = out
        save_state(work, name, state)
    return out


def long_run(state: dict) -> dict | None:
    """The goals' figures from the long run on one card: the pick's confirmation against the Trainer's best and
    the Trainer as users run it, measured alone on the same GPU (:func:`alone_case`); None until both ran there."""
    confirm, alone = state.get("confirm") or {}, state.get("alone") or {}
    if not confirm.get("tokens_per_s") or not alone or confirm.get("gpu") != alone.get("gpu"):
        return None
    flags = alone.get("hf_flags") or {}
    return {"gpu": alone["gpu"], "confirm_steps": confirm.get("steps"),
            "pick_tokens_per_s": confirm["tokens_per_s"],
            "hf_trainer_tokens_per_s": (alone.get("hf") or {}).get("tokens_per_s"),
            "hf_trainer_flags_tokens_per_s": flags.get("tokens_per_s"),
            "hf_trainer_flags": flags.get("flags"), "hf_trainer_flags_batch": flags.get("batch"),
            "search_complete": (state.get("hf_flags") or {}).get("complete")}


def merge_lanes(work: Path, name: str, other: Path) -> dict:
    """Fold another lane's state (the same lease's other GPU, its own work folder) into this one: the figures
    this lane lacks, the union of the grid's points, of the Trainer's search points (its column summed up again)
    and of the cross-checks. Both lanes hold the same fixed grid, or nothing is merged. Run again at every call:
    it only adds."""
    state, theirs = load_state(work, name), load_state(other, name)
    if theirs.get("grid_members") is not None and theirs["grid_members"] != state.get("grid_members"):
        raise SystemExit(f"{other / name / 'state.json'}: another grid than {work / name / 'state.json'}'s; "
                         "a lane measures the grid its partner fixed (grid --members-from)")
    for key in ("hf", "tune", "confirm", "alone"):
        if theirs.get(key) and not state.get(key):
            state[key] = theirs[key]
    # the Trainer's search, its variants shared between lanes: the union of the points, its column summed up again
    points = {_trainer_point_key(p["flags"], p["batch"]): p
              for p in (theirs.get("hf_search_points") or []) + (state.get("hf_search_points") or [])}
    if points:
        state["hf_search_points"] = list(points.values())
        state["hf_flags"] = trainer_search_summary(name, state["hf_search_points"])
    state["grid"] = {**(theirs.get("grid") or {}), **(state.get("grid") or {})}
    rows = list(state.get("crosscheck") or [])
    state["crosscheck"] = rows + [r for r in theirs.get("crosscheck") or [] if r not in rows]
    save_state(work, name, state)
    log(f"{name}: merged {other}: {len(state['grid'])} grid point(s), {len(state['crosscheck'])} cross-check(s)")
    return state


# a state's figures, named as the report names where each ran
FIGURE_NAMES = {"tune": "tune's search", "confirm": "the 200-step confirmation",
                "hf": "the HF Trainer as users run it", "hf_flags": "the HF Trainer with its flags"}


def lanes_line(state: dict) -> str | None:
    """Where the figures of a lease of several GPUs come from, and how the cards compare (the cross-checks); the
    figures kept from an earlier lease (``reused_from``, dev/tune/reuse_state.py) named apart."""
    def named(whats: list[str]) -> str:
        n = whats.count("grid")
        return ", ".join([w for w in whats if w != "grid"] + ([f"{n} grid point(s)"] if n else []))

    where: dict = {}
    kept: dict = {}
    for key, what in FIGURE_NAMES.items():
        figure = state.get(key) or {}
        if figure.get("reused_from"):
            kept.setdefault(figure["reused_from"], []).append(what)
        elif figure.get("gpu") is not None:
            where.setdefault(figure["gpu"], []).append(what)
    for g in (state.get("grid") or {}).values():
        if g.get("reused_from"):
            kept.setdefault(g["reused_from"], []).append("grid")
        elif g.get("gpu") is not None:
            where.setdefault(g["gpu"], []).append("grid")
    line = "".join(f"Kept from an earlier lease ({label}), which the change since cannot reach: {named(whats)}; "
                   "the rest measured in this one. " for label, whats in kept.items())
    if len(where) < 2:
        return line.strip() or None
    parts = [f"GPU {gpu}: {named(whats)}" for gpu, whats in sorted(where.items())]
    line += f"Measured side by side on {len(where)} GPUs of one host, in one lease ({'; '.join(parts)})."
    checks: dict = {}
    for r in state.get("crosscheck") or []:
        if r.get("tokens_per_s"):
            checks.setdefault((r["what"], r.get("steps")), {})[r["gpu"]] = r["tokens_per_s"]
    for (what, steps), by_gpu in checks.items():
        if len(by_gpu) >= 2:
            (ga, a), *rest = sorted(by_gpu.items())
            cards = "both cards" if len(by_gpu) == 2 else f"each of the {len(by_gpu)} cards"
            line += (f" The same configuration on {cards} ({what}, {steps} timed steps): {a:,.0f} tokens/s on GPU {ga}"
                     + "".join(f", {b:,.0f} on GPU {gb} ({b / a:.3f}x)" for gb, b in rest) + ".")
    # the goals divide figures from two cards; the pick's cross-check on the HF Trainer's card gives the same
    # ratios from one card, so a difference between the cards cannot make or break a goal unseen
    for key in ("hf", "hf_flags"):
        hf, what = state.get(key) or {}, FIGURE_NAMES[key]
        pick_there = next((by_gpu.get(hf.get("gpu")) for (w, _), by_gpu in checks.items() if w == "pick"), None)
        if (hf.get("tokens_per_s") and pick_there and not hf.get("reused_from")
                and hf.get("gpu") != (state.get("tune") or {}).get("gpu")):
            line += (f" On GPU {hf['gpu']}, where {what} ran ({hf['tokens_per_s']:,.0f} tokens/s), the pick's "
                     f"cross-check is {pick_there / hf['tokens_per_s']:.3f}x it.")
    return line


# --- the report ----------------------------------------------------------------------------------

def gpu_text(gpu: str | None) -> str:
    """``GPU 0`` (a lane's card, its CUDA_VISIBLE_DEVICES), or the lease's one GPU (none set)."""
    return f"GPU {gpu}" if gpu is not None else "the lease's one GPU"


def case_of(state: dict) -> dict:
    """One ``cases`` entry (exactly :data:`CASE_KEYS`) from a model's state."""
    tune = state.get("tune") or {}
    confirm = state.get("confirm") or {}
    grid = [g["tokens_per_s"] for g in (state.get("grid") or {}).values() if g.get("tokens_per_s")]
    return {
        "model": state["model"],
        "pick_tokens_per_s": tune.get("pick_tokens_per_s"),
        # the grid's best only once every point was measured: a part of the grid is no best to compare with
        "best_tokens_per_s": max(grid) if grid and grid_left(state) == 0 else None,
        "hf_trainer_tokens_per_s": (state.get("hf") or {}).get("tokens_per_s"),
        "hf_trainer_flags_tokens_per_s": (state.get("hf_flags") or {}).get("tokens_per_s"),
        "pick_peak_mib": confirm.get("peak_mib") or tune.get("pick_peak_mib"),
        "pick_predicted_mib": confirm.get("predicted_mib") or tune.get("pick_predicted_mib"),
        "tune_s": tune.get("tune_s"),
        # every Trainer configuration measured: its micro-batch, flags and tokens/s
        "hf_trainer_points": [{k: p.get(k) for k in ("batch", "gradient_accumulation_steps", "flags", "tokens_per_s",
                                                    "peak_mib", "status", "gpu")}
                              for p in (state.get("hf_flags") or {}).get("points") or []],
        "long_run": long_run(state),
    }


def grid_left(state: dict) -> int | None:
    """Grid points not measured yet (None: the grid never started)."""
    members = state.get("grid_members")
    return None if members is None else max(0, len(members) - len(state.get("grid") or {}))


def ratio_result(r: float, goal: float) -> str:
    """``met: 1.234x`` or ``MISSED: ...``, with a fourth decimal where three would round a miss up to the goal."""
    text = f"{r:.3f}x"
    if r < goal and float(text[:-1]) >= goal:
        text = f"{r:.4f}x"
    return f"{'met' if r >= goal else 'MISSED'}: {text}"


def goals(case: dict, state: dict) -> list[tuple[str, str]]:
    """The issue's goals, each (goal, "met ..." / "MISSED ...")."""
    def ratio(a, b):
        return a / b if a and b else None
    out = []
    r = ratio(case["pick_tokens_per_s"], case["best_tokens_per_s"])
    left = grid_left(state)
    if left:
        members = len(state["grid_members"])
        out.append(("pick within 5% of the grid's best", f"not measured: the grid ran {members - left} of its "
                    f"{members} points"))
    else:
        grid = list((state.get("grid") or {}).values())
        failed = [g for g in grid if not g.get("tokens_per_s")]
        # points that did not run (out of memory, refused by the model, a library's failure) are no part of the best
        ran = (f" ({len(grid) - len(failed)} of the {len(grid)} points ran; {len(failed)} did not: "
               f"{sum(1 for g in failed if g.get('oom'))} out of memory, "
               f"{sum(1 for g in failed if not g.get('oom'))} refused or failed)") if failed else ""
        out.append(("pick within 5% of the grid's best", "-" if r is None else
                    f"{'met' if r >= 0.95 else 'MISSED'}: {r:.3f}x{ran}"))
    t = case["tune_s"]
    out.append(("found in at most 10 minutes", "-" if t is None else f"{'met' if t <= 600 else 'MISSED'}: {t:.0f} s"))
    # the Trainer goals' ratios from the long run on one card where it ran (the pick's confirmation against the
    # Trainer alone), else from the search's figures, said as such
    lr = case.get("long_run")
    for goal, key, target in (("at least 2x the HF Trainer as users run it", "hf_trainer_tokens_per_s", 2.0),
                              ("at least 1.1x the HF Trainer with its best flags", "hf_trainer_flags_tokens_per_s",
                               1.1)):
        if lr and lr.get(key):
            r = ratio(lr["pick_tokens_per_s"], lr[key])
            where = (f" (the pick's {lr['confirm_steps']} steps against the Trainer alone, both on "
                     f"{gpu_text(lr['gpu'])})")
        else:
            r = ratio(case["pick_tokens_per_s"], case[key])
            where = " (search figures, not measured alone)"
        out.append((goal, "-" if r is None else ratio_result(r, target) + where))
    p, m = case["pick_predicted_mib"], case["pick_peak_mib"]
    out.append(("memory predicted within 5%", "-" if not (p and m) else
                f"{'met' if abs(p - m) <= 0.05 * m else 'MISSED'}: {100 * (p - m) / m:+.1f}%"))
    c = state.get("confirm") or {}
    out.append((f"trains {c.get('steps', 200)} steps without running out of memory", "-" if not c else
                ("MISSED: out of memory" if c.get("oom") else "met" if not c.get("error") else f"MISSED: {c['error']}")))
    return out


def faster_probe_line(path: Path) -> str | None:
    """Where tune measured a configuration faster than its pick (a shorter probe, which the ranking puts below
    the longer ones), one line saying so: what the search left on the table."""
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    pick = data.get("pick") or {}
    ok = [r for r in data.get("ranked", []) if r.get("status") == "ok" and r.get("tokens_per_s")]
    if not ok or not pick.get("tokens_per_s"):
        return None
    fastest = max(ok, key=lambda r: r["tokens_per_s"])
    if fastest["tokens_per_s"] <= pick["tokens_per_s"]:
        return None
    return (f"The fastest configuration tune measured was not its pick: `{fastest['label']}` ran "
            f"{fastest['tokens_per_s']:,.0f} tokens/s in its {fastest['stage']} ({fastest['steps_measured']} "
            f"step(s)), {fastest['tokens_per_s'] / pick['tokens_per_s']:.3f}x the pick.")


def profile_line(p: dict, name: str, hf_tokens_per_s: float | None = None) -> str:
    """What ``profile_pick.py`` measured of the pick's step, in one paragraph (where a goal's miss comes from);
    ``hf_tokens_per_s``: the HF Trainer as its users run it, against which the step's floor is put."""
    families = ", ".join(f"{fam} {ms:,.0f}" for fam, ms in list(p["by_family_ms_per_step"].items())[:5])
    line = (f"Where the pick's step goes (`dev/tune/profile_pick.py`, [{name}]({name})): {p['wall_ms_per_step']:,.0f} ms a "
            f"step, the GPU busy {p['gpu_busy_ms_per_step']:,.0f} ms ({families} ms); "
            f"{p['flops_per_token']['total'] / 1e9:.2f} GFLOP a token, {p['model_tflops']:,.0f} TFLOP/s")
    if p.get("mfu"):
        line += f", {100 * p['mfu']:.0f}% of the {p['peak_tflops']:,.1f} TFLOP/s dense bf16 peak"
    if p.get("mfu_of_2x_hf"):
        line += f"; 2x the HF Trainer as its users run it would need {100 * p['mfu_of_2x_hf']:.0f}%"
    gemm_ms, tokens = p["by_family_ms_per_step"].get("gemm"), p.get("tokens_per_step")
    if gemm_ms and tokens:
        # the GEMMs' own rate: the dense matmul FLOPs of a step (6 N a token) over their kernels' time
        gemm_tflops = p["flops_per_token"]["dense"] * tokens / (gemm_ms / 1e3) / 1e12
        line += f". Its GEMMs run at {gemm_tflops:,.0f} TFLOP/s"
        if p.get("peak_tflops"):
            line += f" ({100 * gemm_tflops / p['peak_tflops']:.0f}% of that peak)"
        # the floor of this step as its kernels run: nothing but its GEMMs and attention
        floor = tokens / ((gemm_ms + p["by_family_ms_per_step"].get("attention", 0.0)) / 1e3)
        line += f"; a step of only its GEMMs and attention, as they run, would be {floor:,.0f} tokens/s"
        if hf_tokens_per_s:
            line += f", {floor / hf_tokens_per_s:.2f}x the HF Trainer as its users run it"
    return line + "."


def long_run_line(lr: dict) -> str:
    """The goals' long-run figures in one sentence."""
    flags = _flags_label({k: v for k, v in (lr.get("hf_trainer_flags") or {}).items() if k in ("torch_compile",
                          "torch_compile_mode", "use_liger_kernel")})
    return (f"The Trainer goals' ratios come from the long run, on {gpu_text(lr['gpu'])} with nothing else running "
            f"on the host: the pick over {lr['confirm_steps']} steps {_fmt(lr['pick_tokens_per_s'])} tokens/s; the HF Trainer "
            f"with its best flags ({flags}, micro-batch {lr.get('hf_trainer_flags_batch')}) "
            f"{_fmt(lr['hf_trainer_flags_tokens_per_s'])}; as its users run it "
            + (_fmt(lr['hf_trainer_tokens_per_s']) if lr.get('hf_trainer_tokens_per_s') else
               "not measured alone (that goal's ratio is the search's figures)")
            + "." + ("" if lr.get("search_complete") else " The Trainer's search was not complete (below)."))


def versions_text(versions: dict | None) -> str:
    """`` Versions: torch 2.11.0, transformers 5.17.0, ...`` (those installed), or nothing."""
    named = [f"{lib} {v}" for lib, v in (versions or {}).items() if v]
    return f" Versions: {', '.join(named)}." if named else ""


def _fmt(v, spec=",.0f"):
    return "-" if v is None else format(v, spec)


def readme(folder: Path, into: Path | None = None) -> str:
    """The README section, generated from ``folder``'s ``tune.json``; ``into``: the file it goes into (its links
    then lead from there into ``folder``, and its headings sit under that file's heading of the area: the
    machine at :data:`SECTION_LEVEL`, each model one below), else ``folder``'s own README (the machine its title,
    each model a ``##``)."""
    base = Path(os.path.relpath(folder.resolve(), into.resolve().parent)) if into is not None else Path()
    level = SECTION_LEVEL if into is not None else 1
    data = json.loads((folder / "tune.json").read_text())
    measured = f" Measured with `{data['measured_with']}`." if data.get("measured_with") else ""
    device = data.get("device", "-")
    title = device if into is not None else f"fasttrain tune against the Hugging Face Trainer: {device}"
    lines = ["#" * level + f" {title}", "",
             f"Device: {device}. bf16, random init, the same global batch for every column "
             "(tokens per optimizer step below); tokens/s over optimizer steps after the first (compilation, "
             f"warm-up) ones.{measured}{versions_text(data.get('versions'))} Command: `{data.get('command', '-')}`."
             + (f" Files: [`{folder.as_posix()}/`]({base.as_posix()}/)." if into is not None else ""), "",
             "| model | tokens per step | HF Trainer (users) | HF Trainer (its best flags) | tune's pick | grid's best "
             "| pick peak MiB | predicted MiB | search s |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for c in data["cases"]:
        tokens = (data.get("states", {}).get(c["model"]) or {}).get("global_batch_tokens")
        lines.append(f"| {c['model']} | {_fmt(tokens)} | {_fmt(c['hf_trainer_tokens_per_s'])} "
                     f"| {_fmt(c['hf_trainer_flags_tokens_per_s'])} "
                     f"| {_fmt(c['pick_tokens_per_s'])} | {_fmt(c['best_tokens_per_s'])} | {_fmt(c['pick_peak_mib'])} "
                     f"| {_fmt(c['pick_predicted_mib'])} | {_fmt(c['tune_s'])} |")
    for detail in data.get("details", []):
        lines += ["", "#" * (level + 1) + f" {detail['model']}", ""]
        if detail.get("pick_label"):
            lines.append(f"Pick: `{detail['pick_label']}` — `{detail.get('lab_command', '')}`")
            lines.append("")
        lines += ["| goal | result |", "| --- | --- |"]
        lines += [f"| {g} | {r} |" for g, r in detail["goals"]]
        case = next((c for c in data["cases"] if c["model"] == detail["model"]), {})
        if case.get("long_run"):
            lines += ["", long_run_line(case["long_run"])]
        faster = faster_probe_line(folder / f"{detail['model']}-tune" / "tune.json")
        if faster:
            lines += ["", faster]
        profile = folder / "logs" / f"{detail['model']}-profile.json"
        if profile.is_file():
            hf = next((c["hf_trainer_tokens_per_s"] for c in data["cases"] if c["model"] == detail["model"]), None)
            lines += ["", profile_line(json.loads(profile.read_text()), (base / "logs" / profile.name).as_posix(), hf)]
        for note in detail.get("notes", []):
            lines.append(f"\n- {note}")
        points = ((data.get("states", {}).get(detail["model"]) or {}).get("hf_flags") or {}).get("points")
        if points:
            lines += ["", "Every HF Trainer point measured (its best flags' column is the fastest):", "",
                      "| Trainer flags | micro-batch x accumulation | tokens/s | peak MiB | status | GPU |",
                      "| --- | ---: | ---: | ---: | --- | --- |"]
            lines += [f"| {_flags_label(p['flags'])} | {p['batch']} x {p['gradient_accumulation_steps']} "
                      f"| {_fmt(p.get('tokens_per_s'))} | {_fmt(p.get('peak_mib'))} | {p['status']} "
                      f"| {p.get('gpu') or '-'} |" for p in points]
    return "\n".join(lines) + "\n"


def report(work: Path, results: Path, models: list[str], command: str, measured_with: str | None = None) -> Path:
    import shutil

    from fasttrain.environment import environment, machine_slug
    from fasttrain.files import atomic_write_text

    states = {name: load_state(work, name) for name in models}
    for name, state in states.items():
        # the Trainer's column summed up again by today's rules from the points measured (whether the search is
        # complete: a retry the rules added since is a ladder left unfinished, said as such)
        points = state.get("hf_search_points")
        if points:
            state["hf_flags"] = trainer_search_summary(name, points)
    cases, details = [], []
    for name, state in states.items():
        case = case_of(state)
        assert tuple(case) == CASE_KEYS
        cases.append(case)
        tune = state.get("tune") or {}
        details.append({"model": name, "goals": goals(case, state), "pick_label": tune.get("pick_label"),
                        "lab_command": tune.get("lab_command"),
                        "notes": (state.get("hf") or {}).get("notes", []) + (state.get("hf_flags") or {}).get("notes", [])
                        + [line for line in [lanes_line(state)] if line]})
    # the machine the phases ran on (recorded by each phase), so that a report written elsewhere from a state
    # copied back says the GPU's name, not its own
    env = next((s["environment"] for s in states.values() if s.get("environment")), None) or environment()
    folder = results / machine_slug(env)
    folder.mkdir(parents=True, exist_ok=True)
    gpu = env.get("gpu") or {}
    versions = next((s["versions"] for s in states.values() if s.get("versions")), None)
    data = {"kind": "tune-bench", "schema": 1, "device": gpu.get("name") or env.get("cpu"), "command": command,
            "measured_with": measured_with, "versions": versions,
            "environment": env, "cases": cases, "details": details, "states": states}
    atomic_write_text(folder / "tune.json", json.dumps(data, indent=2, default=str))
    atomic_write_text(folder / "README.md", readme(folder))
    for name, state in states.items():
        # tune's own answer beside the comparison: its ranked table, long-format CSV and plot
        tune_folder = Path((state.get("tune") or {}).get("folder") or "")
        if tune_folder.name and (tune_folder / "tune.json").is_file():
            shutil.copytree(tune_folder, folder / f"{name}-tune", dirs_exist_ok=True)
    return folder


# --- the command line ------------------------------------------------------------------------------

def _check_markers(ap: argparse.ArgumentParser, path: Path) -> None:
    """Checked before anything is written: the file and its two marker lines."""
    lines = [ln.strip() for ln in path.read_text().splitlines()] if path.is_file() else []
    if lines.count(README_START) != 1 or lines.count(README_END) != 1:
        ap.error(f"--into {path}: needs a file with one line {README_START} and one {README_END}")


def _fraction(ap: argparse.ArgumentParser, flag: str, text: str) -> tuple[int, int]:
    """``k/n`` with 1 <= k <= n, else one line."""
    try:
        k, n = (int(x) for x in text.split("/"))
    except ValueError:
        k = n = 0
    if not 1 <= k <= n:
        ap.error(f"{flag} {text}: give k/n with 1 <= k <= n, such as 1/1 or 2/3")
    return k, n


def bench_versions() -> dict[str, str | None]:
    """The versions of :data:`BENCH_LIBRARIES` in this process (None where one is not installed)."""
    from fasttrain.lab.record import library_versions

    return library_versions(BENCH_LIBRARIES)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("phase", help="prepare, hf, hf-flags, tune, grid, confirm, report or all; several joined by "
                    "commas run in one process (prepare,hf,hf-flags); readme: WORK is a results folder whose "
                    "README.md (and --into's section) is written again from its tune.json")
    ap.add_argument("work", type=Path)
    ap.add_argument("--model", action="append", choices=tuple(MODELS), help="repeatable for report")
    ap.add_argument("--budget", default="7m", help="tune's --budget (the phase must end within the device's 10 minutes)")
    ap.add_argument("--quick", action="store_true", help="short probes: a sanity run, not the committed figures")
    ap.add_argument("--steps", type=int, default=None, help="timed HF Trainer steps (after --skip)")
    ap.add_argument("--skip", type=int, default=None, help="first HF Trainer steps excluded from the timing")
    ap.add_argument("--probe-steps", type=int, default=None, help="tune's first-rung steps")
    ap.add_argument("--max-candidates", type=int, default=8)
    ap.add_argument("--grid-size", type=int, default=30)
    ap.add_argument("--grid-steps", type=int, default=None, help="timed steps of a grid point (default 1)")
    ap.add_argument("--part", default="1/1", help="grid part k/n (each part one command)")
    ap.add_argument("--stop-after", type=float, default=None,
                    help="grid: start no new point after this many seconds (run the phase again for the rest)")
    ap.add_argument("--time-left", type=float, default=None,
                    help="grid, hf-flags: seconds this call has; a point starts only where its expected time fits")
    ap.add_argument("--claims", type=Path, default=None,
                    help="grid: a folder shared with the other GPU's lane, through which each point is taken once")
    ap.add_argument("--members-from", type=Path, default=None,
                    help="grid: the other lane's work folder, whose fixed grid this lane measures")
    ap.add_argument("--from", dest="source", type=Path, action="append", default=None,
                    help="merge: another lane's work folder (repeatable: every other lane's, in one process); "
                         "crosscheck: the one holding the pick and the grid")
    ap.add_argument("--crosscheck-steps", type=int, default=3)
    ap.add_argument("--share", default="1/1",
                    help="hf-flags: this lane's share k/n of the Trainer's flag variants (the others' lanes run the rest)")
    ap.add_argument("--alone-steps", type=int, default=30,
                    help="alone: timed steps of the Trainer's best point measured again alone")
    ap.add_argument("--alone-users-steps", type=int, default=10,
                    help="alone: timed steps of the Trainer as users run it measured again alone")
    ap.add_argument("--confirm-steps", type=int, default=None)
    ap.add_argument("--results", type=Path, default=Path("results/tune"))
    ap.add_argument("--measured-with", default=None,
                    help="report: the device command that measured the phases (recorded, and named in the README)")
    ap.add_argument("--also", type=Path, action="append", default=[],
                    help="readme: another results folder whose section follows (one section for every machine)")
    ap.add_argument("--into", type=Path, default=None,
                    help=f"report, readme: also write the section into this file (the results index, "
                         f"results/README.md) between {README_START} and {README_END}")
    args = ap.parse_args(argv)
    import torch

    from fasttrain.environment import environment

    cuda = torch.cuda.is_available()
    models = args.model or ["gpt2-124m"]
    quick = args.quick or not cuda
    # a step is 0.5M tokens (16 to 64 micro-batches): steps vary by about 1% (H100, GPT-2 124M), so a few timed
    # steps measure; the HF Trainer's first step compiles, its second is a steady one
    steps = args.steps or (3 if quick else 6)
    skip = args.skip if args.skip is not None else 2
    # the grid times one step after the warm-up (at 0.1-0.5M tokens a step, steps vary by about 1%: the grid finds
    # the best, it does not rank within 1%); a point tune measured is read from its cache at its rungs' lengths
    grid_steps = args.grid_steps or 1
    first_rung = args.probe_steps or 3
    tune_rungs = tuple(first_rung * 2 ** k for k in range(6))
    confirm_steps = args.confirm_steps or (4 if quick else 200)
    k, n = _fraction(ap, "--part", args.part)
    share = _fraction(ap, "--share", args.share)
    command = "python3 dev/tune/bench_tune.py " + " ".join(sys.argv[1:] if argv is None else argv)
    if args.phase in ("report", "readme"):
        # readme: WORK is a results folder (results/tune/<machine>): its README.md from its tune.json
        if args.phase == "readme" and not (args.work / "tune.json").is_file():
            ap.error(f"readme: {args.work} holds no tune.json; give a results folder such as "
                     "results/tune/nvidia-h100-80gb-hbm3")
        for other in args.also:         # every input checked before anything is written
            if not (other / "tune.json").is_file():
                ap.error(f"--also {other}: holds no tune.json; give a results folder")
        if args.into is not None:
            _check_markers(ap, args.into)
        from fasttrain.files import atomic_write_text, write_into

        if args.phase == "report":
            folder = report(args.work, args.results, models, command, args.measured_with)
        else:
            folder = args.work
            atomic_write_text(folder / "README.md", readme(folder))
        section = "\n".join(readme(f, args.into) for f in [folder, *args.also])
        print(section)
        if args.into is not None:
            write_into(args.into, section, start=README_START, end=README_END)
        return 0
    every = ["prepare", "hf", "hf-flags", "tune", "grid", "confirm"]
    lanes = ["fix-grid", "merge", "crosscheck", "alone"]
    asked = every if args.phase == "all" else [p.strip() for p in args.phase.split(",") if p.strip()]
    unknown = [p for p in asked if p not in every + lanes]
    if unknown:
        ap.error(f"unknown phase {', '.join(unknown)}: give {', '.join(every + lanes)}, report or all")
    if "merge" in asked and args.source is None:
        ap.error("merge needs --from, the other lane's work folder")
    unfinished = False
    for name in models:
        for phase in asked:
            state = load_state(args.work, name)
            log(f"== {name}: {phase}")
            if phase == "prepare":
                prepare(args.work, name)
                continue
            if phase == "fix-grid":
                fix_grid(args.work, name, cuda, args.grid_size)
                continue
            if phase == "merge":
                for other in args.source:
                    merge_lanes(args.work, name, other)
                continue
            if phase == "hf":
                state["hf"] = hf_trainer_case(args.work, name, steps=skip + steps, skip=skip, cuda=cuda)
            elif phase == "hf-flags":
                best = hf_search_case(args.work, name, steps=skip + steps, skip=skip, cuda=cuda,
                                      time_left=args.time_left, share=share)
                state = load_state(args.work, name)          # with the points the search saved as it went
                state["hf_flags"] = best
                # a share cut by --time-left is not done: the lease script runs the phase again next call
                unfinished = unfinished or not best.pop("share_complete")
            elif phase == "tune":
                state["tune"] = tune_case(args.work, name, budget=args.budget, cuda=cuda, steps=args.probe_steps,
                                          max_candidates=args.max_candidates)
            elif phase == "grid":
                grid_case(args.work, name, cuda=cuda, size=args.grid_size, steps=grid_steps, part=(k, n),
                          reuse_steps=tune_rungs, stop_after=args.stop_after, claims=args.claims,
                          members_from=args.members_from, time_left=args.time_left)
                state = load_state(args.work, name)
            elif phase == "confirm":
                state["confirm"] = confirm_case(args.work, name, cuda=cuda, steps=confirm_steps)
            elif phase == "alone":
                alone_case(args.work, name, cuda=cuda, steps=args.alone_steps, users_steps=args.alone_users_steps,
                           skip=skip)
                state = load_state(args.work, name)
            elif phase == "crosscheck":
                state["crosscheck"] = crosscheck_case(args.work, name, cuda=cuda, steps=args.crosscheck_steps,
                                                      source=args.source[0] if args.source else None)
            key = {"hf-flags": "hf_flags"}.get(phase, phase)
            # the Trainer's column names the GPU its best point ran on (a lane's share, or the lanes' merged)
            if isinstance(state.get(key), dict) and phase not in ("grid", "hf-flags"):
                state[key]["gpu"] = gpu_slot()
            state["environment"] = environment()
            state["versions"] = bench_versions()
            save_state(args.work, name, state)
            log(json.dumps({key: state.get(key.replace("-", "_")) for key in (phase,)}, default=str)[:400])
    if args.phase == "all":
        folder = report(args.work, args.results, models, command)
        print(readme(folder))
    if unfinished:
        log("hf-flags: this share of the Trainer's search ran out of --time-left; run the phase again for the rest")
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
