"""One parser for :class:`~fasttrain.lab.config.LabConfig` overrides, typed by the dataclass's own
annotations: the CLI's flags, ``--set FIELD=VALUE``, ``--variant NAME:FIELD=VALUE,...``, and run
records (a record's ``config`` back into a LabConfig; a LabConfig as the command line that runs it).

A field's kind is read off its annotation: ``bool``, ``int``, ``float``, ``str`` (with its choices
where ``lab/config.py`` lists them), ``tuple[str, ...]``; ``X | None`` also takes ``none``.
"""

from __future__ import annotations

import dataclasses
import shlex
import types
import typing
from dataclasses import dataclass
from functools import cache

from fasttrain.errors import FasttrainError
from fasttrain.lab.config import LabConfig

TRUE = ("1", "true", "yes", "on")
FALSE = ("0", "false", "no", "off")


@dataclass(frozen=True)
class FieldKind:
    name: str
    type: type                      # bool, int, float, str or tuple
    optional: bool                  # None allowed
    choices: tuple[str, ...] | None  # the allowed strings, where config.py lists them
    default: object

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


def _choices() -> dict[str, tuple[str, ...]]:
    from fasttrain.lab import config as C

    out = {"style": C.STYLES, "optim": C.OPTIMS, "gradient_checkpointing": C.CHECKPOINTING,
           "attn_implementation": C.ATTENTIONS, "torch_compile_mode": C.COMPILE_MODES}
    for name, attr in (("torch_compile_scope", "COMPILE_SCOPES"), ("torch_compile_backend", "COMPILE_BACKENDS"),
                       ("activation", "ACTIVATIONS"), ("bin_dtype", "BIN_DTYPES")):
        if hasattr(C, attr):
            out[name] = getattr(C, attr)
    return out


@cache
def field_kinds() -> dict[str, FieldKind]:
    """Every LabConfig field's kind, from its annotation."""
    hints = typing.get_type_hints(LabConfig)
    choices = _choices()
    out = {}
    for f in dataclasses.fields(LabConfig):
        hint = hints[f.name]
        args = typing.get_args(hint)
        optional = isinstance(hint, types.UnionType) and type(None) in args or typing.get_origin(hint) is typing.Union
        base = next((a for a in args if a is not type(None)), hint) if optional else hint
        kind = tuple if typing.get_origin(base) is tuple else base
        if kind not in (bool, int, float, str, tuple):
            raise TypeError(f"LabConfig.{f.name}: annotation {hint} has no parser")
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        out[f.name] = FieldKind(f.name, kind, optional, choices.get(f.name), default)
    return out


def kind_of(name: str) -> FieldKind:
    kinds = field_kinds()
    key = name.strip().replace("-", "_")
    if key not in kinds:
        raise FasttrainError(f"unknown lab setting {name!r}; settings are LabConfig fields "
                             f"(see: fasttrain lab --help; flag names with underscores)")
    return kinds[key]


def parse_value(name: str, raw, *, list_separator: str = ","):
    """``raw`` (a string, or a value already typed) as the value of field ``name``."""
    kind = kind_of(name)
    what = f"{kind.flag} {raw!r}"
    if not isinstance(raw, str):
        return _typed(kind, raw, what)
    text = raw.strip()
    if kind.optional and text.lower() in ("none", "null"):
        return None
    if kind.type is bool:
        if text.lower() in TRUE:
            return True
        if text.lower() in FALSE:
            return False
        raise FasttrainError(f"{what}: give true or false")
    if kind.type is tuple:
        return tuple(t.strip() for t in text.split(list_separator) if t.strip())
    if kind.type is int:
        try:
            return int(text)
        except ValueError:
            raise FasttrainError(f"{what}: give an integer") from None
    if kind.type is float:
        try:
            return float(text)
        except ValueError:
            raise FasttrainError(f"{what}: give a number") from None
    if kind.choices is not None and text not in kind.choices:
        raise FasttrainError(f"unknown {kind.flag} {text!r}; use one of {', '.join(kind.choices)}")
    return text


