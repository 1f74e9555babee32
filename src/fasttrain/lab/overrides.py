"""One parser for :class:`~fasttrain.lab.config.LabConfig` overrides, typed by the dataclass's own
annotations: the CLI's flags, ``--set FIELD=VALUE``, ``--variant NAME:FIELD=VALUE,...``, and run
records (a record's ``config`` back into a LabConfig; a LabConfig as the command line that runs it).

A field's kind is read off its annotation: ``bool``, ``int``, ``float``, ``str`` (with the choices its
declaration lists), ``tuple[str, ...]``; ``X | None`` also takes ``none``. A field's other names (its
declaration's ``aliases``) are read as the field.
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
    choices: tuple[str, ...] | None  # the allowed strings (the field's declaration)
    default: object
    group: str = "run"              # its --help section
    help: str = ""
    aliases: tuple[str, ...] = ()   # other names it answers to (with a one-line note)

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


@cache
def field_kinds() -> dict[str, FieldKind]:
    """Every LabConfig field's kind: its type from its annotation, the rest from its declaration
    (:func:`fasttrain.lab.config.setting`)."""
    hints = typing.get_type_hints(LabConfig)
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
        meta = f.metadata
        out[f.name] = FieldKind(f.name, kind, optional, meta.get("choices"), default, meta.get("group", "run"),
                                meta.get("help", ""), tuple(meta.get("aliases", ())))
    return out


@cache
def aliases() -> dict[str, str]:
    """Every other name of a setting -> its field name."""
    return {alias: kind.name for kind in field_kinds().values() for alias in kind.aliases}


def alias_note(given: str, name: str, how: str = "--") -> str:
    """The one line an alias gets: which name it stands for."""
    dash = (lambda n: "--" + n.replace("_", "-")) if how == "--" else (lambda n: n)
    return f"{dash(given)} is another name of {dash(name)}; read as {dash(name)}"


def canonical(name: str) -> str:
    """The field a setting's name (a field, or one of its aliases; dashes or underscores) stands for."""
    key = name.strip().replace("-", "_")
    return aliases().get(key, key)


def kind_of(name: str) -> FieldKind:
    kinds = field_kinds()
    key = canonical(name)
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


def settings_of(cfg: LabConfig, preset_name: str | None = None) -> tuple[str | None, dict]:
    """``(preset, settings)`` that rebuild ``cfg`` through ``fasttrain lab``: the lab's GPT from its
    preset (``cfg.name`` when it is one, else ``preset_name`` or shakespeare-char) and the fields that
    differ from it; a transformers model from no preset, with every field that differs from LabConfig's
    defaults and every one its own defaults set (:data:`fasttrain.lab.config.DERIVED`), so that they
    read back as they are."""
    from fasttrain.lab.config import DERIVED, PRESETS

    if cfg.model == "gpt":
        name = cfg.name if cfg.name in PRESETS else (preset_name or "shakespeare-char")
        base = LabConfig(name=name, **PRESETS[name])
        return name, {k: v for k, v in changed(cfg, base).items() if k != "name"}
    settings = changed(cfg, LabConfig())
    settings.update({k: getattr(cfg, k) for k in DERIVED})
    return None, {f.name: settings[f.name] for f in dataclasses.fields(LabConfig)
                  if f.name in settings and f.name != "name"}


def command_line(cfg: LabConfig, preset_name: str | None = None) -> str:
    """The ``fasttrain lab`` command that runs ``cfg`` (:func:`settings_of`)."""
    name, settings = settings_of(cfg, preset_name)
    return shlex.join(["fasttrain", "lab", *(["--preset", name] if name else []), *flags(settings)])


def settings_yaml(cfg: LabConfig) -> str:
    """``cfg`` as a ``--config`` file (YAML): the preset, then the settings (:func:`settings_of`)."""
    yaml = _yaml()
    name, settings = settings_of(cfg)
    data = {"preset": name} if name else {}
    data.update({k: list(v) if isinstance(v, tuple) else v for k, v in settings.items()})
    return yaml.safe_dump(data, sort_keys=False, default_flow_style=False)


def _yaml():
    try:
        import yaml
    except ImportError as exc:
        from fasttrain.lab.config import missing_extra

        raise missing_extra("PyYAML (--config .yaml, --print-config)", exc) from None
    return yaml


