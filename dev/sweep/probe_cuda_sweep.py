"""Time rung-8 sweeps of K models against one model on MNIST (a probe before the bench suite `many`).

python3 dev/sweep/probe_cuda_sweep.py [K ...]  ->  one line per (model, K): sweep train ms, per-epoch p50,
and the ratio to K = 1.
"""

import sys

from fasttrain.contract import default_config, parse_model
from fasttrain.data import load_dataset
from fasttrain.sweep import run_sweep, sweep_configs

ks = [int(a) for a in sys.argv[1:]] or [1, 4, 16, 64]
data = load_dataset("mnist")
grids = {1: (1, 1), 4: (2, 2), 16: (4, 4), 32: (8, 4), 64: (8, 8)}
for model, length in (("logreg", {"epochs": 20}), ("mlp:128x3", {"steps": 5000}), ("mlp:1024x3", {"steps": 5000})):
    spec = parse_model(model)
    base = default_config(spec, precision="fp16", eval_every=100, **length)
    one = None
    for k in ks:
        if model == "mlp:1024x3" and k > 16:
            continue
        nl, ns = grids[k]
        lrs = [base.lr * f for f in (1, 0.5, 2, 0.25, 0.75, 1.5, 0.35, 0.6)[:nl]]
        configs = sweep_configs(base, lrs, list(range(ns)))
        records, _, timing = run_sweep("cuda", spec, configs, data, {"rung": 8})
        one = one or timing["train_ms"]
        accs = [r.final["test_acc"] for r in records]
        print(f"{model:11s} K={k:3d} train {timing['train_ms']:9.1f} ms  epoch p50 {timing['epoch_ms']['p50']:8.2f} ms "
              f" x{timing['train_ms'] / one:5.2f} of one  setup {timing['setup_ms']:7.0f} ms  "
              f"acc {min(accs):.4f}..{max(accs):.4f}", flush=True)
