"""``fasttrain bench``: the benchmark suites and the README generator (registered by fasttrain.cli)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shlex
from pathlib import Path

import click
from rich.console import Console
from rich.markup import escape

from fasttrain.bench.results import Progress
from fasttrain.errors import FasttrainError
from fasttrain.files import check_output_folder


@contextlib.contextmanager
def folder_lock(folder: Path):
    """Hold an exclusive lock on a results folder while a command writes into it: two runs into
    one folder would each merge with the files as they were before the other's rows, and the last
    to write would drop the other's results. The second run is refused, saying why. The lock's file lives
    beside the user's temporary files, named by the folder's resolved path, so that nothing but results is
    left in the folder."""
    import fcntl
    import hashlib
    import tempfile

    locks = Path(tempfile.gettempdir()) / f"fasttrain-locks-{os.getuid()}"
    locks.mkdir(parents=True, exist_ok=True)
    name = hashlib.sha1(str(Path(folder).resolve()).encode()).hexdigest()[:20]
    handle = open(locks / f"bench-{name}.lock", "a+")
    try:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "another process"
            raise FasttrainError(f"{folder} is in use by another fasttrain bench ({holder}); wait for it to finish, "
                                 "or write to another --out") from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()}\n")
        handle.flush()
        yield
    finally:
        handle.close()  # closing releases the lock

console = Console(stderr=True, highlight=False, soft_wrap=True)
out_console = Console(highlight=False, soft_wrap=True)


@click.group("bench", context_settings={"help_option_names": ["-h", "--help"]})
def command() -> None:
    """Benchmark suites (the ladder table, the hidden-size sweep, the loss curves, the record table, the peers,
    and the suites engines bring), one output format: long CSV, JSON, Markdown, PNG."""


def _suite_options(fn):
    options = [
        click.option("--quick", is_flag=True, help="A short smoke run (< 2 min on 2 CPU cores): fewer epochs/steps, "
                     "1 seed, first 10,000/2,000 examples, no torch.compile rows."),
        click.option("--engines", help="Only these engines, comma-separated (e.g. cuda,jax)."),
        click.option("--rows", help="Only rows whose label contains one of these, comma-separated (e.g. 'defaults')."),
        click.option("--models", help="Only these of the suite's models, comma-separated (e.g. mlp:1024x3); the "
                     "results merge with the folder's earlier ones."),
        click.option("--repeats", type=click.IntRange(1, 100), help="Runs per row, seeds 0..N-1 (default 3; --quick 1; curves: always seed 0 alone)."),
        click.option("--out", type=click.Path(file_okay=False), help="Output folder (default results/<gpu-or-cpu-slug>/)."),
        click.option("--dataset", default="mnist", show_default=True, help="mnist, fashion-mnist or kmnist."),
        click.option("--data-dir", type=click.Path(file_okay=False), help="Data root (default: $FASTTRAIN_DATA_DIR or ~/.cache/fasttrain)."),
        click.option("--synthetic", is_flag=True, help="Train on synthetic MNIST-shaped data (timings only)."),
        click.option("--fresh", is_flag=True, help="Discard earlier results in --out instead of merging with them."),
        click.option("--list", "list_only", is_flag=True, help="Show the rows, and which would be skipped and why; run nothing."),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def _hidden_option(fn):
    return click.option("--hidden", help="Sweep hidden sizes, comma-separated (default 128,...,8192; --quick 128,256,512).")(fn)


def _command_line(ctx: click.Context) -> str:
    """The command as a user would type it again: the subcommand and every option not at its default."""
    words = ["fasttrain", "bench", ctx.info_name]
    for param in ctx.command.params:
        value = ctx.params.get(param.name)
        if not isinstance(param, click.Option) or value in (None, False) or value == param.default:
            continue
        flag = param.opts[0]
        words += [flag] if param.is_flag else [flag, str(value)]
    return " ".join(shlex.quote(w) for w in words)


def _parse_list(text: str | None, what: str, cast=str) -> list | None:
    if not text:
        return None
    try:
        return [cast(item.strip()) for item in text.split(",") if item.strip()]
    except ValueError:
        raise FasttrainError(f"{what}: expected a comma-separated list, got {text!r}") from None


class _RichProgress(Progress):
    """rich progress bars for the runner (stderr), with one line per finished or skipped row."""

    def __init__(self):
        from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
        from rich.progress import Progress as Bars

        # runs done of all planned, elapsed and the time left at the pace so far
        self._bar = Bars(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                         TextColumn("left"), TimeRemainingColumn(), console=console, transient=True)
        self._task = None

    def start(self, total: int, description: str) -> None:
        self._bar.start()
        self._task = self._bar.add_task(description, total=total)

    def describe(self, description: str) -> None:
        self._bar.update(self._task, description=description)

    def advance(self, n: int = 1) -> None:
        self._bar.advance(self._task, n)

    def log(self, message: str) -> None:
        self._bar.console.print(message)

    def stop(self) -> None:
        self._bar.stop()


def run_suites(ctx: click.Context, names: list[str], quick, engines, repeats, out, dataset, data_dir, synthetic, fresh,
               list_only, hidden=None, rows=None, models=None) -> None:
    from fasttrain.bench import runner, suites
    from fasttrain.bench.data import bench_data
    from fasttrain.environment import machine_slug

    engines_filter = set(_parse_list(engines, "--engines") or []) or None
    runner.check_engines_filter(engines_filter)
    hidden_sizes = _parse_list(hidden, "--hidden", int)
    if hidden_sizes and any(h < 1 for h in hidden_sizes):
        raise FasttrainError(f"--hidden: sizes must be positive, got {hidden}")
    built = [suites.build(name, quick, repeats, hidden_sizes) for name in names]
    row_filter = _parse_list(rows, "--rows")
    if row_filter:  # re-run some rows; the results merge with the folder's earlier ones
        built = [dataclasses.replace(s, rows=tuple(r for r in s.rows if any(f in r.label for f in row_filter)))
                 for s in built]
        if not any(s.rows for s in built):
            raise FasttrainError(f"--rows {rows}: no row label contains that (see --list)")

    model_filter = _parse_list(models, "--models")
    if model_filter:  # re-run some models; the results merge with the folder's earlier ones
        unknown = [m for m in model_filter if not any(m in s.models for s in built)]
        if unknown:
            raise FasttrainError(f"--models: {unknown[0]} is not a model of {', '.join(names)} (its models: "
                                 f"{', '.join(dict.fromkeys(m for s in built for m in s.models))})")
        built = [dataclasses.replace(s, models=tuple(m for m in s.models if m in model_filter)) for s in built]
    if list_only:
        for suite in built:
            out_console.print(f"[bold]{suite.name}[/]: {suite.title}; {len(suite.cases())} cases, {suite.repeats} seed(s) each")
            for case, reason in runner.plan(suite, engines_filter):
                status = "[green]runs[/]" if reason is None else f"[yellow]skip[/]: {escape(reason)}"
                many = "" if case.k is None else f" K={case.k:<3}"
                out_console.print(f"  {case.row.label:<28} {case.model:<11}{many} {status}")
        return

    data, info, note = bench_data(dataset, data_dir, quick, synthetic)  # before any folder is made
    folder = check_output_folder(out if out else Path("results") / machine_slug(), "--out", parents=True)
    with folder_lock(folder):
        _run_locked(ctx, built, folder, data, info, note, engines_filter, fresh)


def _run_locked(ctx, built, folder: Path, data, info: dict, note, engines_filter, fresh: bool) -> None:
    from fasttrain.bench import figures, report, runner, tables
    from fasttrain.files import atomic_write_text

    olds = {}
    for suite in built:
        json_path = folder / f"{suite.name}.json"
        if fresh or not json_path.exists():
            continue
        try:
            old = report.load_result(json_path)
        except FasttrainError as exc:
            raise FasttrainError(f"{exc}; move it away, or pass --fresh to replace it") from None
        if (old.quick, old.dataset) != (suite.quick, info):
            raise FasttrainError(
                f"{json_path} holds results of another setting ({tables.dataset_line(old.dataset)}"
                f"{', --quick' if old.quick else ''}) than this run ({tables.dataset_line(info)}"
                f"{', --quick' if suite.quick else ''}); merging would drop them: use another --out, or --fresh to "
                "replace them")
        olds[suite.name] = old
    if note:
        console.print(f"[bold yellow]warning:[/] {note}")
    console.print(f"data: {tables.dataset_line(info)}; results -> {folder}/")
    if figures.matplotlib_or_none() is None:
        console.print(f"[yellow]{figures.MATPLOTLIB_MISSING}[/]")

    command_text = _command_line(ctx)
    failed: list[str] = []
    for suite in built:
        json_path = folder / f"{suite.name}.json"
        old = olds.get(suite.name)

        def save_so_far(partial, old=old, json_path=json_path):
            # after every row: a run cut short (a time limit, a crash) keeps the rows it finished
            atomic_write_text(json_path, report.to_json(runner.merge(partial, old)[0]))

        result = runner.run_suite(suite, data, engines_filter=engines_filter, command=command_text, dataset_info=info,
                                  progress=_RichProgress(), on_case=save_so_far)
        failed += [f"{c.suite} {c.label} {c.model}" for c in result.cases if c.status == "failed"]
        result, kept = runner.merge(result, old)
        if kept:
            console.print(f"kept {kept} earlier result(s) from {json_path} (rows or sizes not run now; --fresh drops them)")
        written = report.write_plots(result, folder) + report.write_outputs(result, folder)
        click.echo(report.to_markdown(result))
        console.print("wrote " + ", ".join(str(p) for p in written))

    write_folder_outputs(folder)
    if failed:
        raise FasttrainError(f"{len(failed)} row(s) failed: {'; '.join(failed)} (tracebacks in the suite's JSON under {folder}/)")


def write_folder_outputs(folder: Path) -> None:
    """The combined long CSV and the folder's own README over every suite in it."""
    from fasttrain.bench import report, suites
    from fasttrain.bench.readme import readme_section
    from fasttrain.files import atomic_write_text

    results = [report.load_result(folder / f"{n}.json") for n in suites.all_suites() if (folder / f"{n}.json").is_file()]
    atomic_write_text(folder / "results.csv", report.to_csv(results))
    atomic_write_text(folder / "README.md", readme_section(folder, link_base="", heading="# Benchmark results"))
    console.print(f"wrote {folder / 'results.csv'}, {folder / 'README.md'}")


