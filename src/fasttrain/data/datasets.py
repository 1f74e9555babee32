"""MNIST-like datasets: where they live, how they are verified, downloaded and loaded.

Location, first match wins: ``--data-dir`` > ``$FASTTRAIN_DATA_DIR`` > ``$XDG_CACHE_HOME/fasttrain``
> ``~/.cache/fasttrain``. Each dataset's files sit in ``<root>/<dataset>/``, except when the root
itself is named after the dataset (``FASTTRAIN_DATA_DIR=.../mnist`` holds the MNIST files
directly).

Verification: each ``.gz`` has the MD5 torchvision lists. For MNIST we also know the MD5 of the
decompressed content, which holds for any gzip of the same bytes; a file passes when either its
``.gz`` MD5 or (where known) its content MD5 matches.
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from fasttrain.data.idx import md5_hex, parse_idx, read_idx_file
from fasttrain.errors import DataError

ROLES = ("train_images", "train_labels", "test_images", "test_labels")
FILENAMES = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}
IMAGE_SHAPE = (28, 28)
NUM_CLASSES = 10


@dataclass(frozen=True)
class FileSpec:
    filename: str  # the .gz name
    gz_md5: str
    content_md5: str | None = None  # MD5 of the decompressed IDX bytes, where known


@dataclass(frozen=True)
class DatasetSpec:
    name: str
    title: str
    mirrors: tuple[str, ...]
    files: dict[str, FileSpec] = field(default_factory=dict)
    train_size: int = 60000
    test_size: int = 10000


def _files(gz: dict[str, str], content: dict[str, str] | None = None) -> dict[str, FileSpec]:
    content = content or {}
    return {role: FileSpec(FILENAMES[role] + ".gz", gz[role], content.get(role)) for role in ROLES}


DATASETS: dict[str, DatasetSpec] = {
    "mnist": DatasetSpec(
        "mnist",
        "MNIST",
        ("https://ossci-datasets.s3.amazonaws.com/mnist/", "http://yann.lecun.com/exdb/mnist/"),
        _files(
            {
                "train_images": "f68b3c2dcbeaaa9fbdd348bbdeb94873",
                "train_labels": "d53e105ee54ea40749a09fcbcd1e9432",
                "test_images": "9fb629c4189551a2d022fa330f9573f3",
                "test_labels": "ec29112dd5afa0611ce80d1b7f02629c",
            },
            {
                "train_images": "6bbc9ace898e44ae57da46a324031adb",
                "train_labels": "a25bea736e30d166cdddb491f175f624",
                "test_images": "2646ac647ad5339dbf082846283269ea",
                "test_labels": "27ae3e4e09519cfbb04c329615203637",
            },
        ),
    ),
    "fashion-mnist": DatasetSpec(
        "fashion-mnist",
        "Fashion-MNIST",
        ("http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",),
        _files(
            {
                "train_images": "8d4fb7e6c68d591d4c3dfef9ec88bf0d",
                "train_labels": "25c81989df183df01b3e8a0aad5dffbe",
                "test_images": "bef4ecab320f06d8554ea6380940ec79",
                "test_labels": "bb300cfdad3c16e7a12a480ee83cd310",
            }
        ),
    ),
    "kmnist": DatasetSpec(
        "kmnist",
        "Kuzushiji-MNIST",
        ("http://codh.rois.ac.jp/kmnist/dataset/kmnist/",),
        _files(
            {
                "train_images": "bdb82020997e1d708af4cf47b453dcf7",
                "train_labels": "e144d726b3acfaa3e44228e80efcd344",
                "test_images": "5c965bf0a639b31b8f53240b1b52f4d7",
                "test_labels": "7320c461ea6c1c855c0b718fb2a4b134",
            }
        ),
    ),
}


def dataset_spec(name: str) -> DatasetSpec:
    try:
        return DATASETS[name]
    except KeyError:
        from fasttrain.data.text import TEXT_DATASETS

        raise DataError(f"unknown dataset {name!r}; choose one of: {', '.join([*DATASETS, *TEXT_DATASETS])}") from None


def data_root(data_dir: str | os.PathLike | None = None) -> Path:
    """The data root: ``data_dir`` > $FASTTRAIN_DATA_DIR > $XDG_CACHE_HOME/fasttrain > ~/.cache/fasttrain."""
    if data_dir:
        return Path(data_dir).expanduser()
    if os.environ.get("FASTTRAIN_DATA_DIR"):
        return Path(os.environ["FASTTRAIN_DATA_DIR"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "fasttrain"
    return Path.home() / ".cache" / "fasttrain"


def dataset_dir(name: str, data_dir: str | os.PathLike | None = None) -> Path:
    root = data_root(data_dir)
    return root if root.name == name else root / name


def download_command(name: str, data_dir: str | os.PathLike | None = None) -> str:
    return f"fasttrain data download --dataset {name} --data-dir {data_root(data_dir)}"


def _locate(spec: DatasetSpec, role: str, directory: Path, data_dir) -> Path:
    """The file for ``role``: the ``.gz`` if present, else an uncompressed copy."""
    gz = directory / spec.files[role].filename
    if gz.exists():
        return gz
    raw = directory / FILENAMES[role]
    if raw.exists():
        return raw
    raise DataError(f"{spec.title} file not found: {gz}; download it with: {download_command(spec.name, data_dir)}")


def _check_checksum(spec: DatasetSpec, role: str, path: Path, file_bytes: bytes, content: bytes,
                    data_dir=None) -> None:
    fs = spec.files[role]
    if fs.content_md5 is not None and md5_hex(content) == fs.content_md5:
        return
    if file_bytes is not None and path.suffix == ".gz" and md5_hex(file_bytes) == fs.gz_md5:
        return
    if fs.content_md5 is None and path.suffix != ".gz":
        return  # no content checksum published for an uncompressed copy: structure checks only
    raise DataError(
        f"{path}: checksum mismatch (not the published {spec.title} file); delete it and run: "
        f"{download_command(spec.name, data_dir)}"
    )


def _read_checked(spec: DatasetSpec, role: str, path: Path) -> tuple[np.ndarray, bytes, bytes]:
    """Read one file once and check its structure (gzip, magic, sizes, 28x28 images, labels 0..9);
    returns (array, file bytes, decompressed content) so the checksum needs no second read."""
    file_bytes, content = read_idx_file(path)
    array = parse_idx(content, str(path))
    if role.endswith("images"):
        if array.ndim != 3 or array.shape[1:] != IMAGE_SHAPE:
            raise DataError(f"{path}: images are {array.shape[1:]} but must be 28x28")
    else:
        if array.ndim != 1:
            raise DataError(f"{path}: labels must be a 1-D IDX array, got shape {array.shape}")
        if array.size and int(array.max()) >= NUM_CLASSES:
            raise DataError(f"{path}: label {int(array.max())} is outside 0..9; the file is corrupt")
    return array, file_bytes, content


def _read_verified(spec: DatasetSpec, role: str, path: Path, verify: bool, data_dir=None) -> np.ndarray:
    array, file_bytes, content = _read_checked(spec, role, path)
    if verify:
        _check_checksum(spec, role, path, file_bytes, content, data_dir)
    return array


@dataclass(frozen=True)
class Dataset:
    """Images as uint8 (N, 28, 28) and labels as uint8 (N,): engines upload bytes, not floats."""

    name: str
    train_images: np.ndarray
    train_labels: np.ndarray
    test_images: np.ndarray
    test_labels: np.ndarray

    def __post_init__(self) -> None:
        for split in ("train", "test"):
            images, labels = getattr(self, f"{split}_images"), getattr(self, f"{split}_labels")
            if len(images) != len(labels):
                raise DataError(f"{self.name}: {len(images)} {split} images but {len(labels)} labels")

    @property
    def n_train(self) -> int:
        return len(self.train_labels)

    def subset(self, n_train: int, n_test: int) -> "Dataset":
        """The first examples of each split: small data for quick checks."""
        return Dataset(
            self.name,
            self.train_images[:n_train],
            self.train_labels[:n_train],
            self.test_images[:n_test],
            self.test_labels[:n_test],
        )


def to_inputs(images: np.ndarray, dtype=np.float32) -> np.ndarray:
    """Training inputs: ``x = pixel / 255``, flattened to 784 features."""
    return (images.reshape(len(images), -1).astype(dtype) / dtype(255.0)).astype(dtype, copy=False)


def load_dataset(name: str = "mnist", data_dir: str | os.PathLike | None = None, verify: bool = True) -> Dataset:
    """Load a dataset's four files. Checks run in the order that gives the most useful message:
    every file present, then each file's structure, then image/label counts, then checksums."""
    spec = dataset_spec(name)
    directory = dataset_dir(name, data_dir)
    paths = {role: _locate(spec, role, directory, data_dir) for role in ROLES}
    checked = {role: _read_checked(spec, role, paths[role]) for role in ROLES}
    data = Dataset(name, **{role: array for role, (array, _, _) in checked.items()})
    if verify:
        for role in ROLES:
            _, file_bytes, content = checked[role]
            _check_checksum(spec, role, paths[role], file_bytes, content, data_dir)
    return data


