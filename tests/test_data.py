"""IDX reading/writing, dataset verification, every bad input, and downloads from a local server."""

from __future__ import annotations

import functools
import gzip
import hashlib
import http.server
import threading
from pathlib import Path

import numpy as np
import pytest

from fasttrain.data import datasets as ds
from fasttrain.errors import DataError
import os
import socket
import time
from fasttrain.data.idx import MAX_IDX_BYTES, encode_idx, read_idx, read_idx_file, write_idx
from tests_support import fasttrain_in_process, one_line_error


def test_idx_round_trip_raw_and_gz(tmp_path):
    rng = np.random.default_rng(1)
    images = rng.integers(0, 256, size=(37, 28, 28), dtype=np.uint8)
    labels = rng.integers(0, 10, size=37, dtype=np.uint8)
    for name, array in (("img", images), ("lab", labels)):
        for suffix in ("", ".gz"):
            path = tmp_path / f"{name}{suffix}"
            write_idx(path, array)
            back = read_idx(path)
            assert back.dtype == np.uint8 and back.shape == array.shape
            np.testing.assert_array_equal(back, array)
    # header layout: magic 0x00000803 then big-endian sizes
    assert encode_idx(images)[:8] == bytes([0, 0, 8, 3, 0, 0, 0, 37])


def _write_dataset(directory: Path, n_train=20, n_test=10, **overrides) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    arrays = {
        "train_images": rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8),
        "train_labels": rng.integers(0, 10, n_train, dtype=np.uint8),
        "test_images": rng.integers(0, 256, (n_test, 28, 28), dtype=np.uint8),
        "test_labels": rng.integers(0, 10, n_test, dtype=np.uint8),
    }
    arrays.update(overrides)
    for role, array in arrays.items():
        write_idx(directory / (ds.FILENAMES[role] + ".gz"), array)
    return directory


def test_load_unverified_synthetic(tmp_path):
    _write_dataset(tmp_path / "mnist")
    data = ds.load_dataset("mnist", tmp_path, verify=False)
    assert data.train_images.shape == (20, 28, 28) and data.train_images.dtype == np.uint8
    x = ds.to_inputs(data.train_images)
    assert x.shape == (20, 784) and x.dtype == np.float32 and 0 <= x.min() and x.max() <= 1


def test_data_dir_resolution(tmp_path, monkeypatch):
    monkeypatch.delenv("FASTTRAIN_DATA_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert ds.data_root() == tmp_path / "xdg" / "fasttrain"
    monkeypatch.setenv("FASTTRAIN_DATA_DIR", str(tmp_path / "env"))
    assert ds.data_root() == tmp_path / "env"
    assert ds.data_root(tmp_path / "flag") == tmp_path / "flag"
    # a root named after the dataset holds its files directly; otherwise <root>/<dataset>
    assert ds.dataset_dir("mnist", tmp_path / "mnist") == tmp_path / "mnist"
    assert ds.dataset_dir("kmnist", tmp_path / "data") == tmp_path / "data" / "kmnist"


def test_missing_file_names_the_download_command(tmp_path):
    with pytest.raises(DataError, match=r"not found: .*train-images-idx3-ubyte.gz; download it with: fasttrain data download --dataset mnist --data-dir"):
        ds.load_dataset("mnist", tmp_path)


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (lambda p: p.write_bytes(p.read_bytes()[:-30]), "truncated or corrupt gzip"),
        (lambda p: p.write_bytes(b"not gzip at all"), "truncated or corrupt gzip"),
        (lambda p: p.write_bytes(gzip.compress(b"\x00\x00\x09\x03" + bytes(20))), "wrong magic number"),
        (lambda p: p.write_bytes(gzip.compress(encode_idx(np.zeros((20, 28, 28), np.uint8))[:-5])), "truncated or corrupt"),
        (lambda p: write_idx(p, np.zeros((20, 28, 27), np.uint8)), "must be 28x28"),
    ],
)
def test_bad_image_files(tmp_path, corrupt, message):
    directory = _write_dataset(tmp_path / "mnist")
    corrupt(directory / "train-images-idx3-ubyte.gz")
    with pytest.raises(DataError, match=message):
        ds.load_dataset("mnist", tmp_path, verify=False)


