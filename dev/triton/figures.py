"""The triton engine's recorded figures: ``python -m fasttrain.engines.triton.figures --out results/triton``.

Runs, on real MNIST through the shared driver (so every number is timed the way every engine's is):
- ``logreg``, 20 epochs, batch 128, fp32 (the seed study's benchmark; target <= 2 ms/epoch on an
  H100): the persistent kernel at several program counts, the graph and eager step loops, the
  unfused kernels; tf32x3 and fp16 variants;
- ``mlp:128x3``, ``mlp:1024x3``, ``mlp:8192x3``, 5000 steps, batch 32, fp16: persistent (where the
  width allows), graph, eager and unfused;
- optionally other engines on the same configs in the same process (``--compare jax,cuda``);
- the kernel micro-benchmarks of each kernel module (``triton.testing.do_bench``, median).

Writes ``figures.json`` (one row per run plus the full run records), ``kernels.json`` and
``README.md`` (the tables) into ``--out``, after every run, so a run cut short keeps what it did.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

from fasttrain.training import atomic_write_text

LOGREG = dict(epochs=20, batch_size=128, lr=0.1)
MLP = dict(steps=5000, batch_size=32, lr=0.003)

PLAN = [
    # (label, engine, model, config, precision, options)
    *[(f"persistent, {p} programs x {w} warps{', ' + dot if dot != 'ieee' else ''}", "triton", "logreg", LOGREG, prec,
       {"mode": "persistent", "programs": p, "warps": w, **({"fp32_dot": dot} if dot != "ieee" else {})})
      for p, w, prec, dot in [(49, 4, "fp32", "ieee"), (49, 8, "fp32", "ieee"), (49, 16, "fp32", "ieee"),
                              (25, 8, "fp32", "ieee"), (49, 8, "fp32", "tf32x3"), (49, 8, "fp32", "tf32"),
                              (49, 16, "fp32", "tf32"), (49, 8, "fp16", "ieee"), (49, 16, "fp16", "ieee"),
                              (49, 8, "bf16", "ieee")]],
    ("persistent, 1 program", "triton", "logreg", LOGREG, "fp32", {"mode": "persistent", "programs": 1}),
    ("graph", "triton", "logreg", LOGREG, "fp32", {"mode": "graph"}),
    ("graph, unfused", "triton", "logreg", LOGREG, "fp32", {"mode": "graph", "fused": False}),
    ("eager", "triton", "logreg", LOGREG, "fp32", {"mode": "eager"}),
    ("persistent", "triton", "mlp:128x3", MLP, "fp16", {"mode": "persistent"}),
    ("graph", "triton", "mlp:128x3", MLP, "fp16", {"mode": "graph"}),
    ("graph, backward v3", "triton", "mlp:128x3", MLP, "fp16", {"mode": "graph", "backward": "v3"}),
    ("graph, unfused", "triton", "mlp:128x3", MLP, "fp16", {"mode": "graph", "fused": False}),
    ("eager", "triton", "mlp:128x3", MLP, "fp16", {"mode": "eager"}),
    ("persistent", "triton", "mlp:128x3", MLP, "fp32", {"mode": "persistent"}),
    ("graph", "triton", "mlp:128x3", MLP, "fp32", {"mode": "graph"}),
    ("graph", "triton", "mlp:1024x3", MLP, "fp16", {"mode": "graph"}),
    ("graph, backward v3", "triton", "mlp:1024x3", MLP, "fp16", {"mode": "graph", "backward": "v3"}),
    ("graph, unfused", "triton", "mlp:1024x3", MLP, "fp16", {"mode": "graph", "fused": False}),
    ("eager", "triton", "mlp:1024x3", MLP, "fp16", {"mode": "eager"}),
    ("graph", "triton", "mlp:8192x3", MLP, "fp16", {"mode": "graph"}),
    ("graph, backward v3", "triton", "mlp:8192x3", MLP, "fp16", {"mode": "graph", "backward": "v3"}),
    ("graph, unfused", "triton", "mlp:8192x3", MLP, "fp16", {"mode": "graph", "fused": False}),
]

COMPARE = {  # other engines on the same configs in the same process (whatever is registered and available)
    "jax": [("logreg", LOGREG, "fp32", {}), ("mlp:128x3", MLP, "fp16", {}), ("mlp:1024x3", MLP, "fp16", {}),
            ("mlp:8192x3", MLP, "fp16", {})],
    "cuda": [("logreg", LOGREG, "fp32", {"rung": 6}), ("logreg", LOGREG, "fp32", {"rung": 8}),
             ("mlp:128x3", MLP, "fp16", {"rung": 8}), ("mlp:1024x3", MLP, "fp16", {"rung": 8}),
             ("mlp:8192x3", MLP, "fp16", {"rung": 8})],
    "torch-fast": [("logreg", LOGREG, "fp32", {}), ("mlp:128x3", MLP, "fp16", {}), ("mlp:1024x3", MLP, "fp16", {}),
                   ("mlp:8192x3", MLP, "fp16", {})],
}


def summarize(label, engine, model, precision, options, record) -> dict:
    train_ms = sum(row["train_ms"] for row in record.epochs)
    steps = sum(row["steps"] for row in record.epochs)
    env = record.environment
    return {
        "engine": engine, "label": label, "model": model, "precision": precision, "options": options,
        "mode": env.get("mode"), "programs": env.get("programs"), "launches_per_step": env.get("launches_per_step"),
        "device": env.get("device") or env.get("gpu"),
        "setup_ms": record.setup_ms,
        "avg_epoch_ms_second_half": record.avg_epoch_ms_second_half,
        "p50_epoch_ms": record.epoch_ms.get("p50"),
        "train_ms": train_ms, "steps": steps, "us_per_step": train_ms * 1e3 / steps,
        "final_train_loss": record.epochs[-1]["train_loss"],
        "test_acc": record.final["test_acc"], "test_loss": record.final["test_loss"],
    }


def markdown(rows: list[dict], kernels: list[dict], meta: dict) -> str:
    lines = [
        "# Triton engine figures",
        "",
        f"Written by `{meta['command']}` on {meta['device']} ({meta['date']}); triton {meta.get('triton')}, "
        f"torch {meta.get('torch')}. Every training figure is the shared driver's timing (device synchronized "
        "around each epoch; setup, compilation and graph capture excluded). logreg: 20 epochs, batch 128; "
        "mlp: 5000 steps, batch 32. `ms/epoch` is the mean over the second half of the epochs (logreg); "
        "`us/step` is all training time over all steps.",
        "",
        "| engine | model | precision | variant | launches/step | ms/epoch (2nd half) | us/step | setup ms "
        "| test acc | max abs W err / max abs W (vs fp64) |",
        "| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['engine']} | {r['model']} | {r['precision']} | {r['label']} | | failed: "
                         f"{r['error'][:80]} | | | | |")
            continue
        lps = r.get("launches_per_step")
        lines.append(
            f"| {r['engine']} | {r['model']} | {r['precision']} | {r['label']} | "
            f"{'' if lps is None else format(lps, '.3g')} | {r['avg_epoch_ms_second_half']:.2f} | "
            f"{r['us_per_step']:.2f} | {r['setup_ms']:.0f} | {r['test_acc']:.4f} | "
            f"{format(r['weight_error_vs_fp64'], '.1e') if 'weight_error_vs_fp64' in r else ''} |")
    if kernels:
        lines += ["", "## Kernels (median of `triton.testing.do_bench`)", "",
                  "| kernel | shape / config | precision | us | GFLOP/s | GB/s |", "| --- | --- | --- | ---: | ---: | ---: |"]
        for k in kernels:
            if "error" in k:
                lines.append(f"| {k['kernel']} | failed: {k['error'][:80]} | | | | |")
                continue
            shape = (f"{k['m']}x{k['k']}x{k['n']}" if "k" in k else
                     f"programs {k['programs']}, {k['steps']} steps" if "programs" in k else f"{k.get('m')}x{k.get('n')}")
            us = k.get("us", k.get("ms", 0) * 1e3)
            lines.append(f"| {k['kernel']} | {shape} | {k.get('prec', '')} | {us:.1f} | "
                         f"{k.get('gflops', float('nan')):.0f} | {k.get('gbps', float('nan')):.0f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="results/triton")
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--only", default="", help="comma-separated models to run (default: all)")
    parser.add_argument("--compare", default="", help="other engines to run on the same configs, e.g. jax,cuda")
    parser.add_argument("--no-kernels", action="store_true", help="skip the kernel micro-benchmarks")
    parser.add_argument("--budget-s", type=float, default=1e9, help="stop starting new runs after this many seconds")
    args = parser.parse_args(argv)

    import torch
    import triton

    from fasttrain.contract import default_config, parse_model
    from fasttrain.data.datasets import load_dataset
    from fasttrain.engines import get_engine
    from fasttrain.parity import reference_run, weight_error
    from fasttrain.training import run

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data = load_dataset("mnist", args.data_dir)
    only = {m for m in args.only.split(",") if m}
    meta = {"command": "python -m fasttrain.engines.triton.figures " + " ".join(argv or sys.argv[1:]),
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "date": time.strftime("%Y-%m-%d"), "triton": triton.__version__, "torch": torch.__version__}
    plan = [p for p in PLAN if not only or p[2] in only]
    for engine in [e for e in args.compare.split(",") if e]:
        plan += [(f"{engine} {' '.join(f'--{k} {v}' for k, v in opts.items()) or 'defaults'}", engine, model, cfg,
                  prec, opts) for model, cfg, prec, opts in COMPARE.get(engine, []) if not only or model in only]
    rows, records, kernels, references = [], [], [], {}
    began = time.perf_counter()

    def save():
        atomic_write_text(out / "figures.json", json.dumps({"meta": meta, "rows": rows, "records": records},
                                                           indent=1) + "\n")
        atomic_write_text(out / "README.md", markdown(rows, kernels, meta))

    for label, engine, model, cfg, precision, options in plan:
        if time.perf_counter() - began > args.budget_s:
            rows.append({"engine": engine, "label": label, "model": model, "precision": precision,
                         "error": "not run: --budget-s reached"})
            continue
        try:
            reason = get_engine(engine).available()
            if reason:
                raise RuntimeError(f"unavailable: {reason}")
            spec = parse_model(model)
            config = default_config(spec, precision=precision, eval_every=10**6, **cfg)
            record, weights = run(engine, spec, config, data, options)
            row = summarize(label, engine, model, precision, options, record)
            if model == "logreg":  # parity after 20 epochs against the float64 reference (cheap for logreg)
                if "logreg" not in references:
                    references["logreg"] = reference_run(model, config, data)[1]
                row["weight_error_vs_fp64"] = weight_error(weights, references["logreg"])
            records.append(record.to_dict())
        except Exception as exc:  # record the failure, keep going
            row = {"engine": engine, "label": label, "model": model, "precision": precision, "options": options,
                   "error": f"{type(exc).__name__}: {exc}".splitlines()[0][:300]}
            traceback.print_exc()
        rows.append(row)
        print(json.dumps(row), flush=True)
        save()

    if not args.no_kernels and torch.cuda.is_available():
        from fasttrain.engines.triton import linear_backward, linear_forward, persistent, softmax_xent

        for name, fn in [("linear_forward", lambda: linear_forward.bench(prec="fp16")),
                         ("linear_forward", lambda: linear_forward.bench(shapes=((128, 784, 10),), prec="ieee")),
                         ("softmax_xent", softmax_xent.bench),
                         ("linear_backward", lambda: linear_backward.bench(prec="fp16")),
                         ("persistent", persistent.bench)]:
            try:
                kernels += fn()
            except Exception as exc:
                kernels.append({"kernel": name, "error": f"{type(exc).__name__}: {exc}"[:300]})
                traceback.print_exc()
            save()
        atomic_write_text(out / "kernels.json", json.dumps(kernels, indent=1) + "\n")
    save()
    print(markdown(rows, kernels, meta))


if __name__ == "__main__":
    main()
