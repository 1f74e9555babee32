"""A run's configuration, resolved once, and where each value came from.

Where a value comes from, lowest first: :class:`~fasttrain.lab.config.LabConfig`'s default; the
preset (the lab's GPT: ``shakespeare-char`` unless another is named); the model's own defaults (a
transformers model, ``--model hf:...``: :mod:`fasttrain.lab.defaults`; no preset applies unless one is
named, and then its settings other than the GPT's shape go over the model's defaults); the
``--config`` file; the flags (or the Python API's arguments). ``--resume DIR`` alone takes the saved
run's settings instead, and refuses a flag that would change its trajectory. The configuration is
validated here, once (:func:`fasttrain.lab.config.validate`; later steps only ask whether it was).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from fasttrain.errors import FasttrainError
from fasttrain.lab.config import GPT_SHAPE, PRESETS, LabConfig, validate

DEFAULT_PRESET = "shakespeare-char"     # the lab's GPT without --preset; a transformers model takes none


@dataclass
class Resolved:
    """A run's configuration and where each setting came from (``default``, ``preset NAME``,
    ``model``, ``file PATH``, ``flag``, ``argument``, ``saved``)."""

    cfg: LabConfig
    sources: dict = field(default_factory=dict)     # field -> where its value came from
    reasons: dict = field(default_factory=dict)     # field -> why the model's default is what it is
    notes: list = field(default_factory=list)       # lines to print before work starts (aliases, warm-up)
    fit_context: bool = False                       # the context is the model's: lowered to what the corpus allows

    def lines(self) -> list[str]:
        """Every value that differs from LabConfig's defaults or was set by the model, a file or a flag,
        and where it came from."""
        base = LabConfig()
        rows = []
        for f in dataclasses.fields(LabConfig):
            value = getattr(self.cfg, f.name)
            where = self.sources.get(f.name, "default")
            if value == getattr(base, f.name) and where in ("default", "saved") or where.startswith("preset") \
                    and value == getattr(base, f.name):
                continue
            why = self.reasons.get(f.name)
            shown = ",".join(value) if isinstance(value, tuple) else value
            rows.append(f"  {f.name:<28} {str(shown):<24} {where}" + (f" ({why})" if why else ""))
        head = "configuration (values other than LabConfig's defaults, and where each came from):"
        return [head, *(rows or ["  (all defaults)"]), *self.notes]


def resolve_settings(preset_name: str | None, given: dict, sources: dict | None = None,
                     notes: list | None = None) -> Resolved:
    """The configuration of ``given`` settings (from a file or flags: ``sources`` says which; default
    ``argument``) over the preset (the lab's GPT) or the model's own defaults; validated once, here."""
    from fasttrain.lab.defaults import hf_defaults, warmup_note

    sources = dict(sources) if sources is not None else {k: "argument" for k in given}
    notes = list(notes or [])
    if given.get("resume") is not None and preset_name is None and "model" not in given:
        return _resume(given, sources, notes)
    model = given.get("model", "gpt")
    values, reasons = {}, {}
    if model == "gpt":
        name = preset_name or DEFAULT_PRESET
        if name not in PRESETS:
            raise FasttrainError(f"unknown preset {name!r}; use one of {', '.join(PRESETS)}")
        values = {"name": name, **PRESETS[name]}
        sources.update({k: f"preset {name}" for k in values if k not in given})
    else:
        for key, (value, why) in hf_defaults(model, given).items():
            if key not in given:
                values[key], reasons[key], sources[key] = value, why, "model"
        if preset_name is not None:
            # asked for by name: its schedule and sizes over the model's defaults (the GPT's shape is not the model's)
            if preset_name not in PRESETS:
                raise FasttrainError(f"unknown preset {preset_name!r}; use one of {', '.join(PRESETS)}")
            for key, value in PRESETS[preset_name].items():
                if key not in given and key not in GPT_SHAPE:
                    values[key], sources[key] = value, f"preset {preset_name}"
                    reasons.pop(key, None)
    cfg = validate(_build(values, given))
    note = warmup_note(cfg)
    if note:
        notes.append(note)
    return Resolved(cfg, sources, reasons, notes, fit_context=sources.get("context") == "model")


def _build(values: dict, given: dict) -> LabConfig:
    cfg = LabConfig().with_(**{**values, **given})
    mods = cfg.lora_target_modules
    if isinstance(mods, (list, str)):
        cfg = cfg.with_(lora_target_modules=tuple(mods.split(",") if isinstance(mods, str) else mods))
    return cfg


def _resume(given: dict, sources: dict, notes: list) -> Resolved:
    """``--resume DIR`` alone: the saved run's settings; a setting given beside it must agree with the
    saved one where it would change the run's trajectory, else one line names it."""
    from fasttrain.lab.overrides import saved_settings
    from fasttrain.lab.resume import OPERATIONAL

    path = given["resume"]
    saved = saved_settings(path)
    for name, value in given.items():
        if name in OPERATIONAL or value == getattr(saved, name):
            continue
        flag = "--" + name.replace("_", "-")
        raise FasttrainError(f"--resume {path}: {flag} {value!r} differs from the saved run's "
                             f"{getattr(saved, name)!r}; drop {flag} (the run continues with its saved settings)")
    cfg = validate(saved.with_(**given))
    merged = {f.name: "saved" for f in dataclasses.fields(LabConfig)}
    merged.update(sources)
    return Resolved(cfg, merged, {}, notes)


__all__ = ["DEFAULT_PRESET", "Resolved", "resolve_settings"]
