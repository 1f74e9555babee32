"""Is the package's rung 7 (fused_step.cu) bit-identical to an earlier version of dev/cuda?

The package's kernel is compared without its cluster splits (--step-fsplit 1 --step-bsplit 1), which change the
order of the sums, against a version without them; against v7 (fused_step_v7.cu) both run the default plan.

    PYTHONPATH=src python3 dev/cuda/check_step_identity.py [fused_step_v3.cu]   (GPU, repo root)

Trains the same jobs (synthetic data, then MNIST when FASTTRAIN_DATA_DIR holds it) with both sessions and
compares every step's loss and the final weights bit for bit: a version that only changes how the bytes move
(v4's forward ring) must not change a single rounding. Exits non-zero on the first difference.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np

from fasttrain.contract import default_config, epoch_order, initial_weights, parse_model, schedule
from fasttrain.data.synthetic import synthetic_dataset
from fasttrain.engines.base import Job

os.environ.setdefault("FASTTRAIN_ENGINE_PATH", str(Path(__file__).resolve().parent / "engines"))
from fasttrain.engines import registry  # noqa: E402

registry()


def train(session, job) -> tuple[np.ndarray, list]:
    losses = []
    try:
        for epoch, steps in enumerate(job.schedule.steps_per_epoch, start=1):
            st = session.train_epoch(epoch, epoch_order(job.config.seed, epoch, job.data.n_train), steps)
            losses.append(st.step_losses)
        return np.concatenate(losses), session.weights()
    finally:
        session.close()


def main(argv) -> int:
    from fasttrain.engines.base import make_options
    from fasttrain.engines.cuda_dev import CudaDevEngine
    from fasttrain.engines.cuda_dev.history import SESSIONS, make_dev_session

    version = argv[0] if argv else "fused_step_v3.cu"   # v4 is bit-identical to v3; v5 is not (another order)
    cases = [("mlp:100x2", "fp16", 37, dict(epochs=2)), ("mlp:256x2", "bf16", 32, dict(epochs=2)),
             ("mlp:128x3", "fp16", 128, dict(epochs=2)), ("mlp:64x1", "fp16", 256, dict(epochs=2)),
             # v8's first layer as one kernel mid-epoch (the default from width 1920; here forced by BO 16 / 32)
             ("mlp:256x2", "bf16", 37, dict(epochs=2), {"step_bo": 16}),
             ("mlp:512x3", "fp16", 29, dict(epochs=2), {"step_bo": 32, "step_graph": False})]
    datasets = [("synthetic", synthetic_dataset())]
    if os.environ.get("FASTTRAIN_DATA_DIR"):
        from fasttrain.data import load_dataset

        datasets.append(("mnist", load_dataset("mnist")))
        cases += [("mlp:2048x3", "fp16", 32, dict(steps=300)), ("mlp:8192x3", "bf16", 32, dict(steps=100)),
                  ("mlp:4096x2", "fp16", 32, dict(steps=200))]
    bad = 0
    for dname, data in datasets:
        for model, precision, batch, length, *tuning in cases:
            tuning = tuning[0] if tuning else {}
            if dname == "synthetic" and "steps" in length:
                continue
            spec = parse_model(model)
            cfg = default_config(spec, precision=precision, batch_size=batch, eval_every=100, **length)
            job = Job(spec, cfg, data, initial_weights(spec, cfg.seed), schedule(cfg, data.n_train))
            # without its cluster splits the package's kernel is v6 sum for sum; against v7 both split alike
            unsplit = {} if SESSIONS[version].cluster_split else {"step_fsplit": 1, "step_bsplit": 1}
            opts = make_options(CudaDevEngine, {"rung": 7, **unsplit, **tuning})
            new_l, new_w = train(make_dev_session(job, opts), job)
            old_l, old_w = train(make_dev_session(job, make_options(CudaDevEngine, {"rung": 7, "kernel": version,
                                                                                    **tuning})), job)
            same = np.array_equal(new_l, old_l) and all(np.array_equal(a, c) and np.array_equal(b, d)
                                                        for (a, b), (c, d) in zip(new_w, old_w))
            bad += not same
            print(f"{dname:9s} {model:11s} {precision} batch {batch:3d} {len(new_l):5d} steps{' ' + str(tuning) if tuning else ''}: "
                  f"{'bit-identical' if same else 'DIFFERENT'} to {version} (final loss {new_l[-1]:.6f} vs {old_l[-1]:.6f})",
                  flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
