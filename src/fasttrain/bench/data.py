"""The data a benchmark trains on: the real dataset when it can be found, else synthetic, said loudly."""

from __future__ import annotations

import numpy as np

from fasttrain.bench.suites import QUICK_DATA
from fasttrain.data.datasets import Dataset, load_dataset
from fasttrain.errors import DataError


def synthetic_dataset(n_train: int = 60000, n_test: int = 10000, seed: int = 0) -> Dataset:
    """MNIST-shaped learnable data: each class a noisy copy of its own random 28x28 template.

    Same shapes and dtypes as MNIST, so timings are comparable; accuracies are not."""
    rng = np.random.default_rng(seed)
    templates = rng.integers(0, 256, size=(10, 28, 28))

    def split(n):
        labels = rng.integers(0, 10, size=n).astype(np.uint8)
        noise = rng.integers(-60, 61, size=(n, 28, 28))
        return np.clip(templates[labels] + noise, 0, 255).astype(np.uint8), labels

    train_images, train_labels = split(n_train)
    test_images, test_labels = split(n_test)
    return Dataset("synthetic", train_images, train_labels, test_images, test_labels)


def bench_data(dataset: str = "mnist", data_dir=None, quick: bool = False, synthetic: bool = False):
    """(data, info, note): ``note`` is None, or why synthetic data stands in for ``dataset``."""
    note = None
    data = None
    if not synthetic:
        try:
            data = load_dataset(dataset, data_dir)
        except DataError as exc:
            note = f"{dataset} not available ({exc}); using SYNTHETIC data: timings hold, accuracies mean nothing"
    else:
        note = "--synthetic: using SYNTHETIC data: timings hold, accuracies mean nothing"
    if data is None:
        n_train, n_test = QUICK_DATA if quick else (60000, 10000)
        data = synthetic_dataset(n_train, n_test)
    subset = False
    if quick and data.name != "synthetic" and data.n_train > QUICK_DATA[0]:
        data = data.subset(*QUICK_DATA)
        subset = True
    info = {"name": data.name, "n_train": data.n_train, "n_test": int(len(data.test_labels)),
            "synthetic": data.name == "synthetic", "subset": subset}
    return data, info, note
