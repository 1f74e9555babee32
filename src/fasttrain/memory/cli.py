"""``fasttrain memory``: the training-memory estimator, its page, the cost table and the GPU check.

    fasttrain memory [--preset llama3-8b] [--heads A] ... [--mode playbook|precise] [--json]
    fasttrain memory --html out.html
    fasttrain memory --hf-config X --strategy fsdp --nproc-per-node 8 --bf16 [--gpu-gb 80]
    fasttrain memory cost [--preset llama3-405b] [--mfu 40 | --tflops 400] [--price 2]
    fasttrain memory validate --out results/memory/validation.csv
"""

from __future__ import annotations

import json

import click
from rich.console import Console
from rich.table import Table

from fasttrain.errors import FasttrainError

out = Console(width=140)

# the lab's names (TrainingArguments' where it has one): --micro-batch and --seq are their other names
_SIZE_FLAGS = [("--heads", "heads", "a: attention heads"), ("--kv-heads", "kv_heads", "g: key/value heads (precise)"),
               ("--per-device-train-batch-size", "micro_batch", "b: sequences per GPU (also: --micro-batch)"),
               ("--hidden", "hidden", "h: hidden size"),
               ("--ffn", "ffn", "h_ff: feed-forward size"), ("--layers", "layers", "L: layers"),
               ("--context", "seq", "s: sequence length, tokens (also: --seq)"), ("--vocab", "vocab", "v: vocabulary"),
               ("--tp", "tp", "t: tensor parallelism"), ("--dp", "dp", "d: data parallelism"),
               ("--opt-bytes", "opt_bytes", "k: optimizer bytes per parameter (Adam 8)")]


# other names -> (the option's name, its flag)
ALIASES = {"--micro-batch": ("micro_batch", "--per-device-train-batch-size"), "--seq": ("seq", "--context")}


