"""``fasttrain lab``: train the lab's transformer on Tiny Shakespeare with any set of techniques.

    fasttrain lab --preset tiny --max-steps 20 --bf16 --gradient-checkpointing --out run.json
    fasttrain lab pitfall --preset shakespeare-char        # a step timed without / with synchronization

Every option is a field of :class:`fasttrain.lab.config.LabConfig` (flag = field name with dashes,
as in Hugging Face ``TrainingArguments``); options not given keep the preset's value.
Subcommands live in their own modules, each exposing a click command named ``command``: add the
module's name to ``SUBCOMMANDS`` to register one.
"""

from __future__ import annotations

import dataclasses
import importlib

import click
from rich.console import Console
from rich.table import Table

from fasttrain.errors import FasttrainError
from fasttrain.files import check_output_path
from fasttrain.lab.parallel import launch as dist_launch
from fasttrain.lab.config import PRESET_NOTES, PRESETS, LabConfig, preset

SUBCOMMANDS: tuple[str, ...] = ("fasttrain.lab.experiments.sumdemo", "fasttrain.lab.experiments.speedrun", "fasttrain.lab.experiments.scaling",
                                 "fasttrain.lab.tokenizer", "fasttrain.lab.sample")

out = Console(width=160)
err = Console(stderr=True)

