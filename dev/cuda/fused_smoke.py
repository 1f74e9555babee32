"""A short run of each fused rung on synthetic data, checked against the float64 reference.

    PYTHONPATH=src python3 dev/cuda/fused_smoke.py [--only rung7|rung8|grid|history]

Small enough to run under ``compute-sanitizer`` (memcheck, racecheck, synccheck): one epoch of
rung 8 logreg (cluster 7 and 4, batch 37), rung 8 MLPs on a cluster (mlp:100x2, mlp:128x3, mlp:64x2: the compact
fallback) and on the persistent grid (mlp:256x2, mlp:256x1), rung 7 on mlp:100x2 and logreg and with the tuning
options (mlp:128x3 with BI 64 / 2 stages and BI 32 / 2 blocks an SM); ``--only history`` runs the earlier kernel
versions of this folder (logreg v5, step v1, grid v1/v2, mlp v1/v2). Exits non-zero when a loss is not finite
or strays more than 5% from the reference.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np

from fasttrain.contract import default_config, epoch_order, initial_weights, parse_model, schedule
from fasttrain.data.synthetic import synthetic_dataset
from fasttrain.engines.base import Job


# the cuda-dev engine (the earlier kernel versions of this folder) joins the registry from here
os.environ.setdefault("FASTTRAIN_ENGINE_PATH", str(Path(__file__).resolve().parent / "engines"))
from fasttrain.engines import registry  # noqa: E402

registry()

synthetic = synthetic_dataset  # 600 / 200 examples by default


def check(data, model, rung, precision, batch, epochs, **tuning) -> bool:
    """``tuning``: options of the cuda-dev engine (the cuda engine's, plus ``kernel`` for a file of dev/cuda)."""
    from fasttrain.engines.base import make_options
    from fasttrain.engines.cuda_dev import CudaDevEngine
    from fasttrain.engines.cuda_dev.history import make_dev_session
    from fasttrain.engines.numpy.engine import NumpySession

    spec = parse_model(model)
    cfg = default_config(spec, precision=precision, batch_size=batch, epochs=epochs, lr=0.05)
    job = Job(spec, cfg, data, initial_weights(spec, cfg.seed), schedule(cfg, data.n_train))
    ref_job = Job(spec, cfg.with_(precision="fp64"), data, job.init_weights, job.schedule)
    options = make_options(CudaDevEngine, {"rung": rung, "debug": True, **tuning})
    sess, ref = make_dev_session(job, options), NumpySession(ref_job, 1)
    ok = True
    for epoch, steps in enumerate(job.schedule.steps_per_epoch, start=1):
        order = epoch_order(cfg.seed, epoch, data.n_train)
        a, b = sess.train_epoch(epoch, order, steps), ref.train_epoch(epoch, order, steps)
        la, lb = a.loss_sum / a.count, b.loss_sum / b.count
        dev = abs(la - lb) / lb
        good = np.isfinite(la) and dev < 0.05 and np.all(np.isfinite(a.step_losses))
        ok &= bool(good)
        print(f"{model:10s} rung {rung} {precision} B={batch} {tuning or ''} epoch {epoch}: loss {la:.5f} ref {lb:.5f} "
              f"dev {dev:.4f} acc {a.correct / a.count:.3f} ref {b.correct / b.count:.3f} {'ok' if good else 'BAD'}",
              flush=True)
    tl, ta = sess.evaluate()
    rl, ra = ref.evaluate()
    print(f"   test loss {tl:.5f} ref {rl:.5f}  acc {ta:.4f} ref {ra:.4f}", flush=True)
    sess.close()
    return ok


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--only", default=None, help="rung7, rung8, grid or history (the earlier versions)")
    args = parser.parse_args(argv)
    data = synthetic()
    ok = True
    if args.only in (None, "rung8"):
        ok &= check(data, "logreg", 8, "fp16", 37, args.epochs, logreg_cluster=7)
        ok &= check(data, "logreg", 8, "bf16", 37, args.epochs, logreg_cluster=4)
        ok &= check(data, "mlp:100x2", 8, "fp16", 37, args.epochs)
        ok &= check(data, "mlp:128x3", 8, "bf16", 32, args.epochs)
        ok &= check(data, "mlp:64x2", 8, "fp16", 50, args.epochs)   # the blocked build does not fit: compact
    if args.only in (None, "rung8", "grid"):   # the persistent grid: widths 256..1024
        ok &= check(data, "mlp:256x2", 8, "fp16", 37, args.epochs)
        ok &= check(data, "mlp:256x1", 8, "bf16", 29, args.epochs)
    if args.only in (None, "rung7"):
        ok &= check(data, "mlp:100x2", 7, "fp16", 37, args.epochs)
        ok &= check(data, "logreg", 7, "bf16", 37, args.epochs)
        ok &= check(data, "mlp:128x3", 7, "bf16", 37, args.epochs, step_bi=64, step_stages=2)
        ok &= check(data, "mlp:128x3", 7, "fp16", 32, args.epochs, step_bi=32, step_bo=32, step_bwd_minb=2,
                    step_fwd_minb=2, step_osplit=3)
        # v7's cluster splits (the blocks of a cluster read each other's shared memory)
        ok &= check(data, "mlp:512x3", 7, "fp16", 29, args.epochs, step_fsplit=4, step_bsplit=4)
        ok &= check(data, "mlp:1024x2", 7, "bf16", 32, args.epochs, step_fsplit=8, step_bsplit=8, step_pdl="off")
        # v8's first layer as one kernel mid-epoch (ft_bwd_fwd_x), BO 16, a partial last batch
        ok &= check(data, "mlp:256x2", 7, "bf16", 37, args.epochs, step_bo=16)
    if args.only == "history":
        for cluster in (7, 4):
            for precision in ("fp16", "bf16"):
                ok &= check(data, "logreg", 8, precision, 37, args.epochs, logreg_cluster=cluster,
                            kernel="fused_logreg_v5.cu")
        ok &= check(data, "logreg", 8, "fp16", 37, args.epochs, kernel="fused_logreg_v2.cu")
        ok &= check(data, "mlp:100x2", 7, "fp16", 37, args.epochs, kernel="fused_step_v1.cu")
        ok &= check(data, "mlp:512x3", 7, "bf16", 29, args.epochs, kernel="fused_step_v7_lastfused.cu")
        ok &= check(data, "mlp:512x3", 7, "bf16", 32, args.epochs, kernel="fused_step.cu:l2=24")
        ok &= check(data, "mlp:100x2", 8, "fp16", 37, args.epochs, kernel="fused_mlp_v1.cu")
        ok &= check(data, "mlp:128x3", 8, "fp16", 32, args.epochs, kernel="fused_mlp_v2.cu")
        ok &= check(data, "mlp:256x2", 8, "fp16", 37, args.epochs, kernel="fused_grid_v1.cu")
        ok &= check(data, "mlp:256x3", 8, "fp16", 50, args.epochs, kernel="fused_grid_v2.cu")
    print("SMOKE", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