def _options(fn):
    for flag, (name, _) in ALIASES.items():
        fn = click.option(flag, "alias__" + name, type=int, hidden=True)(fn)
    for flag, name, help_ in reversed(_SIZE_FLAGS):
        fn = click.option(flag, name, type=int, help=help_)(fn)
    decorators = [
        click.option("--preset", help="Start from a preset (default llama3-8b); see --list-presets."),
        click.option("--hf-config", type=click.Path(), help="precise: a Hugging Face config.json (or its folder) of a "
                     "llama, mistral, qwen2, gemma, phi3 or gpt2 model instead of a preset; give the training shape "
                     "with --per-device-train-batch-size, --context, --precision (default: bf16 autocast), --attention (default: "
                     "sdpa), --recompute, --optim."),
        click.option("--keep-logits", is_flag=True, help="precise: the trainer holds the model's output (logits) "
                     "through backward."),
        click.option("--compiled", type=click.Choice(["none", "model", "blocks"]), help="precise, --hf-config: "
                     "torch.compile of the whole model (the loss inside) or of each decoder layer (default none)."),
        click.option("--float8", type=click.Choice(["none", "tensorwise", "rowwise"]), help="precise, --hf-config: "
                     "torchao's float8 training of the layers' Linear layers (the lab's --float8; default none)."),
        click.option("--cuda-graphs", is_flag=True, help="precise, with --compiled: the compiled code captured as CUDA "
                     "graphs (--torch-compile-mode reduce-overhead, the cudagraphs backend), whose private memory pool "
                     "peaks apart from the rest."),
        click.option("--liger", is_flag=True, help="precise, --hf-config: liger-kernel's patches of the family "
                     "(RMSNorm, RoPE, SwiGLU/GeGLU, fused linear cross-entropy), as --use-liger-kernel applies them."),
        click.option("--list-presets", is_flag=True, help="List the presets and exit."),
        click.option("--mixed", is_flag=True, help="Mixed precision (bf16 + fp32 master weights)."),
        click.option("--precision", type=click.Choice(["fp32", "mixed", "amp"]),
                     help="fp32, mixed (widget) or amp (PyTorch autocast, precise only)."),
        click.option("--seq-parallel", is_flag=True, help="Sequence parallelism."),
        click.option("--recompute", type=click.Choice(["none", "selective", "full"])),
        click.option("--recompute-layers", type=int, help="precise, with --recompute full: only the first this many "
                     "layers recompute, the rest keep their activations (the lab's --checkpoint-blocks)."),
        click.option("--zero", type=click.IntRange(0, 3), help="ZeRO stage 0..3 over --dp."),
        click.option("--ffn-act", type=click.Choice(["relu", "gelu", "swiglu"])),
        click.option("--attention", type=click.Choice(["eager", "flash", "sdpa"]),
                     help="precise: attention kernel (sdpa = flash: no s^2 term)."),
        click.option("--norm", type=click.Choice(["rms", "layer"]), help="precise: RMSNorm or LayerNorm."),
        click.option("--pos", type=click.Choice(["rope", "learned"]), help="precise: position encoding."),
        click.option("--tied/--untied", default=None, help="precise: tied input/output embeddings."),
        click.option("--bias/--no-bias", default=None, help="precise: biases in the linear layers."),
        click.option("--dropout/--no-dropout", default=None, help="precise: dropout (masks kept for backward)."),
        click.option("--optimizer", type=click.Choice(["foreach", "fused"]), help="precise: AdamW implementation."),
        click.option("--optim", help="precise: optimizer state kind: adamw, adamw_8bit (torchao), adafactor, sgd, "
                     "sgd_momentum (also the lab's adamw_torch, adamw_torch_fused)."),
        click.option("--lora-r", "lora_rank", type=int, help="precise: LoRA rank r on a frozen base (peft); 0 = off."),
        click.option("--lora-targets", help="precise: comma-separated LoRA targets among qkv, proj, up, down, head "
                     "(default qkv,proj); with --hf-config the model's own module names (q_proj, v_proj, c_attn, ...; "
                     "default its query and value projections)."),
        click.option("--lora-dropout", type=float, help="precise: peft's lora_dropout (> 0 keeps a mask per target)."),
        click.option("--prompt-tokens", type=int, help="precise: P trainable soft-prompt tokens on a frozen base."),
        click.option("--grad-buffers", is_flag=True, help="precise: gradients persist between steps (DDP, Megatron)."),
        click.option("--workspace-mib", type=float, help="precise: cuBLAS workspaces in MiB (default 65, measured on Hopper)."),
        click.option("--mode", type=click.Choice(["playbook", "precise"]), default="precise", show_default=True),
        click.option("--json", "as_json", is_flag=True, help="Print the breakdown as JSON."),
        click.option("--html", type=click.Path(dir_okay=False), help="Write the interactive page here."),
        # the lab's own words for a run on N GPUs (fasttrain lab --strategy S under torchrun, --bf16)
        click.option("--strategy", type=click.Choice(STRATEGY_CHOICES), help="precise: the lab's --strategy over "
                     "--nproc-per-node GPUs (fsdp: ZeRO-3, fsdp-zero2: gradients and optimizer sharded); with "
                     "--nproc-per-node, every strategy and checkpointing choice is ranked by its per-GPU peak."),
        click.option("--nproc-per-node", type=click.IntRange(1, 1024), help="precise: GPUs the run uses (torchrun's "
                     "--nproc-per-node); ranks what fits on them."),
        click.option("--bf16", is_flag=True, help="precise: the lab's --bf16 (autocast over fp32 weights; under fsdp, "
                     "its bf16 mixed-precision policy)."),
        click.option("--fsdp-reduce-dtype", type=click.Choice(["fp32", "bf16"]), help="precise, --strategy fsdp or "
                     "fsdp-zero2: the lab's --fsdp-reduce-dtype, the dtype of FSDP's reduce-scatter buffers (default "
                     "fp32)."),
        click.option("--gpu-gb", type=click.FloatRange(min=0, min_open=True), default=80.0, show_default=True,
                     help="Memory of one GPU in GB (1e9 bytes) for the ranking of what fits."),
    ]
    for deco in reversed(decorators):
        fn = deco(fn)
    return fn


STRATEGY_CHOICES = ("none", "ddp", "zero1", "fsdp", "fsdp-zero2", "tp")


def asked_run(opts: dict) -> tuple[int, str]:
    """GPUs and strategy asked for: one GPU alone, or N under ddp unless --strategy says otherwise."""
    n = opts.get("nproc_per_node") or 1
    return n, opts.get("strategy") or ("none" if n == 1 else "ddp")


def lab_words(opts: dict) -> bool:
    """Whether the run is asked in the lab's words (--strategy, --nproc-per-node)."""
    return opts.get("strategy") is not None or opts.get("nproc_per_node") is not None