@command.command()
@_suite_options
@click.pass_context
def ladder(ctx, **kwargs) -> None:
    """The seed study's table: every engine and rung on logreg, 20 epochs, batch 128."""
    run_suites(ctx, ["ladder"], **kwargs)


@command.command()
@_suite_options
@_hidden_option
@click.pass_context
def sweep(ctx, **kwargs) -> None:
    """Time against hidden size: mlp:Hx3, 5000 steps, batch 32, lr 0.003, fp16 (JAX and rungs 7-8 also bf16), 3 seeds."""
    run_suites(ctx, ["sweep"], **kwargs)


@command.command()
@_suite_options
@click.pass_context
def curves(ctx, **kwargs) -> None:
    """Loss curves of every engine on seed 0 against the NumPy fp64 reference."""
    run_suites(ctx, ["curves"], **kwargs)


@command.command("all")
@_suite_options
@_hidden_option
@click.pass_context
def all_(ctx, **kwargs) -> None:
    """ladder, sweep and curves, one after another."""
    run_suites(ctx, ["ladder", "sweep", "curves"], **kwargs)


@command.command()
@click.argument("results_dir", type=click.Path(file_okay=False))
def render(results_dir) -> None:
    """Rewrite the CSV, Markdown and PNG files of RESULTS_DIR from its JSON files (e.g. after a run on a
    machine without matplotlib)."""
    from fasttrain.bench import figures, report, suites

    folder = Path(results_dir)
    if not folder.is_dir():
        raise FasttrainError(f"{folder}: no such folder; give a folder of benchmark results")
    names = [n for n in suites.all_suites() if (folder / f"{n}.json").is_file()]
    if not names:
        raise FasttrainError(f"{folder}: no suite's results (<suite>.json) to render")
    if figures.matplotlib_or_none() is None:
        console.print(f"[yellow]{figures.MATPLOTLIB_MISSING}[/]")
    with folder_lock(folder):
        results = [report.load_result(folder / f"{name}.json") for name in names]  # all readable before any write
        for result in results:
            written = report.write_plots(result, folder) + report.write_outputs(result, folder)
            console.print("wrote " + ", ".join(str(p) for p in written))
        write_folder_outputs(folder)