def _typed(kind: FieldKind, value, what: str):
    """A JSON value (a record's config) as the field's type."""
    if value is None:
        if kind.optional:
            return None
        raise FasttrainError(f"{what}: this setting cannot be null")
    if kind.type is tuple:
        if not isinstance(value, (list, tuple)):
            raise FasttrainError(f"{what}: give a list")
        return tuple(str(v) for v in value)
    if kind.type is bool:
        if not isinstance(value, bool):
            raise FasttrainError(f"{what}: give true or false")
        return value
    if kind.type is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise FasttrainError(f"{what}: give an integer")
        return value
    if kind.type is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise FasttrainError(f"{what}: give a number")
        return float(value)
    if not isinstance(value, str):
        raise FasttrainError(f"{what}: give a string")
    return value


def parse_assignments(text: str) -> dict:
    """"learning_rate=2e-3,max_steps=1200" -> {field: value}; a list's items joined by ``+``."""
    out = {}
    for item in (t for t in text.split(",") if t.strip()):
        key, sep, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not key:
            raise FasttrainError(f"override {item!r}: write FIELD=VALUE (e.g. learning_rate=2e-3)")
        out[kind_of(key).name] = parse_value(key, value, list_separator="+")
    return out


def parse_variant(text: str) -> tuple[str, dict]:
    """"NAME:field=value,..." -> (NAME, overrides)."""
    name, sep, body = text.partition(":")
    name = name.strip()
    if not sep or not name or not body.strip():
        raise FasttrainError(f"--variant {text!r}: write NAME:FIELD=VALUE[,FIELD=VALUE...] "
                             f"(e.g. lr-2e-3:learning_rate=2e-3,min_lr=2e-4)")
    return name, parse_assignments(body)


def config_from_dict(data: dict) -> LabConfig:
    """A LabConfig from a run record's ``config`` (every field typed and checked; unknown ones refused)."""
    if not isinstance(data, dict):
        raise FasttrainError("the record's config is not an object; is this a fasttrain lab run record?")
    kinds = field_kinds()
    unknown = sorted(set(data) - set(kinds))
    if unknown:
        raise FasttrainError(f"the record's config has setting(s) this fasttrain does not know: {', '.join(unknown)}")
    return LabConfig(**{name: _typed(kinds[name], value, f"{kinds[name].flag} {value!r}")
                        for name, value in data.items()})


def changed(cfg: LabConfig, base: LabConfig) -> dict:
    """The fields of ``cfg`` that differ from ``base``'s."""
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(LabConfig)
            if getattr(cfg, f.name) != getattr(base, f.name)}


def command_line(cfg: LabConfig, preset_name: str = "shakespeare-char") -> str:
    """The ``fasttrain lab`` command that runs ``cfg``: the preset and one flag per field that differs."""
    from fasttrain.lab.config import PRESETS

    base = LabConfig(name=preset_name, **PRESETS[preset_name])
    settings = {name: value for name, value in changed(cfg, base).items() if name != "name"}
    return shlex.join(["fasttrain", "lab", "--preset", preset_name, *flags(settings)])


def flags(settings: dict) -> list[str]:
    """``{field: value}`` as ``fasttrain lab`` flags (a value typed, or as text; a number written as given)."""
    args: list[str] = []
    for name, raw in settings.items():
        kind, value = kind_of(name), parse_value(name, raw)
        if kind.type is bool:
            args.append(kind.flag if value else f"--no-{kind.flag[2:]}")
        elif value is None:
            args += [kind.flag, "none"]
        elif kind.type is tuple:
            args += [kind.flag, ",".join(value)]
        else:
            args += [kind.flag, str(raw).strip()]
    return args


__all__ = ["FieldKind", "field_kinds", "kind_of", "parse_value", "parse_assignments", "parse_variant",
           "config_from_dict", "changed", "command_line", "flags"]
