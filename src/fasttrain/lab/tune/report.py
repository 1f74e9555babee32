"""What ``fasttrain tune`` answers: the ranked table, the pick as a ``fasttrain lab`` command line and as
Hugging Face ``TrainingArguments``, and the results folder (``tune.json``, ``tune.csv`` in long format,
``tune.png``: throughput against memory with the frontier marked)."""

from __future__ import annotations

import csv
import io
import json
import os
from dataclasses import fields
from pathlib import Path

from fasttrain.lab.config import LabConfig, training_arguments_of

MIB = 2 ** 20
# fields that are not the training's (where to write, the preset's name, a search of its own)
ANSWER_SKIPS = {"save", "auto_find_batch_size", "name"}
# the answer's shape, written out even where it equals the preset's (a reader should not need the defaults)
ANSWER_ALWAYS = ("per_device_train_batch_size", "gradient_accumulation_steps")


def _mib(value) -> float | None:
    return None if value is None else value / MIB


def entry_row(entry, result, rank: int | None) -> dict:
    """One row of the ranked table (and of ``tune.json``'s ``ranked``)."""
    probe = entry.last
    base_loss = None
    loss = None
    step = result.loss_step
    if step and probe is not None and len(entry.probes[0].losses) >= step:
        loss = entry.probes[0].losses[step - 1]
        if result.baseline is not None and result.baseline.ok:
            base_loss = result.baseline.probes[0].losses[step - 1]
    status = ("ok" if entry.ok else "out of memory" if probe is not None and probe.oom
              else f"failed: {probe.error}" if probe is not None else entry.skipped or "not measured")
    return {
        "rank": rank,
        "label": entry.candidate.label.strip(),
        "settings": dict(entry.candidate.settings),
        "per_device_train_batch_size": entry.candidate.micro_batch,
        "gradient_accumulation_steps": entry.candidate.accumulation,
        "stage": entry.stage,
        "rungs": len(entry.probes),
        "steps_measured": entry.steps_measured,
        # the probe it is ranked on (the longest it reached) and the time all its probes took
        "ranked_on_steps": probe.steps if probe is not None else None,
        "seconds_measured": sum(p.wall_s for p in entry.probes) if entry.probes else None,
        "pick": entry is result.pick,
        "note": "",
        "tokens_per_s": probe.tokens_per_s if entry.ok else None,
        "peak_mib": _mib(probe.peak_bytes) if probe is not None else None,
        "reserved_mib": _mib(probe.reserved_bytes) if probe is not None else None,
        "predicted_mib": _mib(entry.predicted_bytes),
        "compile_s": max((p.compile_s for p in entry.probes), default=None),
        "warmup_s": max((p.warmup_s for p in entry.probes), default=None),
        "loss": loss,
        "loss_vs_baseline": None if loss is None or base_loss is None else loss - base_loss,
        "cached": bool(entry.probes) and all(p.cached for p in entry.probes),
        "status": status,
        "baseline": entry is result.baseline,
        "overrides": {k: v for k, v in entry.candidate.overrides},
    }


RANKING = ("ranked as the pick was chosen: by the longest probe each configuration reached (more steps first), "
           "then its tokens/s on that probe; a row measured on a shorter probe ranks below, even where faster")


def ranked_rows(result) -> list[dict]:
    """The measured configurations in the search's order (the pick's measure: the longest probe reached,
    then tokens/s on it), each saying what it was ranked on; a row faster than the pick on a shorter
    probe says so in its ``note``."""
    rows = []
    rank = 0
    pick = result.pick.last if result.pick is not None and result.pick.ok else None
    for entry in result.entries:
        if not entry.probes and not entry.skipped:
            continue
        if entry.ok:
            rank += 1
        row = entry_row(entry, result, rank if entry.ok else None)
        if pick is not None and entry.ok and entry.last.steps < pick.steps and entry.last.tokens_per_s > pick.tokens_per_s:
            row["note"] = f"faster than the pick on a {entry.last.steps}-step probe, not measured at the pick's {pick.steps}"
        rows.append(row)
    return rows


