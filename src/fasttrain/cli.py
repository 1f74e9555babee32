"""The command line, a thin layer over the Python API.

Errors a user can cause print one line (``error: ...``) and exit non-zero, without a traceback.
Subcommands living beside their code (bench, memory, lab, tune) are added by :func:`add_commands`.
"""

from __future__ import annotations

import sys

import click
from rich.console import Console
from rich.table import Table

from fasttrain.errors import FasttrainError

console = Console(stderr=True)
out_console = Console()


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="fasttrain")
def cli() -> None:
    """fasttrain: train small networks as fast as the hardware allows, measured side by side."""


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


@cli.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
@click.option("--engine", default="numpy", show_default=True, help="Engine name (see: fasttrain engines).")
@click.option("--model", default="logreg", show_default=True, help="logreg or mlp:HxN (e.g. mlp:128x3).")
@click.option("--epochs", type=int, help="Epochs (logreg default 20).")
@click.option("--steps", type=int, help="SGD steps instead of epochs (mlp default 5000).")
@click.option("--batch-size", type=int, help="Batch size (logreg 128, mlp 32).")
@click.option("--lr", help="Learning rate (logreg 0.1, mlp 0.003); a comma list (0.03,0.1,0.3) trains a sweep.")
@click.option("--seed", default="0", show_default=True,
              help="Seed (initial weights, batch order); a comma list (0,1,2,3) trains a sweep.")
@click.option("--precision", type=click.Choice(["fp32", "fp64", "fp16", "bf16"]), default="fp32", show_default=True)
@click.option("--eval-every", type=int, default=1, show_default=True, help="Test evaluation every N epochs.")
@click.option("--log-every", type=int, default=50, show_default=True, help="Loss-curve point every N steps.")
@click.option("--drop-last", is_flag=True, help="Drop the last partial batch of each epoch.")
@click.option("--dataset", default="mnist", show_default=True, help="mnist, fashion-mnist or kmnist.")
@click.option("--data-dir", type=click.Path(file_okay=False), help="Data root (default: $FASTTRAIN_DATA_DIR or ~/.cache/fasttrain).")
@click.option("--out", type=click.Path(), help="Write the run record (JSON) here; for a sweep, a folder: a run "
              "record per model, sweep.json, sweep.md, sweep.png.")
@click.option("--save-weights", type=click.Path(), help="Write the trained weights (.npz) here; for a sweep, a "
              "folder of <model>.npz.")