def read_aliases(opts: dict) -> list[str]:
    """Each other name given (--micro-batch, --seq) read as its option, in place; the lines saying so."""
    notes = []
    for flag, (name, canonical) in ALIASES.items():
        value = opts.pop("alias__" + name, None)
        if value is None:
            continue
        if opts.get(name) is not None and opts[name] != value:
            raise FasttrainError(f"{flag} {value} and {canonical} {opts[name]} name the same setting; give one")
        opts[name] = value
        notes.append(f"{flag} is another name of {canonical}; read as {canonical}")
    return notes


def setup_from_options(opts: dict):
    """A :class:`Setup` from CLI options: the preset, then every flag given; ``--strategy`` over
    ``--nproc-per-node`` and ``--bf16`` last, as the lab would run them (:mod:`fasttrain.memory.fit`)."""
    from fasttrain.memory.config import check
    from fasttrain.memory.fit import strategy_changes

    if opts.get("bf16") and (opts.get("mixed") or opts.get("precision") is not None):
        raise FasttrainError("--bf16 is the lab's precision flag; drop --mixed/--precision (or --bf16)")
    if opts.get("bf16"):
        opts = {**opts, "precision": "amp"}
    reduce_dtype(opts)                      # refused without the lab's words, before anything else
    if not lab_words(opts):
        return _setup_from_flags(opts)
    given = [flag for flag, name in (("--dp", "dp"), ("--tp", "tp"), ("--zero", "zero"), ("--grad-buffers", "grad_buffers"))
             if opts.get(name) not in (None, False)]
    if given:
        raise FasttrainError(f"--strategy/--nproc-per-node set {', '.join(given)} as the lab's run would; drop "
                             f"{', '.join(given)}")
    n, strategy = asked_run(opts)
    if (opts.get("mode") or "precise") != "precise":
        raise FasttrainError("--strategy/--nproc-per-node work in --mode precise only")
    setup = _setup_from_flags(opts)
    return check(setup.with_(**strategy_changes(strategy, n, bool(opts.get("bf16")), reduce_dtype(opts))), "precise")


def reduce_dtype(opts: dict) -> str:
    """``--fsdp-reduce-dtype``, given with the lab's words only (--strategy / --nproc-per-node)."""
    dtype = opts.get("fsdp_reduce_dtype")
    if dtype is not None and not lab_words(opts):
        raise FasttrainError("--fsdp-reduce-dtype is FSDP's: give it with --strategy fsdp or fsdp-zero2")
    return dtype or "fp32"


def _setup_from_flags(opts: dict):
    from fasttrain.memory.config import check, preset

    if opts.get("attention") == "sdpa":
        opts = {**opts, "attention": "flash"}
    if opts.get("hf_config") is not None:
        return _setup_from_hf_options(opts)
    if opts.get("compiled") not in (None, "none"):
        raise FasttrainError("--compiled is modelled for a transformers model (--hf-config); the lab's GPT compiled "
                             "keeps what it keeps eager (within about 1%): drop --compiled")
    if opts.get("float8") not in (None, "none"):
        raise FasttrainError("--float8 is modelled for a transformers model (--hf-config), not for the lab's GPT; "
                             "give --hf-config or drop --float8")
    if opts.get("liger"):
        raise FasttrainError("--liger is modelled for a transformers model (--hf-config), not for the lab's GPT; "
                             "give --hf-config or drop --liger")
    changes = {name: opts[name] for _, name, _ in _SIZE_FLAGS if opts.get(name) is not None}
    if opts.get("mixed") and opts.get("precision") not in (None, "mixed"):
        raise FasttrainError(f"--mixed and --precision {opts['precision']} contradict each other; give one")
    if opts.get("mixed"):
        changes["precision"] = "mixed"
    for name in ("precision", "recompute", "recompute_layers", "zero", "ffn_act", "attention", "norm", "pos", "tied",
                 "bias", "dropout", "optimizer", "workspace_mib"):
        if opts.get(name) is not None:
            changes[name] = opts[name]
    for name in ("seq_parallel", "grad_buffers", "cuda_graphs"):
        if opts.get(name):
            changes[name] = True
    changes.update(training_changes(opts))
    setup = preset(opts.get("preset") or "llama3-8b", **changes)
    return check(setup, opts.get("mode") or "precise")


