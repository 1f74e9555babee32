"""The data a benchmark trains on: the real dataset, or synthetic data only when asked for
(``--synthetic`` or ``--dataset synthetic``), said loudly. A dataset that cannot be loaded is an
error, never a silent stand-in: results measured on noise would pass for real ones."""

from __future__ import annotations

from fasttrain.bench.suite import QUICK_DATA
from fasttrain.data.datasets import Dataset, load_dataset
from fasttrain.data.synthetic import synthetic_dataset as _synthetic
from fasttrain.errors import DataError


def synthetic_dataset(n_train: int = 60000, n_test: int = 10000, seed: int = 0) -> Dataset:
    """MNIST-sized synthetic data (see :func:`fasttrain.data.synthetic.synthetic_dataset`)."""
    return _synthetic(n_train, n_test, seed)


def bench_data(dataset: str = "mnist", data_dir=None, quick: bool = False, synthetic: bool = False):
    """(data, info, note): ``note`` is None, or why synthetic data stands in for ``dataset``."""
    data = None
    if synthetic or dataset == "synthetic":
        note = "--synthetic: using SYNTHETIC data: timings hold, accuracies mean nothing"
    else:
        note = None
        try:
            data = load_dataset(dataset, data_dir)
        except DataError as exc:
            raise DataError(f"{exc} (or benchmark on synthetic data, timings only: --synthetic)") from None
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