def test_label_out_of_range(tmp_path):
    _write_dataset(tmp_path / "mnist", train_labels=np.full(20, 10, np.uint8))
    with pytest.raises(DataError, match="label 10 is outside 0..9"):
        ds.load_dataset("mnist", tmp_path, verify=False)


def test_count_mismatch(tmp_path):
    _write_dataset(tmp_path / "mnist", train_labels=np.zeros(19, np.uint8))
    with pytest.raises(DataError, match="20 train images but 19 labels"):
        ds.load_dataset("mnist", tmp_path, verify=False)


def test_checksum_mismatch(tmp_path):
    _write_dataset(tmp_path / "mnist")
    with pytest.raises(DataError, match="checksum mismatch"):
        ds.load_dataset("mnist", tmp_path, verify=True)


def test_real_mnist_verifies(mnist_dir):
    report = ds.verify_dataset("mnist", mnist_dir)
    assert len(report) == 4 and all(status == "ok" for _, status in report)
    data = ds.load_dataset("mnist", mnist_dir)
    assert data.train_images.shape == (60000, 28, 28) and data.test_labels.shape == (10000,)


# --- downloads, from an HTTP server on loopback ------------------------------------------------


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture
def file_server(tmp_path):
    """Serves tmp_path/www/<mirror>/ on 127.0.0.1; yields (base_url, www_dir)."""
    www = tmp_path / "www"
    www.mkdir()
    handler = functools.partial(_QuietHandler, directory=str(www))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", www
    server.shutdown()
    server.server_close()


@pytest.fixture
def tiny_spec(tmp_path, monkeypatch):
    """A dataset spec whose checksums are those of small synthetic files in tmp_path/src."""
    source = _write_dataset(tmp_path / "src")
    files = {}
    for role in ds.ROLES:
        name = ds.FILENAMES[role] + ".gz"
        files[role] = ds.FileSpec(name, hashlib.md5((source / name).read_bytes()).hexdigest())
    spec = ds.DatasetSpec("tiny", "Tiny", ("unused",), files)
    monkeypatch.setitem(ds.DATASETS, "tiny", spec)
    return source


def test_download_falls_back_to_second_mirror(file_server, tiny_spec, tmp_path):
    base, www = file_server
    (www / "good").mkdir()
    for f in tiny_spec.iterdir():
        (www / "good" / f.name).write_bytes(f.read_bytes())
    target = tmp_path / "data"
    report = ds.download_dataset("tiny", target, mirrors=(f"{base}/missing/", f"{base}/good/"), retries=1, progress=False)
    assert [status.startswith("downloaded from") and "/good/" in status for _, status in report] == [True] * 4
    assert ds.load_dataset("tiny", target).n_train == 20
    # a second call keeps the valid files
    again = ds.download_dataset("tiny", target, mirrors=(f"{base}/good/",), retries=1, progress=False)
    assert {status for _, status in again} == {"present"}


def test_download_rejects_corrupt_bytes_and_leaves_no_partial_file(file_server, tiny_spec, tmp_path):
    base, www = file_server
    (www / "bad").mkdir()
    for f in tiny_spec.iterdir():
        data = f.read_bytes()
        (www / "bad" / f.name).write_bytes(data[:-10])  # truncated gzip on the server
    target = tmp_path / "data"
    with pytest.raises(DataError, match="could not download train-images-idx3-ubyte.gz from any mirror"):
        ds.download_dataset("tiny", target, mirrors=(f"{base}/bad/",), retries=2, progress=False)
    assert not (target / "tiny").exists()  # neither the final file nor a temporary one, nor the folder made for them


def test_download_retries_then_fails_cleanly(tmp_path, tiny_spec):
    # nothing listens on this loopback port: every attempt fails with a connection error
    with pytest.raises(DataError, match="from any mirror: tried http://127.0.0.1:9/ \\(2 attempts"):
        ds.download_dataset("tiny", tmp_path, mirrors=("http://127.0.0.1:9/",), retries=2, progress=False, timeout=2)
    assert not (tmp_path / "tiny").exists()


