"""The command line, a thin layer over the Python API.

Errors a user can cause print one line (``error: ...``) and exit non-zero, without a traceback.
Subcommands living beside their code (bench, memory) are added by :func:`_load_plugins`.
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
@click.option("--lr", type=float, help="Learning rate (logreg 0.1, mlp 0.003).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--precision", type=click.Choice(["fp32", "fp64", "fp16", "bf16"]), default="fp32", show_default=True)
@click.option("--eval-every", type=int, default=1, show_default=True, help="Test evaluation every N epochs.")
@click.option("--log-every", type=int, default=50, show_default=True, help="Loss-curve point every N steps.")
@click.option("--drop-last", is_flag=True, help="Drop the last partial batch of each epoch.")
@click.option("--dataset", default="mnist", show_default=True, help="mnist, fashion-mnist or kmnist.")
@click.option("--data-dir", type=click.Path(file_okay=False), help="Data root (default: $FASTTRAIN_DATA_DIR or ~/.cache/fasttrain).")
@click.option("--out", type=click.Path(dir_okay=False), help="Write the run record (JSON) here.")
@click.option("--save-weights", type=click.Path(dir_okay=False), help="Write the trained weights (.npz) here.")
@click.option("--quiet", is_flag=True, help="No progress bar or table.")
@click.pass_context
def train(ctx, engine, model, epochs, steps, batch_size, lr, seed, precision, eval_every, log_every, drop_last,
          dataset, data_dir, out, save_weights, quiet) -> None:
    """Train a model with one engine. Engine options (e.g. --rung 3) follow the common ones."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    import fasttrain
    from fasttrain.engines import get_engine
    from fasttrain.engines.base import parse_option_words

    engine_options = parse_option_words(get_engine(engine), ctx.args)
    if epochs is not None and steps is not None:
        raise FasttrainError("give --epochs or --steps, not both")
    spec = fasttrain.parse_model(model)
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


@cli.command()
def engines() -> None:
    """List the engines, whether each can run here, and why not."""
    import dataclasses

    from fasttrain.engines import registry

    table = Table(title="fasttrain engines")
    for column in ("engine", "available", "precisions", "options", "description"):
        table.add_column(column)
    for name, engine_cls in registry().items():
        reason = engine_cls.available()
        opts = " ".join(f"--{f.name.replace('_', '-')}" for f in dataclasses.fields(engine_cls.Options))
        table.add_row(name, "yes" if reason is None else f"no: {reason}", ",".join(engine_cls.precisions),
                      opts or "-", engine_cls.description)
    # piped or captured output has no terminal width: print wide rather than one word per line
    (out_console if out_console.is_terminal else Console(width=200)).print(table)


@cli.command("evaluate")
@click.option("--weights", "weights_path", required=True, type=click.Path(dir_okay=False), help="Weights .npz.")
@click.option("--dataset", default="mnist", show_default=True)
@click.option("--data-dir", type=click.Path(file_okay=False))
def evaluate_cmd(weights_path, dataset, data_dir) -> None:
    """Score saved weights on the test set (float64)."""
    import fasttrain
    from fasttrain.data import load_dataset

    weights = fasttrain.load_weights(weights_path)
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

    for path, status in download_dataset(dataset, data_dir, force=force):
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


def _load_plugins() -> None:
    """Subcommands living beside their code: each module exposes a click command named ``command``."""
    import importlib

    for module in ("fasttrain.bench.cli", "fasttrain.memory.cli", "fasttrain.lab.cli"):
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            # the plugin (or its package) is absent: run without it; a missing dependency *inside* it still raises
            if exc.name == module or module.startswith(f"{exc.name}."):
                continue
            raise
        cli.add_command(mod.command)


def main(argv: list[str] | None = None) -> int:
    _load_plugins()
    try:
        cli.main(args=argv, prog_name="fasttrain", standalone_mode=False)
    except click.exceptions.Exit as exc:
        return exc.exit_code
    except click.exceptions.Abort:
        console.print("aborted")
        return 130
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