HELP = {
    "model": "gpt (the lab's own GPT, shaped by the flags below) or hf:PATH_OR_NAME (a transformers causal LM: "
             "a folder with config.json, weights loaded if present, else initialized from the config).",
    "style": "gpt2 (LayerNorm, learned positions, GELU, tied) or llama (RMSNorm, RoPE, SwiGLU, GQA).",
    "layers": "Transformer blocks.", "heads": "Attention heads.", "kv_heads": "Key/value heads (llama: GQA).",
    "width": "Hidden size.", "ffn": "Feed-forward width (default 4 w; llama 8/3 w).",
    "context": "Tokens per sequence.", "vocab_size": "Vocabulary (default: the corpus' 65 characters).",
    "pad_vocab_to_multiple_of": "Pad the vocabulary to a multiple of N (e.g. 64).",
    "dropout": "Dropout probability.", "bias": "Biases in linear layers and LayerNorm.",
    "per_device_train_batch_size": "Sequences per micro-batch.",
    "gradient_accumulation_steps": "Micro-batches per optimizer step.",
    "auto_find_batch_size": "Find the largest micro-batch that fits, by trying (GPU).",
    "max_steps": "Optimizer steps.", "learning_rate": "Peak learning rate.", "min_lr": "Learning rate at the end.",
    "warmup_steps": "Linear warm-up steps.", "weight_decay": "Decoupled weight decay (matrices only).",
    "adam_beta1": "AdamW beta1.", "adam_beta2": "AdamW beta2.", "adam_epsilon": "AdamW epsilon.",
    "max_grad_norm": "Gradient clipping norm (0: off).", "optim": "Optimizer.",
    "fp16": "Autocast to fp16 with a GradScaler.", "bf16": "Autocast to bf16.", "tf32": "TF32 matmuls.",
    "gradient_checkpointing": "Recompute activations: full (every block) or selective (attention core).",
    "torch_compile": "torch.compile the model.", "torch_compile_mode": "torch.compile mode.",
    "torch_compile_backend": "inductor, or cudagraphs (CUDA graphs of forward and backward, no code generation).",
    "cuda_graph_step": "Capture the whole eager step (with the optimizer) as one CUDA graph, no compiler (GPU).",
    "activation": "The MLP's activation: style (gpt2: gelu, llama: swiglu), gelu, relu, relu2 (relu^2), swiglu.",
    "qk_norm": "RMS-normalize queries and keys per head before attention.",
    "zero_init_proj": "Start attention's and the MLP's output projections at zero.",
    "unet_skips": "U-net skips: block i's output feeds block L-1-i through a learned scalar.",
    "logit_softcap": "Soft-cap the logits at C: C tanh(z / C) (0: off).",
    "attn_implementation": "eager (PyTorch ops) or sdpa (scaled_dot_product_attention, flash).",
    "use_liger_kernel": "liger-kernel's RMSNorm/LayerNorm, SwiGLU, RoPE, fused linear cross-entropy (GPU).",
    "liger_kernels": "Which of them --use-liger-kernel applies to a transformers model: all, or "
                     "fused_linear_cross_entropy alone (the logits never made; the layers left to torch.compile).",
    "preload": "Keep the corpus on the device and cut batches there.",
    "dataloader_num_workers": "DataLoader worker processes.", "dataloader_pin_memory": "Pin host batches.",
    "dataloader_prefetch_factor": "Batches each worker loads ahead.", "data_dir": "Data root (default: "
    "$FASTTRAIN_DATA_DIR or ~/.cache/fasttrain); holds tinyshakespeare/input.txt.",
    "train_file": "Your UTF-8 text to train on (instead of Tiny Shakespeare).",
    "val_file": "UTF-8 text to validate on (default: the last --val-fraction of --train-file).",
    "val_fraction": "Share of the tokens kept for validation (default 0.1 without --val-file/--val-bin).",
    "train_bin": "Token ids to train on: a raw .bin (nanoGPT's), of --bin-dtype.",
    "val_bin": "Token ids to validate on (default: the last --val-fraction of --train-bin).",
    "bin_dtype": "The ids' type in the .bin files: uint16 (nanoGPT's) or uint32.",
    "tokenizer": "char, hf:PATH (tokenizer.json or folder) or tiktoken:NAME (default: the model's own, else char).",
    "torch_empty_cache_steps": "torch.cuda.empty_cache() every N steps.",
    "eval_interval": "Validation every N steps (0: only at the end).",
    "eval_tokens": "Validation token budget (default: the whole split).",
    "eval_batch_size": "Sequences per validation batch.", "log_interval": "Loss-curve point every N steps.",
    "timing_warmup_steps": "First steps timed apart (compilation, warm-up).", "seed": "Seed.",
    "device": "auto, cpu, cuda or cuda:N.", "lora_r": "LoRA rank (0: off).", "lora_alpha": "LoRA alpha.",
    "lora_dropout": "LoRA dropout.", "lora_target_modules": "Comma-separated: qkv, proj, up, down, head.",
    "prompt_tuning_tokens": "Trainable soft-prompt tokens (base frozen).",
    "init_from": "Start from a checkpoint written with --save (fine-tuning).",
    "save": "Write the trained model to this folder (model.safetensors + config.json).",
}
HELP.update({
    "torch_compile_scope": "What torch.compile compiles: model (one graph) or blocks (each repeated block alone).",
    "save_steps": "Write a training-state checkpoint (weights, optimizer, schedule, data position, random states) "
                  "every N steps into --output-dir.",
    "save_total_limit": "Keep only the newest N checkpoints.", "output_dir": "Where --save-steps writes checkpoint-N/.",
    "resume": "Continue from a checkpoint (a checkpoint-N folder, or the newest in an --output-dir).",
})
SKIP = {"name"}
NONE = object()          # "none" given for an optional setting: None, not "keep the preset's value"


def _given(options: dict) -> dict:
    """The LabConfig fields given on the command line (``none`` -> None)."""
    fields = {f.name for f in dataclasses.fields(LabConfig)}
    return {k: (None if v is NONE else v) for k, v in options.items() if v is not None and k in fields}


def _option_for(kind):
    """The click option of one LabConfig field, typed by :mod:`fasttrain.lab.overrides`."""
    from fasttrain.lab.overrides import parse_value

    help_ = HELP.get(kind.name, "")
    if kind.name == "gradient_checkpointing":
        # --gradient-checkpointing alone means full
        return click.option(kind.flag, kind.name, type=click.Choice(kind.choices), is_flag=False, flag_value="full",
                            default=None, help=help_ + " [none|full|selective; alone: full]")
    if kind.type is bool:
        return click.option(f"{kind.flag}/--no-{kind.flag[2:]}", kind.name, default=None, help=help_)
    if kind.choices is not None:
        return click.option(kind.flag, kind.name, type=click.Choice(kind.choices), default=None, help=help_)
    if kind.type in (tuple, str) or kind.optional:
        # parsed by the one override parser (lists comma-separated; "none" for an optional field)
        def convert(ctx, param, value, name=kind.name):
            if value is None:
                return None
            parsed = parse_value(name, value)
            return NONE if parsed is None else parsed
        metavar = {int: "INTEGER", float: "FLOAT", tuple: "A,B,..."}.get(kind.type, "TEXT") \
            + ("|none" if kind.optional else "")
        return click.option(kind.flag, kind.name, type=str, default=None, callback=convert, metavar=metavar,
                            help=help_)
    return click.option(kind.flag, kind.name, type=kind.type, default=None, help=help_)


