"""The largest micro-batch that fits: halving and bisection over trial runs of two steps."""

from __future__ import annotations

from fasttrain.lab.config import LabConfig
from fasttrain.lab.measure import free_memory, oom_types, sync


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


def _steps_fit(cfg: LabConfig, corpus, device, batch: int, make) -> bool:
    from fasttrain.lab.build import build_model
    from fasttrain.lab.trainer import Trainer

    try:
        model = make() if make is not None else build_model(cfg, corpus.vocab_size, device)
        trainer = Trainer(cfg, model, corpus, device, batch=batch)
        trainer.train(2, evaluate=False)
        sync(device)
        return True
    except oom_types():
        return False


def probe_batch(cfg: LabConfig, corpus, device, batch: int, make=None) -> bool:
    """Does training at micro-batch ``batch`` fit? (a fresh model -- ``make()``, default the one
    ``cfg`` names -- trained two steps through the trainer, so that the optimizer state exists).
    Out-of-memory is caught in a frame that is gone, with its tensors, before the cache is emptied."""
    fits = _steps_fit(cfg, corpus, device, batch, make)
    free_memory(device)
    return fits
