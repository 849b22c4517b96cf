"""The errors a run ends with, each told in one line (bad input, `BAD_INPUT`: exit 2); imported
by every layer of `common/`, so this module imports none of it."""

from __future__ import annotations

import os
import re


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the problem and the fix."""


class DatasetError(RuntimeError):
    """A dataset cannot be read or fetched; the message says which file and what to do."""


class WriteFailed(RuntimeError):
    """A file the run writes (a checkpoint, --save-state, the record) could not be written: a
    full disk, a quota, a file-size limit. Its partial files are already removed; the run ends
    "failed" with this one line and no traceback (common/trainer.py). `path`: the file."""

    def __init__(self, message: str, path: str | os.PathLike[str] = ""):
        super().__init__(message)
        self.path = str(path)


class RunFailed(RuntimeError):
    """Training failed and its record (with the epochs measured so far) is already written."""


BAD_INPUT = (ConfigError, DatasetError)


def first_line(exc: BaseException) -> str:
    """An exception's message as one line: its first non-empty line (torch's load errors run
    over several lines, with advice that does not apply), the last one of a message that holds
    a C++ traceback (MXNet), or its type name."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    if lines and lines[0].startswith("Traceback"):  # MXNet's C++ errors: the cause comes last
        return re.sub(r"^\w+Error: ", "", lines[-1])
    return lines[0] if lines else type(exc).__name__