def config_options(fn):
    """One click option per LabConfig field, typed by its annotation; every default is None (= keep
    the preset's value)."""
    from fasttrain.lab.overrides import field_kinds

    for kind in reversed(list(field_kinds().values())):
        if kind.name in SKIP:
            continue
        fn = _option_for(kind)(fn)
    fn = click.option("--preset", "preset_name", default="shakespeare-char", show_default=True,
                      help=f"Start from a preset: {', '.join(PRESETS)}.")(fn)
    return fn


def config_from(preset_name: str, options: dict) -> LabConfig:
    return preset(preset_name, **_given(options))


def config_from_record(path, options: dict) -> LabConfig:
    """The configuration a run record ran, with the flags given beside ``--from-record`` on top."""
    from fasttrain.lab.config import validate
    from fasttrain.lab.record import config_of_record, load_record

    return validate(config_of_record(load_record(path)).with_(**_given(options)))


def _mib(value) -> str:
    return "-" if value is None else f"{value / 2**20:,.1f}"


def print_summary(record: dict) -> None:
    cfg = record["config"]
    mem, est = record["memory"], record["estimate"]
    title = (f"{cfg['name']} · {record['device']} · {record['precision']} · batch "
             f"{record['batch']['per_device_train_batch_size']}x{record['batch']['gradient_accumulation_steps']} · "
             f"{cfg['optim']} · {record['params']['trainable']:,}/{record['params']['total']:,} params trained")
    table = Table(title=title)
    for col in ("setup ms", "warm-up ms", "p50 step ms", "mean step ms", "tokens/s", "peak MiB", "reserved MiB",
                "estimate MiB", "est. error", "train loss", "val loss"):
        table.add_column(col, justify="right")
    s = record["step_ms"]
    err_pct = est.get("error_pct")
    table.add_row(f"{record['setup_ms']:.0f}", f"{sum(record['warmup_ms']):.0f}",
                  "-" if s["p50"] is None else f"{s['p50']:.2f}", "-" if s["mean"] is None else f"{s['mean']:.2f}",
                  "-" if record["tokens_per_s"] is None else f"{record['tokens_per_s']:,.0f}",
                  _mib(mem["peak_allocated_bytes"]), _mib(mem["peak_reserved_bytes"]), _mib(est.get("precise_bytes")),
                  "-" if err_pct is None else f"{err_pct:+.1f}%",
                  "-" if record["final"]["train_loss"] is None else f"{record['final']['train_loss']:.4f}",
                  f"{record['final']['val_loss']:.4f}")
    out.print(table)
    kinds = mem["by_kind"]
    out.print("memory by kind (MiB): " + ", ".join(f"{k} {_mib(v)}" for k, v in kinds.items()))
    note = warmup_only_note(record)
    if note:
        out.print(note, markup=False, highlight=False, soft_wrap=True)


@click.group("lab", invoke_without_command=True, context_settings={"help_option_names": ["-h", "--help"]})
@config_options
@dist_launch.parallel_options
@click.option("--out", "out_path", type=click.Path(dir_okay=False), help="Write the run record (JSON) here.")
@click.option("--from-record", "from_record", type=click.Path(dir_okay=False),
              help="Rerun the configuration of a run record (flags given beside it override it).")
