"""Where a lab run's logged steps go while it runs: lines, metrics files, TensorBoard, Weights & Biases.

:class:`~fasttrain.lab.trainer.Metrics` hands every logged step (every ``--log-interval`` steps and
the last) and every evaluation to a :class:`Loggers`, which fans them out to its sinks:

- :class:`StepLines`: one line per logged step through the run's ``log`` when the output is not a
  terminal (a file, a pipe, a batch job's log), where the progress bar shows nothing;
- :class:`JsonlSink`, :class:`CsvSink`: ``metrics.jsonl`` / ``metrics.csv``, flushed at each logged
  step (a crash keeps the curve so far);
- :class:`TensorBoardSink`: ``torch.utils.tensorboard``'s event file (needs ``tensorboard``);
- :class:`WandbSink`: a Weights & Biases run (``wandb``; ``WANDB_MODE=offline`` writes it locally).

``--report-to`` chooses them as the Hugging Face Trainer names them: ``none``, ``jsonl``, ``csv``,
``tensorboard``, ``wandb``, ``all`` or a comma-separated list (default ``jsonl,csv``). They are
written under ``--logging-dir DIR`` (``DIR/metrics.jsonl``, ``DIR/tensorboard/``, ``DIR/wandb/``),
else beside the run record ``--out RUN.json`` (``RUN.metrics.jsonl``, ``RUN.tensorboard/``, ...);
with neither, the default files are not written and an explicit ``--report-to`` is refused.

A logged step's row: ``step``, ``loss`` (the global batch's mean), ``lr`` (the step's), ``grad_norm``
(the total norm before clipping, as ``clip_grad_norm_`` computed it; none with ``--max-grad-norm 0``),
``tokens_per_s`` (tokens of the steps since the last logged step over their measured time),
``memory_gb`` (the peak allocated on a GPU since the last evaluation, else the process' peak
resident memory) and ``tokens_seen`` (step x tokens per optimizer step).
"""

from __future__ import annotations

import csv
import json
import math
import os
import sys
from pathlib import Path

from fasttrain.errors import FasttrainError

REPORTERS = ("jsonl", "csv", "tensorboard", "wandb")
DEFAULT_REPORT_TO = "jsonl,csv"
# the columns of a logged step (and of an evaluation: step, tokens_seen, val_loss)
COLUMNS = ("step", "loss", "lr", "grad_norm", "tokens_per_s", "memory_gb", "tokens_seen", "val_loss")


def reporters(report_to: str) -> tuple[str, ...]:
    """``--report-to`` as the sinks it names (in :data:`REPORTERS` order); one line if it names none."""
    names = [n.strip() for n in str(report_to).split(",") if n.strip()]
    unknown = [n for n in names if n not in (*REPORTERS, "all", "none")]
    if unknown or not names:
        raise FasttrainError(f"--report-to {report_to!r}: name none, all or any of {', '.join(REPORTERS)} "
                             f"(comma-separated, e.g. --report-to jsonl,tensorboard)")
    if "none" in names and len(names) > 1:
        raise FasttrainError(f"--report-to {report_to!r}: none cannot go with other loggers")
    if "all" in names:
        return REPORTERS
    return tuple(n for n in REPORTERS if n in names)


def log_prefix(cfg, record_path=None) -> str | None:
    """Where the files go: ``DIR/`` for ``--logging-dir DIR``, ``RUN.`` beside ``--out RUN.json``, else None."""
    if cfg.logging_dir:
        return os.path.join(os.fspath(Path(cfg.logging_dir).expanduser()), "")
    if record_path:
        path = Path(record_path).expanduser()
        return os.fspath(path.with_suffix("")) + "."
    return None


