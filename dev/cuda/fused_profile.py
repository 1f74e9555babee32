"""Phase profiles of the rung-8 kernels (clock64() counters, FT_PROF=1 builds) and short ncu targets.

    PYTHONPATH=src python3 dev/cuda/fused_profile.py --profile --out /tmp/profile        # logreg + mlp phases
    PYTHONPATH=src python3 dev/cuda/fused_profile.py --profile-grid mlp:1024x3 --out /tmp/profile
    PYTHONPATH=src python3 dev/cuda/fused_profile.py --ncu-target mlp:8192x3 --options '{"step_bi": 32}'

Timed figures of every version and tuning are the record suite's (``fasttrain bench record``, with
``FASTTRAIN_ENGINE_PATH=dev/cuda/engines`` for the earlier versions): the same driver and stopwatch as every
engine. This script reads the kernels' own cycle counters, around two epochs timed with the core's
:class:`~fasttrain.timing.Stopwatch`.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import numpy as np

os.environ.setdefault("FASTTRAIN_ENGINE_PATH", str(Path(__file__).resolve().parent / "engines"))

from fasttrain.contract import default_config, epoch_order, initial_weights, parse_model, schedule  # noqa: E402
from fasttrain.data.datasets import load_dataset  # noqa: E402
from fasttrain.engines import registry  # noqa: E402
from fasttrain.engines.base import Job, make_options  # noqa: E402
from fasttrain.timing import Stopwatch  # noqa: E402
from fasttrain.training import atomic_write_text  # noqa: E402

registry()


def make_session(job, rung, **options):
    """A cuda-dev session (``kernel``: a file of dev/cuda, empty: the package's; ``prof``: the counters)."""
    from fasttrain.engines.cuda_dev import CudaDevEngine
    from fasttrain.engines.cuda_dev.history import make_dev_session

    return make_dev_session(job, make_options(CudaDevEngine, {"rung": rung, **options}))


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
    spec = parse_model("logreg")
    cfg = default_config(spec, precision="fp16", epochs=2)
    plan = schedule(cfg, data.n_train)
    job = Job(spec, cfg, data, initial_weights(spec, cfg.seed), plan)
    results = []
    for tuning in configs:
        session = make_session(job, 8, **tuning)
        watch = Stopwatch(session.sync)
        ms = _two_epochs(session, watch, cfg, plan, data)
        prof = session.profile() if tuning.get("prof") else None
        fixed = _kernel_times(session, job) if not tuning.get("prof") and tuning.get("logreg_cluster") == 7 else None
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
            names = LOGREG_PHASES[tuning.get("kernel") or "fused_logreg_v4.cu"]
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


def profile_mlp(data, version="") -> list[dict]:
    spec = parse_model("mlp:128x3")
    cfg = default_config(spec, precision="fp16", steps=3750)
    plan = schedule(cfg, data.n_train)
    job = Job(spec, cfg, data, initial_weights(spec, cfg.seed), plan)
    session = make_session(job, 8, prof=True, kernel=version)
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
    spec = parse_model(model)
    cfg = default_config(spec, precision="fp16", steps=2 * steps)
    plan = schedule(cfg, data.n_train)
    job = Job(spec, cfg, data, initial_weights(spec, cfg.seed), plan)
    session = make_session(job, 8, prof=True, **tuning)
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
    parser.add_argument("--out", default="/tmp/fused-profile")
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--profile", action="store_true", help="the rung-8 logreg and mlp phase profiles")
    parser.add_argument("--profile-grid", default=None, metavar="MODEL",
                        help="the phase profile of the rung-8 grid kernel for MODEL (e.g. mlp:1024x3)")
    parser.add_argument("--ncu-target", default=None, metavar="MODEL",
                        help="run 8 rung-7 steps of MODEL without a graph (a short target for ncu) and exit")
    parser.add_argument("--options", default="{}", metavar="JSON",
                        help='cuda-dev options for --ncu-target, e.g. \'{"kernel": "fused_step_v1.cu", "step_bi": 32}\'')
    args = parser.parse_args(argv)
    data = load_dataset("mnist", args.data_dir)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.ncu_target:
        spec = parse_model(args.ncu_target)
        cfg = default_config(spec, precision="fp16", steps=8)
        job = Job(spec, cfg, data, initial_weights(spec, cfg.seed), schedule(cfg, data.n_train))
        session = make_session(job, 7, step_graph=False, **json.loads(args.options))
        session.train_epoch(1, epoch_order(cfg.seed, 1, data.n_train), 8)
        session.close()
    if args.profile_grid:
        res = profile_grid(data, args.profile_grid)
        res += profile_grid(data, args.profile_grid, kernel="fused_grid_v1.cu")
        atomic_write_text(out / "grid_profile.json", json.dumps(res, indent=1) + "\n")
    if args.profile:
        v5 = "fused_logreg_v5.cu"
        res = profile_logreg(data, [dict(prof=True, logreg_cluster=7), dict(logreg_cluster=7),
                                    dict(logreg_cluster=7, kernel="fused_logreg_v3.cu"),
                                    {"prof": True, "logreg_cluster": 7, "kernel": v5}, {"logreg_cluster": 7, "kernel": v5}])
        res += profile_mlp(data)
        atomic_write_text(out / "fused_profile.json", json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