# what a config.json decides: refused beside --hf-config
_ARCH_FLAGS = {"preset": "--preset", "heads": "--heads", "kv_heads": "--kv-heads", "hidden": "--hidden",
               "ffn": "--ffn", "layers": "--layers", "vocab": "--vocab", "ffn_act": "--ffn-act", "norm": "--norm",
               "pos": "--pos", "tied": "--tied/--untied", "bias": "--bias/--no-bias",
               "dropout": "--dropout/--no-dropout"}


def _setup_from_hf_options(opts: dict):
    """--hf-config: the model from its config.json, the training shape from the other flags."""
    from fasttrain.memory.config import check
    from fasttrain.memory.hf_config import read_config_json, setup_from_hf_config

    given = [flag for name, flag in _ARCH_FLAGS.items() if opts.get(name) is not None]
    if given:
        raise FasttrainError(f"--hf-config sets the architecture; drop {', '.join(given)}")
    if (opts.get("mode") or "precise") != "precise":
        raise FasttrainError("--hf-config works in --mode precise only (the widget knows its own GPT)")
    config = read_config_json(opts["hf_config"])
    # a transformers model trains as the lab would run it: bf16 autocast (amp) unless asked otherwise
    precision = "mixed" if opts.get("mixed") else (opts.get("precision") or "amp")
    if opts.get("mixed") and opts.get("precision") not in (None, "mixed"):
        raise FasttrainError(f"--mixed and --precision {opts['precision']} contradict each other; give one")
    changes = {name: opts[name] for name in ("tp", "dp", "opt_bytes", "zero", "workspace_mib", "recompute_layers")
               if opts.get(name) is not None}
    for name in ("seq_parallel", "grad_buffers", "cuda_graphs"):
        if opts.get(name):
            changes[name] = True
    changes.update(training_changes(opts))
    if opts.get("optimizer") is not None:
        changes.setdefault("optimizer", opts["optimizer"])
    attention = {"flash": "sdpa", None: "sdpa"}.get(opts.get("attention"), opts.get("attention"))
    # a batch given as 0 is refused by the estimator's check, never read as "not given" (batch 1)
    micro_batch = 1 if opts.get("micro_batch") is None else opts["micro_batch"]
    setup = setup_from_hf_config(config, micro_batch=micro_batch, seq=opts.get("seq"),
                                 precision=precision, recompute=opts.get("recompute") or "none", attention=attention,
                                 keep_logits=bool(opts.get("keep_logits")), compiled=opts.get("compiled") or "none",
                                 liger=bool(opts.get("liger")), float8=opts.get("float8") or "none", **changes)
    return check(setup, "precise")


def hf_defaults_lines(opts: dict, setup) -> list[str]:
    """--hf-config: the line saying the precision, attention and context the estimate assumed, and why."""
    if opts.get("hf_config") is None:
        return []
    precision = ("bf16 autocast (default; --precision fp32 or mixed for others)" if opts.get("precision") is None
                 and not opts.get("mixed") else f"precision {setup.precision}")
    attention = "sdpa attention (default)" if opts.get("attention") is None else f"{opts['attention']} attention"
    context = (f"context {setup.seq} (asked for)" if opts.get("seq") is not None
               else f"context {setup.seq} (the model's positions; --context N for another)")
    return [f"--hf-config: {precision}, {attention}, {context}, micro-batch {setup.micro_batch}"]


def training_changes(opts: dict) -> dict:
    """Setup changes for --optim (the lab's names mapped), --lora-* and --prompt-tokens."""
    from fasttrain.memory.config import OPTIM_ALIASES

    changes = {}
    optim = opts.get("optim")
    if optim is not None:
        optim = optim.strip().lower()
        if optim in OPTIM_ALIASES:
            optim, impl = OPTIM_ALIASES[optim]
            if opts.get("optimizer") not in (None, impl):
                raise FasttrainError(f"--optim {opts['optim']} and --optimizer {opts['optimizer']} contradict each other")
            changes["optimizer"] = impl
        elif optim in ("adamw_8bit", "adafactor") and opts.get("optimizer") is None:
            changes["optimizer"] = "foreach"          # no fused implementation: the presets' fused does not apply
        changes["optim"] = optim
    for name in ("lora_rank", "lora_dropout", "prompt_tokens"):
        if opts.get(name) is not None:
            changes[name] = opts[name]
    if opts.get("lora_targets") is not None:
        changes["lora_targets"] = tuple(x.strip() for x in opts["lora_targets"].split(",") if x.strip())
    return changes


