"""Everything the lab checks before any work starts, so that bad input costs no training and loses
no file: one :class:`~fasttrain.errors.FasttrainError` line naming the flag, the user's path (never
a temporary name) and the fix.

- output folders (``--save`` of the lab and the speedrun): a folder that exists and is not one of
  our checkpoints is refused (the run would replace it as a whole, and with it the files it
  holds); an existing checkpoint is replaced whole when the run ends (:func:`save_folder_state`
  says so before training); ``~`` is expanded; a missing or unwritable parent is refused;
- ``--out`` against ``--save`` (the same path, or the record inside the checkpoint folder, which
  the checkpoint's replacement would delete);
- every output against every input (:mod:`fasttrain.lab.outputs`): ``--out``, ``--save``,
  ``--output-dir`` and tune's ``--cache`` never name nor hold a corpus file, the tokenizer, the
  model folder, ``--init-from`` or ``--resume``; an existing file of another kind is never
  replaced; a folder holding another run's checkpoints is refused unless ``--overwrite-output-dir``;
  ``--output-dir`` inside ``--save`` is refused; one run at a time per folder (a lock);
- ``--device``: its form (``cuda:abc``) in :func:`fasttrain.lab.config.validate`, its existence
  here (no CUDA, a GPU index the machine lacks);
- the vocabulary against the corpus, and whether the run fits the device's memory: the memory
  estimator predicts the peak before anything is allocated (:func:`check_fits`).

Import cost: torch only inside the device and memory checks.
"""

from __future__ import annotations

import os
from pathlib import Path

from fasttrain.errors import FasttrainError
from fasttrain.lab.config import is_hf
from fasttrain.lab.outputs import (CHECKPOINT_FORMAT, check_cache_file, check_output_file,  # noqa: F401
                                   check_output_folders, check_save_folder, expand, hold_outputs, is_lab_checkpoint,
                                   run_inputs, save_folder_state)


# --- paths ---------------------------------------------------------------------------------------

def check_outputs(cfg, out=None) -> None:
    """``--out`` (the run record, a file) against the run's inputs (:func:`check_output_file`) and
    ``--save`` (the checkpoint, a folder): not the same path, and not inside the checkpoint folder
    (its replacement would delete the record)."""
    if out is None:
        return
    check_output_file(out, "--out", run_inputs(cfg))
    if cfg.save is None:
        return
    record = expand(out, "--out").resolve()
    folder = expand(cfg.save, "--save").resolve()
    if record == folder:
        raise FasttrainError(f"--out {out} and --save {cfg.save} name the same path; the record is a file and the "
                             f"checkpoint a folder: give them different paths (e.g. --out run.json)")
    if folder in record.parents:
        raise FasttrainError(f"--out {out} is inside the --save folder {cfg.save}, which the checkpoint replaces "
                             f"whole; write the record beside it (e.g. --out {folder.name}.json)")


def check_run(cfg, out=None) -> None:
    """The checks of a lab run that need no corpus: the configuration (:func:`validate`), the
    output paths, the device. Called by ``lab.train.run`` (the Python API) and by the CLI before
    it launches any process."""
    from fasttrain.lab.config import ensure_valid

    ensure_valid(cfg)               # validated where it was built; checked here only if it was not
    check_outputs(cfg, out)
    check_output_folders(cfg)
    if is_hf(cfg.model):
        from fasttrain.lab.hf import check_hf_folder

        check_hf_folder(cfg.model)      # config.json's fields, an encoder, the weights against the config
    if cfg.init_from is not None:
        expand(cfg.init_from, "--init-from")
    check_device(cfg.device)


# --- the device ----------------------------------------------------------------------------------

def check_device(device: str, flag: str = "--device") -> None:
    """Refuse a device this machine lacks: CUDA without a GPU, a GPU index past the last."""
    from fasttrain.lab.config import _check_device_text

    text = str(device)
    _check_device_text(text)            # the form first: cuda:abc is refused on any machine
    if text in ("auto", "cpu"):
        return
    import torch

    if not torch.cuda.is_available():
        raise FasttrainError(f"{flag} {text}: no CUDA GPU here (torch {torch.__version__}); use {flag} cpu")
    if text.startswith("cuda:"):
        index, count = int(text[len("cuda:"):]), torch.cuda.device_count()
        if index >= count:
            have = "cuda:0" if count == 1 else f"cuda:0 .. cuda:{count - 1}"
            raise FasttrainError(f"{flag} {text}: this machine has {count} GPU{'s' if count > 1 else ''} ({have}); "
                                 f"give one of those")


# --- the corpus and the memory --------------------------------------------------------------------

