"""Where the lab writes its checkpoints: recognizing one of ours, and refusing, before any work, a
folder whose files a checkpoint would replace (see :mod:`fasttrain.lab.preflight`). No torch, no
other lab module: the configuration's validation uses it too."""

from __future__ import annotations

import contextlib
import json
import os
import re
from pathlib import Path

from fasttrain.errors import FasttrainError
from fasttrain.lab.models import HF_PREFIX, is_hf

CHECKPOINT_FORMAT = "fasttrain-lab-checkpoint-1"
CHECKPOINT_FILES = ("config.json", "model.safetensors")
# the corpus' tokenizer saved beside the weights (a BPE's files; none for characters or tiktoken)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def expand(path, flag: str) -> Path:
    """``path`` with a leading ``~`` expanded (a quoted ``~`` reaches us unexpanded by the shell);
    refused when empty."""
    text = os.fspath(path)
    if not text.strip():
        raise FasttrainError(f"{flag} is empty; give a path")
    return Path(text).expanduser()


def is_lab_checkpoint(folder) -> bool:
    """Whether ``folder`` holds one of our checkpoints and nothing else: ``config.json`` (a JSON
    object carrying our format marker), ``model.safetensors`` and maybe the corpus' tokenizer."""
    folder = Path(folder)
    try:
        entries = {p.name for p in folder.iterdir()}
    except OSError:
        return False
    if not set(CHECKPOINT_FILES) <= entries <= set(CHECKPOINT_FILES + TOKENIZER_FILES):
        return False
    try:
        meta = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(meta, dict) and meta.get("format") == CHECKPOINT_FORMAT


def save_folder_state(path) -> str:
    """``"new"`` (missing or empty: the run creates it) or ``"checkpoint"`` (one of ours: replaced
    whole when the run ends); anything else is refused by :func:`check_save_folder`."""
    folder = Path(os.fspath(path)).expanduser()
    if not folder.exists() or (folder.is_dir() and not any(folder.iterdir())):
        return "new"
    return "checkpoint" if is_lab_checkpoint(folder) else "other"


def check_save_folder(path, flag: str = "--save") -> Path:
    """Refuse, before any work, a checkpoint folder that cannot be written or whose files would be
    lost: a file, a folder holding anything but one of our checkpoints, a missing or unwritable
    parent. Returns the expanded path."""
    text = os.fspath(path)
    folder = expand(path, flag)
    if folder.exists() and not folder.is_dir():
        raise FasttrainError(f"{flag} {text}: that is a file, not a folder; give a folder for the checkpoint")
    parent = folder.resolve().parent
    if not parent.is_dir():
        raise FasttrainError(f"{flag} {text}: folder {parent} does not exist; create it first")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise FasttrainError(f"{flag} {text}: folder {parent} is not writable (the checkpoint is written beside "
                             f"it and renamed into place); choose another path")
    if folder.is_dir():
        try:
            names = sorted(p.name for p in folder.iterdir())
        except OSError as exc:
            raise FasttrainError(f"{flag} {text}: cannot read the folder ({exc.strerror}); choose another") from None
        if names and not is_lab_checkpoint(folder):
            shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
            raise FasttrainError(f"{flag} {text}: the folder holds other files ({shown}) and is not a lab "
                                 f"checkpoint; the checkpoint replaces its folder whole, so give a new or empty "
                                 f"folder")
    return folder


# --- a run's inputs against its outputs -------------------------------------------------------------
#
# Every command that runs the lab (lab, tune, lab eval, lab sample, lab plot, fasttrain.lab.run)
# resolves its paths here: what the run reads (run_inputs) and what it writes (the record --out, the
# checkpoint --save, the training states in --output-dir, tune's --cache). An output never names an
# input, never lands inside an input folder, and never replaces a file the lab did not write; a
# folder another run wrote is written into only with --overwrite-output-dir.

OVERWRITE = "--overwrite-output-dir"
TEMPORARY_SUFFIXES = (".tmp", ".old")        # a save's temporaries (checkpoint.save_checkpoint, resume.save_state)
LOCK_SUFFIX = ".fasttrain-lock"
STATE_FOLDER = re.compile(r"^checkpoint-\d+$")


def _resolved(path) -> Path:
    return Path(os.fspath(path)).expanduser().resolve()


