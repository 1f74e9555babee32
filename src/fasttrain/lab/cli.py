"""``fasttrain lab``: train the lab's transformer (or a transformers model) with any set of techniques.

    fasttrain lab --preset tiny --max-steps 20 --bf16 --gradient-checkpointing --out run.json
    fasttrain lab --model hf:./my-llama --train-file notes.txt --config run.yaml
    fasttrain lab --resume runs/a                           # continues a run with its saved settings
    fasttrain lab pitfall --preset shakespeare-char        # a step timed without / with synchronization

Every setting is a field of :class:`fasttrain.lab.config.LabConfig`, declared there once (its help,
group, choices and other names): the options here and ``--help``'s sections are generated from the
declarations. Where a value comes from, lowest first: LabConfig's default, the preset (the lab's
GPT only; ``shakespeare-char`` unless another is named), the model's own defaults (``--model hf:``:
:mod:`fasttrain.lab.defaults`), the ``--config`` file, the flags. Every run prints the values that
differ from LabConfig's defaults and where each came from before any work starts.
"""

from __future__ import annotations

import dataclasses

from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

from fasttrain.errors import FasttrainError
from fasttrain.files import check_output_path
from fasttrain.lab import sample, tokenizer
from fasttrain.lab.config import GROUPS, PRESET_NOTES, PRESETS, LabConfig, validate
from fasttrain.lab.experiments import scaling, speedrun, sumdemo
from fasttrain.lab.parallel import launch as dist_launch
from fasttrain.lab.settings import DEFAULT_PRESET, Resolved, resolve_settings

out = Console(width=160)
err = Console(stderr=True)



class _NoneGiven(str):
    """``none`` given for an optional setting: None, not "keep the preset's value" (a string, so that
    a worker's command line rebuilt from the parsed values says ``none`` again)."""


NONE = _NoneGiven("none")
ALIAS_PREFIX = "alias__"        # the hidden options of a setting's other names


# --- the options, generated from LabConfig's declarations -------------------------------------------

class SettingOption(click.Option):
    """A click option that knows its ``--help`` section."""

    def __init__(self, *args, group: str = "run", **kwargs):
        super().__init__(*args, **kwargs)
        self.group = group


# the sections of options that are not LabConfig fields
OTHER_GROUPS = {name: "parallel" for name in dist_launch.PARALLEL_OPTIONS + dist_launch.LAUNCH_OPTIONS}
OTHER_GROUPS.update({"preset_name": "run", "config_file": "run", "print_config": "run", "out_path": "output",
                     "from_record": "run", "list_presets": "run", "quiet": "output", "help": "run",
                     "global_batch_size": "batch"})


class GroupedHelp:
    """``--help`` with the options in sections (model, data, batch, precision, memory, speed, ...)."""

    def format_options(self, ctx, formatter) -> None:
        sections: dict[str, list] = {}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is None:
                continue
            group = getattr(param, "group", None) or OTHER_GROUPS.get(param.name, "other")
            sections.setdefault(group, []).append(record)
        for group in [*GROUPS, *sorted(set(sections) - set(GROUPS))]:
            if group in sections:
                with formatter.section(f"{group.capitalize()} options"):
                    formatter.write_dl(sections[group])
        if isinstance(self, click.Group):
            self.format_commands(ctx, formatter)


class GroupedCommand(GroupedHelp, click.Command):
    pass


class GroupedGroup(GroupedHelp, click.Group):
    pass


def _shown_default(kind) -> str:
    value = kind.default
    if value is None:
        return "none"
    if kind.type is bool:
        return "on" if value else "off"
    if kind.type is tuple:
        return ",".join(value)
    return str(value)


def _option_for(kind):
    """The click option of one LabConfig field, typed by :mod:`fasttrain.lab.overrides`, its help
    and section from the field's declaration; every default is None (= not given)."""
    from fasttrain.lab.overrides import parse_value

    help_ = kind.help + (f" (also: {', '.join('--' + a.replace('_', '-') for a in kind.aliases)})"
                         if kind.aliases else "")
    common = dict(default=None, help=help_, show_default=_shown_default(kind), group=kind.group, cls=SettingOption)
    if kind.name == "gradient_checkpointing":
        # --gradient-checkpointing alone means full
        return click.option(kind.flag, kind.name, type=click.Choice(kind.choices), is_flag=False, flag_value="full",
                            **common)
    if kind.type is bool:
        return click.option(f"{kind.flag}/--no-{kind.flag[2:]}", kind.name, **common)
    if kind.choices is not None:
        return click.option(kind.flag, kind.name, type=click.Choice(kind.choices), **common)
    if kind.type in (tuple, str) or kind.optional:
        # parsed by the one override parser (lists comma-separated; "none" for an optional field)
        def convert(ctx, param, value, name=kind.name):
            if value is None:
                return None
            parsed = parse_value(name, value)
            return NONE if parsed is None else parsed
        metavar = {int: "INTEGER", float: "FLOAT", tuple: "A,B,..."}.get(kind.type, "TEXT") \
            + ("|none" if kind.optional else "")
        return click.option(kind.flag, kind.name, type=str, callback=convert, metavar=metavar, **common)
    return click.option(kind.flag, kind.name, type=kind.type, **common)


