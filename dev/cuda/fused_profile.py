"""Benchmark of rungs 7 and 8 (issue 5): fills the issue's table with measured figures.

    python -m fasttrain.engines.cuda.fused_bench --out results/record [--data-dir DIR] [--quick]

Every row is a full training run through the shared driver (:func:`fasttrain.training.run`, engine
``cuda`` with ``--rung 7|8``), so the times are the driver's: an epoch is timed from before
``train_epoch`` to the end of its device work. Per-epoch workloads (logreg) report the mean epoch
time over the second half of training; per-run workloads (the MLPs, 5000 steps) report the sum of
the epochs' train times (setup, compilation and evaluation excluded). Where a float64 NumPy run is
affordable the row also carries the parity figures of the issue (worst relative deviation of the
per-epoch train loss, and the final test-accuracy difference). Variants (cluster sizes of the rung-8
kernel) are timed with the same stopwatch through :func:`fasttrain.engines.cuda.fused.make_session`.

Writes ``fused.json`` (everything, including the run records), ``fused.csv`` and ``fused.md``.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from fasttrain.bench.timing import Stopwatch, summarize_epochs
from fasttrain.contract import default_config, epoch_order, initial_weights, parse_model, schedule
from fasttrain.data.datasets import load_dataset
from fasttrain.engines.base import Job
from fasttrain.environment import environment
from fasttrain.training import atomic_write_text, run

# (workload key, model, config overrides, rung, metric, anchors, floor, target, parity affordable)
WORKLOADS = [
    ("logreg", "logreg", dict(epochs=20, batch_size=128), 8, "ms/epoch",
     "JAX jit(lax.scan) 8.5; whole-epoch CUDA-graph PyTorch 28.5; seed's CUDA best 17", "0.3-0.6 ms/epoch",
     ("<=", 0.7), True),
    ("mlp:128x3", "mlp:128x3", dict(steps=5000, batch_size=32, lr=0.003), 8, "ms/run",
     "JAX 0.20 s; PyTorch whole-step graph 0.55 s; pure-CUDA 1.50 s (H200)", "~15 ms", ("<=", 25.0), True),
    ("mlp:1024x3", "mlp:1024x3", dict(steps=5000, batch_size=32, lr=0.003), 8, "ms/run",
     "JAX 0.31 s; PyTorch graph 0.89 s; pure-CUDA 1.6 s (H200)", "~40 ms", ("<=", 60.0), True),
    ("mlp:8192x3", "mlp:8192x3", dict(steps=5000, batch_size=32, lr=0.003), 7, "ms/run",
     "JAX 5.5 s; torch.compile 8.04 s; pure-CUDA 7.7 s (H200)", "1.4 s (fp16 weights), 2.8 s (fp32 master)",
     ("<=", 3000.0), False),
]

# rung-7 variants timed beside the driver's row (fp16, same stopwatch); v2 dropped (measured slower, calls 4-5).
# fused_step_v3 (NOTES-fused.md): default = ft_bwd ring BI 64 / 4 stages / 1 block an SM, ft_fwd BO 64 with
# 4 k-steps of W ahead, first layer BI 16 with its output rows split over the idle SMs.
V3 = "fused_step_v3.cu"
STEP_VARIANTS = {
    "mlp:8192x3": (
        {"version": "fused_step_v1.cu"},                                      # baseline, same stopwatch
        {"version": V3},                                                      # ring bwd + FU 4 fwd
        {"version": V3, "fu": 2},                                             # ring bwd, fwd loads as v1 (isolates bwd)
        {"version": V3, "bi": 32, "bwd_minb": 2},                             # bwd 2 blocks an SM, 3 stages
        {"version": V3, "bi": 32, "bo": 32, "bwd_minb": 2, "fwd_minb": 2},    # both kernels 2 blocks an SM
    ),
    "mlp:1024x3": (
        {"version": "fused_step_v1.cu", "carveout": None},
        {"version": V3},                                                      # BI 8 ring, fwd FU 8 (one L2 trip a warp)
        {"version": V3, "stages": 2, "fu": 2},                                # shallow: the latency-bound control
    ),
}


def _metric(record, metric: str) -> float:
    if metric == "ms/epoch":
        return record.avg_epoch_ms_second_half
    return float(sum(row["train_ms"] for row in record.epochs))


def _parity(record, ref) -> dict:
    worst = max(abs(a["train_loss"] - b["train_loss"]) / b["train_loss"] for a, b in zip(record.epochs, ref.epochs))
    return {"train_loss_max_rel_dev": worst,
            "test_acc": record.final["test_acc"], "ref_test_acc": ref.final["test_acc"],
            "test_acc_diff_pp": 100 * (record.final["test_acc"] - ref.final["test_acc"])}


class _Opts:
    def __init__(self, rung):
        self.rung, self.debug = rung, False


def time_variant(data, model, overrides, rung, precision, **tuning) -> dict:
    """The driver's timing loop (Stopwatch around train_epoch) for a session with tuning overrides."""
    from fasttrain.engines.cuda.fused import make_session

    spec = parse_model(model)
    cfg = default_config(spec, precision=precision, **overrides)
    plan = schedule(cfg, data.n_train)
    job = Job(spec, cfg, data, initial_weights(spec, cfg.seed), plan)
    session = make_session(job, _Opts(rung), **tuning)
    try:
        watch = Stopwatch(session.sync)
        times, losses = [], []
        for epoch, steps in enumerate(plan.steps_per_epoch, start=1):
            order = epoch_order(cfg.seed, epoch, data.n_train)
            ms, stats = watch.time_ms(lambda: session.train_epoch(epoch, order, steps))
            times.append(ms)
            losses.append(stats.loss_sum / stats.count)
        test_loss, test_acc = session.evaluate()
        env = session.environment()
    finally:
        session.close()
    return {"model": model, "rung": rung, "precision": precision, "tuning": tuning, "epoch_ms": times,
            "stats": summarize_epochs(times), "train_loss": losses, "test_acc": test_acc, "run_ms": sum(times),
            "environment": env}


