"""Run records a person can rerun: what a lab run record holds besides its measurements, the record
as a Python object (:class:`RunRecord`, what ``fasttrain.lab.run`` returns), reading a record back
(``fasttrain lab --from-record RUN.json``) and plotting loss curves, of one run or several on the same
axes (``fasttrain lab plot A.json B.json``).

Provenance (:func:`provenance`): the command line that runs the configuration again, this
process's own argv, the versions of every library a technique uses, the model's source, family
and configuration, and the corpus -- its file's SHA-256 where the data source knows it, and the
SHA-256 of the token ids themselves (train then validation, as stored), so that a rerun on other
data is seen even where the text is the same.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from fasttrain.errors import FasttrainError
from fasttrain.lab.data import tokens_sha256
from fasttrain.lab.resume import model_change, model_description

# every library a lab technique runs on (distribution names)
LIBRARIES = ("torch", "numpy", "transformers", "tokenizers", "peft", "torchao", "liger-kernel", "safetensors",
             "bitsandbytes")


def library_versions(names=LIBRARIES) -> dict[str, str | None]:
    """Installed version of each of ``names`` (default :data:`LIBRARIES`; None: not installed)."""
    out = {}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def provenance(cfg, lab_model, corpus) -> dict:
    """The record's rerun section (see the module docstring)."""
    from fasttrain.lab.config import PRESETS
    from fasttrain.lab.hf.config import is_hf
    from fasttrain.lab.overrides import command_line

    return {
        "command": command_line(cfg, cfg.name if cfg.name in PRESETS else "shakespeare-char")
        if lab_model.name == "gpt" or is_hf(lab_model.name) else None,
        "argv": list(sys.argv),
        "libraries": library_versions(),
        "model_source": {"name": lab_model.name, "family": lab_model.family, "vocab_size": lab_model.vocab_size,
                         "context": lab_model.context, "config_file": model_description(cfg.model)},
        "corpus": {"sha256": getattr(corpus, "sha256", None), "tokens_sha256": tokens_sha256(corpus),
                   "vocab_size": int(corpus.vocab_size), "train_tokens": int(len(corpus.train)),
                   "val_tokens": int(len(corpus.val)), "tokenizer": _tokenizer_description(corpus)},
    }


def _tokenizer_description(corpus) -> dict | str | None:
    """What rebuilds the corpus' tokenizer (a JSON-able description), never the object itself."""
    tok = getattr(corpus, "tokenizer", None)
    if tok is None or isinstance(tok, str | dict):
        return tok
    return tok.describe() if hasattr(tok, "describe") else type(tok).__name__


@dataclass
class RunRecord:
    """One lab run: the measurements of its JSON record as attributes, and the trained model.

    ``record.to_dict()`` is the JSON run record (``fasttrain lab --out``)."""

    config: dict
    loss_curve: list[dict]
    evals: list[dict]
    memory: dict
    step_ms: dict
    tokens_per_s: float | None
    final: dict
    model: Any = None                       # the trained nn.Module (the module itself, not a wrapper)
    data: dict = field(default_factory=dict, repr=False)

    @classmethod
    def from_dict(cls, record: dict, model=None) -> "RunRecord":
        return cls(config=record["config"], loss_curve=record["loss_curve"], evals=record["eval"],
                   memory=record["memory"], step_ms=record["step_ms"], tokens_per_s=record["tokens_per_s"],
                   final=record["final"], model=model, data=record)

    @property
    def losses(self) -> list[float]:
        return [p["loss"] for p in self.loss_curve]

    @property
    def val_loss(self) -> float | None:
        return self.final.get("val_loss")

    @property
    def peak_memory_bytes(self) -> int | None:
        return self.memory.get("peak_allocated_bytes")

    @property
    def timings(self) -> dict:
        """Setup, warm-up steps, the other steps (p20/p50/p80/mean ms), training, evaluation and wall time."""
        return {k: self.data.get(k) for k in ("setup_ms", "warmup_ms", "step_ms", "train_ms", "eval_ms", "wall_ms",
                                              "tokens_per_s")}

    def to_dict(self) -> dict:
        return dict(self.data)

    def save(self, path) -> Path:
        from fasttrain.lab.checkpoint import write_record

        return write_record(self.data, path)

    def plot(self, path) -> Path:
        return plot_loss_curve(self.data, path)


def load_record(path) -> dict:
    """A lab run record (JSON) from ``path``; one line saying what is wrong otherwise."""
    from fasttrain.files import read_json_object

    p = Path(path)
    record = read_json_object(p, "run record", missing="no such run record", hint=f"write one with: fasttrain lab ... --out {p}")
    if record.get("kind") != "lab-run" or "config" not in record:
        raise FasttrainError(f"{p}: not a lab run record (written by fasttrain lab --out)")
    return record


def config_of_record(record: dict):
    """The :class:`~fasttrain.lab.config.LabConfig` a record ran (validated); ``save`` and ``resume`` dropped."""
    from fasttrain.lab.config import validate
    from fasttrain.lab.overrides import config_from_dict

    cfg = config_from_dict(record["config"])
    drop = {name: None for name in ("save", "resume") if hasattr(cfg, name)}
    return validate(cfg.with_(**drop))


