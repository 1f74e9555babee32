"""MNIST-like datasets: where they live, how they are verified, downloaded and loaded.

Location: :mod:`fasttrain.data.locations` decides it (the data root holds one folder per dataset).
The text corpora are found and checked by :mod:`fasttrain.data.text`; their download is the one below.

Verification: each ``.gz`` has the MD5 torchvision lists. For MNIST we also know the MD5 of the
decompressed content, which holds for any gzip of the same bytes; a file passes when either its
``.gz`` MD5 or (where known) its content MD5 matches. An uncompressed copy of a dataset whose
content MD5 we do not know (Fashion-MNIST, KMNIST) cannot be checked, so it is refused with the
command that fetches the published ``.gz`` files, never called verified.
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from fasttrain.data.idx import md5_hex, parse_idx, read_idx_file
from fasttrain.data.locations import data_root, dataset_dir, download_command  # noqa: F401 - re-exported
from fasttrain.data.text import TEXT_DATASETS, text_path, text_spec, verify_text
from fasttrain.data.text import check_text as _check_text
from fasttrain.errors import DataError
from fasttrain.files import default_file_mode

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
        raise DataError(f"unknown dataset {name!r}; choose one of: {', '.join([*DATASETS, *TEXT_DATASETS])}") from None


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
        raise DataError(
            f"{path}: an uncompressed {spec.title} file, which cannot be verified (only the published .gz files' "
            f"checksums are known); put {fs.filename} there instead, e.g. run: {download_command(spec.name, data_dir)}"
        )
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


def _fetch(url: str, dest: Path, progress: bool, timeout, description: str) -> None:
    import pooch

    bar = _RichDownloadBar(description) if progress else False
    downloader = pooch.HTTPDownloader(progressbar=bar, timeout=timeout)
    try:
        downloader(url, str(dest), None)
    finally:
        if bar:
            bar.close()


# (connect, read) timeouts in seconds and tries per mirror: on a network that accepts connections but
# never answers, each try gives up after READ_TIMEOUT s of silence, so MNIST's two mirrors fail in
# about 2 x 2 x 8 s; DEADLINE caps the whole download however many mirrors a dataset lists.
CONNECT_TIMEOUT = 5.0
READ_TIMEOUT = 8.0
RETRIES = 2
DEADLINE = 45.0


def _offline_hint(title: str, directory: Path) -> str:
    """Where copied files would be found: the dataset's folder, or a folder of that name under a root of one's own."""
    return (f"offline? copy the {title} files into {directory}, or into ROOT/{directory.name}/ and point "
            "FASTTRAIN_DATA_DIR or --data-dir at ROOT")


def _make_dataset_folder(directory: Path) -> list[Path]:
    """Create the folder a download writes into; returns the folders created (removed again if the
    download fails, so nothing half-made is left)."""
    if directory.exists() and not directory.is_dir():
        raise DataError(f"{directory} is a file, not a folder; choose another --data-dir")
    created = _created_folders(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DataError(f"cannot create {directory} ({exc.strerror}); choose another folder with --data-dir "
                        "or FASTTRAIN_DATA_DIR") from None
    return created


def _created_folders(directory: Path) -> list[Path]:
    """The folders ``directory.mkdir(parents=True)`` would create, innermost first."""
    missing = []
    for folder in (directory, *directory.parents):
        if folder.exists():
            break
        missing.append(folder)
    return missing


def _remove_created(created: list[Path]) -> None:
    """Remove the folders a download made (innermost first) while they are empty."""
    for folder in created:
        try:
            folder.rmdir()
        except OSError:
            break


def download_dataset(
    name: str = "mnist",
    data_dir: str | os.PathLike | None = None,
    *,
    mirrors: tuple[str, ...] | None = None,
    retries: int = RETRIES,
    progress: bool = True,
    timeout: float | tuple[float, float] = (CONNECT_TIMEOUT, READ_TIMEOUT),
    force: bool = False,
    deadline: float = DEADLINE,
    log=None,
) -> list[tuple[Path, str]]:
    """Download and verify a dataset's files, trying each mirror with retries.

    Each file is written to a temporary name in the target folder, verified, then renamed into
    place, so a partial or unverified file never sits at the final path. Files already present
    and valid are kept (``force`` re-downloads them). ``log(line)`` hears of every failed try. On
    failure the error names every mirror tried and how; folders created for the download are
    removed again when nothing was saved in them. Text corpora (Tiny Shakespeare) are one file
    checked by SHA-256 (:mod:`fasttrain.data.text`).
    """
    if name in TEXT_DATASETS:
        return download_text(name, data_dir, urls=mirrors, retries=retries, progress=progress, timeout=timeout,
                             force=force, deadline=deadline, log=log)
    spec = dataset_spec(name)
    mirrors = mirrors or spec.mirrors
    directory = dataset_dir(name, data_dir)
    created = _make_dataset_folder(directory)
    started = time.monotonic()
    report = []
    try:
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
            tried: list[str] = []
            source = None
            for number, mirror in enumerate(mirrors, start=1):
                url = mirror.rstrip("/") + "/" + fs.filename
                outcome = _try_download(_gz_verifier(spec, role), url, directory, final, retries, progress, timeout,
                                        f"{fs.filename} (mirror {number}/{len(mirrors)}", started + deadline, log)
                if outcome is None:
                    source = url
                    break
                tried.append(f"{mirror} ({outcome})")
            if source is None:
                raise DataError(f"could not download {fs.filename} from any mirror: tried {'; '.join(tried) or 'none'}; "
                                f"{_offline_hint(spec.title, directory)}")
            report.append((final, f"downloaded from {source}"))
    except BaseException:
        _remove_created(created)
        raise
    return report


def _gz_verifier(spec, role):
    """A verifier for :func:`_try_download`: the file is an IDX .gz of ``spec``'s ``role``."""
    def verify(tmp: Path) -> Path:
        verified = tmp.with_name(tmp.name + ".gz")  # verification reads the suffix
        tmp.rename(verified)
        try:
            _read_verified(spec, role, verified, verify=True)
        except BaseException:
            verified.unlink(missing_ok=True)
            raise
        return verified
    return verify


