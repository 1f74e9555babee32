"""Rung-8 logreg sweeps by cluster size: how many clusters of each size run at once (the driver's occupancy
query) and the sweep's time for K models, to choose a sweep's cluster size.

python3 dev/sweep/probe_clusters.py
"""

from fasttrain.contract import default_config, parse_model
from fasttrain.data import load_dataset
from fasttrain.sweep import run_sweep, sweep_configs

data = load_dataset("mnist")
spec = parse_model("logreg")
base = default_config(spec, precision="fp16", eval_every=100, epochs=20)
grids = {1: (1, 1), 16: (4, 4), 32: (8, 4), 64: (8, 8)}
for cluster in (7, 6, 5, 4):
    for k, (nl, ns) in grids.items():
        lrs = [base.lr * f for f in (1, 0.5, 2, 0.25, 0.75, 1.5, 0.35, 0.6)[:nl]]
        configs = sweep_configs(base, lrs, list(range(ns)))
        records, _, timing = run_sweep("cuda", spec, configs, data, {"rung": 8, "logreg_cluster": cluster})
        env = records[0].environment
        print(f"cluster {cluster} K={k:3d} active {env.get('active_clusters')} train {timing['train_ms']:8.1f} ms "
              f"epoch p50 {timing['epoch_ms']['p50']:6.2f} ms", flush=True)