LOGREG_PHASES = {
    "fused_logreg_v1.cu": {0: "wait data", 1: "convert", 2: "fwd+push", 3: "wait partials", 4: "softmax", 5: "backward"},
    "fused_logreg_v2.cu": {0: "loop", 1: "fwd+scatter", 2: "convert next", 3: "wait partials", 4: "softmax+gather",
                           5: "wait g", 6: "backward"},
    "fused_logreg_v3.cu": {0: "loop", 8: "fwd compute", 1: "fence+bar+scatter", 2: "convert next", 3: "wait partials",
                           9: "softmax", 10: "fence+bar", 4: "gather issue+stats", 5: "wait g", 6: "backward"},
    "fused_logreg_v4.cu": {0: "loop", 8: "fwd compute", 1: "fence+bar+scatter+stats", 2: "convert next",
                           3: "wait partials", 9: "softmax", 10: "fence+bar", 4: "gather issue+X frags", 5: "wait g",
                           6: "backward"},
    "fused_logreg_v5.cu": {0: "loop", 8: "fwd compute", 1: "fence+bar+send+stats", 4: "X frags", 2: "convert next",
                           3: "wait partials", 9: "softmax all rows", 10: "bar", 6: "backward+bar"},
}
PRODUCER = {16: "wait stage", 17: "issue"}


def _kernel_times(session, job) -> dict:
    """Event-timed launches of the epoch kernel with 1..all steps (lr = 0): the intercept is the fixed cost."""
    import cupy as cp

    out = {}
    order = session.orders[0]
    for k in (1, 2, 50, job.schedule.steps_per_epoch[0]):
        ts = []
        for _ in range(3):
            e0, e1 = cp.cuda.Event(), cp.cuda.Event()
            e0.record(session.stream)
            session._launch(order, k, 0.0)
            e1.record(session.stream)
            e1.synchronize()
            ts.append(cp.cuda.get_elapsed_time(e0, e1))
        out[k] = round(float(np.median(ts)), 4)
    return out