def pick_config(result) -> LabConfig | None:
    if result.pick is None:
        return None
    return result.base.with_(**result.pick.candidate.overrides_dict())


def lab_command(cfg: LabConfig) -> str:
    """``fasttrain lab ...`` that trains ``cfg``: the settings :func:`fasttrain.lab.overrides.settings_of` gives
    (the lab's GPT: its preset and what differs from it; a transformers model: no preset -- its own defaults, not
    a preset's, stand under its flags -- and those defaults written out), the micro-batch and the accumulation
    always (a reader should not need the defaults)."""
    from fasttrain.lab.overrides import flags, settings_of

    preset, settings = settings_of(cfg)
    chosen = {f.name: settings[f.name] if f.name in settings else getattr(cfg, f.name) for f in fields(LabConfig)
              if f.name not in ANSWER_SKIPS and (f.name in settings or f.name in ANSWER_ALWAYS)}
    return " ".join(["fasttrain", "lab", *(["--preset", preset] if preset else []), *flags(chosen)])


# TrainingArguments keys named otherwise than the LabConfig field they come from
ARGUMENT_SOURCES = {"lr_scheduler_type": "min_lr", "lr_scheduler_kwargs": "min_lr",
                    "liger_kernel_config": "liger_kernels"}


def answer_arguments(result, cfg: LabConfig) -> tuple[dict, dict, list[str]]:
    """The pick's :func:`training_arguments` holding only what tune decided (the micro-batch, the
    accumulation and the settings of the pick's axes) and what the user gave (``result.fixed``): the
    preset's learning rate, schedule and steps are not tune's answer. Found on a CPU it still reads as
    a GPU's (``use_cpu`` is the runner's business, not the answer's)."""
    args, model_kwargs, notes = training_arguments(cfg)
    chosen = set(ANSWER_ALWAYS) | set(result.pick.candidate.overrides_dict()) | set(getattr(result, "fixed", ()))
    if "torch_compile" in chosen:
        chosen.add("torch_compile_mode")
    args = {k: v for k, v in args.items() if ARGUMENT_SOURCES.get(k, k) in chosen}
    model_kwargs = {k: v for k, v in model_kwargs.items() if k in chosen}
    family = getattr(result, "family", None)
    if cfg.use_liger_kernel and family:
        from fasttrain.lab.tune.space import liger_support

        if liger_support(family) is not None and liger_support(family, "fused_linear_cross_entropy") is None:
            # the Trainer's use_liger_kernel is liger's family patch, of which this family has none: it would
            # train with the logits made, silently
            args.pop("use_liger_kernel", None)
            args.pop("liger_kernel_config", None)
            notes = notes + [f"liger's fused linear cross-entropy on the {family} model's head is the lab's own "
                             f"forward (liger has no {family} patch, so the Trainer's use_liger_kernel would apply "
                             f"nothing): left out here"]
        elif cfg.torch_compile and cfg.torch_compile_scope == "model" and "use_liger_kernel" in args:
            # the Trainer compiles the model with liger's own forward inside, which dynamo cannot trace (measured on
            # an H200, Qwen2.5-0.5B, torch 2.11, liger-kernel 0.8.5: "RuntimeError when making fake tensor call")
            args.pop("use_liger_kernel", None)
            args.pop("liger_kernel_config", None)
            notes = notes + [f"liger's fused linear cross-entropy beside the whole compiled {family} model is the "
                             f"lab's own head, after the compiled graph; the Trainer's use_liger_kernel with "
                             f"torch_compile compiles liger's forward, which does not trace: left out here"]
    return args, model_kwargs, notes


