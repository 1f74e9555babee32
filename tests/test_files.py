"""The file writers (`fasttrain.files`): a write is whole or not at all, in the usual mode."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest


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
