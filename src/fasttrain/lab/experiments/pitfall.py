"""The timing pitfall: a GPU step timed without and with device synchronization."""

from __future__ import annotations

from fasttrain.lab.config import LabConfig, validate
from fasttrain.lab.measure import gpu_name
from fasttrain.timing import summarize


def timing_pitfall(cfg: LabConfig, *, repeats: int = 5, warmup: int = 3, corpus=None) -> dict:
    """Training steps timed two ways, ``repeats`` each after ``warmup`` steps, all through the
    trainer's loop: ``perf_counter`` around the step alone (``timing="launch"``: measures how long
    the CPU took to *enqueue* the GPU's work, since kernels launch asynchronously; the device is
    synchronized after the clock stops, so each step starts on an idle device) and with
    ``torch.cuda.synchronize()`` before and after (``timing="step"``: measures the work). Both
    include loading the step's batch. On the CPU both are the same: it computes synchronously."""
    from fasttrain.lab.build import make_trainer, resolve_device
    from fasttrain.lab.data import load_corpus
    from fasttrain.lab.trainer import Metrics

    validate(cfg)
    device = resolve_device(cfg)
    corpus = corpus or load_corpus(cfg.data_dir)
    trainer = make_trainer(cfg, corpus, device)
    trainer.train(warmup, evaluate=False)
    timed = cfg.with_(timing_warmup_steps=0)
    unsynced, synced = Metrics(timed, device, curve=False), Metrics(timed, device, curve=False)
    trainer.train(repeats, timing="launch", metrics=unsynced, evaluate=False)
    trainer.train(repeats, timing="step", metrics=synced, evaluate=False)
    return {"device": gpu_name(device), "config": cfg.name, "repeats": repeats,
            "without_sync_ms": summarize(unsynced.step_ms), "with_sync_ms": summarize(synced.step_ms),
            "without_sync_all_ms": unsynced.step_ms, "with_sync_all_ms": synced.step_ms}
