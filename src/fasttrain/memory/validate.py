"""Check the ``precise`` estimate against a GPU: the cases, each measured row beside its estimate,
and the CSV and Markdown of a validation run. What trains the cases is the lab's trainer
(``fasttrain.lab.experiments.memory_check``; this package does not import the lab).

Every case trains the lab's GPT through the lab's trainer with AdamW (foreach, PyTorch's
default on CUDA, unless the case says fused) for ``steps`` steps on fixed random tokens: fp32 or
bf16 autocast, eager or flash attention (``F.scaled_dot_product_attention``), without or with
activation checkpointing (selective: the attention core; full: every block). The peak covers all
steps (the optimizer state exists from the first step on). All cases run in one process, one
after the other; what stays allocated between cases (cuBLAS workspaces) is measured once at the
start and reported.

``python -m fasttrain memory validate --out results/memory/validation.csv`` writes the CSV and a
Markdown table beside it (same name, ``.md``). ``--debug DIR`` also records the allocator's
history during the last step of each case and writes, per case, what was alive at the peak.
"""

from __future__ import annotations

import csv
import gc
import json
from contextlib import nullcontext
from pathlib import Path

from fasttrain.errors import FasttrainError
from fasttrain.memory.config import preset
from fasttrain.memory.precise import estimate

MiB = 1024 ** 2

# name, preset, overrides. val-llama: GQA 16/4, SwiGLU, RMSNorm, RoPE, untied; val-gpt: GPT-2
# style (tied, learned positions, LayerNorm, GELU, biases, dropout 0.1); val-relu: ReLU MLP,
# LayerNorm without bias, RoPE, multi-head.
CASES: list[tuple[str, str, dict]] = [
    ("llama-fp32-eager", "val-llama", dict(precision="fp32")),
    ("llama-fp32-eager-selective", "val-llama", dict(precision="fp32", recompute="selective")),
    ("llama-fp32-eager-full", "val-llama", dict(precision="fp32", recompute="full")),
    ("llama-amp-eager", "val-llama", dict(precision="amp")),
    ("llama-amp-eager-selective", "val-llama", dict(precision="amp", recompute="selective")),
    ("llama-amp-eager-full", "val-llama", dict(precision="amp", recompute="full")),
    ("llama-amp-flash", "val-llama", dict(precision="amp", attention="flash")),
    ("llama-amp-flash-full", "val-llama", dict(precision="amp", attention="flash", recompute="full")),
    ("llama-amp-eager-b1-s2048", "val-llama", dict(precision="amp", micro_batch=1, seq=2048)),
    ("llama-fp32-eager-b32-s256", "val-llama", dict(precision="fp32", micro_batch=32, seq=256)),
    ("gpt-fp32-eager", "val-gpt", dict(precision="fp32")),
    ("gpt-amp-eager", "val-gpt", dict(precision="amp")),
    ("gpt-amp-flash", "val-gpt", dict(precision="amp", attention="flash")),
    ("gpt-fp32-flash-full", "val-gpt", dict(precision="fp32", attention="flash", recompute="full")),
    ("relu-fp32-eager", "val-relu", dict(precision="fp32")),
    ("relu-amp-eager-selective", "val-relu", dict(precision="amp", recompute="selective")),
    ("relu-amp-eager-fused-adamw", "val-relu", dict(precision="amp", optimizer="fused")),
    # shapes whose peak is inside the layers, at the optimizer step or elsewhere (the cases above
    # all peak at the loss's backward): long sequences, small vocabularies, wide models
    ("llama-amp-eager-b2-s4096", "val-llama", dict(precision="amp", micro_batch=2, seq=4096)),
    ("llama-fp32-eager-v4096", "val-llama", dict(precision="fp32", vocab=4096)),
    ("llama-amp-eager-full-b2-s4096", "val-llama", dict(precision="amp", micro_batch=2, seq=4096, recompute="full")),
    ("llama-amp-eager-selective-b2-s4096", "val-llama", dict(precision="amp", micro_batch=2, seq=4096,
                                                            recompute="selective")),
    ("llama-amp-flash-v1024-s8192", "val-llama", dict(precision="amp", attention="flash", vocab=1024, seq=8192,
                                                     micro_batch=1, ffn=1024)),
    ("swiglu-amp-flash-mlp", "val-llama", dict(precision="amp", attention="flash", vocab=1024, seq=128,
                                              micro_batch=64, ffn=8192)),
    ("relu-amp-eager-mlp", "val-relu", dict(precision="amp", vocab=4096, seq=256, micro_batch=32, ffn=16384)),
    ("relu-fp32-eager-mlp", "val-relu", dict(precision="fp32", vocab=4096, seq=128, micro_batch=64, ffn=16384)),
    ("gpt-amp-flash-full", "val-gpt", dict(precision="amp", attention="flash", recompute="full")),
    ("gpt-fp32-flash-full-v4096", "val-gpt", dict(precision="fp32", attention="flash", recompute="full", vocab=4096)),
    ("wide-fp32-adamw", "val-llama", dict(precision="fp32", hidden=4096, heads=32, kv_heads=8, ffn=11008, layers=4,
                                          seq=128, micro_batch=1)),
    ("wide-amp-fused-adamw", "val-llama", dict(precision="amp", hidden=4096, heads=32, kv_heads=8, ffn=11008,
                                               layers=4, seq=128, micro_batch=1, optimizer="fused")),
]
QUICK = ("llama-amp-eager", "llama-amp-eager-b2-s4096", "gpt-amp-flash-full")

