"""The timing pitfall: a GPU step timed without and with device synchronization."""

from __future__ import annotations

import time

from fasttrain.lab.config import LabConfig, validate
from fasttrain.lab.measure import gpu_name, sync
from fasttrain.timing import summarize
from fasttrain.lab.train import Trainer, resolve_device


def timing_pitfall(cfg: LabConfig, *, repeats: int = 5, warmup: int = 3, corpus=None) -> dict:
    """One training step timed two ways, ``repeats`` times each after ``warmup`` steps:
    ``perf_counter`` around the step alone (measures how long the CPU took to *enqueue* the GPU's
    work: kernels launch asynchronously) and with ``torch.cuda.synchronize()`` before and after
    (measures the work). On the CPU both are the same: it computes synchronously."""
    from fasttrain.lab.data import load_corpus

    validate(cfg)
    device = resolve_device(cfg)
    corpus = corpus or load_corpus(cfg.data_dir)
    trainer = Trainer(cfg, corpus, device)
    batches = trainer.batches(warmup + 2 * repeats)
    for _ in range(warmup):
        trainer.step(*next(batches))
    sync(device)
    unsynced, synced = [], []
    for _ in range(repeats):
        x, y = next(batches)
        t = time.perf_counter()
        trainer.step(x, y)                       # no synchronization: the clock stops at the launch
        unsynced.append(1e3 * (time.perf_counter() - t))
        sync(device)                            # (let the queued work finish before the next case)
        x, y = next(batches)
        sync(device)
        t = time.perf_counter()
        trainer.step(x, y)
        sync(device)
        synced.append(1e3 * (time.perf_counter() - t))
    return {"device": gpu_name(device), "config": cfg.name, "repeats": repeats,
            "without_sync_ms": summarize(unsynced), "with_sync_ms": summarize(synced),
            "without_sync_all_ms": unsynced, "with_sync_all_ms": synced}
