"""Writing result files safely: checked before any work, written whole or not at all.

Every file the project writes goes to a temporary name in the target folder and is renamed into
place once complete, so a full disk, a crash or Ctrl-C never leaves a half-written file at the
final path, and an earlier file at that path survives a failed write. The finished file gets the
mode an ordinary ``open(path, "w")`` would give it (0666 less the umask), not the 0600 of the
temporary file.
"""

from __future__ import annotations

import contextlib
import math
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

from fasttrain.errors import FasttrainError


def default_file_mode() -> int:
    """0666 less the process umask: the mode ``open(path, "w")`` creates files with."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, suffix: str = ".tmp") -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success it replaces ``path``, on any error it is
    removed and ``path`` is left as it was. ``suffix`` lets writers that look at the name
    (``np.savez`` adds ``.npz``, matplotlib picks the format from it) see the right one."""
    path = Path(path).expanduser()         # a quoted ~ reaches us unexpanded by the shell
    try:
        fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=suffix,
                                        dir=path.parent if str(path.parent) else ".")
    except OSError as exc:
        # the message names the user's path, not the temporary name beside it
        raise FasttrainError(f"{path}: cannot write there ({exc.strerror}); check that its folder exists and "
                             "is writable") from None
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        os.chmod(tmp, default_file_mode())
        try:
            os.replace(tmp, path)
        except IsADirectoryError:
            raise FasttrainError(f"{path} is a folder; give a file name (e.g. {path / 'run.json'})") from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` whole or not at all (see the module docstring)."""
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def save_figure(fig, path: str | os.PathLike, **savefig_options) -> None:
    """A matplotlib figure saved whole or not at all (a temporary file of the same type, then a rename)."""
    with atomic_path(path, suffix=Path(path).suffix) as tmp:
        fig.savefig(tmp, **savefig_options)


def finite_or_none(value):
    """``value`` with every NaN or infinite float replaced by None, recursively: JSON has no NaN, and a
    record must stay readable by any JSON parser (written with ``allow_nan=False``)."""
    import numpy as np

    if isinstance(value, float | np.floating):
        return float(value) if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite_or_none(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite_or_none(v) for v in value]
    return value


def write_into(path: str | os.PathLike, section: str, *, start: str, end: str) -> None:
    """Replace what lies between the marker lines ``start`` and ``end`` of the text file ``path`` with
    ``section`` (a generated part of a README); the rest of the file is kept, the write is whole."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise FasttrainError(f"{path}: no such file") from None
    lines = text.splitlines(keepends=True)
    starts = [i for i, line in enumerate(lines) if line.strip() == start]
    ends = [i for i, line in enumerate(lines) if line.strip() == end]
    if len(starts) != 1 or len(ends) != 1 or ends[0] < starts[0]:
        raise FasttrainError(f"{path}: needs exactly one line {start} and, below it, one line {end} "
                             "around the place for the results")
    new = "".join(lines[: starts[0] + 1]) + section.rstrip("\n") + "\n" + "".join(lines[ends[0]:])
    atomic_write_text(path, new)


def _folder_path(path: str | os.PathLike, flag: str) -> Path:
    """``path`` as a folder to write: refused when empty or an existing file."""
    text = os.fspath(path)
    if not text.strip():
        raise FasttrainError(f"{flag} is empty; give a folder")
    folder = Path(text).expanduser()
    if folder.exists() and not folder.is_dir():
        raise FasttrainError(f"{flag} {text}: that is a file, not a folder; give a folder")
    return folder


def check_new_folder(path: str | os.PathLike, flag: str) -> Path:
    """Refuse, before any work, a folder to be written that cannot be: empty, an existing file, or in a
    folder that does not exist or cannot be written (it is not created here: nothing is made anywhere
    a typo points)."""
    folder = _folder_path(path, flag)
    parent = folder.resolve().parent
    if not parent.is_dir():
        raise FasttrainError(f"{flag} {os.fspath(path)}: folder {parent} does not exist; create it first")
    if not os.access(parent, os.W_OK):
        raise FasttrainError(f"{flag} {os.fspath(path)}: folder {parent} is not writable; choose another path")
    return folder


def check_output_path(path: str | os.PathLike | None, flag: str) -> None:
    """Refuse, before any work, an output path that cannot become a file: empty, naming a folder
    (``dir/`` or an existing folder), in a folder that does not exist or cannot be written."""
    if path is None:
        return
    text = os.fspath(path)
    if not text.strip():
        raise FasttrainError(f"{flag} is empty; give a file name (e.g. {flag} run.json)")
    if text.endswith(("/", os.sep)) or Path(text).expanduser().is_dir():
        raise FasttrainError(f"{flag} {text}: that is a folder; give a file name inside it (e.g. {flag} "
                             f"{os.path.join(text, 'run.json' if 'out' in flag else 'weights.npz')})")
    parent = Path(text).expanduser().resolve().parent
    if not parent.is_dir():
        raise FasttrainError(f"{flag} {text}: folder {parent} does not exist; create it first")
    if not os.access(parent, os.W_OK):
        raise FasttrainError(f"{flag} {text}: folder {parent} is not writable; choose another path")


def check_distinct_outputs(**paths: str | os.PathLike | None) -> None:
    """Refuse two outputs of one command naming the same file: the second would replace the first."""
    seen: dict[Path, str] = {}
    for flag, path in paths.items():
        if path is None:
            continue
        resolved = Path(path).expanduser().resolve()
        if resolved in seen:
            raise FasttrainError(f"{seen[resolved]} and {flag} name the same file {path}; the second would "
                                 "replace the first: give them different paths")
        seen[resolved] = flag


def check_output_folder(path: str | os.PathLike, flag: str, parents: bool = False) -> Path:
    """An output folder, created if missing: with its missing parents only when ``parents`` (the
    folder itself was asked for), else only when its parent exists; refused when it is a file or
    cannot be written."""
    text = os.fspath(path)
    folder = _folder_path(path, flag)
    if not folder.exists():
        parent = folder.resolve().parent
        if not parents and not parent.is_dir():
            raise FasttrainError(f"{flag} {text}: folder {parent} does not exist; create it first")
        try:
            folder.mkdir(parents=parents, exist_ok=True)
        except OSError as exc:
            raise FasttrainError(f"{flag} {text}: cannot create the folder ({exc.strerror}); choose another") from None
    if not os.access(folder, os.W_OK):
        raise FasttrainError(f"{flag} {text}: folder is not writable; choose another")
    return folder


def swap_folder(tmp: str | os.PathLike, final: str | os.PathLike) -> None:
    """Put the finished folder ``tmp`` in place of ``final`` whole: an existing ``final`` is first
    renamed aside (to a fresh name beside it) and removed only once ``tmp`` has taken its place, so a
    crash leaves either the old folder or the new one, never a mix."""
    import shutil

    tmp, final = Path(tmp), Path(final)
    if final.exists():
        old = Path(tempfile.mkdtemp(prefix=final.name + ".", suffix=".old", dir=final.parent))
        os.replace(final, old)          # onto an empty folder: the rename replaces it
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)


def read_json_object(path: str | os.PathLike, what: str, *, missing: str = "no such file", hint: str = "") -> dict:
    """The JSON object in the file ``path`` (a result, a record); one line otherwise, naming ``what`` it
    should be: missing (``missing``, then ``hint``: how to make one), a folder, unreadable, or JSON that
    is not an object."""
    import json

    path = Path(path).expanduser()
    if path.is_dir():
        raise FasttrainError(f"{path} is a folder, not a {what}; give the file")
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise FasttrainError(f"{path}: {missing}" + (f"; {hint}" if hint else "")) from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise FasttrainError(f"{path}: not a {what} (unreadable JSON: {str(exc)[:80]})") from None
    except OSError as exc:
        raise FasttrainError(f"{path}: cannot read it ({exc.strerror})") from None
    if not isinstance(data, dict):
        raise FasttrainError(f"{path}: not a {what} (not a JSON object)")
    return data
