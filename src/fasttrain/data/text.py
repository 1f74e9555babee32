"""Text corpora (Tiny Shakespeare): found like MNIST, SHA-256 verified (downloaded, atomically, by
:func:`fasttrain.data.datasets.download_dataset`).

The file is looked for in the corpus' folder of the data root, ``<root>/<name>/`` (or the root itself
when it is named after the corpus); :mod:`fasttrain.data.locations` decides where that is.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from fasttrain.data.locations import dataset_dir, download_command
from fasttrain.errors import DataError


@dataclass(frozen=True)
class TextSpec:
    name: str
    title: str
    filename: str
    sha256: str
    size: int
    urls: tuple[str, ...]


TEXT_DATASETS: dict[str, TextSpec] = {
    "tinyshakespeare": TextSpec(
        "tinyshakespeare", "Tiny Shakespeare", "input.txt",
        "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed", 1_115_394,
        ("https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt",
         "https://github.com/karpathy/char-rnn/raw/master/data/tinyshakespeare/input.txt"),
    ),
}


def text_spec(name: str) -> TextSpec:
    try:
        return TEXT_DATASETS[name]
    except KeyError:
        raise DataError(f"unknown text corpus {name!r}; choose one of: {', '.join(TEXT_DATASETS)}") from None


def text_path(name: str = "tinyshakespeare", data_dir=None) -> Path:
    return dataset_dir(name, data_dir) / text_spec(name).filename


def check_text(spec: TextSpec, path: Path, raw: bytes, data_dir=None) -> None:
    digest = hashlib.sha256(raw).hexdigest()
    if digest != spec.sha256:
        raise DataError(f"{path}: checksum mismatch (SHA-256 {digest[:12]}..., not the published {spec.title} "
                        f"file); delete it and run: {download_command(spec.name, data_dir)} (your own text? "
                        f"train on it with: fasttrain lab --train-file {path})")


def load_text(name: str = "tinyshakespeare", data_dir=None, verify: bool = True) -> str:
    """The corpus as one string, its SHA-256 checked."""
    spec = text_spec(name)
    path = text_path(name, data_dir)
    if path.is_dir():
        raise DataError(f"{path} is a folder, not the {spec.title} file; the corpus is the one file {spec.filename} "
                        f"in {path.parent} (move that folder away, then run: {download_command(name, data_dir)})")
    if not path.exists():
        raise DataError(f"{spec.title} file not found: {path}; download it with: {download_command(name, data_dir)}")
    raw = path.read_bytes()
    if verify:
        check_text(spec, path, raw, data_dir)
    return raw.decode("utf-8")


def verify_text(name: str, data_dir=None) -> list[tuple[Path, str]]:
    load_text(name, data_dir, verify=True)
    return [(text_path(name, data_dir), "ok")]
