"""``fasttrain bench``: the benchmark suites and the README generator (registered by fasttrain.cli)."""

from __future__ import annotations

import dataclasses
import shlex
from pathlib import Path

import click
from rich.console import Console
from rich.markup import escape

from fasttrain.bench.runner import Progress
from fasttrain.errors import FasttrainError

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
        from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
        from rich.progress import Progress as Bars

        self._bar = Bars(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                             console=console, transient=True)
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
               list_only, hidden=None, rows=None) -> None:
    from fasttrain.bench import plots, report, runner, suites
    from fasttrain.bench.data import bench_data
    from fasttrain.environment import machine_slug
    from fasttrain.training import atomic_write_text

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

    if list_only:
        for suite in built:
            out_console.print(f"[bold]{suite.name}[/]: {suite.title}; {len(suite.cases())} cases, {suite.repeats} seed(s) each")
            for case, reason in runner.plan(suite, engines_filter):
                status = "[green]runs[/]" if reason is None else f"[yellow]skip[/]: {escape(reason)}"
                out_console.print(f"  {case.row.label:<28} {case.model:<11} {status}")
        return

    folder = Path(out) if out else Path("results") / machine_slug()
    folder.mkdir(parents=True, exist_ok=True)
    data, info, note = bench_data(dataset, data_dir, quick, synthetic)
    if note:
        console.print(f"[bold yellow]warning:[/] {note}")
    console.print(f"data: {report.dataset_line(info)}; results -> {folder}/")
    if plots.matplotlib_or_none() is None:
        console.print(f"[yellow]{plots.MATPLOTLIB_MISSING}[/]")

    command_text = _command_line(ctx)
    failed: list[str] = []
    for suite in built:
        json_path = folder / f"{suite.name}.json"
        old = None
        if not fresh and json_path.is_file():
            try:
                old = report.load_result(json_path)
            except FasttrainError as exc:
                console.print(f"[yellow]not merging with {json_path}: {escape(str(exc))}[/]")

        def save_so_far(partial, old=old, json_path=json_path):
            # after every row: a run cut short (a time limit, a crash) keeps the rows it finished
            atomic_write_text(json_path, report.to_json(runner.merge(partial, old)[0]))

        result = runner.run_suite(suite, data, engines_filter=engines_filter, command=command_text, dataset_info=info,
                                  progress=_RichProgress(), on_case=save_so_far)
        failed += [f"{c.suite} {c.label} {c.model}" for c in result.cases if c.status == "failed"]
        result, kept = runner.merge(result, old)
        if kept:
            console.print(f"kept {kept} earlier result(s) from {json_path} (rows or sizes not run now; --fresh drops them)")
        written = plots.write_plots(result, folder) + report.write_outputs(result, folder)
        click.echo(report.to_markdown(result))
        console.print("wrote " + ", ".join(str(p) for p in written))

    write_folder_outputs(folder)
    if failed:
        raise FasttrainError(f"{len(failed)} row(s) failed: {'; '.join(failed)} (tracebacks in the suite's JSON under {folder}/)")


def write_folder_outputs(folder: Path) -> None:
    """The combined long CSV and a README preview over every suite in the folder."""
    from fasttrain.bench import report, suites
    from fasttrain.bench.readme import readme_section
    from fasttrain.training import atomic_write_text

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
    """Time against hidden size: mlp:Hx3, 5000 steps, batch 32, lr 0.003, fp16, 3 seeds."""
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
    from fasttrain.bench import plots, report, suites

    folder = Path(results_dir)
    names = [n for n in suites.all_suites() if (folder / f"{n}.json").is_file()]
    if not names:
        raise FasttrainError(f"{folder}: no suite's results (<suite>.json) to render")
    if plots.matplotlib_or_none() is None:
        console.print(f"[yellow]{plots.MATPLOTLIB_MISSING}[/]")
    for name in names:
        result = report.load_result(folder / f"{name}.json")
        written = plots.write_plots(result, folder) + report.write_outputs(result, folder)
        console.print("wrote " + ", ".join(str(p) for p in written))
    write_folder_outputs(folder)


@command.command("merge")
@click.argument("into", type=click.Path(file_okay=False))
@click.argument("parts", nargs=-1, required=True, type=click.Path(file_okay=False, exists=True))
def merge_cmd(into, parts) -> None:
    """Merge the results of runs split over several calls (PARTS folders, later ones win for a row
    they ran) into INTO, then write its CSV, Markdown and PNG files. Parts must come from the same
    GPU kind, data and --quick setting."""
    from fasttrain.bench import plots, report, runner, suites

    folder = Path(into)
    folder.mkdir(parents=True, exist_ok=True)
    merged_any = False
    for name in suites.all_suites():
        paths = [p for p in [folder / f"{name}.json", *(Path(d) / f"{name}.json" for d in parts)] if p.is_file()]
        if not paths or paths == [folder / f"{name}.json"]:
            continue
        results = [report.load_result(p) for p in dict.fromkeys(paths)]
        gpus = {report.gpu_name(r.environment) for r in results if r.ran()}
        if len(gpus) > 1:
            raise FasttrainError(f"{name}: parts measured on different GPUs ({', '.join(sorted(gpus))}); keep them in separate folders")
        acc = results[0]
        for part in results[1:]:
            if (part.quick, part.dataset) != (acc.quick, acc.dataset):
                raise FasttrainError(f"{name}: parts differ in --quick or data ({acc.dataset['name']} vs {part.dataset['name']}); "
                                     "merge only runs of one setting")
            acc = runner.merge(part, acc)[0]
        written = plots.write_plots(acc, folder) + report.write_outputs(acc, folder)
        console.print(f"{name}: merged {len(results)} file(s); wrote " + ", ".join(str(p) for p in written))
        merged_any = True
    if not merged_any:
        raise FasttrainError(f"no suite's results (<suite>.json) in {', '.join(parts)}")
    write_folder_outputs(folder)


@command.command()
@click.argument("results_dir", type=click.Path(file_okay=False))
@click.option("--link-base", help="Prefix of image links (default: RESULTS_DIR/, a path from the repository root).")
@click.option("--into", "into", type=click.Path(dir_okay=False),
              help="Write it into this file between <!-- bench-results:start --> and <!-- bench-results:end -->.")
def readme(results_dir, link_base, into) -> None:
    """Print the README's Results section from the result files in RESULTS_DIR."""
    from fasttrain.bench.readme import readme_section, write_into

    section = readme_section(results_dir, link_base)
    if into:
        write_into(into, section)
        console.print(f"wrote the results section of {into} from {results_dir}")
    else:
        click.echo(section, nl=False)


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

    for name, (_builder, help) in all_suites().items():
        if name not in command.commands:
            _suite_command(name, help)


_add_suite_commands()
