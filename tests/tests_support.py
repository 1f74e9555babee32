"""Helpers shared by the hardening tests: run the CLI in a subprocess, check a one-line error."""

from __future__ import annotations

import os
import re
import subprocess
import sys


def fasttrain_cli(*args, env=None, cwd=None, timeout=300):
    environ = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "fasttrain", *map(str, args)], capture_output=True, text=True,
                          env=environ, cwd=cwd, timeout=timeout)


def one_line_error(result, pattern):
    """Exit non-zero, no traceback, exactly one ``error: ...`` line on stderr, matching ``pattern``."""
    assert result.returncode != 0, result
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert re.search(pattern, lines[0]), lines[0]
    return lines[0]