def _within(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def run_inputs(cfg) -> list[tuple[str, Path]]:
    """``(flag, resolved path)`` of everything a lab run reads: the corpus files, the tokenizer, a
    local model folder, the checkpoint it starts from (``--init-from``) or continues (``--resume``)."""
    pairs = [("--train-file", cfg.train_file), ("--val-file", cfg.val_file), ("--train-bin", cfg.train_bin),
             ("--val-bin", cfg.val_bin), ("--init-from", cfg.init_from), ("--resume", cfg.resume)]
    if isinstance(cfg.tokenizer, str) and cfg.tokenizer.startswith("hf:"):
        pairs.append(("--tokenizer", cfg.tokenizer[3:]))
    if is_hf(cfg.model) and Path(cfg.model[len(HF_PREFIX):]).expanduser().exists():
        pairs.append(("--model", cfg.model[3:]))      # a hub name is no path of this machine
    return [(flag, _resolved(path)) for flag, path in pairs if path is not None and os.fspath(path).strip()]


def is_run_record(path) -> bool:
    """Whether the file ``path`` is a lab run record (``fasttrain lab --out``), which a rerun may replace."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and data.get("kind") == "lab-run"


def check_output_file(path, flag: str, inputs, *, keeps: str = "the record", is_ours=is_run_record) -> Path:
    """An output file of a run: not one of ``inputs`` (``(flag, path)``), not inside an input folder or
    a training-state checkpoint, and not an existing file of another kind than ``is_ours`` accepts."""
    target = _resolved(path)
    for name, source in inputs:
        if target == source:
            raise FasttrainError(f"{flag} {path} is the {name} this run reads; writing {keeps} there would replace "
                                 f"it: give another file")
        if source in target.parents:
            raise FasttrainError(f"{flag} {path} is inside the {name} folder {source}, which this run reads; write "
                                 f"{keeps} beside it")
    if STATE_FOLDER.match(target.parent.name):
        raise FasttrainError(f"{flag} {path} is inside the training-state checkpoint {target.parent}; write {keeps} "
                             f"outside it")
    if target.is_file() and not is_ours(target):
        raise FasttrainError(f"{flag} {path}: the file exists and is not {keeps} of a lab run; it is never "
                             f"replaced: give a new file name")
    return target


def _listing(names) -> str:
    names = sorted(names)
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def own_entries(folder: Path) -> list[str]:
    """The names in ``folder`` that a person or another run put there: not a save's temporaries nor
    its lock (a run killed mid-save leaves those; the next save removes them)."""
    return [p.name for p in folder.iterdir()
            if not p.name.endswith(TEMPORARY_SUFFIXES + (LOCK_SUFFIX,))]


def check_output_folders(cfg) -> None:
    """``--save`` and ``--output-dir`` against the run's inputs and each other (see the block comment)."""
    inputs = run_inputs(cfg)
    overwrite = cfg.overwrite_output_dir
    save = _resolved(cfg.save) if cfg.save is not None else None
    if save is not None:
        for name, source in inputs:
            if _within(source, save):
                what = "is" if source == save else "holds"
                raise FasttrainError(f"--save {cfg.save} {what} the {name} {source} this run reads, and the "
                                     f"checkpoint replaces its folder whole: give a new folder")
        if save_folder_state(save) == "checkpoint" and not overwrite:
            raise FasttrainError(f"--save {cfg.save} holds another run's checkpoint; give a new folder, or add "
                                 f"{OVERWRITE} to replace it when this run ends")
    if not cfg.save_steps or cfg.output_dir is None:
        return
    states = _resolved(cfg.output_dir)
    if save is not None and _within(states, save):
        raise FasttrainError(f"--output-dir {cfg.output_dir} is inside the --save folder {cfg.save}, which the "
                             f"final checkpoint replaces whole (and the training states with it): give an "
                             f"--output-dir beside it")
    resuming = cfg.resume is not None and _within(_resolved(cfg.resume), states)
    for name, source in inputs:
        if name != "--resume" and _within(states, source) and source.is_dir():
            raise FasttrainError(f"--output-dir {cfg.output_dir} is inside the {name} folder {source}, which this "
                                 f"run reads; give an --output-dir of its own")
    if resuming or overwrite or not states.is_dir():
        return
    names = own_entries(states)
    ours = [n for n in names if STATE_FOLDER.match(n)]
    if ours:
        raise FasttrainError(f"--output-dir {cfg.output_dir} holds another run's checkpoints ({_listing(ours)}); "
                             f"continue that run with --resume {cfg.output_dir}, give a new folder, or add "
                             f"{OVERWRITE} (its checkpoints are kept, never pruned)")
    if names:
        raise FasttrainError(f"--output-dir {cfg.output_dir} holds other files ({_listing(names)}); give a new or "
                             f"empty folder, or add {OVERWRITE} to write checkpoint-N folders beside them")


def is_tune_cache(path) -> bool:
    """Whether the file ``path`` is tune's probe cache (a JSON object with ``schema`` and ``probes``)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and "schema" in data and isinstance(data.get("probes"), dict)


def check_cache_file(path, inputs=(), flag: str = "--cache") -> Path:
    """tune's probe cache: read and rewritten whole, so it must be a cache already or a new file in a
    folder that exists (a mistyped path creates no folders)."""
    text = os.fspath(path)
    if not text.strip():
        raise FasttrainError(f"{flag} is empty; give a file name (e.g. {flag} tune-probes.json)")
    target = Path(text).expanduser()
    if target.is_dir():
        raise FasttrainError(f"{flag} {text}: that is a folder; give a file inside it (e.g. {flag} "
                             f"{os.path.join(text, 'tune-probes.json')})")
    parent = target.resolve().parent
    if not parent.is_dir():
        raise FasttrainError(f"{flag} {text}: folder {parent} does not exist; create it first (or leave {flag} "
                             f"out for the default cache)")
    check_output_file(target, flag, inputs, keeps="the probe cache", is_ours=is_tune_cache)
    return target


# --- one run at a time per output folder ---------------------------------------------------------

def _lock_file(folder: Path) -> Path:
    return folder.parent / f".{folder.name}{LOCK_SUFFIX}"


@contextlib.contextmanager
def hold_outputs(cfg):
    """Hold ``--save`` and ``--output-dir`` for this run: a second run given the same folder while
    this one runs is refused in one line. The lock (an advisory ``flock`` on a file beside the
    folder) dies with the process, so a killed run leaves nothing that blocks the next one."""
    import fcntl

    folders = [("--save", cfg.save)] + ([("--output-dir", cfg.output_dir)] if cfg.save_steps else [])
    held = []
    try:
        for flag, path in folders:
            if path is None:
                continue
            folder = _resolved(path)
            if not folder.parent.is_dir():
                continue                # refused by the folder checks, which name the fix
            lock = _lock_file(folder)
            try:
                fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError:
                continue                # an unwritable parent: refused by the folder checks, which name the fix
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                raise FasttrainError(f"{flag} {path}: another run is writing to this folder right now (it holds "
                                     f"{lock.name}); wait for it to end or give another folder") from None
            held.append((lock, fd))
        yield
    finally:
        for lock, fd in reversed(held):
            with contextlib.suppress(OSError):
                lock.unlink()
            os.close(fd)


def remove_stale_temporaries(folder, prefix: str = "") -> None:
    """Remove what a save killed mid-write left in ``folder``: ``PREFIX*.tmp`` folders (the unfinished
    new checkpoint) and ``NAME.*.old`` folders whose ``NAME`` is back in place (the replaced one).
    Called with the folder held (:func:`hold_outputs`), so no running save owns them."""
    import shutil

    folder = Path(folder)
    if not folder.is_dir():
        return
    for p in folder.iterdir():
        if not p.is_dir() or not p.name.startswith(prefix):
            continue
        if p.name.endswith(".tmp"):
            shutil.rmtree(p, ignore_errors=True)
        elif p.name.endswith(".old") and (folder / p.name.rsplit(".", 2)[0]).exists():
            shutil.rmtree(p, ignore_errors=True)


# the image formats a plot is written in (matplotlib's, by the file's extension)
FIGURE_EXTENSIONS = (".png", ".svg", ".pdf", ".jpg", ".jpeg")


def check_figure_path(path, flag: str = "--out", inputs=()) -> Path:
    """A plot's output file: a known image extension (matplotlib picks the format by it and raises
    on any other), and not one of ``inputs`` (the record it plots) nor an existing non-image file."""
    text = os.fspath(path)
    target = check_output_file(path, flag, inputs, keeps="the plot",
                               is_ours=lambda p: p.suffix.lower() in FIGURE_EXTENSIONS)
    suffix = Path(text).suffix.lower()
    if suffix not in FIGURE_EXTENSIONS:
        shown = f"'{suffix}'" if suffix else "none"
        raise FasttrainError(f"{flag} {text}: the extension ({shown}) names no image format; end it in "
                             f"{', '.join(FIGURE_EXTENSIONS)} (e.g. {flag} {Path(text).stem or 'loss'}.png)")
    return target