@command.command("merge")
@click.argument("into", type=click.Path(file_okay=False))
@click.argument("parts", nargs=-1, required=True, type=click.Path(file_okay=False, exists=True))
def merge_cmd(into, parts) -> None:
    """Merge the results of runs split over several calls (PARTS folders, later ones win for a row
    they ran) into INTO, then write its CSV, Markdown and PNG files. Parts must come from the same
    GPU kind, data and --quick setting."""
    folder = check_output_folder(into, "INTO", parents=True)
    with folder_lock(folder):
        _merge_locked(folder, parts)


def _merge_locked(folder: Path, parts) -> None:
    from fasttrain.bench import report, runner, suites, tables

    merged_any = False
    for name in suites.all_suites():
        paths = [p for p in [folder / f"{name}.json", *(Path(d) / f"{name}.json" for d in parts)] if p.is_file()]
        if not paths or paths == [folder / f"{name}.json"]:
            continue
        results = [report.load_result(p) for p in dict.fromkeys(paths)]
        gpus = {tables.gpu_name(r.environment) for r in results if r.ran()}
        if len(gpus) > 1:
            raise FasttrainError(f"{name}: parts measured on different GPUs ({', '.join(sorted(gpus))}); keep them in separate folders")
        acc = results[0]
        for part in results[1:]:
            if (part.quick, part.dataset) != (acc.quick, acc.dataset):
                raise FasttrainError(f"{name}: parts differ in --quick or data ({acc.dataset['name']} vs {part.dataset['name']}); "
                                     "merge only runs of one setting")
            acc = runner.merge(part, acc)[0]
        written = report.write_plots(acc, folder) + report.write_outputs(acc, folder)
        console.print(f"{name}: merged {len(results)} file(s); wrote " + ", ".join(str(p) for p in written))
        merged_any = True
    if not merged_any:
        raise FasttrainError(f"no suite's results (<suite>.json) in {', '.join(parts)}")
    write_folder_outputs(folder)