@click.option("--list-presets", is_flag=True, help="List the presets and exit.")
@click.option("--quiet", is_flag=True, help="No progress or table.")
@click.pass_context
def command(ctx, preset_name, out_path, from_record, list_presets, quiet, **options) -> None:
    """Train the lab's transformer on Tiny Shakespeare and measure speed, memory and loss."""
    if ctx.invoked_subcommand is not None:
        return
    if list_presets:
        for name in PRESETS:
            out.print(f"{name:18s} {PRESET_NOTES.get(name, '')}")
        return
    from fasttrain.lab import noise, preflight

    noise.filter_known_noise()                  # before peft/torchao are imported
    parallel, launch = dist_launch.parallel_from_options(options)
    cfg = config_from_record(from_record, options) if from_record else config_from(preset_name, options)
    if out_path is not None:
        preflight.check_outputs(cfg, out_path)  # --out against --save first: the clearer of the two lines
        check_output_path(out_path, "--out")    # before training: a bad path must not cost the run
        out_path = str(preflight.expand(out_path, "--out"))
    if launch is not None:
        # this process only starts torchrun; every worker runs this command without the launcher's options
        dist_launch.check_before_launch(cfg, parallel, launch)     # GPUs against processes: the clearer line
    preflight.check_run(cfg, out_path)          # the same checks lab.train.run makes (Python API)
    if launch is not None:
        warning = dist_launch.cpu_oversubscription(launch.nproc_per_node, cfg.device)
        if warning:
            err.print(warning, markup=False, highlight=False, soft_wrap=True)
        dist_launch.launch(launch, dist_launch.worker_argv(ctx, skip=dist_launch.LAUNCH_OPTIONS))
        return
    main = dist_launch.env_rank() == 0          # several processes: rank 0 alone prints and writes
    quiet = quiet or not main
    with dist_launch.rank_prefixed_errors():
        _train(cfg, parallel, out_path, quiet, main)


def _train(cfg, parallel, out_path, quiet, main) -> None:
    from fasttrain.lab import noise
    from fasttrain.lab.checkpoint import write_record
    from fasttrain.lab.outputs import save_folder_state
    from fasttrain.lab.progress import RunProgress
    from fasttrain.lab.train import run

    replacing = cfg.save is not None and save_folder_state(cfg.save) == "checkpoint"
    log = None if quiet else (lambda line: err.print(line))
    if replacing and not quiet:
        err.print(f"--save {cfg.save}: holds a lab checkpoint; it is replaced whole when this run ends "
                  "(until then it stays as it is)", markup=False, highlight=False, soft_wrap=True)
    bar = None
    if not quiet:
        bar = RunProgress(f"lab {cfg.name}", cfg.max_steps, tokens_per_step=cfg.batch_tokens,
                          warmup_steps=cfg.timing_warmup_steps, device=_device_kind(cfg.device), console=err)
        bar.start()
    try:
        record = run(cfg, log=log, progress=bar, parallel=parallel)
    finally:
        if bar is not None:
            bar.stop()
    if out_path and main:
        write_record(record, out_path)
    if not quiet:
        print_summary(record)
        for line in dist_launch.summary_lines(record):
            out.print(line)
        if out_path:
            out.print(f"run record: {out_path}")
        if cfg.save:
            out.print(f"checkpoint: {cfg.save}" + (" (replaced the earlier one)" if replacing else ""), markup=False,
                      highlight=False, soft_wrap=True)
        dropped = noise.summary()
        if dropped:
            err.print(dropped, markup=False, highlight=False, soft_wrap=True)


def _device_kind(device: str) -> str:
    if device == "auto":
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    return str(device).split(":")[0]


def warmup_only_note(record: dict) -> str | None:
    """Why the step-time columns are empty: every step was a timing warm-up step."""
    if record["step_ms"].get("p50") is not None:
        return None
    warm, steps = record["config"].get("timing_warmup_steps"), record["config"].get("max_steps")
    return (f"step times empty: all {steps} steps were timing warm-up (--timing-warmup-steps {warm}: compilation "
            f"and allocator growth are timed apart, in 'warm-up ms'); run more than {warm} steps "
            f"(--max-steps {warm + 10}) or lower --timing-warmup-steps")


