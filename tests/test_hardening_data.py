"""Bad data files and an unreachable network: one clear error, quickly, and nothing left behind."""

from __future__ import annotations

import gzip
import os
import socket
import threading
import time

import numpy as np
import pytest

from fasttrain.data import datasets as ds
from fasttrain.data.idx import MAX_IDX_BYTES, encode_idx, read_idx, read_idx_file, write_idx
from fasttrain.errors import DataError


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
    from tests_support import fasttrain_cli, one_line_error

    d = tmp_path / "kmnist"
    d.mkdir()
    rng = np.random.default_rng(0)
    for role in ds.ROLES:
        shape = (5, 28, 28) if role.endswith("images") else (5,)
        write_idx(d / ds.FILENAMES[role], rng.integers(0, 10, shape, dtype=np.uint8))
    one_line_error(fasttrain_cli("data", "verify", "--dataset", "kmnist", "--data-dir", tmp_path), "cannot be verified")


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