def _print_breakdown(b) -> None:
    from fasttrain.memory.breakdown import format_gib
    from fasttrain.memory.playbook import format_bytes

    s = b.setup
    fmt = format_bytes if b.mode == "playbook" else format_gib
    title = (f"{b.mode} · a={s.heads} g={s.g} b={s.micro_batch} h={s.hidden} h_ff={s.ffn} L={s.layers} s={s.seq} "
             f"v={s.vocab} · t={s.tp} d={s.dp} ZeRO-{s.zero} · {s.precision} · recompute {s.recompute} · "
             f"{s.ffn_act}{' · SP' if s.seq_parallel else ''}"
             + (f" · {s.optim}" if s.optim != "adamw" else "")
             + (f" · LoRA r={s.lora_rank} on {','.join(s.lora_targets)}" if s.lora_rank else "")
             + (f" · {s.prompt_tokens} prompt tokens" if s.prompt_tokens else "")
             + (f" · {s.modules} d={s.d} · {s.attention}" if s.modules != "lab" else "")
             + (f" · compiled ({s.compiled})" if s.compiled != "none" and s.modules != "lab" else "")
             + (" · CUDA graphs" if s.cuda_graphs else "")
             + (f" · float8 ({s.float8})" if s.float8 != "none" else ""))
    table = Table(title=title, title_justify="left")
    for col, just in (("", "left"), ("bytes", "right"), ("share", "right"), ("note", "left")):
        table.add_column(col, justify=just)
    for line in (x for x in b.lines if x.in_total):
        share = f"{100 * line.bytes / b.total:.1f}%" if b.total else "-"
        table.add_row(line.name, fmt(line.bytes), share, line.note)
        for child in line.children:
            table.add_row(f"  {child.name}", fmt(child.bytes), "", "")
    table.add_row("[bold]total[/bold]", f"[bold]{fmt(b.total)}[/bold]", "100.0%", f"{b.params:,.0f} parameters")
    for line in (x for x in b.lines if not x.in_total):
        table.add_row(f"[dim]{line.name}[/dim]", f"[dim]{fmt(line.bytes)}[/dim]", "", f"[dim]{line.note}[/dim]")
        for child in line.children:
            table.add_row(f"[dim]  {child.name}[/dim]", f"[dim]{fmt(child.bytes)}[/dim]", "", "")
    out.print(table)
    for note in b.notes:
        out.print(f"  {note}")


@click.group("memory", invoke_without_command=True, context_settings={"help_option_names": ["-h", "--help"]})
@_options
@click.pass_context
def command(ctx, **opts) -> None:
    """Training memory per GPU: parameters, gradients, optimizer, activations (playbook or precise)."""
    if ctx.invoked_subcommand is not None:
        return
    from fasttrain.memory import estimate
    from fasttrain.memory.config import PRESET_NOTES, PRESETS

    if opts["list_presets"]:
        for name in PRESETS:
            out.print(f"{name:15s} {PRESET_NOTES.get(name, '')}")
        return
    if opts["html"] is not None:
        from fasttrain.files import check_output_path

        check_output_path(opts["html"], "--html")  # before any work; the folder must exist already
    notes = read_aliases(opts)
    setup = setup_from_options(opts)
    for line in notes + hf_defaults_lines(opts, setup):
        click.echo(line, err=True)
    b = estimate(setup, opts["mode"])
    fits = _fits(setup, opts) if lab_words(opts) else None
    if opts["html"] is not None:
        from fasttrain.memory.page import write_hf_page, write_page

        if opts.get("hf_config") is not None:
            n, strategy = asked_run(opts)
            path = write_hf_page(opts["html"], setup, b, model=str(opts["hf_config"]), nproc_per_node=n,
                                 gpu_gb=opts["gpu_gb"], bf16=bool(opts.get("bf16")), strategy=strategy)
        else:
            path = write_page(opts["html"], setup=setup, mode=opts["mode"], preset=opts.get("preset") or "llama3-8b")
        if not opts["as_json"]:
            out.print(f"page: {path}")
            return
        # both asked for: the JSON alone on stdout (it may be piped), the page's path on stderr
        click.echo(f"page: {path}", err=True)
    if opts["as_json"]:
        click.echo(json.dumps({**b.to_dict(), **({"fits": fits} if fits is not None else {})}, indent=1))
    else:
        _print_breakdown(b)
        if fits is not None:
            _print_fits(fits)