def verify_dataset(name: str = "mnist", data_dir: str | os.PathLike | None = None) -> list[tuple[Path, str]]:
    """Check every file of a dataset (structure, counts, checksums); raises DataError on the first failure."""
    from fasttrain.data.text import TEXT_DATASETS, verify_text

    if name in TEXT_DATASETS:
        return verify_text(name, data_dir)
    load_dataset(name, data_dir, verify=True)
    directory = dataset_dir(name, data_dir)
    return [(_locate(dataset_spec(name), role, directory, data_dir), "ok") for role in ROLES]


class _RichDownloadBar:
    """The progress-bar interface pooch's HTTPDownloader drives (total, update, reset, close), on rich."""

    def __init__(self, description: str):
        from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

        self._progress = Progress(
            "[progress.description]{task.description}", BarColumn(), DownloadColumn(), TransferSpeedColumn(),
            transient=True,
        )
        self._task = self._progress.add_task(description, total=None)
        self._progress.start()
        self.total = None

    def update(self, n: int) -> None:
        self._progress.update(self._task, advance=n, total=self.total)

    def reset(self) -> None:
        self._progress.reset(self._task, total=self.total)

    def close(self) -> None:
        self._progress.stop()


def _fetch(url: str, dest: Path, progress: bool, timeout: float) -> None:
    import pooch

    bar = _RichDownloadBar(dest.name.split(".tmp")[0]) if progress else False
    downloader = pooch.HTTPDownloader(progressbar=bar, timeout=timeout)
    try:
        downloader(url, str(dest), None)
    finally:
        if bar:
            bar.close()