def _two_epochs(session, watch, cfg, plan, data) -> list[float]:
    """The driver's stopwatch around epochs 1 and 2 of the contract's order (ms each)."""
    ms = []
    for epoch in (1, 2):
        t, _ = watch.time_ms(lambda e=epoch: session.train_epoch(e, epoch_order(cfg.seed, e, data.n_train),
                                                                 plan.steps_per_epoch[e - 1]))
        ms.append(t)
    return ms


def profile_logreg(data, configs) -> list[dict]:
    """Per-phase clock64() cycles of rung 8 logreg (one epoch after a warm one), and ablation timings."""
    from fasttrain.engines.cuda.fused import make_session

    spec = parse_model("logreg")
    cfg = default_config(spec, precision="fp16", epochs=2)
    plan = schedule(cfg, data.n_train)
    job = Job(spec, cfg, data, initial_weights(spec, cfg.seed), plan)
    results = []
    for tuning in configs:
        session = make_session(job, _Opts(8), **tuning)
        watch = Stopwatch(session.sync)
        ms = _two_epochs(session, watch, cfg, plan, data)
        prof = session.profile() if tuning.get("prof") else None
        fixed = _kernel_times(session, job) if not tuning.get("prof") and tuning.get("cluster") == 7 else None
        if fixed:   # host overhead of train_epoch = its wall time minus the kernel's event time
            t_host = []
            for _ in range(3):
                t, _ = watch.time_ms(lambda: session.train_epoch(1, epoch_order(cfg.seed, 1, data.n_train),
                                                                 plan.steps_per_epoch[0]))
                t_host.append(t)
            fixed["train_epoch_wall_ms"] = round(float(np.median(t_host)), 4)
        session.close()
        row = {"tuning": tuning, "epoch_ms": ms}
        if fixed:
            row["kernel_ms_by_steps"] = fixed
            print(f"   kernel time by steps (events, lr=0): {fixed}", flush=True)
        if prof is not None:
            steps = plan.steps_per_epoch[1]
            from fasttrain.engines.cuda.fused import LOGREG_VERSION

            names = LOGREG_PHASES[tuning.get("version", LOGREG_VERSION)]
            row["cycles_per_step"] = {name: (prof[:, i] / steps).round(1).tolist() for i, name in names.items()}
            row["producer_cycles_per_step"] = {name: (prof[:, i] / steps).round(1).tolist() for i, name in PRODUCER.items()}
        results.append(row)
        print(f"profile {tuning}: epoch ms {ms[0]:.3f} {ms[1]:.3f}", flush=True)
        if prof is not None:
            for name, v in row["cycles_per_step"].items():
                print(f"   {name:14s} cycles/step per CTA: {v}", flush=True)
            for name, v in row["producer_cycles_per_step"].items():
                print(f"   producer {name:10s}: {v}", flush=True)
    return results


MLP_PHASES = ["wait data", "layer 1", "layers 2..", "logits+softmax", "bwd last", "bwd NL..2", "bwd 1"]


def profile_mlp(data, version="fused_mlp_v2.cu") -> list[dict]:
    from fasttrain.engines.cuda.fused import make_session

    spec = parse_model("mlp:128x3")
    cfg = default_config(spec, precision="fp16", steps=3750)
    plan = schedule(cfg, data.n_train)
    job = Job(spec, cfg, data, initial_weights(spec, cfg.seed), plan)
    session = make_session(job, _Opts(8), prof=True, version=version)
    ms = _two_epochs(session, Stopwatch(session.sync), cfg, plan, data)
    prof = session.profile()
    session.close()
    steps = plan.steps_per_epoch[1]
    row = {"model": "mlp:128x3", "version": version, "epoch_ms": ms,
           "cycles_per_step": {name: (prof[:, i] / steps).round(1).tolist() for i, name in enumerate(MLP_PHASES)},
           "producer_cycles_per_step": {name: (prof[:, i] / steps).round(1).tolist() for i, name in PRODUCER.items()}}
    print(f"profile mlp:128x3 rung 8 {version}: epoch ms {ms[0]:.3f} {ms[1]:.3f} ({steps} steps)", flush=True)
    for name, v in row["cycles_per_step"].items():
        print(f"   {name:14s} cycles/step per CTA: {v}", flush=True)
    for name, v in row["producer_cycles_per_step"].items():
        print(f"   producer {name:10s}: {v}", flush=True)
    return [row]


