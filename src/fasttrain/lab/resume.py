"""Training state checkpoints: ``--save-steps N`` writes one every N steps, ``--resume DIR`` continues.

A checkpoint is a folder ``OUTPUT_DIR/checkpoint-<step>/`` holding ``state.pt`` -- the weights, the
optimizer's state, the GradScaler's, the step index (which is both the learning-rate schedule's
position and the data's: step ``i``'s batch is drawn from ``(seed, i)`` alone), the random
generators (torch's CPU and CUDA ones, numpy's, Python's), the loss curve and evaluations so far
and the run's configuration -- and ``trainer_state.json`` (the step and configuration, to read).
It is written into a temporary folder beside it and renamed into place, so a run killed while
writing leaves the previous checkpoints whole; then all but the newest ``save_total_limit`` are
removed. ``state.pt`` holds tensors, numbers, strings, lists and dicts only (the generators'
states as tensors and lists): it loads with ``torch.load(weights_only=True)``.

On the CPU a run killed after a checkpoint and resumed from it follows the uninterrupted run's loss
curve bit for bit: the same weights, optimizer moments, batches and random draws, in the same order.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
import uuid
from pathlib import Path

from fasttrain.errors import FasttrainError
from fasttrain.files import swap_folder

STATE = "state.pt"
PATTERN = re.compile(r"^checkpoint-(\d+)$")
# settings that may differ between the run that saved and the run that resumes: where things are
# written, what is logged, the step budget... not what the trajectory depends on
OPERATIONAL = {"name", "save", "resume", "output_dir", "save_steps", "save_total_limit", "data_dir", "device",
               "max_steps", "eval_interval", "eval_tokens", "eval_batch_size", "log_interval", "timing_warmup_steps",
               "report_to", "logging_dir", "overwrite_output_dir",
               "dataloader_num_workers", "dataloader_pin_memory", "dataloader_prefetch_factor", "preload"}


def _portable_rng(rng: dict) -> dict:
    """The generators' states as tensors and lists (loadable with ``weights_only=True``)."""
    import torch

    kind, keys, pos, has_gauss, cached = rng["numpy"]
    version, state, gauss = rng["python"]
    out = {"torch": rng["torch"], "numpy": {"kind": kind, "keys": torch.from_numpy(keys.copy()), "pos": int(pos),
                                            "has_gauss": int(has_gauss), "cached": float(cached)},
           "python": {"version": version, "state": list(state), "gauss": gauss}}
    if "cuda" in rng:
        out["cuda"] = list(rng["cuda"])
    return out


def _native_rng(rng: dict) -> dict:
    n, p = rng["numpy"], rng["python"]
    out = {"torch": rng["torch"],
           "numpy": (n["kind"], n["keys"].numpy(), n["pos"], n["has_gauss"], n["cached"]),
           "python": (p["version"], tuple(p["state"]), p["gauss"])}
    if "cuda" in rng:
        out["cuda"] = rng["cuda"]
    return out