def check_loggers(cfg, record_path=None) -> tuple[str, ...]:
    """Before any work: the sinks ``cfg`` asks for, each with a place to write and its library; the
    sinks that will run (the default files are dropped quietly where there is no place)."""
    names = reporters(cfg.report_to)
    prefix = log_prefix(cfg, record_path)
    if prefix is None:
        if names and cfg.report_to != DEFAULT_REPORT_TO:
            raise FasttrainError(f"--report-to {cfg.report_to}: give --logging-dir DIR (or --out RUN.json, beside "
                                 f"which the logs go)")
        return ()
    if cfg.logging_dir:
        folder = Path(cfg.logging_dir).expanduser()
        if folder.exists() and not folder.is_dir():
            raise FasttrainError(f"--logging-dir {cfg.logging_dir}: that is a file; give a folder")
        existing = folder if folder.exists() else folder.parent
        if not existing.is_dir() or not os.access(existing, os.W_OK):
            raise FasttrainError(f"--logging-dir {cfg.logging_dir}: {existing} is not a writable folder; "
                                 f"choose another")
    if "tensorboard" in names:
        try:
            import tensorboard  # noqa: F401  (torch.utils.tensorboard writes through it)
        except ImportError:
            raise FasttrainError("--report-to tensorboard needs the tensorboard package: pip install tensorboard "
                                 "(or the lab extra)") from None
    if "wandb" in names:
        try:
            import wandb  # noqa: F401
        except ImportError:
            raise FasttrainError("--report-to wandb needs the wandb package: pip install wandb (or the lab "
                                 "extra); WANDB_MODE=offline writes the run without an account") from None
        if not wandb_credentials():
            raise FasttrainError(WANDB_LOGIN)
    return names


WANDB_LOGIN = ("--report-to wandb: no W&B account here (no WANDB_API_KEY, no `wandb login`); log in, or set "
               "WANDB_MODE=offline to write the run locally (wandb sync uploads it later)")


def wandb_credentials() -> bool:
    """Whether a W&B run can start without asking: offline or disabled, an API key in the environment,
    or the key ``wandb login`` writes into ~/.netrc for the server's host."""
    if os.environ.get("WANDB_MODE", "").lower() in ("offline", "disabled", "dryrun") or os.environ.get("WANDB_API_KEY"):
        return True
    import netrc
    from urllib.parse import urlparse

    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        return netrc.netrc(os.environ.get("NETRC")).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def is_terminal() -> bool:
    """Whether the run's messages (stderr) reach a terminal, where the progress bar shows the steps."""
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


def step_line(row: dict, total: int | None = None) -> str:
    """``step 20/200  loss 3.2104  lr 1.00e-03  grad-norm 0.871  12,345 tok/s  mem 0.41 GB  40,960 tokens``."""
    width = len(str(total)) if total else 6
    parts = [f"step {row['step']:>{width}}" + (f"/{total}" if total else "")]
    for key, text in (("loss", "loss {:.4f}"), ("lr", "lr {:.2e}"), ("grad_norm", "grad-norm {:.3g}"),
                      ("tokens_per_s", "{:,.0f} tok/s"), ("memory_gb", "mem {:.2f} GB"),
                      ("tokens_seen", "{:,} tokens")):
        if row.get(key) is not None:
            parts.append(text.format(row[key]))
    return "  ".join(parts)


# --- sinks: each takes rows (step(row), evaluation(row)) and is closed once -----------------------------

class StepLines:
    def __init__(self, log, total: int):
        self.log, self.total = log, total

    def step(self, row: dict) -> None:
        self.log(step_line(row, self.total))

    def evaluation(self, row: dict) -> None:
        pass                                    # Metrics logs its own validation line

    def close(self) -> None:
        pass


class JsonlSink:
    """One JSON object a line: ``{"step": .., "loss": ..}`` for a logged step, ``{"step": .., "val_loss": ..}``
    for an evaluation."""

    def __init__(self, path: str):
        self.path = path
        self.file = open(path, "w", encoding="utf-8")

    def _write(self, row: dict) -> None:
        clean = {k: (v if not isinstance(v, float) or math.isfinite(v) else None) for k, v in row.items()}
        self.file.write(json.dumps(clean) + "\n")
        self.file.flush()

    step = evaluation = _write

    def close(self) -> None:
        self.file.close()


class CsvSink:
    """The columns of :data:`COLUMNS`; a logged step leaves ``val_loss`` empty, an evaluation the rest."""

    def __init__(self, path: str):
        self.path = path
        self.file = open(path, "w", encoding="utf-8", newline="")
        self.writer = csv.DictWriter(self.file, fieldnames=COLUMNS, extrasaction="ignore")
        self.writer.writeheader()
        self.file.flush()

    def _write(self, row: dict) -> None:
        self.writer.writerow({k: ("" if row.get(k) is None else row[k]) for k in COLUMNS})
        self.file.flush()

    step = evaluation = _write

    def close(self) -> None:
        self.file.close()


