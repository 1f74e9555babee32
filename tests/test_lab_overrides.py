"""The one override parser, typed by LabConfig's annotations: the CLI's flags, --set, --variant and
records all read values the same way."""

from __future__ import annotations

import dataclasses
import shlex

import pytest

from fasttrain.errors import FasttrainError
from fasttrain.lab import overrides as O
from fasttrain.lab.config import LabConfig, preset


def test_every_field_has_a_kind_read_off_its_annotation():
    kinds = O.field_kinds()
    assert set(kinds) == {f.name for f in dataclasses.fields(LabConfig)}
    assert kinds["learning_rate"].type is float and not kinds["learning_rate"].optional
    assert kinds["kv_heads"].type is int and kinds["kv_heads"].optional
    assert kinds["lora_target_modules"].type is tuple
    assert kinds["bf16"].type is bool
    assert kinds["optim"].choices and "muon" in kinds["optim"].choices


@pytest.mark.parametrize("name, raw, value", [
    ("learning_rate", "2e-3", 2e-3), ("max_steps", "1200", 1200), ("bf16", "true", True), ("bf16", "off", False),
    ("kv_heads", "none", None), ("eval_tokens", "4096", 4096), ("optim", "muon", "muon"),
    ("lora_target_modules", "qkv,proj", ("qkv", "proj")), ("dropout", "0", 0.0),
])
def test_values_are_typed_by_the_field(name, raw, value):
    got = O.parse_value(name, raw)
    assert got == value and type(got) is type(value)


@pytest.mark.parametrize("name, raw, message", [
    ("max_steps", "1.5", "give an integer"), ("bf16", "maybe", "true or false"), ("optim", "adam", "use one of"),
    ("learning_rate", "fast", "give a number"), ("max_steps", "none", "give an integer"),
    ("no_such_field", "1", "unknown lab setting"),
])
def test_bad_values_are_one_line_naming_the_flag(name, raw, message):
    with pytest.raises(FasttrainError, match=message) as info:
        O.parse_value(name, raw)
    assert "\n" not in str(info.value)


def test_set_and_variant_share_the_parser():
    assert O.parse_assignments("learning_rate=2e-3, max-steps=12,lora_target_modules=qkv+up") == \
        {"learning_rate": 2e-3, "max_steps": 12, "lora_target_modules": ("qkv", "up")}
    assert O.parse_variant("lr:learning_rate=1e-3") == ("lr", {"learning_rate": 1e-3})
    with pytest.raises(FasttrainError, match="FIELD=VALUE"):
        O.parse_assignments("learning_rate")
    from fasttrain.lab.experiments import speedrun

    assert speedrun.parse_assignments is O.parse_assignments


def test_a_record_config_comes_back_as_the_same_config_and_refuses_unknown_settings():
    cfg = preset("tiny", lora_target_modules=("qkv", "up"), kv_heads=None, eval_tokens=None, bf16=True)
    assert O.config_from_dict(cfg.to_dict()) == cfg
    with pytest.raises(FasttrainError, match="does not know: warp_drive"):
        O.config_from_dict({**cfg.to_dict(), "warp_drive": 1})
    with pytest.raises(FasttrainError, match="give an integer"):
        O.config_from_dict({**cfg.to_dict(), "max_steps": "many"})


def test_the_command_line_of_a_config_parses_back_to_it():
    from click.testing import CliRunner

    from fasttrain.lab import cli

    cfg = preset("tiny", max_steps=7, bf16=True, lora_target_modules=("qkv", "up"), lora_r=2, eval_tokens=None)
    line = O.command_line(cfg, "tiny")
    assert line.startswith("fasttrain lab --preset tiny") and "--bf16" in line and "--eval-tokens none" in line
    seen = {}
    orig = cli.resolve

    def capture(preset_name, options, ctx=None):          # the CLI's parsing, not a run
        seen["cfg"] = orig(preset_name, options, ctx).cfg
        raise SystemExit(0)

    cli.resolve = capture
    try:
        CliRunner().invoke(cli.command, shlex.split(line)[2:])
    finally:
        cli.resolve = orig
    assert seen["cfg"] == cfg


def test_lab_flags_read_back_as_settings():
    """A lab command line passed on (the scaling sweep's base after --) is read back by the one parser."""
    from fasttrain.lab.overrides import flags, settings_from_flags

    got = settings_from_flags(["--model", "hf:/m", "--bf16", "--no-tf32", "--context=64", "--gradient-checkpointing",
                               "--learning-rate", "3e-4"])
    assert got == {"model": "hf:/m", "bf16": True, "tf32": False, "context": 64, "gradient_checkpointing": "full",
                   "learning_rate": 3e-4}
    assert settings_from_flags(flags(got)) == got
    for argv, message in ((["--out", "x.json"], "unknown lab setting 'out'"), (["stray"], "expected a lab setting"),
                          (["--context"], "--context needs a value"), (["--no-context", "3"], "only a switch")):
        with pytest.raises(FasttrainError, match=message):
            settings_from_flags(argv)