# --- bad files and an unreachable network: one clear error, quickly, nothing left behind -------------


def _header(dims: tuple[int, ...]) -> bytes:
    return bytes([0, 0, 8, len(dims)]) + b"".join(int(d).to_bytes(4, "big") for d in dims)


def test_header_dimensions_that_overflow_are_refused(tmp_path):
    # 2^32-1 cubed overflows int64 (np.prod would wrap around to a small or negative number)
    path = tmp_path / "t10k-images-idx3-ubyte"
    path.write_bytes(_header((2**32 - 1, 2**32 - 1, 2**32 - 1)) + b"\0" * 16)
    with pytest.raises(DataError, match="promise .* bytes, more than the .* any MNIST-like file has"):
        read_idx(path)


def test_a_small_gz_that_decompresses_to_gigabytes_is_refused_after_a_few_bytes(tmp_path):
    # header says 10 images of 28x28; the payload goes on with zeros far beyond that
    path = tmp_path / "t10k-images-idx3-ubyte.gz"
    with gzip.open(path, "wb") as handle:
        handle.write(_header((10, 28, 28)))
        zeros = b"\0" * (1 << 20)
        for _ in range(64):  # 64 MiB decompressed from a ~64 KiB file
            handle.write(zeros)
    assert path.stat().st_size < 1 << 20
    start = time.perf_counter()
    with pytest.raises(DataError, match="decompresses to more than the 7,840 bytes its header promises"):
        read_idx(path)
    assert time.perf_counter() - start < 2.0


def test_a_gz_whose_header_promises_too_much_is_refused_before_decompressing(tmp_path):
    path = tmp_path / "train-images-idx3-ubyte.gz"
    path.write_bytes(gzip.compress(_header((60000, 2800, 2800))))
    with pytest.raises(DataError, match="more than the"):
        read_idx_file(path)
    assert MAX_IDX_BYTES >= 60000 * 28 * 28  # the real files fit


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this system")
def test_a_fifo_is_refused_not_read(tmp_path):
    fifo = tmp_path / "t10k-labels-idx1-ubyte.gz"
    os.mkfifo(fifo)
    result: list = []
    worker = threading.Thread(target=lambda: result.append(_raises(lambda: read_idx(fifo))), daemon=True)
    worker.start()
    worker.join(5)
    assert not worker.is_alive(), "reading a FIFO hung"
    assert isinstance(result[0], DataError) and "is a FIFO, not a data file" in str(result[0])


def _raises(fn):
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - returned to the test thread
        return exc
    return None


def test_a_folder_in_place_of_a_file_is_refused(tmp_path):
    (tmp_path / "x.gz").mkdir()
    with pytest.raises(DataError, match="is a folder, not a data file"):
        read_idx(tmp_path / "x.gz")


@pytest.mark.parametrize("dataset", ["fashion-mnist", "kmnist"])
def test_raw_files_without_a_known_checksum_are_not_called_verified(tmp_path, dataset):
    """Random noise in the right IDX structure: structure checks pass, so only a checksum can tell.
    Raw copies of these datasets have none published, so they are refused with the fix."""
    d = tmp_path / dataset
    d.mkdir()
    rng = np.random.default_rng(0)
    write_idx(d / "train-images-idx3-ubyte", rng.integers(0, 256, (60, 28, 28), dtype=np.uint8))
    write_idx(d / "train-labels-idx1-ubyte", rng.integers(0, 10, 60, dtype=np.uint8))
    write_idx(d / "t10k-images-idx3-ubyte", rng.integers(0, 256, (10, 28, 28), dtype=np.uint8))
    write_idx(d / "t10k-labels-idx1-ubyte", rng.integers(0, 10, 10, dtype=np.uint8))
    with pytest.raises(DataError, match=f"an uncompressed {ds.DATASETS[dataset].title} file, which cannot be verified"
                                        f".*fasttrain data download --dataset {dataset}"):
        ds.verify_dataset(dataset, tmp_path)
    with pytest.raises(DataError, match="cannot be verified"):
        ds.load_dataset(dataset, tmp_path)