class TensorBoardSink:
    """Scalars ``train/loss``, ``train/lr``, ... and ``eval/loss`` against the step."""

    def __init__(self, folder: str, config: dict):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=folder)
        self.writer.add_text("config", "```\n" + json.dumps(config, indent=1, default=str) + "\n```")

    def step(self, row: dict) -> None:
        for key in COLUMNS[1:-1]:
            if row.get(key) is not None:
                self.writer.add_scalar(f"train/{key}", row[key], row["step"])
        self.writer.flush()

    def evaluation(self, row: dict) -> None:
        self.writer.add_scalar("eval/loss", row["val_loss"], row["step"])
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """A Weights & Biases run in ``folder`` (``WANDB_MODE=offline``: written there, synced later with
    ``wandb sync``), the config as its config, rows as ``train/...`` and ``eval/loss``."""

    def __init__(self, folder: str, config: dict, name: str):
        import wandb

        os.makedirs(folder, exist_ok=True)
        try:
            self.run = wandb.init(dir=folder, config=config, name=name,
                                  project=os.environ.get("WANDB_PROJECT", "fasttrain"), reinit="create_new",
                                  # no console capture, no summary printed: the run's own lines say it
                                  settings=wandb.Settings(silent=True, console="off"))
        except wandb.errors.UsageError as exc:       # credentials found but refused, or a prompt needed
            raise FasttrainError(f"{WANDB_LOGIN} ({exc})") from None

    def step(self, row: dict) -> None:
        self.run.log({f"train/{k}": row[k] for k in COLUMNS[1:-1] if row.get(k) is not None}, step=row["step"])

    def evaluation(self, row: dict) -> None:
        self.run.log({"eval/loss": row["val_loss"]}, step=row["step"])

    def close(self) -> None:
        self.run.finish()


class Loggers:
    """The run's sinks; ``step(row)`` / ``evaluation(row)`` go to each, ``close()`` once at the end."""

    def __init__(self, sinks=(), paths: dict | None = None):
        self.sinks = list(sinks)
        self.paths = dict(paths or {})          # reporter -> the file or folder it writes

    def step(self, row: dict) -> None:
        for sink in self.sinks:
            sink.step(row)

    def evaluation(self, row: dict) -> None:
        for sink in self.sinks:
            sink.evaluation(row)

    def close(self) -> None:
        sinks, self.sinks = self.sinks, []
        for sink in sinks:
            sink.close()


def open_loggers(cfg, record_path=None, *, log=None, lines: bool | None = None) -> Loggers:
    """The sinks of ``cfg`` (:func:`check_loggers`), opened; ``lines``: one line per logged step through
    ``log`` (default: when stderr is not a terminal)."""
    names = check_loggers(cfg, record_path)
    sinks, paths = [], {}
    if log is not None and (not is_terminal() if lines is None else lines):
        sinks.append(StepLines(log, cfg.max_steps))
    prefix = log_prefix(cfg, record_path)
    if names:
        os.makedirs(os.path.dirname(prefix) or ".", exist_ok=True)
    config = cfg.to_dict()
    try:
        for name in names:
            if name == "jsonl":
                paths[name] = prefix + "metrics.jsonl"
                sinks.append(JsonlSink(paths[name]))
            elif name == "csv":
                paths[name] = prefix + "metrics.csv"
                sinks.append(CsvSink(paths[name]))
            elif name == "tensorboard":
                paths[name] = prefix + "tensorboard"
                sinks.append(TensorBoardSink(paths[name], config))
            elif name == "wandb":
                paths[name] = prefix + "wandb"
                sinks.append(WandbSink(paths[name], config, cfg.name))
    except BaseException:
        Loggers(sinks).close()
        raise
    return Loggers(sinks, paths)


__all__ = ["Loggers", "open_loggers", "check_loggers", "reporters", "log_prefix", "step_line", "is_terminal",
           "REPORTERS", "DEFAULT_REPORT_TO", "COLUMNS", "StepLines", "JsonlSink", "CsvSink", "TensorBoardSink",
           "WandbSink"]