FIELDS = ["case", "preset", "precision", "attention", "recompute", "optimizer", "micro_batch", "seq", "params",
          "measured_mib", "estimate_mib", "error_pct", "within_10pct", "estimate_peak_at", "seconds", "error"]


def case_setup(name: str):
    for case, preset_name, overrides in CASES:
        if case == name:
            return preset(preset_name, **overrides)
    raise FasttrainError(f"unknown validation case {name!r}; use one of {', '.join(c[0] for c in CASES)}")


def warm_up(device):
    """Run a tiny forward + backward so that cuBLAS/cuBLASLt create their workspaces (one per
    thread and stream: the caller's and autograd's) before anything is measured; return the bytes
    that stay allocated."""
    import torch

    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    lin = torch.nn.Linear(256, 256, device=device)
    x = torch.randn(64, 256, device=device, requires_grad=True)
    for ctx in (nullcontext(), torch.autocast("cuda", dtype=torch.bfloat16)):
        with ctx:
            y = lin(x) @ lin.weight + torch.bmm(x[None], lin.weight[None]).squeeze(0)
        y.sum().backward()
    del lin, x, y
    gc.collect()
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated() - before


def trace_peak(snapshot, start_bytes: int, top: int = 40) -> dict:
    """Replay the allocator history: the peak and what was alive then, grouped by size and by the
    innermost fasttrain (else any) Python frame of the allocation."""
    events = snapshot["device_traces"][0] if snapshot["device_traces"] else []
    live: dict[int, tuple[int, str]] = {}
    cur, peak, at_peak = start_bytes, start_bytes, {}
    for e in events:
        if e["action"] == "alloc":
            frames = e.get("frames") or []
            where = next((f"{Path(f['filename']).name}:{f['line']} {f['name']}" for f in frames
                          if "fasttrain" in f["filename"]), None)
            if where is None:
                where = f"{Path(frames[0]['filename']).name}:{frames[0]['line']}" if frames else "(no python frame)"
            live[e["addr"]] = (e["size"], where)
            cur += e["size"]
            if cur > peak:
                peak, at_peak = cur, dict(live)
        elif e["action"] == "free_completed" and e["addr"] in live:
            cur -= live.pop(e["addr"])[0]
    groups: dict[tuple[int, str], int] = {}
    for size, where in at_peak.values():
        groups[(size, where)] = groups.get((size, where), 0) + 1
    rows = sorted(groups.items(), key=lambda kv: -kv[0][0] * kv[1])[:top]
    return {"trace_peak_mib": peak / MiB, "allocated_before_mib": start_bytes / MiB,
            "alive_at_peak": [{"mib": size / MiB, "count": n, "where": where} for (size, where), n in rows]}


def row_for(name: str, setup, *, measured: int, params: int, losses: list[float], seconds: float, cuda: bool,
            debug: dict | None = None) -> dict:
    """One case's row: the measured peak beside the estimate.

    On CUDA the measurement is ``max_memory_allocated`` over all steps. On the CPU (for the tests)
    it is the live-tensor peak of the last step counted by ``fasttrain.memory.tracker`` plus the
    parameters, buffers and optimizer state, and the estimate leaves out the cuBLAS workspaces,
    the token ids (made outside the tracker) and CUDA's in-kernel buffers, and takes PyTorch's
    CPU dropout masks as 4 bytes. (The training itself is the lab's: ``fasttrain.lab.experiments.memory_check``.)
    """
    if cuda:
        est = estimate(setup)
    else:
        est = estimate(setup.with_(workspace_mib=0.0), mask_bytes=4, kernel_temps=False)
        est.total -= 16 * setup.seq * setup.micro_batch
    err = 100.0 * (est.total - measured) / measured
    if not all(x == x for x in losses):
        raise FasttrainError(f"case {name}: the loss became NaN")
    row = {
        "case": name, "preset": next((c[1] for c in CASES if c[0] == name), ""), "precision": setup.precision,
        "attention": setup.attention, "recompute": setup.recompute, "optimizer": setup.optimizer,
        "micro_batch": setup.micro_batch, "seq": setup.seq, "params": params,
        "measured_mib": round(measured / MiB, 1), "estimate_mib": round(est.total / MiB, 1),
        "error_pct": round(err, 2), "within_10pct": abs(err) <= 10.0,
        "estimate_peak_at": est.extra["peak_moment"], "seconds": round(seconds, 2), "error": "",
    }
    if params != est.params:
        row["error"] = f"parameter count differs: model {params}, estimate {est.params:.0f}"
    row["_debug"] = debug or {}
    row["_losses"] = losses
    return row