@command.command()
@click.argument("results_dir", type=click.Path(file_okay=False))
@click.option("--link-base", help="Prefix of image links (default: the path from --into's folder to RESULTS_DIR; "
                                  "without --into, RESULTS_DIR/ as given).")
@click.option("--into", "into", type=click.Path(dir_okay=False),
              help="Write it into this file between <!-- MARKER:start --> and <!-- MARKER:end --> "
                   "(the results index: results/README.md).")
@click.option("--marker", default="bench-results", show_default=True,
              help="The marker lines' name, so that one file holds several generated sections "
                   "(record-results, many-results, lab-results in results/README.md).")
def readme(results_dir, link_base, into, marker) -> None:
    """Print the results section of the result files in RESULTS_DIR (or write it into results/README.md)."""
    from fasttrain.bench.readme import link_base_from, readme_section
    from fasttrain.files import write_into

    if not marker.replace("-", "").isalnum():
        raise FasttrainError(f"--marker {marker!r}: use letters, digits and '-' only")
    if into and link_base is None:
        link_base = link_base_from(results_dir, into)
    # the section sits under the index's own heading of its area; the engines' protocol is written out once, in
    # the main section, and the others point to their folder's README for it
    section = readme_section(results_dir, link_base, protocol="full" if marker == "bench-results" else "link")
    if into:
        write_into(into, section, start=f"<!-- {marker}:start -->", end=f"<!-- {marker}:end -->")
        console.print(f"wrote the {marker} section of {into} from {results_dir}")
    else:
        click.echo(section, nl=False)