@click.option("--quiet", is_flag=True, help="No progress bar or table.")
@click.pass_context
def train(ctx, engine, model, epochs, steps, batch_size, lr, seed, precision, eval_every, log_every, drop_last,
          dataset, data_dir, out, save_weights, quiet) -> None:
    """Train a model with one engine. Engine options (e.g. --rung 3) follow the common ones."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    import fasttrain
    from fasttrain.engines import get_engine
    from fasttrain.engines.base import parse_option_words

    from fasttrain.sweep import parse_sweep_list

    engine_options = parse_option_words(get_engine(engine), ctx.args)
    if epochs is not None and steps is not None:
        raise FasttrainError("give --epochs or --steps, not both")
    lrs = None if lr is None else parse_sweep_list(lr, "--lr", float)
    seeds = parse_sweep_list(seed, "--seed", int)
    spec = fasttrain.parse_model(model)
    if len(lrs or ()) > 1 or len(seeds) > 1:
        _train_sweep(engine, spec, lrs, seeds, engine_options, out, save_weights, quiet,
                     dict(epochs=epochs, steps=steps, batch_size=batch_size, precision=precision, eval_every=eval_every,
                          log_every=log_every, drop_last=drop_last or None, dataset=dataset, data_dir=data_dir))
        return
    lr, seed = (None if lrs is None else lrs[0]), seeds[0]
    for name, value in (("out", out), ("save_weights", save_weights)):
        if value is not None:   # a single run's outputs are files: click's own check, as before sweeps
            click.Path(dir_okay=False).convert(value, next(p for p in ctx.command.params if p.name == name), ctx)
    cfg = fasttrain.default_config(spec, epochs=epochs, steps=steps, batch_size=batch_size, lr=lr, seed=seed,
                                   precision=precision, eval_every=eval_every, log_every=log_every,
                                   drop_last=drop_last or None)
    progress = None if quiet else Progress(
        "[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=console, transient=True,
    )
    rows = []

    def on_epoch(row: dict) -> None:
        rows.append(row)
        if progress:
            progress.update(task, advance=1)
            progress.console.print(
                f"epoch {row['epoch']:>3}  {row['train_ms']:9.1f} ms  loss {_fmt(row['train_loss'], '.4f')}"
                f"  train acc {_fmt(row['train_acc'], '.4f')}  test acc {_fmt(row['test_acc'], '.4f')}"
            )

    if progress:
        n_epochs = cfg.epochs if cfg.steps is None else None
        progress.start()
        task = progress.add_task(f"{engine} {spec.name}", total=n_epochs)
    try:
        record = fasttrain.train(engine, spec, dataset=dataset, data_dir=data_dir, engine_options=engine_options,
                                 on_epoch=on_epoch, out=out, save_weights_to=save_weights, **cfg.to_dict())
    finally:
        if progress:
            progress.stop()
    if record.diverged:
        where = f"; the run record (with 'diverged') is in {out}" if out else ""
        raise FasttrainError(f"training diverged at epoch {record.diverged['epoch']} ({record.diverged['what']} "
                             f"{record.diverged['value']}); lower --lr (now {cfg.lr:g}){where}")
    if quiet:
        return
    table = Table(title=f"{engine} · {spec.name} · {cfg.precision} · batch {cfg.batch_size} · lr {cfg.lr}")
    for column in ("setup ms", "avg epoch ms (2nd half)", "p50 epoch ms", "total ms", "test loss", "test acc"):
        table.add_column(column, justify="right")
    table.add_row(f"{record.setup_ms:.1f}", f"{record.avg_epoch_ms_second_half:.2f}", f"{record.epoch_ms['p50']:.2f}",
                  f"{record.total_ms:.1f}", _fmt(record.final["test_loss"], ".4f"), _fmt(record.final["test_acc"], ".4f"))
    out_console.print(table)
    if out:
        out_console.print(f"run record: {out}")
    if save_weights:
        out_console.print(f"weights: {save_weights}")


def _train_sweep(engine, spec, lrs, seeds, engine_options, out, save_weights, quiet, options: dict) -> None:
    """``fasttrain train --lr a,b,... --seed x,y,...``: every combination at once (fasttrain.train_sweep)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    import fasttrain
    from fasttrain.contract import schedule
    from fasttrain.sweep_report import TABLE_HEADER, summary, table_rows, timing_line

    dataset, data_dir = options.pop("dataset"), options.pop("data_dir")
    base = fasttrain.default_config(spec, **options)
    lrs = lrs or [base.lr]
    k = len(lrs) * len(seeds)
    progress = None if quiet else Progress(
        "[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=console, transient=True,
    )

    def on_epoch(sweep_epoch: dict) -> None:
        # one line per epoch for the whole sweep: the spread of the live models' figures
        if not progress:
            return
        rows = [r for r in sweep_epoch["models"] if r is not None]
        losses = [r["train_loss"] for r in rows if r["train_loss"] is not None]
        accs = [r["test_acc"] for r in rows if r["test_acc"] is not None]
        loss = f"{min(losses):.4f}–{max(losses):.4f}" if losses else "-"
        progress.update(task, total=n_epochs, advance=1)
        progress.console.print(
            f"epoch {sweep_epoch['epoch']:>3}  {sweep_epoch['train_ms']:9.1f} ms  {sweep_epoch['live']}/{k} models live"
            f"  train loss {loss}  best test acc {_fmt(max(accs) if accs else None, '.4f')}")

    n_epochs = None
    if progress:
        n_epochs = base.epochs
        progress.start()
        task = progress.add_task(f"{engine} {spec.name} × {k}", total=n_epochs)
    try:
        result = fasttrain.train_sweep(engine, spec, lrs=lrs, seeds=seeds, dataset=dataset, data_dir=data_dir,
                                       engine_options=engine_options, on_epoch=on_epoch, out=out,
                                       save_weights_to=save_weights,
                                       **{k: v for k, v in base.to_dict().items() if k not in ("lr", "seed")})
    finally:
        if progress:
            progress.stop()
    summary_data = summary(result)
    if not quiet:
        table = Table(title=f"{engine} · {spec.name} · {base.precision} · batch {base.batch_size} · {k} models at once")
        for column in TABLE_HEADER:
            left = column in ("model", "diverged")
            table.add_column(column, justify="left" if left else "right", no_wrap=left)
        for row in table_rows(summary_data):
            table.add_row(*row, style="red" if row[-1] != "-" else None)
        out_console.print(table)
        out_console.print(f"timing: {timing_line(result.timing)}", highlight=False)
        if out:
            out_console.print(f"run records, sweep.json, sweep.md: {out}/")
        if save_weights:
            out_console.print(f"weights: {save_weights}/")
    if result.all_diverged:
        first = min(r.diverged["epoch"] for r in result.records)
        where = f"; the run records (with 'diverged') are in {out}/" if out else ""
        raise FasttrainError(f"every model of the sweep diverged (from epoch {first}); lower --lr (now "
                             f"{','.join(f'{v:g}' for v in result.lrs)}){where}")