def _alias_option(alias: str, kind):
    """A setting's other name: hidden, read as the setting with a one-line note (:func:`_given`)."""
    flag = "--" + alias.replace("_", "-")
    if kind.type is bool:
        return click.option(f"{flag}/--no-{flag[2:]}", ALIAS_PREFIX + alias, default=None, hidden=True)
    return click.option(flag, ALIAS_PREFIX + alias, type=str, default=None, hidden=True)


def _read_config_file(ctx, param, value):
    """``--config FILE``: its settings become the command's defaults (``ctx.default_map``), so that a
    flag given on the command line wins; a missing, unreadable or unknown key is one line."""
    if value is None or ctx.resilient_parsing:
        return value
    from fasttrain.lab.overrides import read_settings_file

    spellings = {}
    for p in ctx.command.params:
        if p.name and not p.name.startswith(ALIAS_PREFIX):
            spellings[p.name] = p.name
            for opt in [*p.opts, *p.secondary_opts]:
                spellings[opt.lstrip("-").replace("-", "_")] = p.name
    defaults, notes = read_settings_file(value, spellings)
    ctx.default_map = {**(ctx.default_map or {}), **defaults}
    ctx.meta["fasttrain.config_file"] = value
    ctx.meta["fasttrain.alias_notes"] = notes
    return value


def config_options(fn):
    """One click option per LabConfig field (and a hidden one per other name), typed by its
    annotation; ``--preset``, ``--config`` and ``--print-config``."""
    from fasttrain.lab.overrides import field_kinds

    kinds = [k for k in field_kinds().values() if k.name != "name"]
    for kind in reversed(kinds):
        for alias in kind.aliases:
            fn = _alias_option(alias, kind)(fn)
        fn = _option_for(kind)(fn)
    fn = click.option("--print-config", is_flag=True, help="Print the resolved configuration (YAML: every setting "
                      "that differs from LabConfig's defaults) and exit.")(fn)
    fn = click.option("--config", "config_file", type=str, default=None, is_eager=True, expose_value=True,
                      callback=_read_config_file, help="A YAML (.yaml, .yml) or TOML (.toml) file of flags (names "
                      "with - or _); flags given on the command line win.")(fn)
    fn = click.option("--preset", "preset_name", default=None, metavar=f"[{'|'.join(PRESETS)}]",
                      show_default=f"{DEFAULT_PRESET} for the lab's GPT, none for --model hf:",
                      help="Start from a preset (with --model hf: its settings other than the GPT's shape).")(fn)
    return fn


# --- the configuration a command line resolves to ------------------------------------------------

def _given(options: dict, notes: list | None = None) -> dict:
    """The LabConfig fields given (``none`` -> None); a setting's other name read as it, with a note."""
    from fasttrain.lab.overrides import alias_note, aliases, parse_value

    names = {f.name for f in dataclasses.fields(LabConfig)}
    given = {k: (None if v is NONE else v) for k, v in options.items() if v is not None and k in names}
    for key, value in options.items():
        if not key.startswith(ALIAS_PREFIX) or value is None:
            continue
        alias = key[len(ALIAS_PREFIX):]
        name = aliases()[alias]
        typed = value if isinstance(value, bool) else parse_value(name, value)
        if name in given and given[name] != typed:
            raise FasttrainError(f"--{alias.replace('_', '-')} {value} and --{name.replace('_', '-')} "
                                 f"{options[name]} name the same setting with different values; give one")
        given[name] = typed
        if notes is not None:
            notes.append(alias_note(alias, name))
    return given


def _sources(given: dict, ctx) -> dict:
    """``flag`` or ``file PATH`` for each given setting (a file's settings are the command's defaults)."""
    path = ctx.meta.get("fasttrain.config_file") if ctx is not None else None
    out = {}
    for name in given:
        source = None
        if ctx is not None:
            try:
                source = ctx.get_parameter_source(name)
            except (KeyError, TypeError):
                source = None
            if source is None or source.name == "DEFAULT":        # given through one of its other names
                from fasttrain.lab.overrides import field_kinds

                for alias in field_kinds()[name].aliases:
                    alt = ctx.get_parameter_source(ALIAS_PREFIX + alias) if ALIAS_PREFIX + alias in ctx.params else None
                    if alt is not None and alt.name != "DEFAULT":
                        source = alt
        out[name] = f"file {path}" if source is not None and source.name == "DEFAULT_MAP" else "flag"
    return out