def test_raw_mnist_noise_fails_its_content_checksum(tmp_path):
    d = tmp_path / "mnist"
    d.mkdir()
    rng = np.random.default_rng(0)
    write_idx(d / "train-images-idx3-ubyte", rng.integers(0, 256, (60, 28, 28), dtype=np.uint8))
    write_idx(d / "train-labels-idx1-ubyte", rng.integers(0, 10, 60, dtype=np.uint8))
    write_idx(d / "t10k-images-idx3-ubyte", rng.integers(0, 256, (10, 28, 28), dtype=np.uint8))
    write_idx(d / "t10k-labels-idx1-ubyte", rng.integers(0, 10, 10, dtype=np.uint8))
    with pytest.raises(DataError, match="checksum mismatch"):
        ds.verify_dataset("mnist", tmp_path)


def test_the_cli_says_it_in_one_line(tmp_path):
    d = tmp_path / "kmnist"
    d.mkdir()
    rng = np.random.default_rng(0)
    for role in ds.ROLES:
        shape = (5, 28, 28) if role.endswith("images") else (5,)
        write_idx(d / ds.FILENAMES[role], rng.integers(0, 10, shape, dtype=np.uint8))
    one_line_error(fasttrain_in_process("data", "verify", "--dataset", "kmnist", "--data-dir", tmp_path), "cannot be verified")


# --- downloads --------------------------------------------------------------------------------


