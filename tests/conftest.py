"""Shared fixtures: tiny synthetic data for fast engine checks, the real MNIST and Tiny Shakespeare when
FASTTRAIN_DATA_DIR points at them (a test skips without them, saying how to fetch them), the lab's toy
corpus, and the ``gpu`` marker (skipped without a CUDA GPU)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from functools import lru_cache

# Each xdist worker is one of `-n auto` processes on as many cores: one thread each for OpenMP (torch, inductor's
# kernels) and NumPy's BLAS, or the spinning pools of two workers oversubscribe the cores. Set before numpy or
# torch load (and inherited by the processes a test starts); a value given in the environment is kept.
if os.environ.get("PYTEST_XDIST_WORKER"):
    for _threads in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(_threads, "1")

import pytest  # noqa: E402

from fasttrain.data.datasets import Dataset
from fasttrain.data.synthetic import synthetic_dataset


@lru_cache(maxsize=1)
def has_cuda_gpu() -> bool:
    if not shutil.which("nvidia-smi"):
        return False
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return False
    return out.returncode == 0 and "GPU" in out.stdout


def uses_a_module_fixture(item) -> bool:
    info = getattr(item, "_fixtureinfo", None)
    return info is not None and any(defs and defs[-1].scope == "module" for defs in info.name2fixturedefs.values())


@pytest.hookimpl(tryfirst=True)     # before pytest-xdist reads the groups (--dist loadgroup, pyproject.toml)
def pytest_collection_modifyitems(config, items):
    # The workers share the tests one by one, except that the tests of a file which share a module-scoped fixture
    # (a trained model, a quick bench run, the browser) form one group, run by the worker that builds it once.
    for item in items:
        if uses_a_module_fixture(item):
            item.add_marker(pytest.mark.xdist_group(item.path.name))
    if has_cuda_gpu():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the device machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _torch_threads_as_found():
    """A test that sets torch's thread count (a few memory tests measure at 2) leaves the worker's as it found it
    (one thread per worker: the module's top), so the tests after it run as they would alone."""
    torch = sys.modules.get("torch")
    before = torch.get_num_threads() if torch is not None else None
    yield
    torch = sys.modules.get("torch")
    wanted = before if before is not None else int(os.environ.get("OMP_NUM_THREADS", "0") or 0)
    if torch is not None and wanted and torch.get_num_threads() != wanted:
        torch.set_num_threads(wanted)


def make_synthetic(n_train: int = 600, n_test: int = 200, seed: int = 0) -> Dataset:
    """Learnable MNIST-shaped data: each class is a noisy version of its own random template."""
    return synthetic_dataset(n_train, n_test, seed)


@pytest.fixture(scope="session")
def tiny_data() -> Dataset:
    return make_synthetic()


@pytest.fixture(scope="session")
def mnist_dir() -> str:
    """The data root holding the real MNIST (``$FASTTRAIN_DATA_DIR``; a folder named ``mnist`` works too)."""
    from fasttrain.data.locations import dataset_dir

    path = os.environ.get("FASTTRAIN_DATA_DIR")
    if not path or not os.path.isdir(path) or not dataset_dir("mnist", path).is_dir():
        pytest.skip("real MNIST not available: set FASTTRAIN_DATA_DIR to the data root that holds mnist/ "
                    "(fasttrain data download --dataset mnist --data-dir DIR fetches it)")
    return path


@pytest.fixture(scope="session")
def shakespeare_dir() -> str:
    """The data root holding Tiny Shakespeare (``$FASTTRAIN_DATA_DIR/tinyshakespeare/input.txt``). The README's
    set-up fetches MNIST only: a test that needs the real corpus skips without it, saying how to fetch it (most
    lab tests train on the toy corpus instead: the ``corpus`` and ``fake_corpus`` fixtures)."""
    path = os.environ.get("FASTTRAIN_DATA_DIR")
    if not path or not os.path.isfile(os.path.join(path, "tinyshakespeare", "input.txt")):
        pytest.skip("Tiny Shakespeare not available: set FASTTRAIN_DATA_DIR to the data root that holds "
                    "tinyshakespeare/ (fasttrain data download --dataset tinyshakespeare --data-dir DIR fetches it)")
    return path


@pytest.fixture(scope="session")
def mnist(mnist_dir):
    from fasttrain.data import load_dataset

    return load_dataset("mnist", mnist_dir)


@pytest.fixture(scope="session")
def corpus():
    """The lab's corpus of a toy text (tests_support.toy_text): no download, seconds to train on."""
    from fasttrain.lab.data import corpus_from_text
    from tests_support import toy_text

    return corpus_from_text(toy_text())


@pytest.fixture
def fake_corpus(monkeypatch, corpus):
    """``load_corpus`` returns the toy corpus (the CLI paths find no Tiny Shakespeare needed)."""
    import fasttrain.lab.data as data

    monkeypatch.setattr(data, "load_corpus", lambda data_dir=None, name="tinyshakespeare": corpus)
