"""Check the ``precise`` estimate against a GPU: train the reference GPT for a few steps and
compare ``torch.cuda.max_memory_allocated`` with the estimate, case by case.

Every case trains ``fasttrain.lab.model`` with plain PyTorch and AdamW (foreach, PyTorch's
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
import platform
import time
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


def _trace_peak(snapshot, start_bytes: int, top: int = 40) -> dict:
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


def run_case(name: str, steps: int = 3, debug: bool = False, device: str = "cuda", setup=None) -> dict:
    """Train one case; return the measured and estimated peaks.

    On CUDA the measurement is ``max_memory_allocated`` over all steps. On the CPU (for the tests)
    it is the live-tensor peak of the last step counted by ``fasttrain.memory.tracker`` plus the
    parameters, buffers and optimizer state, and the estimate leaves out the cuBLAS workspaces,
    the token ids (made outside the tracker) and CUDA's in-kernel buffers, and takes PyTorch's
    CPU dropout masks as 4 bytes.
    """
    import torch

    from fasttrain.lab import model as gpt

    setup = setup or case_setup(name)
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    if cuda:
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    model = gpt.build(setup, dev)
    kw = {"fused": True} if setup.optimizer == "fused" else {"foreach": True}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, **kw)
    gen = torch.Generator(dev).manual_seed(0)
    idx = torch.randint(0, setup.vocab, (setup.micro_batch, setup.seq), device=dev, generator=gen)
    tgt = torch.randint(0, setup.vocab, (setup.micro_batch, setup.seq), device=dev, generator=gen)
    amp_dtype = torch.bfloat16 if setup.precision == "amp" else None
    amp = (lambda: torch.autocast(dev.type, dtype=amp_dtype)) if amp_dtype else nullcontext
    info: dict = {}
    losses = []
    n_plain = steps if cuda else steps - 1
    for step in range(n_plain):
        last = step == steps - 1
        if debug and last:
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            torch.cuda.memory._record_memory_history(max_entries=500_000, stacks="python")
        with amp():
            loss = model(idx, tgt)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        del loss
        if debug and last:
            torch.cuda.synchronize()
            snap = torch.cuda.memory._snapshot()
            torch.cuda.memory._record_memory_history(enabled=None)
            info = _trace_peak(snap, before)
            del snap
    from fasttrain.memory.tracker import tracked_peak_step

    if cuda:
        torch.cuda.synchronize()
        measured = torch.cuda.max_memory_allocated()
    else:
        measured, _, _ = tracked_peak_step(model, opt, idx, tgt, amp_dtype)
    seconds = time.perf_counter() - start
    if cuda and debug:
        try:
            total, _, tracker = tracked_peak_step(model, opt, idx, tgt, amp_dtype)
            info["dispatch_tracked_mib"] = total / MiB
            info["dispatch_peak_op"] = tracker.peak_op
        except Exception as exc:  # diagnostic only
            info["dispatch_tracked_error"] = repr(exc)[:200]
    params = sum(p.numel() for p in model.parameters())
    del model, opt, idx, tgt
    gc.collect()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
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
    row["_debug"] = info
    row["_losses"] = losses
    return row


def run(cases=None, steps: int = 3, debug_dir: str | None = None, log=print) -> tuple[list[dict], dict]:
    """Run the cases (all by default) on the GPU; return the rows and the environment."""
    import torch

    if not torch.cuda.is_available():
        raise FasttrainError("memory validation needs a CUDA GPU (run it on the device machine)")
    names = [c[0] for c in CASES] if not cases else list(cases)
    for name in names:
        case_setup(name)
    device = torch.device("cuda")
    torch.cuda.init()
    resident = warm_up(device)
    env = {
        "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "cuda": torch.version.cuda,
        "python": platform.python_version(), "steps": steps,
        "resident_after_warmup_mib": round(resident / MiB, 2),
    }
    log(f"{env['gpu']} torch {env['torch']}: {resident / MiB:.1f} MiB stay allocated after warm-up (cuBLAS workspaces)")
    rows = []
    debug_out = {}
    for name in names:
        try:
            row = run_case(name, steps=steps, debug=debug_dir is not None)
        except Exception as exc:  # a failed case is reported, not hidden
            setup = case_setup(name)
            row = {k: "" for k in FIELDS}
            row.update(case=name, preset=next(c[1] for c in CASES if c[0] == name), precision=setup.precision,
                       attention=setup.attention, recompute=setup.recompute, optimizer=setup.optimizer,
                       micro_batch=setup.micro_batch, seq=setup.seq, within_10pct=False,
                       error=f"{type(exc).__name__}: {str(exc)[:160]}")
            gc.collect()
            torch.cuda.empty_cache()
        debug_out[name] = {"debug": row.pop("_debug", {}), "losses": row.pop("_losses", [])}
        rows.append(row)
        log(f"{name:32s} measured {row['measured_mib']!s:>9} MiB  estimate {row['estimate_mib']!s:>9} MiB  "
            f"error {row['error_pct']!s:>7}%  {row['error']}")
    if debug_dir:
        Path(debug_dir).mkdir(parents=True, exist_ok=True)
        (Path(debug_dir) / "validation_debug.json").write_text(json.dumps({"env": env, "cases": debug_out}, indent=1))
    return rows, env


def write(rows: list[dict], env: dict, out: str) -> tuple[Path, Path]:
    """The CSV at ``out`` and a Markdown table beside it."""
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    rescored = any("error_at_run_pct" in r for r in rows)
    fields = FIELDS + (["error_at_run_pct"] if rescored else [])
    with open(path, "w", newline="") as fh:
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
    md.write_text("\n".join(lines) + "\n")
    path.with_suffix(".json").write_text(json.dumps({"env": env, "rows": rows}, indent=1))
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