def resolve(preset_name: str | None, options: dict, ctx=None) -> Resolved:
    """The configuration of a command line (:func:`fasttrain.lab.settings.resolve_settings`): the
    options given, each from a flag or the ``--config`` file."""
    if ctx is None:
        ctx = click.get_current_context(silent=True)
    notes = list(ctx.meta.get("fasttrain.alias_notes", ())) if ctx is not None else []
    given = _given(options, notes)
    return resolve_settings(preset_name, given, _sources(given, ctx), notes)


def config_from(preset_name: str | None, options: dict) -> LabConfig:
    return resolve(preset_name, options).cfg


def config_from_record(path, options: dict) -> LabConfig:
    """The configuration a run record ran, with the flags given beside ``--from-record`` on top."""
    from fasttrain.lab.record import check_record_inputs, config_of_record, load_record

    record = load_record(path)
    cfg, given = config_of_record(record), _given(options)
    cfg = validate(cfg.with_(**given)) if given else cfg
    check_record_inputs(record, cfg, path)      # the same data and tokenizer, before any work
    return cfg


def write_config_yaml(resolved: Resolved) -> None:
    """The resolved configuration as YAML on stdout (the preset and every setting that differs from
    it; a ``--config`` file that runs the same); the notes (other names, the warm-up) on stderr."""
    from fasttrain.lab.overrides import settings_yaml

    for line in resolved.notes:
        err.print(line, markup=False, highlight=False, soft_wrap=True)
    out.print(settings_yaml(resolved.cfg), end="", markup=False, highlight=False, soft_wrap=True)


def say_configuration(resolved: Resolved, final: LabConfig | None = None) -> None:
    """The resolved configuration and its sources on stderr; ``final``: the configuration the run trains
    (the context lowered to the corpus, the micro-batch found), where it differs."""
    if final is not None and final != resolved.cfg:
        resolved = dataclasses.replace(resolved, cfg=final)
    for line in resolved.lines():
        err.print(line, markup=False, highlight=False, soft_wrap=True)


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


@click.group("lab", cls=GroupedGroup, invoke_without_command=True,
             context_settings={"help_option_names": ["-h", "--help"]})
@config_options
@dist_launch.parallel_options
@click.option("--out", "out_path", type=click.Path(dir_okay=False), help="Write the run record (JSON) here.")
@click.option("--from-record", "from_record", type=click.Path(dir_okay=False),
              help="Rerun the configuration of a run record (flags given beside it override it).")
@click.option("--list-presets", is_flag=True, help="List the presets and exit.")
@click.option("--quiet", is_flag=True, help="No progress, configuration or table.")
@click.pass_context
def command(ctx, preset_name, config_file, print_config, out_path, from_record, list_presets, quiet,
            **options) -> None:
    """Train the lab's transformer (or a transformers model) and measure speed, memory and loss."""
    if ctx.invoked_subcommand is not None:
        return
    if list_presets:
        for name in PRESETS:
            out.print(f"{name:18s} {PRESET_NOTES.get(name, '')}")
        return
    from fasttrain.lab import noise, preflight

    noise.filter_known_noise()                  # before peft/torchao are imported
    parallel, launch = dist_launch.parallel_from_options(options)
    if from_record:
        resolved = Resolved(config_from_record(from_record, options), {}, {}, [])
    else:
        resolved = resolve(preset_name, options, ctx)
    cfg = resolved.cfg
    if print_config:
        write_config_yaml(resolved)
        return
    if out_path is not None:
        preflight.check_outputs(cfg, out_path)  # --out against --save first: the clearer of the two lines
        check_output_path(out_path, "--out")    # before training: a bad path must not cost the run
        out_path = str(preflight.expand(out_path, "--out"))
    if launch is not None:
        # this process only starts torchrun; every worker runs this command without the launcher's options
        dist_launch.check_before_launch(cfg, parallel, launch)     # GPUs against processes: the clearer line
    dp = dist_launch.data_parallel_ranks(parallel, launch)
    if resolved.sources.get("per_device_train_batch_size") == "flag" and dp and \
            not dist_launch.launched_by_torchrun():
        # both batch flags given: they must agree over the data-parallel ranks this run will have
        dist_launch.check_batch_flags(cfg, parallel, dp)
    preflight.check_run(cfg, out_path)          # the same checks lab.train.run makes (Python API)
    main = dist_launch.env_rank() == 0          # several processes: rank 0 alone prints and writes
    if launch is not None:
        from fasttrain.lab.build import resolve_device
        from fasttrain.lab.checkpoint import read_checkpoint
        from fasttrain.lab.loggers import check_loggers
        from fasttrain.lab.resume import find_checkpoint
        from fasttrain.lab.train import check_libraries

        # what each rank would refuse alike once started, refused once here: --init-from's and --resume's
        # checkpoints, the loggers' folders and, on the CPU, the libraries and techniques the run needs (on GPUs
        # the ranks check those: their float8 check asks the GPU's capability, and this process, which waits for
        # the ranks, touches no GPU they need)
        if cfg.init_from is not None:
            read_checkpoint(cfg.init_from)
        if cfg.resume:
            find_checkpoint(cfg.resume)
        device = resolve_device(cfg)
        if device.type == "cpu":
            check_libraries(cfg, device, out_path)
        else:
            check_loggers(cfg, out_path)
        warning = dist_launch.cpu_oversubscription(launch.nproc_per_node, cfg.device)
        if warning:
            err.print(warning, markup=False, highlight=False, soft_wrap=True)
        dist_launch.launch(launch, dist_launch.worker_argv(ctx, skip=dist_launch.LAUNCH_OPTIONS))
        return
    quiet = quiet or not main
    with dist_launch.rank_prefixed_errors():
        _train(cfg, parallel, out_path, quiet, main, resolved)


