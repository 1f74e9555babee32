"""Where datasets live: the one place that decides it, for the image datasets and the text corpora alike.

The data root, first match wins: ``--data-dir`` > ``$FASTTRAIN_DATA_DIR`` > ``$XDG_CACHE_HOME/fasttrain``
> ``~/.cache/fasttrain``. The root holds one folder per dataset (``<root>/mnist/``,
``<root>/tinyshakespeare/``). A folder named after a dataset is still accepted in place of the root
(``FASTTRAIN_DATA_DIR=.../mnist`` holds the MNIST files directly): it is that dataset's folder, and the
other datasets are looked for beside it, in its parent, which is then the root every hint names.

A root that exists but is a file is refused, in one line naming where the root came from.
"""

from __future__ import annotations

import os
from pathlib import Path

from fasttrain.errors import DataError

# The folder names of every dataset (fasttrain.data.datasets.DATASETS and fasttrain.data.text.TEXT_DATASETS;
# tests/test_data.py holds the three lists equal): a root with one of these names is that dataset's folder.
DATASET_NAMES = ("mnist", "fashion-mnist", "kmnist", "tinyshakespeare")


def _chosen_root(data_dir: str | os.PathLike | None) -> tuple[Path, str]:
    """(the root as given, where it came from: the flag, the variable or the cache)."""
    if data_dir:
        return Path(data_dir).expanduser(), "--data-dir"
    if os.environ.get("FASTTRAIN_DATA_DIR"):
        return Path(os.environ["FASTTRAIN_DATA_DIR"]).expanduser(), "FASTTRAIN_DATA_DIR"
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "fasttrain", "the cache folder"
    return Path.home() / ".cache" / "fasttrain", "the cache folder"


def data_root(data_dir: str | os.PathLike | None = None) -> Path:
    """The data root as chosen: ``data_dir`` > $FASTTRAIN_DATA_DIR > $XDG_CACHE_HOME/fasttrain >
    ~/.cache/fasttrain (a folder named after a dataset stays as given: see :func:`dataset_dir`).
    Refused when it exists and is not a folder."""
    root, source = _chosen_root(data_dir)
    if root.exists() and not root.is_dir():
        where = {"--data-dir": f"--data-dir {root}", "FASTTRAIN_DATA_DIR": f"FASTTRAIN_DATA_DIR={root}"}.get(
            source, f"{source} {root}")
        raise DataError(f"{where} is a file, not a folder; give the data root, the folder that holds one folder "
                        "per dataset (mnist/, tinyshakespeare/, ...)")
    return root


def working_root(data_dir: str | os.PathLike | None = None) -> Path:
    """The folder that holds one folder per dataset: the data root, or the parent of a root named after a
    dataset. This is the ``--data-dir`` every hint names (it works for every dataset)."""
    root = data_root(data_dir)
    return root.parent if root.name in DATASET_NAMES else root


def dataset_dir(name: str, data_dir: str | os.PathLike | None = None) -> Path:
    """The folder of dataset ``name``: the root itself when named after ``name``, else ``<root>/<name>``
    (the root being the parent of a folder named after another dataset)."""
    root = data_root(data_dir)
    if root.name == name:
        return root
    return working_root(data_dir) / name


def download_command(name: str, data_dir: str | os.PathLike | None = None) -> str:
    """The command that fetches dataset ``name`` where it will then be found."""
    return f"fasttrain data download --dataset {name} --data-dir {working_root(data_dir)}"