def _try_download(verify, url, directory: Path, final: Path, retries: int, progress: bool, timeout,
                  description: str, deadline: float, log) -> str | None:
    """Fetch ``url`` into a temporary file, ``verify(tmp) -> path`` it (raising DataError for a bad
    file; it may rename the file and returns where it now is), rename it to ``final``; None on
    success, else what went wrong. Network errors are retried with backoff until ``deadline`` (a
    monotonic time); a file that arrives but fails verification is not retried (the mirror is bad)."""
    last = "not tried: time limit reached"
    for attempt in range(1, retries + 1):
        if time.monotonic() >= deadline:
            return f"{last}; stopped at the time limit of the whole download"
        fd, tmp_name = tempfile.mkstemp(prefix=final.name + ".", suffix=".tmp", dir=directory)
        os.close(fd)
        tmp = Path(tmp_name)
        try:
            _fetch(url, tmp, progress, timeout, f"{description}, attempt {attempt}/{retries})")
            tmp = verify(tmp)
            os.chmod(tmp, default_file_mode())
            os.replace(tmp, final)
            return None
        except DataError as exc:
            if log:
                log(f"{url}: attempt {attempt}/{retries}: {exc}")
            return f"a bad file: {exc}"
        except Exception as exc:  # network errors
            last = f"{attempt} attempt{'s' if attempt > 1 else ''}, last: {type(exc).__name__}"
            if log:
                log(f"{url}: attempt {attempt}/{retries} failed: {type(exc).__name__}: {str(exc)[:160]}")
            if attempt < retries:
                time.sleep(0.25 * min(2.0 ** (attempt - 1), 8.0))
        finally:
            if tmp.exists():
                tmp.unlink()
    return last


def download_text(name: str, data_dir=None, *, urls: tuple[str, ...] | None = None, retries: int | None = None,
                  progress: bool = True, timeout=None, force: bool = False, deadline: float | None = None,
                  log=None) -> list[tuple[Path, str]]:
    """Fetch the corpus into a temporary file beside its final path, check its SHA-256, rename it
    into place (never a partial or unverified file at the final path). The same mirrors, attempts,
    time limits and clean-up as the image datasets (:func:`download_dataset` above)."""
    spec = text_spec(name)
    final = text_path(name, data_dir)
    directory = final.parent
    if final.is_dir():
        raise DataError(f"{final} is a folder, not the {spec.title} file; move it away and run the download again")
    if final.exists() and not force:
        try:
            _check_text(spec, final, final.read_bytes(), data_dir)
            return [(final, "present")]
        except DataError:
            pass  # a bad file is replaced below
    created = _make_dataset_folder(directory)

    def verify(tmp: Path) -> Path:
        _check_text(spec, tmp, tmp.read_bytes(), data_dir)
        return tmp

    mirrors = urls or spec.urls
    stop = time.monotonic() + (DEADLINE if deadline is None else deadline)
    tried: list[str] = []
    try:
        for number, url in enumerate(mirrors, start=1):
            outcome = _try_download(verify, url, directory, final, retries or RETRIES, progress,
                                    timeout or (CONNECT_TIMEOUT, READ_TIMEOUT),
                                    f"{spec.filename} (mirror {number}/{len(mirrors)}", stop, log)
            if outcome is None:
                return [(final, f"downloaded from {url}")]
            tried.append(f"{url} ({outcome})")
        raise DataError(f"could not download {spec.filename} from any mirror: tried {'; '.join(tried) or 'none'}; "
                        f"{_offline_hint(spec.title, directory)}")
    except BaseException:
        _remove_created(created)
        raise