def save_state(trainer, metrics, output_dir, *, keep: int | None = None, run_id: str | None = None) -> Path:
    """Write ``output_dir/checkpoint-<step>`` atomically; keep the newest ``keep`` (None: all) of this
    run's own checkpoints (``run_id``: another run's are never removed). What a save killed mid-write
    left (a ``checkpoint-*.tmp`` folder) is removed first."""
    import torch

    from fasttrain.lab.outputs import remove_stale_temporaries

    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(out, "checkpoint-")
    step = trainer.step_index
    final = out / f"checkpoint-{step}"
    state = trainer.state_dict()
    state["rng"] = _portable_rng(state["rng"])
    state["metrics"] = metrics.state()
    state["config"] = trainer.cfg.to_dict()
    state["format"] = "fasttrain-lab-state-1"
    readable = {"step": step, "config": state["config"], "run": run_id, "data": data_description(trainer.corpus),
                "model": model_description(trainer.cfg.model)}
    tmp = Path(tempfile.mkdtemp(prefix=final.name + ".", suffix=".tmp", dir=out))
    try:
        torch.save(state, tmp / STATE)
        (tmp / TRAINER_STATE).write_text(json.dumps(readable, indent=1))
        # an earlier checkpoint of this run at the same step: replaced whole
        swap_folder(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    if keep:
        for old in [p for p in checkpoints(out) if run_id is not None and run_of(p) == run_id][:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return final


TRAINER_STATE = "trainer_state.json"


def _trainer_state(checkpoint: Path) -> dict:
    try:
        data = json.loads((Path(checkpoint) / TRAINER_STATE).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def run_of(checkpoint: Path) -> str | None:
    """The id of the run that wrote ``checkpoint`` (None: written before runs had ids)."""
    return _trainer_state(checkpoint).get("run")


def data_description(corpus) -> dict:
    """What a training state keeps of its corpus to refuse another on resume: the files (path,
    SHA-256), the tokenizer, and the SHA-256 of the token ids themselves."""
    from fasttrain.lab.data import tokens_sha256

    desc = corpus.describe() if hasattr(corpus, "describe") else {}
    return {"files": [{k: f.get(k) for k in ("role", "path", "sha256")} for f in desc.get("files", [])],
            "tokenizer": desc.get("tokenizer"), "tokens_sha256": tokens_sha256(corpus)}


def model_description(spec) -> dict | None:
    """A transformers model's ``config.json`` as the run read it (its path and SHA-256), to refuse another
    architecture on resume; None for the lab's GPT (its shape is in the saved settings) or a hub name."""
    import hashlib

    from fasttrain.lab.models import HF_PREFIX, is_hf

    if not is_hf(spec):
        return None
    folder = Path(spec[len(HF_PREFIX):]).expanduser()
    config = folder / "config.json" if folder.is_dir() else None
    if config is None or not config.is_file():
        return None
    return {"config": str(config), "sha256": hashlib.sha256(config.read_bytes()).hexdigest()}


def model_change(saved, now) -> str | None:
    """The model's ``config.json`` changed between two :func:`model_description` results, in words."""
    if not isinstance(saved, dict) or not isinstance(now, dict) or saved.get("sha256") == now.get("sha256"):
        return None
    return (f"the model's config.json {now.get('config')} changed since (SHA-256 {str(now.get('sha256'))[:12]}..., "
            f"saved {str(saved.get('sha256'))[:12]}...)")


def data_change(saved: dict, now: dict) -> str | None:
    """The first difference between two :func:`data_description` results, in words (None: the same data)."""
    now_files = {f.get("role"): f for f in now.get("files", [])}
    for was in saved.get("files", []):
        cur = now_files.get(was.get("role"))
        if cur is not None and cur.get("path") == was.get("path") and cur.get("sha256") != was.get("sha256"):
            return (f"the {was.get('role')} file {was.get('path')} changed since (SHA-256 {str(cur.get('sha256'))[:12]}"
                    f"..., saved {str(was.get('sha256'))[:12]}...)")
    if (saved.get("tokenizer") or None) != (now.get("tokenizer") or None):
        def short(t):
            t = t or {}
            return (f"{t.get('kind')} {t.get('path') or t.get('name') or ''} "
                    f"{str(t.get('sha256') or t.get('chars') or '')[:12]}").strip()
        return f"the tokenizer differs (saved {short(saved.get('tokenizer'))}, now {short(now.get('tokenizer'))})"
    if saved.get("tokens_sha256") and saved.get("tokens_sha256") != now.get("tokens_sha256"):
        return (f"the token ids differ (SHA-256 {str(now.get('tokens_sha256'))[:12]}..., saved "
                f"{saved['tokens_sha256'][:12]}...)")
    return None


def check_resume_data(path, corpus, spec=None) -> None:
    """Refuse, before the model is built, resuming on other data than the checkpoint trained on (a
    changed file, another tokenizer, other token ids: the data position would point elsewhere) or on a
    transformers model whose ``config.json`` changed (``spec``: the run's ``--model``)."""
    where = find_checkpoint(path)
    state = _trainer_state(where)
    change = model_change(state.get("model"), model_description(spec))
    if change:
        raise FasttrainError(f"--resume {where}: {change}; resume with the model it was saved with (restore its "
                             f"config.json), or start a new run")
    saved = state.get("data")
    if not isinstance(saved, dict):
        return                          # a checkpoint from before the data was kept: the settings are compared
    change = data_change(saved, data_description(corpus))
    if change:
        raise FasttrainError(f"--resume {where}: {change}; resume on the data it was saved with (restore it), or "
                             f"start a new run")


def checkpoints(folder) -> list[Path]:
    """The complete checkpoints in ``folder``, oldest first."""
    found = []
    for p in Path(folder).iterdir():
        m = PATTERN.match(p.name)
        if m and (p / STATE).is_file():
            found.append((int(m.group(1)), p))
    return [p for _, p in sorted(found)]


def find_checkpoint(path) -> Path:
    """``path`` itself when it is a checkpoint, else the newest checkpoint inside it."""
    p = Path(path)
    if (p / STATE).is_file():
        return p
    if not p.is_dir():
        raise FasttrainError(f"--resume {path}: no such folder; give the --output-dir of a run saved with "
                             f"--save-steps, or one of its checkpoint-N folders")
    found = checkpoints(p)
    if not found:
        raise FasttrainError(f"--resume {path}: no checkpoint in it (checkpoint-N/{STATE}); "
                             f"write some with --save-steps N --output-dir {path}")
    return found[-1]


def resume(trainer, metrics, path, *, log=None) -> Path:
    """Load the newest checkpoint of ``path`` into ``trainer`` and ``metrics``."""
    import torch

    where = find_checkpoint(path)
    try:
        state = torch.load(where / STATE, map_location=trainer.device, weights_only=True)
    except Exception as exc:  # noqa: BLE001 - a damaged file of any kind: one line
        raise FasttrainError(f"--resume {where}: cannot read {STATE} ({type(exc).__name__}: {str(exc)[:100]})") \
            from None
    if not isinstance(state, dict) or state.get("format") != "fasttrain-lab-state-1":
        raise FasttrainError(f"--resume {where}: {STATE} is not a fasttrain lab training state")
    saved, now = state["config"], trainer.cfg.to_dict()
    differ = sorted(k for k in set(saved) | set(now) if k not in OPERATIONAL and saved.get(k) != now.get(k))
    if differ:
        shown = ", ".join(f"{k} (saved {saved.get(k)!r}, now {now.get(k)!r})" for k in differ[:3])
        raise FasttrainError(f"--resume {where}: the run was saved with other settings: {shown}; "
                             f"resume with the settings it was saved with")
    if state["step_index"] >= trainer.cfg.max_steps:
        raise FasttrainError(f"--resume {where}: that run already finished ({state['step_index']} of "
                             f"{trainer.cfg.max_steps} steps); raise --max-steps to train further")
    state["rng"] = _native_rng(state["rng"])
    state["rng"]["torch"] = state["rng"]["torch"].cpu()
    if "cuda" in state["rng"]:
        state["rng"]["cuda"] = [t.cpu() for t in state["rng"]["cuda"]]
    trainer.load_state_dict(state)
    metrics.restore(state["metrics"])
    if log:
        log(f"resumed from {where} at step {trainer.step_index}")
    return where


class Saver:
    """``on_step`` for the loop: a checkpoint every ``save_steps`` steps (not after the last: the run
    is over, its model goes to ``--save``)."""

    def __init__(self, trainer, metrics, cfg, world, resumed: Path | None = None):
        if world.distributed:
            raise FasttrainError("--save-steps with several processes is not supported yet; "
                                 "save from a single-process run")
        self.trainer, self.metrics, self.cfg = trainer, metrics, cfg
        # a resumed run continues the run it resumes: its checkpoints are ours to prune
        self.run_id = (run_of(resumed) if resumed is not None else None) or uuid.uuid4().hex

    def __call__(self, step: int) -> None:
        cfg = self.cfg
        if step % cfg.save_steps == 0 and step < cfg.max_steps:
            save_state(self.trainer, self.metrics, cfg.output_dir, keep=cfg.save_total_limit, run_id=self.run_id)


__all__ = ["save_state", "resume", "find_checkpoint", "checkpoints", "check_resume_data", "data_change",
           "data_description", "model_description", "model_change", "run_of", "Saver"]