@command.command("pitfall")
@config_options
@click.option("--repeats", type=click.IntRange(1, 1000), default=5, show_default=True)
def pitfall(preset_name, repeats, **options) -> None:
    """Time one training step without and with device synchronization, side by side."""
    from fasttrain.lab.experiments.pitfall import timing_pitfall

    cfg = config_from(preset_name, options)
    res = timing_pitfall(cfg, repeats=repeats)
    table = Table(title=f"one training step of {cfg.name} on {res['device']}: {repeats} repeats")
    table.add_column("timed", justify="left")
    for col in ("p20 ms", "p50 ms", "p80 ms"):
        table.add_column(col, justify="right")
    for label, key in (("perf_counter around the step", "without_sync_ms"),
                       ("synchronize, step, synchronize", "with_sync_ms")):
        r = res[key]
        table.add_row(label, f"{r['p20']:.2f}", f"{r['p50']:.2f}", f"{r['p80']:.2f}")
    out.print(table)
    out.print("Without synchronization the clock stops when the CPU has queued the GPU's kernels, "
              "not when they have run.")


@command.command("eval")
@click.argument("checkpoint", type=click.Path())
@click.option("--data-dir", help="Data root holding tinyshakespeare/input.txt.")
@click.option("--eval-tokens", type=int, help="Token budget (default: as the checkpoint's own evaluation; "
              "without a record, the whole validation split).")
@click.option("--device", default="auto", show_default=True)
@click.option("--bf16/--no-bf16", default=None, help="bf16 autocast (default: as recorded in the checkpoint).")
@click.option("--tf32/--no-tf32", default=None, help="TF32 matmuls (default: as recorded in the checkpoint).")
@click.option("--batch", type=int, help="Validation windows per forward (default: as recorded).")
def eval_cmd(checkpoint, data_dir, eval_tokens, device, bf16, tf32, batch) -> None:
    """The validation loss of a checkpoint written with --save, recomputed from it alone."""
    from fasttrain.lab import noise
    from fasttrain.lab.evaluate import evaluate_checkpoint

    noise.filter_known_noise()                  # before peft/torchao are imported

    if batch is not None and batch < 1:
        raise FasttrainError(f"--batch must be a positive integer, got {batch}")
    res = evaluate_checkpoint(checkpoint, data_dir, eval_tokens=eval_tokens, device=device, bf16=bf16, tf32=tf32,
                              batch=batch)
    recorded = res["recorded_val_loss"]
    s = res["settings"]
    precision = "bf16 autocast" if s["bf16"] else "fp16 autocast" if s["fp16"] else "tf32" if s["tf32"] else "fp32"
    out.print(f"val loss {res['val_loss']:.6f} over {res['tokens']:,} predicted tokens ({res['ms']:.0f} ms, {res['device']}, "
              f"{precision}, batch {s['eval_batch_size']})"
              + ("" if recorded is None else f"; recorded at save: {recorded:.6f}"
                 + (" (identical)" if res["val_loss"] == recorded else f" (differs by {res['val_loss'] - recorded:+.2e})")))
    if res.get("recorded_device") and res["recorded_device"] != res["device"]:
        out.print(f"note: recorded on {res['recorded_device']}; another device sums in another order, so expect "
                  "differences in the last digits")


@command.command("plot")
@click.argument("record", type=click.Path(dir_okay=False))
@click.option("--out", "out_path", required=True, type=click.Path(dir_okay=False), help="The PNG to write.")
def plot_cmd(record, out_path) -> None:
    """Plot a run record's loss curve (training and validation loss against the step)."""
    from fasttrain.lab.record import load_record, plot_loss_curve

    check_output_path(out_path, "--out")
    path = plot_loss_curve(load_record(record), out_path)
    out.print(f"loss curve: {path}")


def _load_subcommands() -> None:
    for module in SUBCOMMANDS:
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name == module:      # not written yet: run without it
                continue
            raise
        if hasattr(mod, "command"):
            command.add_command(mod.command)


_load_subcommands()


def _attach_memory_validation() -> None:
    from fasttrain.lab.experiments.memory_check import attach

    attach()


_attach_memory_validation()

__all__ = ["command", "config_options", "config_from", "FasttrainError"]