def _fits(setup, opts: dict) -> dict:
    """The lab's run in words and every strategy x checkpointing ranked (:func:`fasttrain.memory.fit.rank`)."""
    from fasttrain.memory.fit import precision_words, rank

    n, strategy = asked_run(opts)
    gpu_bytes = opts["gpu_gb"] * 1e9
    rows = rank(setup, n, gpu_bytes, bool(opts.get("bf16")), reduce_dtype(opts))
    return {"strategy": strategy, "nproc_per_node": n, "gpu_bytes": gpu_bytes,
            "precision": precision_words(strategy, bool(opts.get("bf16"))), "ranking": [r.to_dict() for r in rows]}


def _print_fits(fits: dict) -> None:
    from fasttrain.memory.breakdown import format_gib

    n, gb = fits["nproc_per_node"], fits["gpu_bytes"] / 1e9
    out.print(f"precision: {fits['precision']}", markup=False, highlight=False)
    table = Table(title=f"what fits on {n} x {gb:g} GB, per GPU, smallest first", title_justify="left")
    for col, just in (("strategy", "left"), ("checkpointing", "left"), ("per GPU", "right"), ("fits", "left")):
        table.add_column(col, justify=just)
    for r in fits["ranking"]:
        mark = "yes" if r["fits"] else ("no" if r["bytes"] is not None else f"cannot: {r['note']}")
        recompute = r["recompute"] + (f", the first {r['blocks']} blocks" if r.get("blocks") else "")
        table.add_row(r["strategy"], recompute, "-" if r["bytes"] is None else format_gib(r["bytes"]), mark)
    out.print(table)
    best = next((r for r in fits["ranking"] if r["fits"]), None)
    out.print("none of them fits: lower --micro-batch or --seq, or use more GPUs" if best is None else
              f"smallest: fasttrain lab {best['lab_flags'] or '(no flags)'} on {n} GPU{'s' if n > 1 else ''} "
              f"({format_gib(best['bytes'])} of {gb:g} GB)", markup=False, highlight=False)
    for r in (r for r in fits["ranking"] if r.get("blocks")):
        out.print(f"{r['strategy']}, fewest recomputed blocks that fit: fasttrain lab {r['lab_flags']} "
                  f"({format_gib(r['bytes'])}; each block not recomputed saves its forward again)",
                  markup=False, highlight=False)


@command.command("cost")
@click.option("--preset", "preset_name", help="Any preset of --list-presets (llama3-8b, llama3-70b and llama3-405b "
              "come with their published token counts and GPU-hours); llama3.1-8b etc. are aliases.")
