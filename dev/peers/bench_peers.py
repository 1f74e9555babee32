"""Benchmarks of the peers our kernels must beat (issue 3): torch-eager, torch-fast's rungs, jax.

    PYTHONPATH=src FASTTRAIN_DATA_DIR=.data/mnist python3 scripts/bench_peers.py --suite logreg --out results/peers
    ... --suite mlp    (mlp:128x3 / mlp:1024x3 / mlp:8192x3, 5000 steps, batch 32, lr 0.003, fp16)

Every row is one ``fasttrain.training.run`` (the shared driver times it: setup apart, epochs
synchronized); its full run record goes to ``<out>/<suite>[-<tag>]-<gpu>.json`` and a summary line
to the ``.csv`` beside it, both rewritten after each row so a run cut short keeps what it
finished. A row that fails is recorded with its error, not dropped. Figures are never typed in.
Run torch and JAX rows in separate processes (``--only torch-eager,torch-fast --tag torch`` and
``--only jax --tag jax``): each framework's runtime threads and allocator then stay out of the
other's timings.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import time
import traceback
from pathlib import Path

# torch and JAX share the GPU in this process: JAX must not grab 75% of its memory up front.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

from fasttrain.contract import default_config, parse_model  # noqa: E402
from fasttrain.data import load_dataset  # noqa: E402
from fasttrain.environment import environment, machine_slug  # noqa: E402
from fasttrain.training import atomic_write_text, run  # noqa: E402

OFF = {"step": "autograd", "compile": "off", "cuda_graph": "off", "fused_sgd": False}
AUTOGRAD = {"step": "autograd"}

# (label, engine, options, precision): the seed study's rungs one at a time, then the best settings.
LOGREG_ROWS = [
    ("tutorial DataLoader", "torch-eager", {}, "fp32"),
    ("host-fed batches, pinned memory", "torch-fast", {**OFF, "preload": False, "pin_memory": True}, "fp32"),
    ("preload", "torch-fast", OFF, "fp32"),
    ("preload + AMP", "torch-fast", OFF, "fp16"),
    ("preload + AMP + compile", "torch-fast", {**OFF, "compile": "default"}, "fp16"),
    ("preload + AMP + compile + fused SGD", "torch-fast", {**OFF, "compile": "default", "fused_sgd": True}, "fp16"),
    ("... + CUDA graph per step", "torch-fast", {**AUTOGRAD, "cuda_graph": "step"}, "fp16"),
    ("... + CUDA graph per epoch", "torch-fast", AUTOGRAD, "fp16"),
    ("... + whole step compiled (--step func): all on", "torch-fast", {}, "fp16"),
    ("autograd, compile, fused SGD, CUDA graph per epoch", "torch-fast", AUTOGRAD, "fp32"),
    ("all on (default)", "torch-fast", {}, "fp32"),
    ("all on (default)", "torch-fast", {}, "bf16"),
    ("jit(lax.scan) (default)", "jax", {}, "fp32"),
    ("jit(lax.scan), unroll 1", "jax", {"unroll": 1}, "fp32"),
    ("jit(lax.scan), unroll 16", "jax", {"unroll": 16}, "fp32"),
    ("jit(lax.scan) (default)", "jax", {}, "bf16"),
    ("jit(lax.scan) (default)", "jax", {}, "fp16"),
]

MLP_WIDTHS = (128, 1024, 8192)
FIELDS = ["label", "engine", "model", "precision", "options", "steps", "epochs", "setup_ms",
          "avg_epoch_ms_second_half", "p50_epoch_ms", "train_s", "total_s", "final_test_acc", "final_train_loss", "error"]


def mlp_rows():
    """Per framework, the rows that matter most first (a deadline cuts from the end)."""
    rows = []
    for width in MLP_WIDTHS:
        model = f"mlp:{width}x3"
        rows += [
            ("all on (default)", "torch-fast", {}, "fp16", model),
            ("autograd, compile, fused SGD, CUDA graph", "torch-fast", AUTOGRAD, "fp16", model),
            ("eager", "torch-eager", {}, "fp16", model),
            ("jit(lax.scan) (default)", "jax", {}, "fp16", model),
            ("jit(lax.scan), unroll 1", "jax", {"unroll": 1}, "fp16", model),
        ]
    priority = {"all on (default)": 0, "jit(lax.scan) (default)": 0, "eager": 1}
    return sorted(rows, key=lambda row: priority.get(row[0], 2))  # stable: widths stay in order


def summary(label: str, record: dict | None, engine: str, model: str, precision: str, options: dict,
            error: str | None = None) -> dict:
    row = {"label": label, "engine": engine, "model": model, "precision": precision,
           "options": json.dumps(options, sort_keys=True), "error": error or ""}
    if record is not None:
        train_ms = [e["train_ms"] for e in record["epochs"]]
        row.update({
            "steps": sum(e["steps"] for e in record["epochs"]),
            "epochs": len(record["epochs"]),
            "setup_ms": round(record["setup_ms"], 1),
            "avg_epoch_ms_second_half": round(record["avg_epoch_ms_second_half"], 3),
            "p50_epoch_ms": round(record["epoch_ms"]["p50"], 3),
            "train_s": round(sum(train_ms) / 1e3, 4),
            "total_s": round(record["total_ms"] / 1e3, 3),
            "final_test_acc": record["final"]["test_acc"],
            "final_train_loss": record["epochs"][-1]["train_loss"],
        })
    return row


def summarize(folder: Path) -> str:
    """A Markdown table of every run record in the JSON files of ``folder`` (figures copied, not typed)."""
    lines = []
    for path in sorted(folder.glob("*.json")):
        doc = json.loads(path.read_text())
        gpu = (doc["environment"].get("gpu") or {}).get("name", "no GPU")
        lines += [f"\n### {path.name} ({doc['suite']}, {gpu})\n",
                  "| engine | model | precision | label | options | setup ms | avg epoch ms (2nd half) | train s | "
                  "total s | test acc |",
                  "| --- | --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: |"]
        for rec in doc["records"]:
            row = summary(rec.get("label", ""), rec, rec["engine"], rec["model"]["name"], rec["config"]["precision"], {})
            resolved = rec["environment"].get("resolved") or {}
            opts = ", ".join(f"{k}={v}" for k, v in resolved.items() if k not in ("device", "epoch_graph_probe"))
            if "unroll" in rec["environment"]:
                opts = f"unroll={rec['environment']['unroll']}"
            lines.append(f"| {rec['engine']} | {row['model']} | {row['precision']} | {row['label']} | {opts} | "
                         f"{row['setup_ms']:.0f} | {row['avg_epoch_ms_second_half']:.2f} | {row['train_s']:.3f} | "
                         f"{row['total_s']:.2f} | {row['final_test_acc']:.4f} |")
        for s in doc["summary"]:
            if s.get("error"):
                lines.append(f"| {s['engine']} | {s['model']} | {s['precision']} | {s['label']} | {s['options']} | "
                             f"failed: {s['error'][:120]} | | | | |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--summarize", type=Path, help="print a Markdown table of the run records in this folder")
    parser.add_argument("--suite", choices=("logreg", "mlp"))
    parser.add_argument("--out", default="results/peers")
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--deadline", type=float, default=0, help="skip rows that start after this many seconds")
    parser.add_argument("--only", default="", help="comma-separated engines to run (default: all)")
    parser.add_argument("--tag", default="", help="added to the output file names (e.g. torch, jax)")
    parser.add_argument("--widths", default="", help="mlp widths to run, e.g. 128,1024 (default: all three)")
    parser.add_argument("--skip", default="", help="comma-separated row numbers (1-based) to leave out")
    args = parser.parse_args(argv)
    if args.summarize:
        sys.stdout.write(summarize(args.summarize))
        return 0
    if not args.suite:
        parser.error("--suite is required (or --summarize FOLDER)")

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    slug = machine_slug()
    stem = "-".join(part for part in (args.suite, args.tag, slug) if part)
    json_path, csv_path = out / f"{stem}.json", out / f"{stem}.csv"
    data = load_dataset("mnist", args.data_dir)
    if args.suite == "logreg":
        rows = [(label, engine, opts, prec, "logreg") for label, engine, opts, prec in LOGREG_ROWS]
    else:
        rows = mlp_rows()
        if args.widths:
            keep = {f"mlp:{w}x3" for w in args.widths.split(",")}
            rows = [r for r in rows if r[4] in keep]
    if args.skip:
        skip = {int(i) for i in args.skip.split(",")}
        rows = [r for i, r in enumerate(rows, start=1) if i not in skip]
    if args.only:
        rows = [r for r in rows if r[1] in args.only.split(",")]

    started = time.perf_counter()
    records, summaries = [], []
    doc = {"suite": args.suite, "environment": environment(), "records": records, "summary": summaries}
    for label, engine, options, precision, model in rows:
        if args.deadline and time.perf_counter() - started > args.deadline:
            summaries.append(summary(label, None, engine, model, precision, options, "skipped: deadline"))
            continue
        spec = parse_model(model)
        cfg = default_config(spec, precision=precision)
        print(f"== {engine} {model} {precision} {label} {options}", flush=True)
        try:
            record, _ = run(engine, spec, cfg, data, options)
            rec = record.to_dict()
            rec["label"] = label
            records.append(rec)
            summaries.append(summary(label, rec, engine, model, precision, options))
        except Exception as exc:  # a failed row is a result too: record why
            traceback.print_exc()
            summaries.append(summary(label, None, engine, model, precision, options,
                                     f"{type(exc).__name__}: {exc}".splitlines()[0][:300]))
        print("   ", {k: summaries[-1].get(k) for k in ("setup_ms", "avg_epoch_ms_second_half", "train_s",
                                                          "total_s", "final_test_acc", "error")}, flush=True)
        atomic_write_text(json_path, json.dumps(doc, indent=1) + "\n")
        with open(csv_path, "w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=FIELDS, restval="")
            writer.writeheader()
            writer.writerows(summaries)
    atomic_write_text(json_path, json.dumps(doc, indent=1) + "\n")

    gpu = (doc["environment"].get("gpu") or {}).get("name", "no GPU")
    print(f"\n{args.suite} on {gpu}")
    print(f"{'engine':12} {'prec':5} {'model':11} {'label':44} {'setup ms':>9} {'epoch ms':>9} {'train s':>8} {'total s':>8} {'acc':>6}")
    for s in summaries:
        if s["error"]:
            print(f"{s['engine']:12} {s['precision']:5} {s['model']:11} {s['label'][:44]:44} {s['error'][:60]}")
            continue
        print(f"{s['engine']:12} {s['precision']:5} {s['model']:11} {s['label'][:44]:44} {s['setup_ms']:9.0f} "
              f"{s['avg_epoch_ms_second_half']:9.2f} {s['train_s']:8.3f} {s['total_s']:8.2f} {s['final_test_acc']:6.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
