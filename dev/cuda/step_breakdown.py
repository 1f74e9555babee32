"""Where rung 7's step goes at the wide widths: each kernel of one step timed alone, and the whole step.

python3 dev/cuda/step_breakdown.py [H ...] [--variants]  (GPU, repo root, FASTTRAIN_DATA_DIR set)

For every width H (default 2048 4096 8192) and every tuning variant, builds the rung-7 session of
mlp:Hx3 (batch 32, fp16) and prints, per kernel of a step: its time (a CUDA graph of REPS launches of that
kernel alone, replayed 5 times, median / REPS), the bytes of W it moves (fp32 masters: forward reads 4 B a
parameter, backward reads and writes 4 + 4) and the rate; then the step's time as the epoch graph replays it
(one epoch of 1875 steps / 1875). The difference between the step and the sum of its kernels is what the
graph's node boundaries cost (launch, ramp, drain). The kernels timed alone run with lr = 0.
"""

import sys

import numpy as np

from fasttrain.contract import default_config, epoch_order, initial_weights, parse_model, schedule
from fasttrain.data import load_dataset
from fasttrain.engines.base import Job
from fasttrain.engines.cuda.engine import CudaOptions
from fasttrain.engines.cuda.fused.plans import NW
from fasttrain.engines.cuda.fused.step import FusedStepSession

REPS = 20
VARIANTS = [{}, {"step_fu": 2}, {"step_fu": 3}, {"step_fu": 6}, {"step_fu": 8}, {"step_bo": 32}, {"step_bo": 16},
            {"step_bo": 32, "step_fwd_minb": 2}, {"step_stages": 3}, {"step_stages": 6}, {"step_stages": 8},
            {"step_bi": 32}, {"step_bi": 16}, {"step_bwd_minb": 2, "step_bi": 32}]


def timed(cp, stream, launch, reps=REPS):
    """Median over 5 replays of a graph of `reps` calls of `launch`, in microseconds a call."""
    with stream:   # a launch outside the stream's context would go to the null stream, uncaptured
        launch()
    stream.synchronize()
    stream.begin_capture()
    try:
        with stream:
            for _ in range(reps):
                launch()
    finally:
        g = stream.end_capture()
    g.upload(stream)
    times = []
    for _ in range(6):
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        e0.record(stream)
        g.launch(stream)
        e1.record(stream)
        e1.synchronize()
        times.append(cp.cuda.get_elapsed_time(e0, e1) * 1e3 / reps)
    return float(np.median(times[1:]))


def kernels(s: FusedStepSession):
    """(name, bytes of W, launch) for each kernel of step 0, as FusedStepSession._step enqueues them."""
    np_ = np
    start, stop = s.bounds[0]
    rows = stop - start
    scale = np_.float32(0.0)
    L = len(s.plan)
    out = [("gather", 0, lambda: s.k_gather((s.bp,), (64,), (s.x_train, s.y_train, s.order_cur, np_.int32(start),
                                                                 np_.int32(rows), s.h[0], s.yb)))]
    for i in range(L - 1):
        p, (wt, b, _, _) = s.plan[i], s.layers[i]
        out.append((f"fwd {i + 1} ({p['out_p']}x{p['in_p']}, BO {p['BO']} FU {p['FU']})", 4 * wt.size,
                    (lambda p=p, wt=wt, b=b, i=i: p["fwd"]((p["out_p"] // p["BO"],), (NW * 32,),
                     (s.h[i], np_.int32(p["in_p"]), wt, b, s.h[i + 1], np_.int32(p["out_p"])), shared_mem=p["fwd_smem"]))))
    p, (wt, b, _, _) = s.plan[-1], s.layers[-1]
    out.append((f"fwd last ({s.split} blocks)", 4 * wt.size,
                lambda: s.k_last((s.split,), (NW * 32,), (s.h[L - 1], np_.int32(p["in_p"]), wt, b, s.yb, np_.int32(rows),
                                                          np_.int32(0), s.part, s.counter, s.dz[L], s.dzT[L], s.stat_loss,
                                                          s.stat_ok), shared_mem=s.last_smem)))
    for l in range(L, 0, -1):
        p, (wt, b, _, _) = s.plan[l - 1], s.layers[l - 1]
        need = l > 1
        dzp, dzpT = (s.dz[l - 1], s.dzT[l - 1]) if need else (s.dz[l], s.dzT[l])
        grid = (p["in_p"] // p["BI"], 1 if need else p["osplit"])
        out.append((f"bwd {l} ({p['out_p']}x{p['in_p']}, BI {p['BI']} S {p['S']} grid {grid[0]}x{grid[1]} "
                    f"regs {p['bwd'].num_regs})", 8 * wt.size,
                    (lambda p=p, wt=wt, b=b, l=l, need=need, dzp=dzp, dzpT=dzpT, grid=grid:
                     p["bwd"](grid, (NW * 32,), (s.dz[l], s.dzT[l], np_.int32(p["out_p"]), s.h[l - 1], np_.int32(p["in_p"]),
                                                 wt, b, scale, scale, np_.int32(need), dzp, dzpT), shared_mem=p["bwd_smem"]))))
    return out


def main(argv):
    import cupy as cp

    variants = VARIANTS if "--variants" in argv else [{}]
    widths = [int(a) for a in argv if a.isdigit()] or [2048, 4096, 8192]
    data = load_dataset("mnist")
    for h in widths:
        spec = parse_model(f"mlp:{h}x3")
        cfg = default_config(spec, precision="fp16", steps=1875)
        job = Job(spec, cfg, data, initial_weights(spec, cfg.seed), schedule(cfg, data.n_train))
        for v in variants:
            try:
                s = FusedStepSession(job, CudaOptions(rung=7, **v))
            except Exception as exc:   # a variant that does not fit this width: say so, go on
                print(f"H={h} {v}: not built ({exc})", flush=True)
                continue
            try:
                rows, total = [], 0.0
                for name, nbytes, launch in kernels(s):
                    us = timed(cp, s.stream, launch)
                    total += us
                    rows.append(f"    {name:62s} {us:8.1f} us" + (f"  {nbytes / us / 1e6:6.2f} TB/s" if nbytes else ""))
                order = epoch_order(0, 1, data.n_train)
                s.train_epoch(1, order, 1875)
                e0, e1 = cp.cuda.Event(), cp.cuda.Event()
                e0.record(s.stream)
                s.train_epoch(1, order, 1875)
                e1.record(s.stream)
                e1.synchronize()
                step = cp.cuda.get_elapsed_time(e0, e1) * 1e3 / 1875
                wbytes = 12 * sum(wt.size for wt, _, _, _ in s.layers)
                print(f"H={h} {v}: step {step:.1f} us ({wbytes / step / 1e6:.2f} TB/s at 12 B/param; 5000 steps "
                      f"{step * 5000 / 1e6:.3f} s), kernels alone {total:.1f} us, boundaries {step - total:.1f} us",
                      flush=True)
                print("\n".join(rows), flush=True)
            finally:
                s.close()


if __name__ == "__main__":
    main(sys.argv[1:])