GRID_PHASES = ["fwd 1", "fwd 2..NL (v2: and the reduces)", "fwd last", "bwd last", "bwd NL..2 (v1)", "bwd 1 (v2: NL..1)"]


def profile_grid(data, model="mlp:1024x3", steps=1875, **tuning) -> list[dict]:
    """Per-phase clock64() cycles of the rung-8 grid kernel (thread 0 of every CTA, waits included), and the
    epoch kernel's event time by number of steps (lr = 0)."""
    from fasttrain.engines.cuda.fused import make_session

    spec = parse_model(model)
    cfg = default_config(spec, precision="fp16", steps=2 * steps)
    plan = schedule(cfg, data.n_train)
    job = Job(spec, cfg, data, initial_weights(spec, cfg.seed), plan)
    session = make_session(job, _Opts(8), prof=True, **tuning)
    ms = _two_epochs(session, Stopwatch(session.sync), cfg, plan, data)
    prof = session.profile()
    kernel = _kernel_times(session, job)
    session.close()
    n = plan.steps_per_epoch[1]
    row = {"model": model, "version": session.version, "tuning": tuning, "grid": session.grid, "epoch_ms": ms, "kernel_ms_by_steps": kernel,
           "cycles_per_step": {name: (prof[:, i] / n).round(1).tolist() for i, name in enumerate(GRID_PHASES)}}
    print(f"profile {model} rung 8 {session.version} {tuning} grid {session.grid}: epoch ms {ms[0]:.3f} {ms[1]:.3f} ({n} steps); "
          f"kernel ms by steps {kernel}", flush=True)
    for name, v in row["cycles_per_step"].items():
        arr = np.asarray(v)
        print(f"   {name:10s} cycles/step: CTA0 {arr[0]:.0f}  mean {arr.mean():.0f}  max {arr.max():.0f}", flush=True)
    return [row]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="results/record")
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--quick", action="store_true", help="skip the 8192-wide model and the variants")
    parser.add_argument("--no-parity", action="store_true", help="skip the float64 reference runs")
    parser.add_argument("--only", default=None, help="comma-separated workload keys")
    parser.add_argument("--profile", action="store_true", help="only the rung-8 phase profile and ablations")
    parser.add_argument("--profile-grid", default=None, metavar="MODEL",
                        help="only the phase profile of the rung-8 grid kernel for MODEL (e.g. mlp:1024x3)")
    parser.add_argument("--ncu-target", default=None, metavar="MODEL",
                        help="run 8 rung-7 steps of MODEL without a graph (a short target for ncu) and exit")
    parser.add_argument("--tuning", default="{}", metavar="JSON",
                        help='session knobs for --ncu-target, e.g. \'{"version": "v3", "bi": 32, "bwd_minb": 2}\'')
    args = parser.parse_args(argv)
    if args.ncu_target:
        from fasttrain.engines.cuda.fused import make_session

        data = load_dataset("mnist", args.data_dir)
        spec = parse_model(args.ncu_target)
        cfg = default_config(spec, precision="fp16", steps=8)
        job = Job(spec, cfg, data, initial_weights(spec, cfg.seed), schedule(cfg, data.n_train))
        session = make_session(job, _Opts(7), graph=False, **json.loads(args.tuning))
        session.train_epoch(1, epoch_order(cfg.seed, 1, data.n_train), 8)
        session.close()
        return 0
    if args.profile_grid:
        data = load_dataset("mnist", args.data_dir)
        res = profile_grid(data, args.profile_grid)
        res += profile_grid(data, args.profile_grid, version="fused_grid_v1.cu", sc_fence=False)
        Path(args.out).mkdir(parents=True, exist_ok=True)
        atomic_write_text(Path(args.out) / "grid_profile.json", json.dumps(res, indent=1) + "\n")
        return 0
    if args.profile:
        data = load_dataset("mnist", args.data_dir)
        v5 = "fused_logreg_v5.cu"
        res = profile_logreg(data, [dict(prof=True, cluster=7), dict(cluster=7), dict(cluster=7, version="fused_logreg_v3.cu"),
                                    {"prof": True, "cluster": 7, "version": v5}, {"cluster": 7, "version": v5}])
        res += profile_mlp(data, "fused_mlp_v3.cu")
        Path(args.out).mkdir(parents=True, exist_ok=True)
        atomic_write_text(Path(args.out) / "fused_profile.json", json.dumps(res, indent=1) + "\n")
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data = load_dataset("mnist", args.data_dir)
    env = environment()
    rows, records, variants = [], {}, []
    only = set(args.only.split(",")) if args.only else None
    for key, model, overrides, rung, metric, anchors, floor, target, parity_ok in WORKLOADS:
        if only and key not in only:
            continue
        if args.quick and key == "mlp:8192x3":
            continue
        spec = parse_model(model)
        for precision in ("fp16", "bf16") if key == "logreg" else ("fp16",):
            for r in ((8, 7) if rung == 8 else (rung,)):
                cfg = default_config(spec, precision=precision, **overrides)
                t0 = time.perf_counter()
                record, _ = run("cuda", spec, cfg, data, {"rung": r})
                wall = time.perf_counter() - t0
                value = _metric(record, metric)
                row = {"workload": key, "rung": r, "precision": precision, "metric": metric, "value": value,
                       "setup_ms": record.setup_ms, "wall_s": wall, "final_test_acc": record.final["test_acc"],
                       "final_train_loss": record.epochs[-1]["train_loss"], "anchors": anchors, "floor": floor,
                       "target": f"{target[0]} {target[1]:g} {metric}",
                       "met": (value <= target[1]) if r == rung else None}
                if parity_ok and not args.no_parity and precision == "fp16":
                    ref_key = (key, "ref")
                    if ref_key not in records:
                        ref, _ = run("numpy", spec, cfg.with_(precision="fp64"), data)
                        records[ref_key] = ref
                    row.update(_parity(record, records[ref_key]))
                rows.append(row)
                records[(key, r, precision)] = record
                print(f"{key:11s} rung {r} {precision}: {value:10.3f} {metric}  test acc {record.final['test_acc']:.4f}"
                      + (f"  loss dev {row['train_loss_max_rel_dev']:.4f}" if "train_loss_max_rel_dev" in row else ""),
                      flush=True)
        if key == "mlp:1024x3" and not args.quick:
            for tuning in ({"version": "fused_grid_v1.cu"}, {"version": "fused_grid_v1.cu", "sc_fence": False},
                           {"version": "fused_grid_v2.cu"}):
                v = time_variant(data, model, overrides, 8, "fp16", **tuning)
                variants.append(v)
                print(f"  variant {model} rung 8 {tuning}: {v['run_ms']:.1f} ms/run", flush=True)
        if key in STEP_VARIANTS and not args.quick:
            for tuning in STEP_VARIANTS[key]:
                v = time_variant(data, model, overrides, 7, "fp16", **tuning)
                variants.append(v)
                tiles = v["environment"].get("tiles", [])
                print(f"  variant {model} rung 7 {tuning}: {v['run_ms']:.1f} ms/run  test acc {v['test_acc']:.4f}  "
                      f"tiles {tiles}", flush=True)
        if key == "mlp:128x3" and not args.quick:
            for version in ("fused_mlp_v1.cu", "fused_mlp_v2.cu"):
                v = time_variant(data, model, overrides, 8, "fp16", version=version)
                variants.append(v)
                print(f"  variant {model} rung 8 {version}: {v['run_ms']:.1f} ms/run", flush=True)
        if key == "logreg" and not args.quick:
            for cluster, version in ((4, "v4"), (5, "v4"), (6, "v4"), (7, "v4"), (7, "v3"), (7, "v2"), (7, "v1"),
                                     (7, "v5"), (4, "v5")):
                v = time_variant(data, "logreg", overrides, 8, "fp16", cluster=cluster, version=f"fused_logreg_{version}.cu")
                variants.append(v)
                print(f"  variant logreg rung 8 {version} cluster {cluster}: {v['stats']['mean_second_half']:.3f} ms/epoch "
                      f"(p50 {v['stats']['p50']:.3f})", flush=True)

    gpu = (env.get("gpu") or {}).get("name") if isinstance(env.get("gpu"), dict) else None
    device = next((r.environment.get("device") for k, r in records.items() if k[1] != "ref"), gpu)
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    payload = {"schema": 1, "created": stamp, "device": device, "environment": env, "rows": rows,
               "variants": variants,
               "records": {"/".join(map(str, k)): rec.to_dict() for k, rec in records.items()}}
    atomic_write_text(out / "fused.json", json.dumps(payload, indent=1, default=float) + "\n")
    buf = io.StringIO()
    fields = ["workload", "rung", "precision", "metric", "value", "target", "met", "final_test_acc",
              "train_loss_max_rel_dev", "test_acc_diff_pp", "setup_ms"]
    writer = csv.DictWriter(buf, fieldnames=fields, extrasaction="ignore")
    writer.writeheader()
    for row in rows:
        writer.writerow(row)
    atomic_write_text(out / "fused.csv", buf.getvalue())
    atomic_write_text(out / "fused.md", render_md(rows, variants, device, stamp))
    print(render_md(rows, variants, device, stamp))
    return 0


