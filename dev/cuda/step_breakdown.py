"""Where rung 7's step goes at the wide widths: each kernel of one step timed alone, and the whole step.

python3 dev/cuda/step_breakdown.py [H ...] [--variants | --pdl]  (GPU, repo root, FASTTRAIN_DATA_DIR set)

For every width H (default 2048 4096 8192) and every tuning variant, builds the rung-7 session of
mlp:Hx3 (batch 32, fp16) and prints, per kernel of a step: its time (a CUDA graph of REPS launches of that
kernel alone, replayed 5 times, median / REPS), the bytes of W it moves (fp32 masters: forward reads 4 B a
parameter, backward reads and writes 4 + 4) and the rate; then the step's time as the epoch graph replays it
(one epoch of 1875 steps / 1875). The difference between the step and the sum of its kernels is what the
graph's node boundaries cost (launch, ramp, drain). The kernels timed alone run with lr = 0.
--pdl: the default plan with and without programmatic dependent launch (--step-pdl on / off), and v4 (dev/cuda).
--clusters: v7's cluster splits (--step-fsplit / --step-bsplit 2, 4, 8) against the default plan and v6 (dev/cuda);
each clustered launch's line names its cluster, and how many of them the GPU holds at once is printed.
--v7: the default plan against no cluster splits, the fused last layer (dev/cuda/fused_step_v7_lastfused.cu) and v6.
--v8: the default plan against v8 without ft_bwd_fwd_x, v8 built with FT_EARLY=0 (no loads before
griddepcontrol.wait) and v7 (dev/cuda);
--v8-tune: the default plan against backward rings of 6, 7 and 3 stages (--step-stages); --v8-tune2: against the
first layer's forward split over clusters of 2, its backward's output rows split 3 or 8 ways, 2 blocks an SM, BO 16.
--v9: the default plan (hidden-to-hidden W^T tiled) against row-major storage (--step-layout rows).
--l2: the default plan against part of the hidden layers' fp32 masters kept resident in the L2's set-aside (12..64 MB,
capped by the device; spread over each W^T by a hit ratio, or its first rows: "prefix"; dev/cuda history's
StepL2Resident); the kernels alone then read their own resident lines, so only the step's time says what it buys.
A kernel timed alone is launched after itself: with lr = 0 its early loads of W^T read what the copy before it
rewrote unchanged, so the timing is fair; in a step its predecessor never writes them.
"""

import os
import sys
from pathlib import Path

import numpy as np

from fasttrain.contract import default_config, epoch_order, initial_weights, parse_model, schedule
from fasttrain.data import load_dataset
from fasttrain.engines.base import Job
from fasttrain.engines.cuda.engine import CudaOptions
from fasttrain.engines.cuda.fused.step import FusedStepSession

REPS = 20
VARIANTS = [{}, {"step_fu": 2}, {"step_fu": 3}, {"step_fu": 6}, {"step_fu": 8}, {"step_bo": 32}, {"step_bo": 16},
            {"step_bo": 32, "step_fwd_minb": 2}, {"step_stages": 3}, {"step_stages": 6}, {"step_stages": 8},
            {"step_bi": 32}, {"step_bi": 16}, {"step_bwd_minb": 2, "step_bi": 32}]
CLUSTER_VARIANTS = [{}, {"step_fsplit": 2}, {"step_fsplit": 4}, {"step_fsplit": 8}, {"step_bsplit": 2},
                    {"step_bsplit": 4}, {"step_bsplit": 8}, {"step_fsplit": 2, "step_bsplit": 2},
                    {"step_fsplit": 4, "step_bsplit": 4}, {"step_fsplit": 4, "step_bsplit": 4, "step_pdl": "off"},
                    {"kernel": "fused_step_v6.cu"}]
# v7 as the package runs it (auto splits, the fused last layer) against each of its changes undone, and v6
V7_VARIANTS = [{}, {"step_fsplit": 1, "step_bsplit": 1}, {"kernel": "fused_step_v7_lastfused.cu"},
               {"kernel": "fused_step_v6.cu"}]
# v8 as the package runs it against v8 with every load after griddepcontrol.wait (the gather still folded) and v7
V8_VARIANTS = [{}, {"kernel": "fused_step.cu:unfused"}, {"kernel": "fused_step.cu:early=0"},
               {"kernel": "fused_step_v7.cu"}]
# v8 with deeper backward rings (more of each warp's W^T chunks loaded before the wait)
V8_TUNE = [{}, {"step_stages": 6}, {"step_stages": 7}, {"step_stages": 3}]
# the first layer split (its forward over a cluster of 2, its backward's output rows) and two blocks an SM
V8_TUNE2 = [{}, {"step_fsplit": 2}, {"step_osplit": 3}, {"step_osplit": 8}, {"step_bwd_minb": 2},
            {"step_fwd_minb": 2}, {"step_bo": 16}]

