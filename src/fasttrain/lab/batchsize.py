"""The largest micro-batch that fits: halving and bisection over trial runs of two steps.

:func:`auto_find` is ``--auto-find-batch-size``: it takes a config and returns the config the run
trains (its ``per_device_train_batch_size`` the one found), so that the micro-batch lives in one
place, the config, from here on."""

from __future__ import annotations

import time

from fasttrain.errors import FasttrainError
from fasttrain.lab.config import LabConfig
from fasttrain.lab.measure import free_memory, gpu_name, oom_types, sync


def find_batch_size(start: int, fits) -> int:
    """The largest batch <= ``start`` for which ``fits(batch)`` holds: halve until one fits, then
    bisect between it and the smallest batch known not to fit. 0 when not even 1 fits."""
    hi_fail = None
    b = start
    while b >= 1 and not fits(b):
        hi_fail, b = b, b // 2
    if b < 1:
        return 0
    lo = b
    if hi_fail is None:
        return lo
    while hi_fail - lo > 1:
        mid = (lo + hi_fail) // 2
        if fits(mid):
            lo = mid
        else:
            hi_fail = mid
    return lo


def _steps_fit(cfg: LabConfig, corpus, device, make) -> bool:
    from fasttrain.lab.build import build_model
    from fasttrain.lab.trainer import Trainer

    try:
        model = make() if make is not None else build_model(cfg, corpus.vocab_size, device)
        trainer = Trainer(cfg, model, corpus, device)
        trainer.train(2, evaluate=False)
        sync(device)
        return True
    except oom_types():
        return False


def probe_batch(cfg: LabConfig, corpus, device, make=None) -> bool:
    """Does training ``cfg`` (at its ``per_device_train_batch_size``) fit? (a fresh model --
    ``make()``, default the one ``cfg`` names -- trained two steps through the trainer, so that the
    optimizer state exists). Out-of-memory is caught in a frame that is gone, with its tensors,
    before the cache is emptied."""
    fits = _steps_fit(cfg, corpus, device, make)
    free_memory(device)
    return fits


def largest_fitting(cfg: LabConfig, corpus, device, start: int, make=None) -> int:
    """The largest micro-batch <= ``start`` at which ``cfg`` trains (0: not even 1)."""
    return find_batch_size(start, lambda b: probe_batch(cfg.with_(per_device_train_batch_size=b), corpus, device,
                                                        make=make))


def auto_find(cfg: LabConfig, corpus, device, make=None, log=None) -> tuple[LabConfig, dict | None]:
    """``cfg`` with the micro-batch the run trains, and what the search did (None when not asked).
    On a GPU the largest micro-batch <= the configured one that fits; on the CPU nothing runs out of
    memory, so the configured one is kept."""
    log = log or (lambda line: None)
    batch = cfg.per_device_train_batch_size
    if not cfg.auto_find_batch_size:
        return cfg, None
    if device.type != "cuda":
        log(f"auto-find-batch-size: no GPU, keeping {batch}")
        return cfg, {"requested": batch, "found": batch, "search_ms": 0.0,
                     "note": "no GPU: nothing runs out of memory, the batch is kept"}
    t0 = time.perf_counter()
    found = largest_fitting(cfg, corpus, device, batch, make=make)
    if found == 0:
        raise FasttrainError(f"not even a batch of 1 fits on {gpu_name(device)}; try --gradient-checkpointing "
                             f"full, --bf16 or a smaller model")
    log(f"auto-find-batch-size: {found} (from {batch})")
    return (cfg.with_(per_device_train_batch_size=found),
            {"requested": batch, "found": found, "search_ms": 1e3 * (time.perf_counter() - t0)})