@cli.command()
def engines() -> None:
    """List the engines, whether each can run here, and why not."""
    # piped or captured output has no terminal width: print wide rather than one word per line
    print_engines(out_console if out_console.is_terminal else Console(width=200))


def print_engines(target: Console) -> None:
    """The engines as a table when the console is wide enough, else one block per engine; rich
    wraps long cells at spaces in both, so an install hint is never cut."""
    import dataclasses

    from fasttrain.engines import registry

    rows = []
    for name, engine_cls in registry().items():
        reason = engine_cls.available()
        opts = " ".join(f"--{f.name.replace('_', '-')}" for f in dataclasses.fields(engine_cls.Options))
        rows.append((name, "yes" if reason is None else f"no: {reason}", ",".join(engine_cls.precisions),
                     opts or "-", engine_cls.description, engine_cls.sweep or "no"))
    if target.width >= 160:
        table = Table(title="fasttrain engines")
        for column in ("engine", "available", "precisions", "options", "description", "many models at once"):
            table.add_column(column, overflow="fold")
        for row in rows:
            table.add_row(*row)
        target.print(table)
        return
    from rich.padding import Padding
    from rich.text import Text

    for name, available, precisions, opts, description, sweep in rows:
        target.print(Text.assemble((name, "bold"), f"  {precisions}"))
        for text, style in ((f"options: {opts}", ""), (description, ""), (f"many models at once: {sweep}", ""),
                            (f"available: {available}", "" if available == "yes" else "yellow")):
            target.print(Padding(Text(text, style=style, overflow="fold"), (0, 0, 0, 2), expand=False))


@cli.command("evaluate")
@click.option("--weights", "weights_path", required=True, type=click.Path(dir_okay=False), help="Weights .npz.")
@click.option("--dataset", default="mnist", show_default=True)
@click.option("--data-dir", type=click.Path(file_okay=False))
def evaluate_cmd(weights_path, dataset, data_dir) -> None:
    """Score saved weights on the test set (float64)."""
    import fasttrain
    from fasttrain.data import load_dataset

    weights = fasttrain.load_weights(weights_path)  # checked: shapes chain 784 -> ... -> 10, all finite
    loss, acc = fasttrain.evaluate_weights(weights, load_dataset(dataset, data_dir))
    out_console.print(f"test loss {loss:.4f}  test acc {acc:.4f}")


@cli.group()
def data() -> None:
    """Download and verify datasets."""


@data.command("download")
@click.option("--dataset", default="mnist", show_default=True,
              help="mnist, fashion-mnist, kmnist or tinyshakespeare.")
