"""Writing result files (fasttrain.files): a quoted ~ is expanded, and a write that cannot happen
names the user's path, never the temporary file beside it."""

from __future__ import annotations

import pytest

from fasttrain.errors import FasttrainError
from fasttrain.files import atomic_write_text


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
