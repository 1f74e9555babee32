"""Where the lab writes its checkpoints: recognizing one of ours, and refusing, before any work, a
folder whose files a checkpoint would replace (see :mod:`fasttrain.lab.preflight`). No torch, no
other lab module: the configuration's validation uses it too."""

from __future__ import annotations

import json
import os
from pathlib import Path

from fasttrain.errors import FasttrainError

CHECKPOINT_FORMAT = "fasttrain-lab-checkpoint-1"
CHECKPOINT_FILES = ("config.json", "model.safetensors")


def expand(path, flag: str) -> Path:
    """``path`` with a leading ``~`` expanded (a quoted ``~`` reaches us unexpanded by the shell);
    refused when empty."""
    text = os.fspath(path)
    if not text.strip():
        raise FasttrainError(f"{flag} is empty; give a path")
    return Path(text).expanduser()


def is_lab_checkpoint(folder) -> bool:
    """Whether ``folder`` holds one of our checkpoints and nothing else: ``config.json`` (a JSON
    object carrying our format marker) and ``model.safetensors``."""
    folder = Path(folder)
    try:
        entries = {p.name for p in folder.iterdir()}
    except OSError:
        return False
    if entries != set(CHECKPOINT_FILES):
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