def _load_file(path: str) -> dict:
    """A ``--config`` file's mapping (YAML or TOML): one line for a missing, unreadable or malformed file."""
    from pathlib import Path

    p = Path(path).expanduser()
    suffix = p.suffix.lower()
    if suffix not in (".yaml", ".yml", ".toml"):
        raise FasttrainError(f"--config {path}: give a .yaml, .yml or .toml file")
    if not p.is_file():
        raise FasttrainError(f"--config {path}: " + ("that is a folder, not a file" if p.is_dir() else "no such file"))
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise FasttrainError(f"--config {path}: cannot read it ({type(exc).__name__})") from None
    if suffix == ".toml":
        import tomllib

        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise FasttrainError(f"--config {path}: not valid TOML ({exc})") from None
    else:
        yaml = _yaml()
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f"line {mark.line + 1}: " if mark is not None else ""
            raise FasttrainError(f"--config {path}: not valid YAML ({where}{getattr(exc, 'problem', None) or exc})") \
                from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise FasttrainError(f"--config {path}: give a mapping of flags (key: value per line), not a "
                             f"{type(data).__name__}")
    return data


def _cli_value(kind: FieldKind, value):
    """A typed setting as the command line's option takes it (a list joined by commas, None as none)."""
    if value is None:
        return "none"
    if kind.type is tuple:
        return ",".join(value)
    if kind.type is bool:
        return value
    return value if kind.type in (int, float) and not kind.optional else str(value)


def read_settings_file(path: str, params: dict) -> tuple[dict, list[str]]:
    """A ``--config`` file as the defaults of a command's options, and the notes of its keys that are
    another name of a setting. ``params``: each spelling of the command's options (its name and its
    flags, with underscores) -> the option's name. A LabConfig setting is typed and checked here
    (the file and the key named in the line); any other option is converted by click."""
    data = _load_file(path)
    kinds = field_kinds()
    defaults, notes = {}, []
    for key, value in data.items():
        spelled = str(key).strip().replace("-", "_")
        name = canonical(spelled)
        if name in kinds and name != "name":
            if spelled != name:
                notes.append(f"{path}: {alias_note(spelled, name, how='')}")
            try:
                typed = parse_value(name, value)
            except FasttrainError as exc:
                raise FasttrainError(f"--config {path}: {key}: {exc}") from None
            defaults[name] = _cli_value(kinds[name], typed)
        elif spelled in params and params[spelled] not in ("config_file", "print_config"):
            defaults[params[spelled]] = value
        else:
            raise FasttrainError(f"--config {path}: unknown key {key!r}: not a flag of this command "
                                 f"(see its --help; write flags as in it, e.g. learning-rate: 3e-4)")
    return defaults, notes


def saved_settings(path) -> LabConfig:
    """The settings a run saved with its training state (``--resume DIR``: the newest checkpoint of
    DIR, or DIR itself), from its ``trainer_state.json``."""
    import json

    from fasttrain.lab.resume import find_checkpoint

    where = find_checkpoint(path)
    state = where / "trainer_state.json"
    try:
        data = json.loads(state.read_text())
        config = data["config"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise FasttrainError(f"--resume {path}: {state} holds no readable settings ({type(exc).__name__}); "
                             f"give the run's flags again beside --resume") from None
    return config_from_dict(config)


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


def settings_from_flags(argv) -> dict:
    """``fasttrain lab`` flags (``--name VALUE``, ``--name=VALUE``, ``--switch`` / ``--no-switch``) as
    ``{field: typed value}``: the reverse of :func:`flags`, for a command that passes a lab command line on
    (the scaling sweep's base). Only settings: a launcher's or an output's flag, or a stray word, is one line."""
    kinds = field_kinds()
    out: dict = {}
    args = list(argv)
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or arg == "--":
            raise FasttrainError(f"{arg!r}: expected a lab setting's flag (--name VALUE, --switch, --no-switch)")
        key, eq, value = arg[2:].partition("=")
        name, negated = key.replace("-", "_"), False
        if canonical(name) not in kinds and name.startswith("no_") and canonical(name[3:]) in kinds:
            name, negated = name[3:], True
        kind = kind_of(name)
        if kind.type is bool and not eq:
            out[kind.name] = not negated
            i += 1
            continue
        if negated:
            raise FasttrainError(f"--{key}: only a switch (true or false) takes --no-")
        if not eq:
            if i + 1 < len(args) and not args[i + 1].startswith("--"):
                value = args[i + 1]
                i += 1
            elif kind.name == "gradient_checkpointing":
                value = "full"          # as the lab's own flag: alone it means full
            else:
                raise FasttrainError(f"{kind.flag} needs a value")
        out[kind.name] = parse_value(kind.name, value)
        i += 1
    return out


__all__ = ["FieldKind", "field_kinds", "kind_of", "canonical", "aliases", "alias_note", "parse_value",
           "parse_assignments", "parse_variant", "config_from_dict", "changed", "settings_of", "command_line", "flags",
           "settings_yaml", "read_settings_file", "saved_settings", "settings_from_flags"]