def check_vocabulary(cfg, corpus) -> None:
    """An explicit --vocab-size must hold every character of the corpus (the embedding's rows)."""
    if cfg.vocab_size is not None and cfg.vocab_size < corpus.vocab_size:
        raise FasttrainError(f"--vocab-size {cfg.vocab_size} is smaller than the corpus' {corpus.vocab_size} "
                             f"characters; give at least {corpus.vocab_size} or leave it out")


def device_memory(device) -> tuple[int, int, str]:
    """(bytes free, bytes total, what they are) of ``device``: the GPU's free and total memory, or the
    machine's available and total RAM on the CPU."""
    if device.type == "cuda":
        import torch

        free, total = torch.cuda.mem_get_info(device)
        # blocks this process's caching allocator holds but does not use are free to this run too
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return free + max(0, cached), total, f"{torch.cuda.get_device_name(device)}"
    info = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, rest = line.partition(":")
            info[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    total = info.get("MemTotal") or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return info.get("MemAvailable", total), total, "this machine's memory (CPU)"


def predicted_peak(cfg, vocab: int) -> int | None:
    """The memory estimator's precise peak for one process of ``cfg`` (None where it cannot say)."""
    from fasttrain.lab.estimate import lab_setup
    from fasttrain.lab.hf.config import is_hf
    from fasttrain.memory import estimate

    try:
        if is_hf(cfg.model):
            setup = _hf_setup(cfg)
            return None if setup is None else int(estimate(setup, "precise").total)
        return int(estimate(lab_setup(cfg, vocab), "precise").total)
    except FasttrainError:
        return None


def _hf_setup(cfg):
    """The estimator's Setup for a local Hugging Face model folder (None: a hub name, or a config
    the estimator does not model; the run is then not refused on a prediction)."""
    import json

    from fasttrain.lab.hf import memory_setup_for

    config = Path(cfg.model[3:]).expanduser() / "config.json"
    try:
        data = json.loads(config.read_text())
    except (OSError, ValueError):
        return None
    make = memory_setup_for(data) if isinstance(data, dict) else None
    return make(cfg, cfg.per_device_train_batch_size) if make is not None else None


def _gib(n: int) -> str:
    return f"{n / 2**30:,.1f} GiB"


def fitting_flags(cfg, vocab: int, limit: int) -> str:
    """The first of: a smaller micro-batch (more accumulation keeps the tokens per step), then
    recomputation and bf16, whose predicted peak fits in ``limit`` bytes."""
    batch, k = cfg.per_device_train_batch_size, cfg.gradient_accumulation_steps
    b = batch // 2
    while b >= 1:
        smaller = predicted_peak(cfg.with_(per_device_train_batch_size=b), vocab)
        if (smaller or limit + 1) <= limit:
            keep = f" --gradient-accumulation-steps {k * batch // b}" if batch % b == 0 else ""
            return f"--per-device-train-batch-size {b}{keep} (predicted {_gib(smaller)})"
        b //= 2
    lean = cfg.with_(gradient_checkpointing="full", bf16=not cfg.fp16, per_device_train_batch_size=1)
    peak = predicted_peak(lean, vocab)
    if peak is not None and peak <= limit:
        return (f"--per-device-train-batch-size 1 --gradient-checkpointing full{'' if cfg.fp16 else ' --bf16'} "
                f"(predicted {_gib(peak)})")
    return "a smaller --width, --layers or --context (not even a batch of 1 with recomputation fits)"


def check_fits(cfg, vocab: int, device, world_size: int = 1) -> int | None:
    """Refuse, before anything is allocated, a run whose predicted peak exceeds the memory there is:
    on a GPU its free memory (with 5% slack for the estimator's error), on the CPU the machine's
    total memory (beyond it the system swaps or kills the process). Skipped for several processes
    (``distributed.check_model_fits`` covers them) and under --auto-find-batch-size on a GPU
    (the search finds what fits). Returns the prediction."""
    if world_size > 1 or (cfg.auto_find_batch_size and device.type == "cuda"):
        return None
    peak = predicted_peak(cfg, vocab)
    if peak is None:
        return None
    free, total, what = device_memory(device)
    limit = int(1.05 * free) if device.type == "cuda" else total
    if peak > limit:
        have = (f"{_gib(free)} free of {_gib(total)}" if device.type == "cuda" else f"{_gib(total)}")
        raise FasttrainError(f"the memory estimator predicts a peak of {_gib(peak)} for this run, more than "
                             f"{what} has ({have}); try {fitting_flags(cfg, vocab, limit)}")
    return peak


def check_ready(cfg, corpus, device, world_size: int = 1) -> None:
    """The checks that need the corpus and the device, before the model is built."""
    check_vocabulary(cfg, corpus)
    check_fits(cfg, corpus.vocab_size, device, world_size)


__all__ = ["CHECKPOINT_FORMAT", "check_device", "check_fits", "check_outputs", "check_ready", "check_run",
           "check_save_folder", "check_vocabulary", "expand", "is_lab_checkpoint", "save_folder_state"]
