"""User-facing errors.

Anything a user can cause (a missing or corrupt file, a bad flag, an engine that cannot run
here) raises :class:`FasttrainError` with one line that says what is wrong and how to fix it.
The CLI prints that line and exits non-zero, without a traceback.
"""


class FasttrainError(Exception):
    """An error caused by input or environment, with a one-line message that names the fix."""


class DataError(FasttrainError):
    """A dataset file is missing, truncated, corrupt or fails verification."""


class EngineUnavailable(FasttrainError):
    """The requested engine cannot run on this machine (the message says why)."""