def failed_row(name: str, exc: BaseException) -> dict:
    """The row of a case that raised (a failed case is reported, not hidden)."""
    setup = case_setup(name)
    row = {k: "" for k in FIELDS}
    row.update(case=name, preset=next(c[1] for c in CASES if c[0] == name), precision=setup.precision,
               attention=setup.attention, recompute=setup.recompute, optimizer=setup.optimizer,
               micro_batch=setup.micro_batch, seq=setup.seq, within_10pct=False,
               error=f"{type(exc).__name__}: {str(exc)[:160]}")
    return row


def write(rows: list[dict], env: dict, out: str) -> tuple[Path, Path]:
    """The CSV at ``out`` and a Markdown table beside it."""
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    rescored = any("error_at_run_pct" in r for r in rows)
    fields = FIELDS + (["error_at_run_pct"] if rescored else [])
    from fasttrain.files import atomic_path, atomic_write_text

    with atomic_path(path) as tmp, open(tmp, "w", newline="") as fh:  # whole or not at all
        writer = csv.DictWriter(fh, fieldnames=fields)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: row.get(k, "") for k in fields})
    ok = sum(1 for r in rows if r.get("within_10pct") is True)
    lines = [
        "# Training memory: `precise` estimate vs. measured peak",
        "",
        f"GPU: {env['gpu']}; torch {env['torch']} (CUDA {env['cuda']}); {env['steps']} AdamW steps per case; "
        f"measured = `torch.cuda.max_memory_allocated()` over all steps, including what stays allocated "
        f"between cases ({env['resident_after_warmup_mib']} MiB after a warm-up: cuBLAS workspaces).",
        "",
        (f"Measured on the device by `python -m fasttrain memory validate`; estimates by `python -m fasttrain "
         f"memory validate --rescore {env['rescored_from']} --out {out}`. " if env.get("rescored") else
         f"Produced by `python -m fasttrain memory validate --out {out}`. ")
        + f"{ok} of {len(rows)} cases within 10%.",
        "",
        "| case | precision | attention | recompute | b x s | params | measured MiB | estimate MiB | error | peak at (estimate) |"
        + (" error at the run |" if rescored else ""),
        "| --- | --- | --- | --- | --- | ---: | ---: | ---: | ---: | --- |" + (" ---: |" if rescored else ""),
    ]
    for r in rows:
        err = f"{r['error_pct']:+.1f}%" if isinstance(r.get("error_pct"), float) else "-"
        mark = "" if r.get("within_10pct") is True else " **miss**"
        lines.append(f"| {r['case']} | {r['precision']} | {r['attention']} | {r['recompute']} | "
                     f"{r['micro_batch']} x {r['seq']} | {r.get('params', '')} | {r.get('measured_mib', '')} | "
                     f"{r.get('estimate_mib', '')} | {err}{mark} | {r.get('estimate_peak_at', '')} |"
                     + (f" {r['error_at_run_pct']:+.1f}% |" if isinstance(r.get("error_at_run_pct"), float)
                        else (" - |" if rescored else "")))
        if r.get("error"):
            lines.append(f"| | | | | | | | | | {r['error']} |")
    if env.get("rescored"):
        lines += ["", f"Measurements from the device run above; estimates recomputed on {env['rescored']} with "
                      "`python -m fasttrain memory validate --rescore` (the estimate is a function of the setup "
                      "alone; the measured column is untouched)."]
    md = path.with_suffix(".md")
    atomic_write_text(md, "\n".join(lines) + "\n")
    atomic_write_text(path.with_suffix(".json"), json.dumps({"env": env, "rows": rows}, indent=1))
    return path, md


def rescore(json_path: str) -> tuple[list[dict], dict]:
    """Recompute the estimate columns of a device run (``validation.json``) with the current
    model; the measured peaks are kept as they were measured."""
    import datetime

    data = json.loads(Path(json_path).read_text())
    rows = []
    for row in data["rows"]:
        row = dict(row)
        row["error_at_run_pct"] = row.get("error_pct", "")
        if isinstance(row.get("measured_mib"), (int, float)):
            est = estimate(case_setup(row["case"]))
            measured = row["measured_mib"] * MiB
            err = 100.0 * (est.total - measured) / measured
            row.update(estimate_mib=round(est.total / MiB, 1), error_pct=round(err, 2), within_10pct=abs(err) <= 10.0,
                       estimate_peak_at=est.extra["peak_moment"])
        rows.append(row)
    env = dict(data["env"], rescored=datetime.date.today().isoformat(), rescored_from=str(json_path))
    return rows, env