@click.option("--params", type=float, help="Parameters (default: the preset's count).")
@click.option("--tokens", type=float, help="Training tokens (default: the published count).")
@click.option("--seq", type=int, help="Sequence length for the attention term.")
@click.option("--mfu", help="Model FLOPs utilization in percent, as on the memory page: 40 or 40% (default 40).")
@click.option("--tflops", type=float, help="Sustained TFLOP/s per GPU (instead of --mfu).")
@click.option("--peak-tflops", type=float, default=989.4, show_default=True, help="Peak per GPU (H100 bf16 dense).")
@click.option("--price", type=float, default=2.0, show_default=True, help="$ per GPU-hour.")
@click.option("--json", "as_json", is_flag=True)
def cost_cmd(preset_name, params, tokens, seq, mfu, tflops, peak_tflops, price, as_json) -> None:
    """Compute (6 N T + attention) -> GPU-hours -> dollars; without --preset, the Llama 3.1 runs
    and the MFU their published GPU-hours imply."""
    from fasttrain.memory import cost as C
    from fasttrain.memory.config import preset
    from fasttrain.memory.training_state import param_counts

    mfu = parse_mfu_percent(mfu)
    check_count(params, "--params")
    check_count(tokens, "--tokens")
    if seq is not None and seq < 1:
        raise FasttrainError(f"--seq must be a positive integer, got {seq}")
    if preset_name is None:
        if params is not None or tokens is not None or seq is not None:
            raise FasttrainError("--params/--tokens/--seq need --preset (or use a preset's own numbers)")
        rows = C.published(peak_tflops=peak_tflops, price=price, mfu=mfu, tflops=tflops)
    else:
        run = C.published_run(preset_name)
        if run is not None:
            arch, tok, sq, hours = C.PUBLISHED[run]
        else:
            arch, tok, sq, hours = preset_name, None, None, None
        s = preset(arch)
        n = params if params is not None else param_counts(s, 1)["total"]
        tok = tokens if tokens is not None else tok
        if tok is None:
            raise FasttrainError(f"preset {preset_name!r} has no published token count; give --tokens")
        sq = seq if seq is not None else (sq or s.seq)
        rows = [C.cost(preset_name, n, tok, s.layers, s.hidden, sq, mfu=mfu, tflops=tflops, peak_tflops=peak_tflops,
                       price=price, published_gpu_hours=hours if tokens is None and params is None else None)]
    if as_json:
        click.echo(json.dumps([r.to_dict() for r in rows], indent=1))
        return
    table = Table(title=f"training cost at {rows[0].tflops_sustained:.0f} TFLOP/s per GPU, ${price:g}/GPU-hour")
    for col in ("run", "params", "tokens", "FLOPs", "GPU-hours", "cost", "published GPU-h", "implied MFU"):
        table.add_column(col, justify="left" if col == "run" else "right")
    for r in rows:
        implied = "-" if r.implied_mfu is None else f"{100 * r.implied_mfu:.1f}% ({100 * r.implied_mfu_dense_only:.1f}% 6ND)"
        table.add_row(r.name, compact(r.params, 1e9, "B", ".2f"), compact(r.tokens, 1e12, "T", ".1f"), f"{r.flops:.3g}",
                      compact(r.gpu_hours, 1e6, "M", ".2f"), "$" + compact(r.dollars, 1e6, "M", ",.1f"),
                      "-" if r.published_gpu_hours is None else compact(r.published_gpu_hours, 1e6, "M", ".2f"),
                      implied)
    out.print(table)
    if any(r.implied_mfu is not None for r in rows):
        out.print(f"  implied MFU = FLOPs / (published GPU-hours x 3600 x {peak_tflops} TFLOP/s); "
                  "the published hours cover the whole project, not only the kernels")


def compact(value: float, scale: float, suffix: str, spec: str, width: int = 10) -> str:
    """``value`` in units of ``scale`` (``8.03B``), or in scientific notation when that would be
    wider than ``width`` characters (``1e+30``): a cell never grows past what the table shows."""
    text = f"{value / scale:{spec}}{suffix}"
    return text if len(text) <= width else f"{value:.3g}"


def check_count(value: float | None, flag: str) -> None:
    """A count flag (--params, --tokens) is a positive finite number."""
    import math

    if value is not None and not (math.isfinite(value) and value > 0):
        raise FasttrainError(f"{flag} must be positive and finite (e.g. 15e12), got {value!r}")


def parse_mfu_percent(text: str | None) -> float | None:
    """``--mfu`` as a fraction for :func:`fasttrain.memory.cost.cost`. The flag is a percentage (the
    memory page's convention): ``40`` or ``40%``. A bare number below 1 is refused as ambiguous
    (0.4 could mean 40% or 0.4%); ``0.4%`` says which."""
    if text is None:
        return None
    raw = text.strip()
    percent_sign = raw.endswith("%")
    try:
        value = float(raw.rstrip("%").strip())
    except ValueError:
        raise FasttrainError(f"--mfu expects a percentage like 40 or 40%, got {text!r}") from None
    if not 0 < value <= 100:
        raise FasttrainError(f"--mfu is a percentage in (0, 100], got {text!r}; e.g. --mfu 40 for 40%")
    if value < 1 and not percent_sign:
        raise FasttrainError(f"--mfu is a percentage: {text} would be {value}% (give --mfu {value * 100:g} for "
                             f"{value * 100:g}%, or --mfu {text}% if {value}% is meant)")
    return value / 100


# ``fasttrain memory validate`` trains through the lab's trainer: it is defined in
# fasttrain.lab.experiments.memory_check and added to this group from there (this package does not import the lab).
