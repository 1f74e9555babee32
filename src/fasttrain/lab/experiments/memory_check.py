"""The memory estimator's validation, trained by the lab's trainer: ``fasttrain memory validate``.

Each case of :data:`fasttrain.memory.validate.CASES` (a memory ``Setup``) becomes the lab's GPT and a
:class:`~fasttrain.lab.config.LabConfig` (AdamW foreach or fused, constant learning rate 1e-4, no
clipping, fp32 or bf16 autocast) and trains ``steps`` steps through :meth:`Trainer.train` on one
fixed batch of random tokens (a generator seeded 0). On CUDA the measured peak is
``max_memory_allocated`` over all steps; on the CPU, the last step runs inside the live-tensor
counter of :mod:`fasttrain.memory.tracker` (parameters, buffers and optimizer state added).
``memory/validate.py`` turns the measurement into a row beside the estimate and writes the results.
"""

from __future__ import annotations

import gc
import itertools
import platform
import time
from contextlib import contextmanager
from pathlib import Path

import click

from fasttrain.errors import FasttrainError


def case_config(setup, device: str):
    """The LabConfig that trains ``setup`` as the estimator counts it."""
    from fasttrain.lab.config import LabConfig

    return LabConfig(name="memory-check", device=device, per_device_train_batch_size=setup.micro_batch,
                     context=setup.seq, layers=setup.layers, heads=setup.heads, width=setup.hidden,
                     optim="adamw_torch_fused" if setup.optimizer == "fused" else "adamw_torch",
                     attn_implementation="sdpa" if setup.attention == "flash" else "eager",   # as build(setup) makes it
                     bf16=setup.precision == "amp", learning_rate=1e-4, min_lr=1e-4, warmup_steps=0,
                     weight_decay=0.0, max_grad_norm=0.0, eval_interval=0, log_interval=1, timing_warmup_steps=0)


def run_case(name: str, steps: int = 3, debug: bool = False, device: str = "cuda", setup=None) -> dict:
    """Train one case through the trainer; return its row (the measured and estimated peaks)."""
    import torch

    from fasttrain.lab.build import gpt_model
    from fasttrain.lab.model import build
    from fasttrain.lab.trainer import Metrics, Trainer
    from fasttrain.memory import validate as V
    from fasttrain.memory.tracker import make_tracker

    setup = setup or V.case_setup(name)
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    if cuda:
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    cfg = case_config(setup, device)
    trainer = Trainer(cfg, gpt_model(build(setup, dev)), data=None, device=dev)
    if setup.optimizer == "foreach":
        # the estimator counts the for-each AdamW (PyTorch's default on CUDA); on the CPU the default
        # is the per-tensor loop, whose temporaries are smaller: ask for for-each there too
        for group in trainer.optimizer.param_groups:
            group["foreach"] = True
    gen = torch.Generator(dev).manual_seed(0)
    idx = torch.randint(0, setup.vocab, (setup.micro_batch, setup.seq), device=dev, generator=gen)
    tgt = torch.randint(0, setup.vocab, (setup.micro_batch, setup.seq), device=dev, generator=gen)
    batches = itertools.repeat([(idx, tgt)])     # one micro-batch a step
    metrics = Metrics(cfg.with_(max_steps=steps), dev)
    info: dict = {}
    tracker = None

    @contextmanager
    def around_last_step(step):
        nonlocal info, tracker
        if step != steps or not (debug or not cuda):
            yield
            return
        if cuda:                    # the allocator's history during the last step
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            torch.cuda.memory._record_memory_history(max_entries=500_000, stacks="python")
            yield
            torch.cuda.synchronize()
            snap = torch.cuda.memory._snapshot()
            torch.cuda.memory._record_memory_history(enabled=None)
            info = V.trace_peak(snap, before)
            return
        existing = [*trainer.model.parameters(), *trainer.model.buffers()]
        for state in trainer.optimizer.state.values():
            existing += [v for v in state.values() if isinstance(v, torch.Tensor)]
        unique = {t.untyped_storage().data_ptr(): t for t in existing}.values()
        tracker = make_tracker(existing)
        tracker.baseline = sum(t.untyped_storage().nbytes() for t in unique)
        with tracker:
            yield

    trainer.train(steps, batches=batches, metrics=metrics, evaluate=False, step_context=around_last_step)
    if cuda:
        torch.cuda.synchronize()
        measured = torch.cuda.max_memory_allocated()
    else:
        measured = tracker.baseline + tracker.peak
    seconds = time.perf_counter() - start
    params = sum(p.numel() for p in trainer.model.parameters())
    losses = [p["loss"] for p in metrics.loss_curve]
    del trainer, idx, tgt, batches
    gc.collect()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    return V.row_for(name, setup, measured=measured, params=params, losses=losses, seconds=seconds, cuda=cuda,
                     debug=info)


def run(cases=None, steps: int = 3, debug_dir: str | None = None, log=print) -> tuple[list[dict], dict]:
    """Run the cases (all by default) on the GPU; return the rows and the environment."""
    import json

    import torch

    from fasttrain.memory import validate as V

    if not torch.cuda.is_available():
        raise FasttrainError("memory validation needs a CUDA GPU (run it on the device machine)")
    names = [c[0] for c in V.CASES] if not cases else list(cases)
    for name in names:
        V.case_setup(name)
    device = torch.device("cuda")
    torch.cuda.init()
    resident = V.warm_up(device)
    env = {
        "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "cuda": torch.version.cuda,
        "python": platform.python_version(), "steps": steps,
        "resident_after_warmup_mib": round(resident / V.MiB, 2),
    }
    log(f"{env['gpu']} torch {env['torch']}: {resident / V.MiB:.1f} MiB stay allocated after warm-up (cuBLAS workspaces)")
    rows = []
    debug_out = {}
    for name in names:
        try:
            row = run_case(name, steps=steps, debug=debug_dir is not None)
        except Exception as exc:  # noqa: BLE001 - a failed case is reported, not hidden
            row = V.failed_row(name, exc)
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


@click.command("validate")
@click.option("--out", default="results/memory/validation.csv", show_default=True, type=click.Path(dir_okay=False))
@click.option("--cases", help="Comma-separated case names (default: all).")
@click.option("--quick", is_flag=True, help="Three cases only.")
@click.option("--steps", type=click.IntRange(2, 20), default=3, show_default=True)
@click.option("--debug", "debug_dir", type=click.Path(file_okay=False), help="Write the allocator analysis here.")
@click.option("--rescore", type=click.Path(dir_okay=False, exists=True),
              help="No GPU: recompute the estimates of a device run's .json with the current model.")
def validate_command(out, cases, quick, steps, debug_dir, rescore) -> None:
    """Train small GPTs on the GPU; compare max_memory_allocated with the precise estimate."""
    from fasttrain.memory import validate as V

    if rescore:
        rows, env = V.rescore(rescore)
        csv_path, md_path = V.write(rows, env, out)
        click.echo(f"wrote {csv_path} and {md_path}")
        return
    names = [c.strip() for c in cases.split(",")] if cases else (list(V.QUICK) if quick else None)
    rows, env = run(names, steps=steps, debug_dir=debug_dir, log=lambda m: click.echo(m))
    csv_path, md_path = V.write(rows, env, out)
    click.echo(f"wrote {csv_path} and {md_path}")


__all__ = ["run_case", "run", "case_config", "validate_command"]
