"""Text corpora (Tiny Shakespeare): found like MNIST, SHA-256 verified, downloaded atomically.

The file is looked for in ``<root>/<name>/`` or in the root itself when the root is named after
the corpus (``--data-dir .../tinyshakespeare``); the root is ``--data-dir`` >
``$FASTTRAIN_DATA_DIR`` > the cache (see :func:`fasttrain.data.datasets.data_root`).
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from pathlib import Path

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
    from fasttrain.data.datasets import dataset_dir

    return dataset_dir(name, data_dir) / text_spec(name).filename


def _check(spec: TextSpec, path: Path, raw: bytes, data_dir=None) -> None:
    from fasttrain.data.datasets import download_command

    digest = hashlib.sha256(raw).hexdigest()
    if digest != spec.sha256:
        raise DataError(f"{path}: checksum mismatch (SHA-256 {digest[:12]}..., not the published {spec.title} "
                        f"file); delete it and run: {download_command(spec.name, data_dir)} (your own text? "
                        f"train on it with: fasttrain lab --train-file {path})")


def load_text(name: str = "tinyshakespeare", data_dir=None, verify: bool = True) -> str:
    """The corpus as one string, its SHA-256 checked."""
    from fasttrain.data.datasets import download_command

    spec = text_spec(name)
    path = text_path(name, data_dir)
    if not path.exists():
        raise DataError(f"{spec.title} file not found: {path}; download it with: {download_command(name, data_dir)}")
    raw = path.read_bytes()
    if verify:
        _check(spec, path, raw, data_dir)
    return raw.decode("utf-8")


def verify_text(name: str, data_dir=None) -> list[tuple[Path, str]]:
    load_text(name, data_dir, verify=True)
    return [(text_path(name, data_dir), "ok")]


def download_text(name: str, data_dir=None, *, urls: tuple[str, ...] | None = None, retries: int | None = None,
                  progress: bool = True, timeout=None, force: bool = False, deadline: float | None = None,
                  log=None) -> list[tuple[Path, str]]:
    """Fetch the corpus into a temporary file beside its final path, check its SHA-256, rename it
    into place (never a partial or unverified file at the final path). The same mirrors, attempts,
    time limits and clean-up as the image datasets (:func:`fasttrain.data.datasets.download_dataset`)."""
    from fasttrain.data import datasets as ds

    spec = text_spec(name)
    final = text_path(name, data_dir)
    directory = final.parent
    if final.exists() and not force:
        try:
            _check(spec, final, final.read_bytes(), data_dir)
            return [(final, "present")]
        except DataError:
            pass  # a bad file is replaced below
    if directory.exists() and not directory.is_dir():
        raise DataError(f"{directory} is a file, not a folder; choose another --data-dir")
    created = ds._created_folders(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DataError(f"cannot create {directory} ({exc.strerror}); choose another folder with --data-dir "
                        "or FASTTRAIN_DATA_DIR") from None

    def verify(tmp: Path) -> Path:
        _check(spec, tmp, tmp.read_bytes(), data_dir)
        return tmp

    mirrors = urls or spec.urls
    stop = time.monotonic() + (ds.DEADLINE if deadline is None else deadline)
    tried: list[str] = []
    try:
        for number, url in enumerate(mirrors, start=1):
            outcome = ds._try_download(verify, url, directory, final, retries or ds.RETRIES, progress,
                                       timeout or (ds.CONNECT_TIMEOUT, ds.READ_TIMEOUT),
                                       f"{spec.filename} (mirror {number}/{len(mirrors)}", stop, log)
            if outcome is None:
                return [(final, f"downloaded from {url}")]
            tried.append(f"{url} ({outcome})")
        raise DataError(f"could not download {spec.filename} from any mirror: tried {'; '.join(tried) or 'none'}; "
                        f"{ds._offline_hint(spec.title)}")
    except BaseException:
        ds._remove_created(created)
        raise