def training_arguments(cfg: LabConfig, cpu: bool = False) -> tuple[dict, dict, list[str]]:
    """The Hugging Face equivalent of ``cfg``: (``TrainingArguments`` keyword arguments, keyword
    arguments of ``from_pretrained`` / ``from_config``, notes on what has no equivalent).
    ``cpu``: it was found on a CPU (``use_cpu=True``: the Trainer refuses bf16 there otherwise)."""
    args = training_arguments_of(cfg)        # each field declares its equivalent (lab/config.py)
    if cpu:
        args["use_cpu"] = True
    if cfg.torch_compile:
        args["torch_compile_mode"] = cfg.torch_compile_mode
    model_kwargs = {"attn_implementation": cfg.attn_implementation}
    notes = []
    if cfg.gradient_checkpointing == "selective":
        notes.append("selective checkpointing (the attention core only) has no TrainingArguments flag: "
                     "gradient_checkpointing=False here")
    if cfg.checkpoint_blocks:
        notes.append(f"checkpointing the first {cfg.checkpoint_blocks} blocks only has no TrainingArguments flag: "
                     f"gradient_checkpointing=True recomputes every block (slower; set layer.gradient_checkpointing"
                     f" = False on the later decoder layers of your model after enabling it)")
    if cfg.preload:
        notes.append("preload (the corpus on the device) has no TrainingArguments flag: the Trainer loads "
                     "batches through its DataLoader")
    for field_name in fields(LabConfig):
        if field_name.name in ("torch_compile_scope", "torch_compile_per_block", "compile_per_block") and \
                getattr(cfg, field_name.name) not in (None, False, "model", "whole"):
            notes.append("per-block compile has no TrainingArguments flag: torch_compile compiles the whole model")
    if cfg.lora_r:
        notes.append(f"LoRA: wrap the model with peft.LoraConfig(r={cfg.lora_r}, lora_alpha={cfg.lora_alpha}) "
                     "before the Trainer")
    if cfg.prompt_tuning_tokens:
        notes.append(f"prompt tuning: peft.PromptTuningConfig(num_virtual_tokens={cfg.prompt_tuning_tokens})")
    return args, model_kwargs, notes


def summary(result, model_id: str = "gpt") -> dict:
    """``tune.json``: the question, the device, the ranked table, the pick and how it was found."""
    rows = ranked_rows(result)
    cfg = pick_config(result)
    winner = None
    if cfg is not None:
        args, model_kwargs, notes = answer_arguments(result, cfg)
        pick_row = entry_row(result.pick, result, 1)
        winner = {**pick_row, "lab_command": lab_command(cfg), "training_arguments": args,
                  "model_kwargs": model_kwargs, "training_arguments_notes": notes}
        winner.update(_scaled_answer(cfg, result, model_id, winner))
    mem = result.memory
    return {
        "kind": "tune", "schema": 1, "model": model_id,
        "device": {"name": mem.name, "total_mib": mem.total_bytes / MIB, "context_mib": mem.context_bytes / MIB,
                   "reserve": mem.reserve, "cpu": mem.cpu},
        "seq": result.seq, "global_batch_tokens": result.global_batch_tokens,
        "budget_s": result.budget_s, "budget_hit": result.budget_hit, "tune_s": result.tune_s,
        "mode": result.mode, "space_size": result.space_size, "pruned_by_prediction": result.pruned,
        "probes_measured": result.probes_measured, "probes_cached": result.probes_cached,
        "loss_compared_at_step": result.loss_step,
        "dropped": result.dropped, "notes": result.notes, "ranking": RANKING,
        "base": result.base.to_dict(),
        "pick": winner,
        "ranked": rows,
        "method": "predicted peak: the memory estimator (precise) of each configuration, pruned when predicted x "
                  "(1 + reserve) + context exceeds the device; probes: short runs of the lab's trainer at a constant "
                  "learning rate, the first steps (compilation, warm-up) timed apart; successive halving, eta 2",
    }


def _scaled_answer(cfg, result, model_id: str, winner: dict) -> dict:
    """Over several processes: the pick as ``fasttrain lab --nproc-per-node N``, ``torchrun``, ``TrainingArguments``
    with ``fsdp``/``fsdp_config``, an accelerate config file, and what the Trainer cannot express; per GPU."""
    from fasttrain.lab.tune.scale import answer
    from fasttrain.lab.tune.space import ScaleConfig

    if not isinstance(cfg, ScaleConfig) or cfg.strategy == "none":
        return {}
    out = answer(cfg, model_id, getattr(result, "family", None), winner["lab_command"], winner["training_arguments"],
                 winner["training_arguments_notes"])
    n = cfg.nproc_per_node
    out["tokens_per_s_per_gpu"] = winner["tokens_per_s"] / n if winner.get("tokens_per_s") else None
    return out