@click.option("--data-dir", type=click.Path(file_okay=False), help="Data root.")
@click.option("--force", is_flag=True, help="Download even files that are present and valid.")
def data_download(dataset, data_dir, force) -> None:
    """Download a dataset (mirror fallback, retries, checksums, atomic writes)."""
    from fasttrain.data import download_dataset

    for path, status in download_dataset(dataset, data_dir, force=force,
                                         log=lambda line: console.print(line, markup=False, highlight=False)):
        out_console.print(f"{path}: {status}")


@data.command("verify")
@click.option("--dataset", default="mnist", show_default=True)
@click.option("--data-dir", type=click.Path(file_okay=False))
def data_verify(dataset, data_dir) -> None:
    """Check a dataset's files: structure and checksums."""
    from fasttrain.data import verify_dataset

    for path, status in verify_dataset(dataset, data_dir):
        out_console.print(f"{path}: {status}")
    out_console.print(f"{dataset}: all files verified")


def add_commands() -> None:
    """The subcommands that live beside their code, registered here by plain imports (once: the
    imports are cheap after the first); ``fasttrain cost`` is ``fasttrain memory cost``, and
    ``fasttrain memory validate`` trains through the lab (which the memory package does not import)."""
    from fasttrain.bench.cli import command as bench
    from fasttrain.lab.cli import command as lab
    from fasttrain.lab.experiments.memory_check import validate_command
    from fasttrain.lab.tune.cli import command as tune
    from fasttrain.memory.cli import command as memory

    memory.add_command(validate_command)
    for sub in (bench, memory, lab, tune):
        cli.add_command(sub)
    # ``fasttrain cost`` is what people type for the training-cost table: the same command
    cli.add_command(memory.commands["cost"], "cost")


def _os_error_line(exc: OSError) -> str:
    """One line for an OSError the code did not turn into a FasttrainError itself (a full disk, a
    read-only folder, a path that is a folder): what failed, on which path, and what to do."""
    import errno

    where = f"{exc.filename}: " if exc.filename else ""
    what = exc.strerror or str(exc) or type(exc).__name__
    fixes = {
        errno.ENOSPC: "free some space or write somewhere else",
        errno.EDQUOT: "free some space or write somewhere else",
        errno.EROFS: "the file system is read-only; write somewhere else",
        errno.EACCES: "no permission there; choose a path you can write, or fix its permissions",
        errno.EPERM: "no permission there; choose a path you can write, or fix its permissions",
        errno.ENOENT: "check the path (its folder must exist)",
        errno.EISDIR: "that path is a folder; give a file name",
        errno.ENOTDIR: "a part of that path is a file, not a folder",
        errno.ENAMETOOLONG: "use a shorter path",
    }
    fix = fixes.get(exc.errno, "check the path and the disk")
    return f"{where}{what}; {fix}"


def main(argv: list[str] | None = None) -> int:
    add_commands()
    no_args_help = getattr(click.exceptions, "NoArgsIsHelpError", ())
    try:
        cli.main(args=argv, prog_name="fasttrain", standalone_mode=False)
    except click.exceptions.Exit as exc:
        return exc.exit_code
    except click.exceptions.Abort:
        console.print("aborted")
        return 130
    except no_args_help as exc:
        # a group called without a subcommand: its help, as written, not squashed into an error line
        click.echo(exc.format_message())
        return 0
    except click.ClickException as exc:
        message = exc.format_message().replace("\n", " ")
        print(f"error: {message} (see: fasttrain {' '.join(a for a in (argv or sys.argv[1:])[:1])} --help)".replace("  ", " "),
              file=sys.stderr)
        return exc.exit_code
    except FasttrainError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # the reader went away (``fasttrain engines | head``): nothing left to say to it
        sys.stderr.close()
        return 141
    except OSError as exc:
        # a disk or path problem the code did not foresee still gets one line, not a traceback;
        # every file the project writes goes through a temporary name, so none is left half-written
        print(f"error: {_os_error_line(exc)}", file=sys.stderr)
        return 1
    except MemoryError:
        print("error: out of memory; use a smaller model, batch or dataset", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