@pytest.fixture
def silent_server():
    """A server that accepts connections and never answers (a captive or broken network)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    held = []
    stop = threading.Event()

    def accept():
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
                held.append(conn)
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    stop.set()
    thread.join(2)
    for conn in held:
        conn.close()
    listener.close()


def test_download_from_a_silent_network_fails_fast_and_says_everything(tmp_path, silent_server):
    target = tmp_path / "cache" / "fasttrain"
    lines: list[str] = []
    start = time.perf_counter()
    with pytest.raises(DataError) as info:
        ds.download_dataset("mnist", target, mirrors=(f"{silent_server}/a/", f"{silent_server}/b/"), retries=2,
                            progress=False, timeout=(1.0, 1.0), log=lines.append)
    elapsed = time.perf_counter() - start
    message = str(info.value)
    assert "\n" not in message
    assert f"{silent_server}/a/ (2 attempts" in message and f"{silent_server}/b/ (2 attempts" in message
    assert "FASTTRAIN_DATA_DIR" in message and "--data-dir" in message
    assert [line.split(": attempt ")[1][:3] for line in lines] == ["1/2", "2/2", "1/2", "2/2"]
    assert elapsed < 15
    assert not (tmp_path / "cache").exists()  # no empty folder left behind


def test_download_defaults_bound_the_whole_failure_well_under_a_minute():
    worst = len(ds.DATASETS["mnist"].mirrors) * ds.RETRIES * (ds.CONNECT_TIMEOUT + ds.READ_TIMEOUT)
    assert min(worst, ds.DEADLINE + ds.CONNECT_TIMEOUT + ds.READ_TIMEOUT) < 60


def test_download_deadline_stops_further_attempts(tmp_path, silent_server):
    start = time.perf_counter()
    with pytest.raises(DataError, match="time limit"):
        ds.download_dataset("mnist", tmp_path / "x", mirrors=(f"{silent_server}/a/", f"{silent_server}/b/"),
                            retries=5, progress=False, timeout=(1.0, 1.0), deadline=1.5)
    assert time.perf_counter() - start < 6


def test_download_keeps_an_existing_folder(tmp_path):
    (tmp_path / "mnist").mkdir()
    (tmp_path / "mnist" / "notes.txt").write_text("mine\n")
    with pytest.raises(DataError):
        ds.download_dataset("mnist", tmp_path, mirrors=("http://127.0.0.1:9/",), retries=1, progress=False,
                            timeout=(1.0, 1.0))
    assert [p.name for p in (tmp_path / "mnist").iterdir()] == ["notes.txt"]


def test_encode_roundtrip_still_reads():
    # the limits leave ordinary files alone
    assert len(encode_idx(np.zeros((3, 28, 28), np.uint8))) == 16 + 3 * 784


# --- the data root: one meaning for every dataset ---------------------------------------------------


def test_the_dataset_names_the_root_knows_are_every_dataset():
    from fasttrain.data.locations import DATASET_NAMES
    from fasttrain.data.text import TEXT_DATASETS

    assert set(DATASET_NAMES) == {*ds.DATASETS, *TEXT_DATASETS}


def test_a_root_named_after_a_dataset_finds_the_others_beside_it(tmp_path, monkeypatch):
    from fasttrain.data.text import text_path

    monkeypatch.setenv("FASTTRAIN_DATA_DIR", str(tmp_path / "mnist"))
    (tmp_path / "mnist").mkdir()
    assert ds.dataset_dir("mnist") == tmp_path / "mnist"          # still accepted: the MNIST files directly
    assert text_path("tinyshakespeare") == tmp_path / "tinyshakespeare" / "input.txt"
    # every hint names a folder that works for every dataset: the root, not the MNIST folder
    assert ds.download_command("tinyshakespeare") == f"fasttrain data download --dataset tinyshakespeare --data-dir {tmp_path}"
    assert ds.download_command("mnist") == f"fasttrain data download --dataset mnist --data-dir {tmp_path}"
    with pytest.raises(DataError, match=f"not found: {tmp_path}/tinyshakespeare/input.txt; download it with: "
                                        f"fasttrain data download --dataset tinyshakespeare --data-dir {tmp_path}$"):
        from fasttrain.data.text import load_text

        load_text("tinyshakespeare")


def test_the_root_holds_one_folder_per_dataset(tmp_path):
    _write_dataset(tmp_path / "mnist")
    (tmp_path / "tinyshakespeare").mkdir()
    assert ds.load_dataset("mnist", tmp_path, verify=False).n_train == 20
    assert ds.dataset_dir("tinyshakespeare", tmp_path) == tmp_path / "tinyshakespeare"


def test_a_data_root_that_is_a_file_is_one_clear_line(tmp_path, monkeypatch):
    from fasttrain.data.text import load_text

    afile = tmp_path / "data.txt"
    afile.write_text("not a folder\n")
    with pytest.raises(DataError, match=f"--data-dir {afile} is a file, not a folder; give the data root"):
        ds.load_dataset("mnist", afile)
    monkeypatch.setenv("FASTTRAIN_DATA_DIR", str(afile))
    with pytest.raises(DataError, match=f"FASTTRAIN_DATA_DIR={afile} is a file, not a folder"):
        load_text("tinyshakespeare")
    with pytest.raises(DataError, match="FASTTRAIN_DATA_DIR=.* is a file"):
        ds.download_dataset("mnist", progress=False)
    assert afile.read_text() == "not a folder\n"
    one_line_error(fasttrain_in_process("data", "verify", "--dataset", "tinyshakespeare", env={"FASTTRAIN_DATA_DIR": str(afile)}),
                   f"FASTTRAIN_DATA_DIR={afile} is a file, not a folder")
    one_line_error(fasttrain_in_process("data", "verify", "--data-dir", afile), "is a file")


def test_a_corpus_path_that_is_a_folder_is_one_clear_line(tmp_path):
    from fasttrain.data.text import load_text

    (tmp_path / "tinyshakespeare" / "input.txt").mkdir(parents=True)
    with pytest.raises(DataError, match=r"input.txt is a folder, not the Tiny Shakespeare file"):
        load_text("tinyshakespeare", tmp_path)
    with pytest.raises(DataError, match=r"input.txt is a folder, not the Tiny Shakespeare file"):
        ds.download_dataset("tinyshakespeare", tmp_path, progress=False)
    assert (tmp_path / "tinyshakespeare" / "input.txt").is_dir()
    one_line_error(fasttrain_in_process("data", "verify", "--dataset", "tinyshakespeare", "--data-dir", tmp_path),
                   "is a folder, not the Tiny Shakespeare file")
