"""Datasets (MNIST, Fashion-MNIST, KMNIST; the Tiny Shakespeare text corpus) and the IDX format."""

from fasttrain.data.datasets import DATASETS, Dataset, download_dataset, load_dataset, to_inputs, verify_dataset
from fasttrain.data.locations import data_root, dataset_dir
from fasttrain.data.idx import read_idx, write_idx

__all__ = [
    "DATASETS",
    "Dataset",
    "data_root",
    "dataset_dir",
    "download_dataset",
    "load_dataset",
    "read_idx",
    "to_inputs",
    "verify_dataset",
    "write_idx",
]
