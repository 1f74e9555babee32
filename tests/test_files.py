"""The file writers (`fasttrain.files`): a write is whole or not at all, in the usual mode; a quoted ~ is
expanded, and a write that cannot happen names the user's path, never the temporary file beside it."""

from __future__ import annotations

import errno
import re
from pathlib import Path

import pytest

from fasttrain.errors import FasttrainError
from fasttrain.files import atomic_write_text


def test_a_failed_write_keeps_the_earlier_file(tmp_path, monkeypatch):
    from fasttrain.files import atomic_write_text

    target = tmp_path / "run.json"
    target.write_text("earlier\n")

    def full_disk(self, text, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(self))

    monkeypatch.setattr(Path, "write_text", full_disk)
    with pytest.raises(OSError):
        atomic_write_text(target, "new\n")
    monkeypatch.undo()
    assert target.read_text() == "earlier\n"
    assert [p.name for p in tmp_path.iterdir()] == ["run.json"]


def test_finite_or_none_makes_any_record_strict_json():
    import json
    import math

    import numpy as np

    from fasttrain.files import finite_or_none

    record = {"loss": float("nan"), "curve": [1.0, np.float32("inf"), np.float64(2.5)], "pair": (math.inf, 3),
              "nested": {"x": -math.inf, "name": "run"}}
    clean = finite_or_none(record)
    assert clean == {"loss": None, "curve": [1.0, None, 2.5], "pair": [None, 3], "nested": {"x": None, "name": "run"}}
    json.dumps(clean, allow_nan=False)
    assert type(clean["curve"][2]) is float


def test_write_into_replaces_only_the_marked_section(tmp_path):
    from fasttrain.errors import FasttrainError
    from fasttrain.files import write_into

    readme = tmp_path / "README.md"
    readme.write_text("# Title\n\n<!-- s:start -->\nold\n<!-- s:end -->\n\nafter\n")
    write_into(readme, "new table\n", start="<!-- s:start -->", end="<!-- s:end -->")
    assert readme.read_text() == "# Title\n\n<!-- s:start -->\nnew table\n<!-- s:end -->\n\nafter\n"
    readme.write_text("<!-- s:end -->\n<!-- s:start -->\n")
    with pytest.raises(FasttrainError, match="needs exactly one line <!-- s:start --> and, below it"):
        write_into(readme, "x", start="<!-- s:start -->", end="<!-- s:end -->")
    assert readme.read_text() == "<!-- s:end -->\n<!-- s:start -->\n"
    with pytest.raises(FasttrainError, match="no such file"):
        write_into(tmp_path / "missing.md", "x", start="a", end="b")

def test_a_quoted_tilde_is_expanded(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    atomic_write_text("~/run.json", "{}")
    assert (tmp_path / "run.json").read_text() == "{}" and not (tmp_path / "~").exists()


def test_errors_name_the_users_path_not_a_temporary_one(tmp_path):
    with pytest.raises(FasttrainError) as exc:
        atomic_write_text(tmp_path / "missing" / "run.json", "{}")
    assert str(exc.value).startswith(f"{tmp_path / 'missing' / 'run.json'}: cannot write there") and ".tmp" not in str(exc.value)
    (tmp_path / "folder").mkdir()
    with pytest.raises(FasttrainError, match="is a folder; give a file name") as exc:
        atomic_write_text(tmp_path / "folder", "{}")
    assert ".tmp" not in str(exc.value)
    assert [p.name for p in tmp_path.iterdir()] == ["folder"]     # no temporary file left


def test_read_json_object_says_what_is_wrong_in_one_line(tmp_path):
    from fasttrain.files import read_json_object

    (tmp_path / "folder.json").mkdir()
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "bad.json").write_bytes(b"\xff{")
    (tmp_path / "ok.json").write_text('{"kind": "x"}')
    cases = [("folder.json", "is a folder, not a run record"), ("list.json", "not a run record (not a JSON object)"),
             ("bad.json", "not a run record (unreadable JSON"), ("missing.json", "no such file; write one first")]
    for name, message in cases:
        with pytest.raises(FasttrainError, match=re.escape(message)):
            read_json_object(tmp_path / name, "run record", hint="write one first")
    assert read_json_object(tmp_path / "ok.json", "run record") == {"kind": "x"}