def download_dataset(
    name: str = "mnist",
    data_dir: str | os.PathLike | None = None,
    *,
    mirrors: tuple[str, ...] | None = None,
    retries: int = 3,
    progress: bool = True,
    timeout: float = 60.0,
    force: bool = False,
) -> list[tuple[Path, str]]:
    """Download and verify a dataset's files, trying each mirror with retries.

    Each file is written to a temporary name in the target folder, verified, then renamed into
    place, so a partial or unverified file never sits at the final path. Files already present
    and valid are kept (``force`` re-downloads them). Text corpora (Tiny Shakespeare) are one
    file checked by SHA-256 (:mod:`fasttrain.data.text`).
    """
    from fasttrain.data.text import TEXT_DATASETS, download_text

    if name in TEXT_DATASETS:
        return download_text(name, data_dir, urls=mirrors, retries=retries, progress=progress, timeout=timeout,
                             force=force)
    spec = dataset_spec(name)
    mirrors = mirrors or spec.mirrors
    directory = dataset_dir(name, data_dir)
    directory.mkdir(parents=True, exist_ok=True)
    report = []
    for role in ROLES:
        fs = spec.files[role]
        final = directory / fs.filename
        if final.exists() and not force:
            try:
                _read_verified(spec, role, final, verify=True)
                report.append((final, "present"))
                continue
            except DataError:
                pass  # a bad file is replaced below
        errors: list[str] = []
        source = next((url for url in (m.rstrip("/") + "/" + fs.filename for m in mirrors)
                       if _try_download(spec, role, url, directory, final, retries, progress, timeout, errors)), None)
        if source is None:
            last = errors[-1] if errors else "no mirror configured"
            raise DataError(f"could not download {fs.filename} from any mirror ({len(errors)} attempts; last: {last})")
        report.append((final, f"downloaded from {source}"))
    return report


def _try_download(spec, role, url, directory: Path, final: Path, retries: int, progress: bool, timeout: float,
                  errors: list[str]) -> bool:
    """Fetch ``url`` into a temporary file, verify it, rename it to ``final``. Network errors are
    retried with backoff; a file that arrives but fails verification is not (the mirror is bad)."""
    for attempt in range(retries):
        fd, tmp_name = tempfile.mkstemp(prefix=final.name + ".", suffix=".tmp", dir=directory)
        os.close(fd)
        tmp = Path(tmp_name)
        try:
            _fetch(url, tmp, progress, timeout)
            verified = tmp.with_name(tmp.name + ".gz")  # verification reads the suffix
            tmp.rename(verified)
            tmp = verified
            _read_verified(spec, role, tmp, verify=True)
            os.replace(tmp, final)
            return True
        except DataError as exc:
            errors.append(f"{url}: {exc}")
            return False
        except Exception as exc:  # network errors
            errors.append(f"{url}: {type(exc).__name__}: {exc}")
            if attempt + 1 < retries:
                time.sleep(0.25 * min(2.0**attempt, 8.0))
        finally:
            if tmp.exists():
                tmp.unlink()
    return False