@command.command("lab")
@click.option("--preset", default="shakespeare-char", show_default=True,
              help="The lab preset of the main table (tiny, shakespeare-char, char-100m).")
@click.option("--steps", type=click.IntRange(1, 100000), default=100, show_default=True,
              help="Timed steps of the baseline row; every row trains the baseline's token budget "
                   "((warmup + steps) x its tokens per step).")
@click.option("--warmup", type=click.IntRange(1, 1000), default=5, show_default=True,
              help="First steps of every row timed apart (compilation, autotuning, allocator growth).")
@click.option("--rows", help="Only rows whose label or technique contains one of these, comma-separated "
                             "(e.g. 'batch,compile,PEFT'; 'sweep' for the batch-size sweep); their pair rows come along.")
@click.option("--repeats", type=click.IntRange(1, 100), default=1, show_default=True,
              help="Runs per row (seeds preset seed + 0..N-1); tables give the median and n.")
@click.option("--sweep-steps", type=click.IntRange(1, 10000), default=10, show_default=True,
              help="Timed steps per batch size of the sweep (char-100m, bf16).")
@click.option("--out", type=click.Path(file_okay=False), help="Output folder (default results/<gpu-or-cpu-slug>/).")
@click.option("--data-dir", type=click.Path(file_okay=False),
              help="Data root holding tinyshakespeare/input.txt (default: $FASTTRAIN_DATA_DIR or ~/.cache/fasttrain).")
@click.option("--device", default="auto", show_default=True, help="auto, cpu, cuda or cuda:N.")
@click.option("--fresh", is_flag=True, help="Discard earlier lab results in --out instead of merging with them.")
@click.option("--list", "list_only", is_flag=True, help="Show the rows, and which would be skipped and why; run nothing.")
@click.option("--model", "model", default="gpt", show_default=True,
              help="The model of the table: gpt (the lab's own, shaped by the preset) or hf:PATH_OR_NAME "
                   "(a transformers causal LM; the preset gives the batch, context and schedule).")
@click.option("--tokenizer", default=None,
              help="The corpus' tokenizer: char, hf:PATH or tiktoken:NAME (default: the model folder's own, "
                   "else characters).")
@click.pass_context
def lab(ctx, preset, steps, warmup, rows, repeats, sweep_steps, out, data_dir, device, fresh, list_only,
        model, tokenizer) -> None:
    """The lecture's table of single-GPU techniques, measured on the lab's transformer: speed, memory and
    validation loss of every technique against one baseline, the estimator's prediction beside each peak,
    and a batch-size sweep to the out-of-memory edge (runs for minutes on a GPU)."""
    from fasttrain.bench import lab as bench_lab
    from fasttrain.lab.config import PRESETS
    from fasttrain.lab.config import preset as lab_preset

    if preset not in PRESETS:
        raise FasttrainError(f"unknown --preset {preset!r}; use one of {', '.join(PRESETS)}")
    base = lab_preset(preset, device=device, model=model, data_dir=data_dir,
                      tokenizer=tokenizer)      # a bad --model or --tokenizer: one line, before any work
    if model != "gpt":
        from fasttrain.lab.hf import load_hf_config

        load_hf_config(model)       # a missing folder or config, an unknown model_type: here, not in every row
    wanted = _parse_list(rows, "--rows")
    chosen = bench_lab.select_rows(bench_lab.lab_rows(base.per_device_train_batch_size), wanted)
    # the batch-size sweep trains its own preset of the lab's GPT: a HF model's table leaves it out
    sweep = bench_lab.sweep_selected(wanted) and model == "gpt"
    plan = bench_lab.LabPlan(preset, steps, warmup, repeats, chosen, sweep, sweep_steps,
                             data_dir=data_dir, device=device, model=model)
    if list_only:
        from fasttrain.lab.train import resolve_device

        cuda = resolve_device(base).type == "cuda"
        out_console.print(f"[bold]lab[/]: {bench_lab.title(preset)}; {plan.repeats} seed(s) per row")
        for row in plan.rows:
            reason = row.cannot_run(cuda)
            status = "[green]runs[/]" if reason is None else f"[yellow]skip[/]: {escape(reason)}"
            out_console.print(f"  {row.technique:<24} {row.label:<28} {status}")
        if plan.sweep:
            status = "[green]runs[/]" if cuda else "[yellow]skip[/]: needs a CUDA GPU"
            out_console.print(f"  {bench_lab.SWEEP_RUNG:<24} {bench_lab.SWEEP_PRESET + ' bf16':<28} {status}")
        return
    from fasttrain.environment import machine_slug
    from fasttrain.lab.data import corpus_for
    from fasttrain.lab.hf.config import is_hf, source_of
    from fasttrain.lab.tokenizer import model_tokenizer

    # missing or corrupt data: one line, before any folder is made; a HF model folder's own tokenizer
    # is the default, as in fasttrain lab
    corpus = corpus_for(base, default_tokenizer=model_tokenizer(source_of(model)) if is_hf(model) else None)
    folder = check_output_folder(out if out else Path("results") / machine_slug(), "--out", parents=True)
    with folder_lock(folder):
        _run_lab_locked(ctx, plan, folder, corpus, fresh)