def _fmt(row) -> str:
    v = row["value"]
    return f"{v:.3f} ms/epoch" if row["metric"] == "ms/epoch" else (f"{v / 1e3:.3f} s" if v >= 1000 else f"{v:.1f} ms")


def render_md(rows, variants, device, stamp) -> str:
    lines = [f"# Rungs 7 and 8, measured on {device} ({stamp})", "",
             "Written by `python -m fasttrain.engines.cuda.fused_bench`; times from the shared driver "
             "(ms/epoch = mean of the second half of the epochs; per-run = sum of the epochs' train times).", "",
             "| workload | anchors on the same kind of GPU | floor | target | measured | rung, precision | met | "
             "loss dev vs fp64 | test acc (diff) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in rows:
        dev = f"{100 * row['train_loss_max_rel_dev']:.2f}%" if "train_loss_max_rel_dev" in row else "n/a"
        acc = f"{100 * row['final_test_acc']:.2f}%"
        if "test_acc_diff_pp" in row:
            acc += f" ({row['test_acc_diff_pp']:+.2f} pp)"
        met = {True: "yes", False: "**no**", None: "(comparison)"}[row["met"]]
        lines.append(f"| `{row['workload']}` | {row['anchors']} | {row['floor']} | {row['target']} | {_fmt(row)} | "
                     f"{row['rung']}, {row['precision']} | {met} | {dev} | {acc} |")
    if variants:
        lines += ["", "Variants (fp16, same stopwatch; ms/epoch for logreg, the run's sum for MLPs in the last column):", "",
                  "| model, kernel | cluster | stages | ms/epoch (2nd half mean) or run | epoch p20 | p50 | p80 | test acc |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for v in variants:
            st = v["stats"]
            main = f"{st['mean_second_half']:.3f}" if v["model"] == "logreg" else f"run {v['run_ms']:.1f} ms"
            knobs = {k: x for k, x in v["tuning"].items() if k not in ("version", "cluster")}
            kernel = v["environment"].get("fused_kernel") + (f" {knobs}" if knobs else "")
            lines.append(f"| {v['model']} {kernel} | {v['tuning'].get('cluster', '')} | "
                         f"{v['environment'].get('stages', '')} | {main} | {st['p20']:.3f} | {st['p50']:.3f} | "
                         f"{st['p80']:.3f} | {100 * v['test_acc']:.2f}% |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