def check_record_inputs(record: dict, cfg, where) -> None:
    """Before a ``--from-record`` rerun: the data it reads again is the data the record ran on. A
    corpus file at the recorded path whose SHA-256 changed, or a tokenizer that is not the recorded
    one, is refused in one line naming it (a flag given beside ``--from-record`` that points
    elsewhere is a deliberate change: not compared)."""
    import hashlib

    from fasttrain.lab.tokenizer import load_tokenizer

    ran = record.get("config") or {}
    corpus = record.get("corpus") if isinstance(record.get("corpus"), dict) else {}
    recorded = corpus.get("sha256")
    for name in ("train_file", "train_bin"):
        path = getattr(cfg, name, None)
        if not path or path != ran.get(name) or not isinstance(recorded, str):
            continue
        digest = hashlib.sha256()
        with open(Path(path).expanduser(), "rb") as fh:
            for block in iter(lambda: fh.read(1 << 24), b""):
                digest.update(block)
        now = digest.hexdigest()
        if now != recorded:
            raise FasttrainError(f"--from-record {where}: --{name.replace('_', '-')} {path} changed since the run "
                                 f"(SHA-256 {now[:12]}..., recorded {recorded[:12]}...); restore the file the run "
                                 f"read, or rerun without --from-record to train on the new one")
    source = record.get("model_source") if isinstance(record.get("model_source"), dict) else {}
    if cfg.model == ran.get("model"):
        change = model_change(source.get("config_file"), model_description(cfg.model))
        if change:
            raise FasttrainError(f"--from-record {where}: {change}; restore the model the run trained, or rerun "
                                 f"without --from-record")
    desc = corpus.get("tokenizer")
    if isinstance(desc, dict) and desc.get("kind") == "hf" and cfg.tokenizer == ran.get("tokenizer"):
        try:
            load_tokenizer(desc)          # its SHA-256 against the recorded one
        except FasttrainError as exc:
            raise FasttrainError(f"--from-record {where}: {exc}") from None


def plot_loss_curve(record: dict, out) -> Path:
    """The training loss (every logged step) and the validation loss (every evaluation) against the
    step, on a log scale, as a PNG at ``out``."""
    return plot_runs({"": record}, out)


def run_labels(paths) -> list[str]:
    """Short labels of run records' files: their names less what all share (``runs/a.json``,
    ``runs/b.json`` -> ``a``, ``b``), the whole path where two names are alike."""
    stems = [Path(p).stem for p in paths]
    return stems if len(set(stems)) == len(stems) else [str(p) for p in paths]


def plot_runs(records: dict, out, sources: dict | None = None) -> Path:
    """The loss curves of several runs on one figure (``{label: record}``), on the same axes: each
    run one colour, its training loss a line, its validation loss dots joined; a log scale. What the
    runs share (device, precision) goes in the title, the rest in the labels. One line naming the
    record that has no curve to draw (``sources``: label -> its file, for that line)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise FasttrainError(f"plotting needs matplotlib ({exc.name} missing): pip install matplotlib") from None
    from fasttrain.files import save_figure

    for label, record in records.items():
        if not (record.get("loss_curve") or record.get("eval")):
            name = (sources or {}).get(label, label)
            raise FasttrainError(f"{str(name) + ': ' if name else ''}the record has no loss curve to plot "
                                 f"(it logged no step)")
    fig, ax = plt.subplots(figsize=(7, 4) if len(records) == 1 else (8, 4.5))
    shared = {key: {r.get(key, "") for r in records.values()} for key in ("device", "precision")}
    for i, (label, record) in enumerate(records.items()):
        colour = f"C{i % 10}"
        prefix = f"{label}: " if len(records) > 1 else ""
        curve, evals = record.get("loss_curve") or [], record.get("eval") or []
        if curve:
            ax.plot([p["step"] for p in curve], [p["loss"] for p in curve], color=colour, lw=1.2,
                    label=f"{prefix}train loss")
        if evals:
            ax.plot([e["step"] for e in evals], [e["val_loss"] for e in evals], "o--", color=colour, lw=1.0, ms=4,
                    label=f"{prefix}validation loss")
    if len(records) == 1:
        record = next(iter(records.values()))
        title = (f"{record.get('config', {}).get('name', 'lab run')} · {record.get('device', '')} · "
                 f"{record.get('precision', '')}")
    else:
        common = [next(iter(v)) for v in shared.values() if len(v) == 1 and next(iter(v))]
        title = " · ".join([f"{len(records)} runs", *common])
    ax.set(xlabel="optimizer step", ylabel="cross-entropy (nats per token)", yscale="log", title=title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small" if len(records) > 2 else None)
    fig.tight_layout()
    path = Path(out)
    save_figure(fig, path)
    plt.close(fig)
    return path


__all__ = ["RunRecord", "LIBRARIES", "library_versions", "provenance", "load_record", "config_of_record",
           "plot_loss_curve", "plot_runs", "run_labels"]