def _run_lab_locked(ctx, plan, folder: Path, corpus, fresh: bool) -> None:
    from fasttrain.bench import lab as bench_lab
    from fasttrain.bench import figures, report, runner, suites

    json_path = folder / "lab.json"
    old = None
    if json_path.exists() and not fresh:
        try:
            old = report.load_result(json_path)
        except FasttrainError as exc:
            raise FasttrainError(f"{exc}; move it away, or pass --fresh to replace it") from None
        setting = bench_lab.dataset_info(corpus, plan)
        if old.dataset != setting:
            raise FasttrainError(f"{json_path} holds lab results of another setting (preset {old.dataset.get('preset')}, "
                                 f"{old.dataset.get('steps')} steps) than this run (preset {plan.preset}, {plan.steps} "
                                 "steps); merging would mix them: use another --out, or --fresh to replace them")
    console.print(f"lab: preset {plan.preset}, {plan.steps} timed steps per baseline row; results -> {folder}/")
    if figures.matplotlib_or_none() is None:
        console.print(f"[yellow]{figures.MATPLOTLIB_MISSING}[/]")

    def save_so_far(partial):
        # after every row: a run cut short (a time limit, a crash) keeps the rows it finished
        report.write_outputs(runner.merge(partial, old)[0], folder)

    run_lab = suites.spec("lab").run   # the suite's own runner (its rows are the lab's, not engines')
    result = run_lab(plan, progress=_RichProgress(), on_case=save_so_far, command=_command_line(ctx), corpus=corpus)
    result, kept = runner.merge(result, old)
    if kept:
        console.print(f"kept {kept} earlier result(s) from {json_path} (rows not run now; --fresh drops them)")
    written = report.write_plots(result, folder) + report.write_outputs(result, folder)
    click.echo(report.to_markdown(result))
    console.print("wrote " + ", ".join(str(p) for p in written))
    write_folder_outputs(folder)
    failed = [c.label for c in result.cases if c.status == "failed"]
    if failed:
        raise FasttrainError(f"{len(failed)} lab row(s) failed: {'; '.join(failed)} (tracebacks in {json_path})")


def _suite_command(name: str, help: str):
    """``fasttrain bench <name>`` for a registered suite that has no command of its own above."""

    @command.command(name, help=help)
    @_suite_options
    @_hidden_option
    @click.pass_context
    def run(ctx, **kwargs) -> None:
        run_suites(ctx, [name], **kwargs)

    return run


def _add_suite_commands() -> None:
    from fasttrain.bench.suites import all_suites

    for name, spec in all_suites().items():
        if name not in command.commands:
            _suite_command(name, spec.help)


_add_suite_commands()