def long_rows(result) -> list[dict]:
    """One row per (configuration, rung, metric): the long CSV."""
    out = []
    for i, entry in enumerate(e for e in result.entries if e.probes):
        for rung, probe in enumerate(entry.probes):
            metrics = {"tokens_per_s": probe.tokens_per_s, "peak_mib": _mib(probe.peak_bytes),
                       "reserved_mib": _mib(probe.reserved_bytes), "predicted_mib": _mib(entry.predicted_bytes),
                       "compile_s": probe.compile_s, "warmup_s": probe.warmup_s, "wall_s": probe.wall_s,
                       "final_loss": probe.losses[-1] if probe.losses else None, "oom": int(probe.oom)}
            for metric, value in metrics.items():
                out.append({"config": i, "label": entry.candidate.label.strip(), "stage": entry.stage, "rung": rung,
                            "steps": probe.steps, "metric": metric, "value": "" if value is None else value,
                            **{f"axis_{a}": c for a, c in entry.candidate.settings},
                            "per_device_train_batch_size": entry.candidate.micro_batch,
                            "gradient_accumulation_steps": entry.candidate.accumulation})
    return out


def frontier(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The (memory, throughput) points no other point beats on both: less memory and more throughput."""
    best = -1.0
    out = []
    for mem, speed in sorted(points, key=lambda p: (p[0], -p[1])):
        if speed > best:
            out.append((mem, speed))
            best = speed
    return out


def plot(result, path: str | os.PathLike) -> bool:
    """Throughput against peak memory (measured; predicted where nothing was measured, as on a CPU)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    from fasttrain.files import save_figure

    pts = []
    for e in result.entries:
        if not e.ok:
            continue
        mem = e.last.peak_bytes if e.last.peak_bytes else e.predicted_bytes
        if mem is not None:
            pts.append((mem / MIB, e.last.tokens_per_s, e))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    if pts:
        ax.scatter([p[0] for p in pts], [p[1] for p in pts], s=18, color="#888", label="measured configurations")
        front = frontier([(p[0], p[1]) for p in pts])
        ax.plot([p[0] for p in front], [p[1] for p in front], "-o", color="#c33", ms=4, label="frontier")
        if result.pick is not None:
            pm = result.pick.last.peak_bytes or result.pick.predicted_bytes
            if pm:
                ax.scatter([pm / MIB], [result.pick.last.tokens_per_s], marker="*", s=160, color="#236",
                           label="pick", zorder=5)
    device_mib = result.memory.total_bytes / MIB
    largest = max((p[0] for p in pts), default=device_mib)
    if device_mib <= 2 * largest:       # else the line would squash every point against the axis
        ax.axvline(device_mib, color="#999", ls="--", lw=1, label="device memory")
    measured = any(e.ok and e.last.peak_bytes for e in result.entries)
    ax.set_xlabel("peak memory, MiB (" + ("measured" if measured else "predicted") + ")")
    ax.set_ylabel("tokens / s")
    ax.set_title(f"fasttrain tune: seq {result.seq}, {result.global_batch_tokens:,} tokens per step "
                 f"({result.memory.name}, {device_mib:,.0f} MiB)", fontsize=9)
    ax.legend(fontsize=8)
    save_figure(fig, path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return True


def write_results(result, folder: str | os.PathLike, model_id: str = "gpt") -> Path:
    """``tune.json``, ``tune.csv``, ``training_arguments.json`` and ``tune.png`` in ``folder``."""
    from fasttrain.files import atomic_write_text

    folder = Path(folder)
    folder.mkdir(parents=False, exist_ok=True)
    data = summary(result, model_id)
    atomic_write_text(folder / "tune.json", json.dumps(data, indent=2, default=str))
    rows = long_rows(result)
    buf = io.StringIO()
    if rows:
        keys = list(dict.fromkeys(k for r in rows for k in r))
        writer = csv.DictWriter(buf, fieldnames=keys, lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
    atomic_write_text(folder / "tune.csv", buf.getvalue())
    if data["pick"] is not None:
        atomic_write_text(folder / "training_arguments.json", json.dumps(data["pick"]["training_arguments"], indent=2))
        if data["pick"].get("accelerate_config"):
            atomic_write_text(folder / "accelerate_config.yaml", data["pick"]["accelerate_config"])
    plot(result, folder / "tune.png")
    return folder


def _fmt(value, spec: str, dash: str = "-") -> str:
    return dash if value is None else format(value, spec)


def print_report(result, console, model_id: str = "gpt", limit: int = 20) -> None:
    """The ranked table, the pick's command line and TrainingArguments, and the notes."""
    from rich.table import Table

    for line in result.dropped:
        console.print(f"[dim]dropped: {line}[/dim]")
    rows = ranked_rows(result)
    table = Table(title=f"fasttrain tune · {model_id} · {result.memory.name} · seq {result.seq} · "
                        f"{result.global_batch_tokens:,} tokens per step · {result.mode}")
    table.caption = RANKING
    for col in ("#", "configuration", "ranked on", "measured", "tokens/s", "peak MiB", "predicted MiB", "compile s",
                "warm-up s", "loss", "vs baseline", "status"):
        table.add_column(col, justify="left" if col in ("configuration", "status") else "right")
    for r in rows[:limit]:
        marks = "".join(m for m, on in ((" (pick)", r["pick"]), (" (baseline)", r["baseline"])) if on)
        table.add_row(_fmt(r["rank"], "d"), r["label"] + marks,
                      _fmt(r["ranked_on_steps"], "d", "-") + (" steps" if r["ranked_on_steps"] else ""),
                      f"{r['steps_measured']} steps, {_fmt(r['seconds_measured'], '.1f')} s",
                      _fmt(r["tokens_per_s"], ",.0f"), _fmt(r["peak_mib"], ",.0f"),
                      _fmt(r["predicted_mib"], ",.0f"), _fmt(r["compile_s"], ".1f"), _fmt(r["warmup_s"], ".1f"),
                      _fmt(r["loss"], ".4f"), _fmt(r["loss_vs_baseline"], "+.4f"),
                      r["status"] + (" (cached)" if r["cached"] else "") + (f"; {r['note']}" if r["note"] else ""))
    console.print(table)
    console.print(f"{result.space_size} configurations, {result.pruned} pruned by prediction, "
                  f"{result.probes_measured} probes measured, {result.probes_cached} from the cache, "
                  f"{result.tune_s:.1f} s" + (" (budget reached: best so far)" if result.budget_hit else ""))
    cfg = pick_config(result)
    scaled = {}
    if cfg is not None:
        args, model_kwargs, notes = answer_arguments(result, cfg)
        scaled = _scaled_answer(cfg, result, model_id, {"lab_command": lab_command(cfg),
                                                        "training_arguments": args, "training_arguments_notes": notes,
                                                        "tokens_per_s": result.pick.last.tokens_per_s})
        args = scaled.get("training_arguments", args)
        console.print("pick: " + scaled.get("lab_command", lab_command(cfg)), soft_wrap=True)
        if scaled:
            console.print(f"per GPU: {scaled['tokens_per_s_per_gpu'] or 0:,.0f} tokens/s ({scaled['strategy']} over "
                          f"{scaled['nproc_per_node']} processes)")
            console.print("torchrun: " + scaled["torchrun_command"], soft_wrap=True)
        console.print("TrainingArguments: " + json.dumps(args), soft_wrap=True)
        if scaled:
            console.print("accelerate config (accelerate launch --config_file F):\n" + scaled["accelerate_config"],
                          soft_wrap=True, highlight=False)
            if scaled["trainer_cannot"]:
                console.print("note: " + scaled["trainer_cannot"], soft_wrap=True)
        console.print("model kwargs: " + json.dumps(model_kwargs), soft_wrap=True)
        for note in notes:
            console.print(f"note: {note}")
    for note in result.notes:
        console.print(f"[yellow]note: {note}[/yellow]")