def _train(cfg, parallel, out_path, quiet, main, resolved=None) -> None:
    from fasttrain.lab import noise
    from fasttrain.lab.checkpoint import write_record
    from fasttrain.lab.outputs import save_folder_state
    from fasttrain.lab.progress import RunProgress
    from fasttrain.lab.train import run

    replacing = cfg.save is not None and save_folder_state(cfg.save) == "checkpoint"
    log = None if quiet else (lambda line: err.print(line, markup=False, highlight=False, soft_wrap=True))
    if replacing and not quiet:
        err.print(f"--save {cfg.save}: holds a lab checkpoint; it is replaced whole when this run ends "
                  "(until then it stays as it is)", markup=False, highlight=False, soft_wrap=True)
    bar = None
    if not quiet:
        bar = RunProgress(f"lab {cfg.name}", cfg.max_steps, tokens_per_step=cfg.batch_tokens,
                          warmup_steps=cfg.timing_warmup_steps, device=_device_kind(cfg.device), console=err)
        bar.start()
    try:
        # the configuration is said once every check has passed and the model is built, before the first step
        announce = None if quiet or resolved is None else (lambda final: say_configuration(resolved, final))
        record = run(cfg, log=log, progress=bar, parallel=parallel,
                     fit_context=resolved is not None and resolved.fit_context,
                     sources=None if resolved is None else resolved.sources, announce=announce,
                     record_path=out_path)
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
        if record.get("logs"):
            out.print("logs: " + ", ".join(record["logs"].values()), markup=False, highlight=False, soft_wrap=True)
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


@command.command("pitfall", cls=GroupedCommand)
@config_options
@click.option("--repeats", type=click.IntRange(1, 1000), default=5, show_default=True)
@click.pass_context
def pitfall(ctx, preset_name, config_file, print_config, repeats, **options) -> None:
    """Time one training step without and with device synchronization, side by side."""
    from fasttrain.lab.experiments.pitfall import timing_pitfall

    resolved = resolve(preset_name, options, ctx)
    if print_config:
        write_config_yaml(resolved)
        return
    cfg = resolved.cfg
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
@click.argument("records", nargs=-1, required=True, type=click.Path(dir_okay=False))
@click.option("--out", "out_path", required=True, type=click.Path(dir_okay=False), help="The PNG to write.")
def plot_cmd(records, out_path) -> None:
    """Plot run records' loss curves (training and validation loss against the step); several runs
    share one figure, each labelled by its file's name."""
    from fasttrain.lab.record import load_record, plot_runs, run_labels

    from fasttrain.lab.outputs import check_figure_path

    check_output_path(out_path, "--out")
    check_figure_path(out_path, "--out", inputs=[("run record", Path(r).expanduser().resolve()) for r in records])
    labels = run_labels(records)
    path = plot_runs({label: load_record(p) for label, p in zip(labels, records)}, out_path,
                     sources=dict(zip(labels, records)))
    out.print(f"loss curve{'s' if len(records) > 1 else ''}: {path}")


for _sub in (sumdemo.command, speedrun.command, scaling.command, tokenizer.command, sample.command):
    command.add_command(_sub)

__all__ = ["command", "config_options", "config_from", "resolve", "Resolved", "FasttrainError"]