# L2 residency: MB of the set-aside (spread by a hit ratio; "prefix": a window on the first bytes of W^T)
# v9: the hidden-to-hidden layers' W^T tiled (the default) against row-major (v8's layout)
V9_VARIANTS = [{}, {"step_layout": "rows"}]
L2_VARIANTS = [{}] + [{"kernel": f"fused_step.cu:l2={v}"} for v in ("12", "24", "32", "64", "24prefix", "64prefix")]


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


W_BYTES = {"fwd": 4, "fwd last": 4, "bwd": 8, "last": 12, "bwd+fwd": 8}   # bytes a parameter of W^T each kind moves (fp32 master)


def kernels(s: FusedStepSession):
    """(name, bytes of W, launch) for each kernel of a mid-epoch step (step 1 of a sequence that goes on: the
    session's own launches, at lr = 0)."""
    out = []
    for kind, layer, launch in s.step_launches(1, 0.0, first=False, last=False):
        if layer is None:
            out.append((kind, 0, launch))
            continue
        p, wt = s.plan[layer], s.layers[layer][0]
        fc, bc = p.get("FC", 1), (p["osplit"] if layer > 0 else 1)
        detail = (f"BO {p['BO']} FU {p['FU']}" + (f" cluster {fc}" if fc > 1 else "") if kind == "fwd"
                  else f"{s.split} blocks" if kind == "fwd last" else f"fwd + bwd, a cluster of {s.split}" if kind == "last"
                  else f"step k's bwd + step k+1's fwd, BO {p['BO']}" if kind == "bwd+fwd"
                  else f"BI {p['BI']} S {p['S']} regs {p['bwd'].num_regs}" + (f" cluster {bc}" if bc > 1 else ""))
        out.append((f"{kind} {layer + 1} ({p['out_p']}x{p['in_p']}, {detail})", W_BYTES[kind] * wt.size, launch))
    return out


def session(job, variant: dict) -> FusedStepSession:
    """The package's rung-7 session with the variant's options, or an earlier kernel of dev/cuda ("kernel")."""
    if "kernel" not in variant:
        return FusedStepSession(job, CudaOptions(rung=7, **variant))
    os.environ.setdefault("FASTTRAIN_ENGINE_PATH", str(Path(__file__).resolve().parent / "engines"))
    from fasttrain.engines import registry

    registry()
    from fasttrain.engines.base import make_options
    from fasttrain.engines.cuda_dev import CudaDevEngine
    from fasttrain.engines.cuda_dev.history import make_dev_session

    return make_dev_session(job, make_options(CudaDevEngine, {"rung": 7, **variant}))


def main(argv):
    import cupy as cp

    variants = (VARIANTS if "--variants" in argv else [{"step_pdl": "on"}, {"step_pdl": "off"}, {"kernel": "fused_step_v4.cu"}]
                if "--pdl" in argv else CLUSTER_VARIANTS if "--clusters" in argv else V7_VARIANTS if "--v7" in argv
                else V8_VARIANTS if "--v8" in argv else V8_TUNE if "--v8-tune" in argv
                else V8_TUNE2 if "--v8-tune2" in argv else L2_VARIANTS if "--l2" in argv
                else V9_VARIANTS if "--v9" in argv else [{}])
    widths = [int(a) for a in argv if a.isdigit()] or [2048, 4096, 8192]
    data = load_dataset("mnist")
    for h in widths:
        spec = parse_model(f"mlp:{h}x3")
        cfg = default_config(spec, precision="fp16", steps=1875)
        job = Job(spec, cfg, data, initial_weights(spec, cfg.seed), schedule(cfg, data.n_train))
        for v in variants:
            try:
                s = session(job, v)
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
                if getattr(s, "windows", None):
                    print(f"    (L2 set aside {s._granted / 2**20:.1f} MB of a device maximum {s.l2_max / 2**20:.1f}; "
                          "windows " + ", ".join(f"{w[1] / 2**20:.1f} MB at hit ratio {w[2]:.3f}"
                                                 for w in s.windows.values()) + ")", flush=True)
                for c in getattr(s, "clusters", []):
                    print(f"    (layer {c['layer']} {c['kernel']}: {c['clusters']} clusters of {c['cluster']}, "
                          f"{c['resident']} resident at once)", flush=True)
            except Exception as exc:   # a variant that fails on this GPU: say so, go on
                print(f"H={h} {v}: failed ({type(exc).__name__}: {exc})", flush=True)
            finally:
                s.close()


if __name__ == "__main__":
    main(sys.argv[1:])
