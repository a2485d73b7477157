"""Writing output files atomically: a failure never leaves a half-written file."""

from __future__ import annotations

import os
import tempfile
from typing import Any, Callable


def usual_mode(mode: int) -> int:
    """``mode`` less the process umask: what open() or mkdir() would give
    (0o666 for files, 0o777 for directories)."""
    umask = os.umask(0)
    os.umask(umask)
    return mode & ~umask


def check_writable(path: str) -> str | None:
    """Why ``path`` cannot be written (an existing directory, a missing or
    unwritable parent directory), or None."""
    if os.path.isdir(path):
        return f"{path} is a directory"
    return directory_problem(os.path.dirname(os.path.abspath(path)))


def directory_problem(directory: str) -> str | None:
    """Why no file can be created in ``directory`` (missing, unwritable), or
    None. Creates and removes a file there, so the answer holds for root and
    for read-only or virtual file systems too (unlike os.access)."""
    if not os.path.isdir(directory):
        return f"directory does not exist: {directory}"
    try:
        fd, probe = tempfile.mkstemp(prefix=".k3jax-probe-", dir=directory)
    except OSError as e:
        return f"cannot create files in {directory}: {e.strerror or e}"
    os.close(fd)
    os.unlink(probe)
    return None


def atomic_write(path: str, write: Callable[[Any], None], mode: str = "wb") -> None:
    """Call ``write(file)`` on a temporary file beside ``path``, then rename it
    over ``path``. The file gets the usual permissions (0666 less the umask).
    An OSError names ``path`` (not the temporary file)."""
    directory = os.path.dirname(os.path.abspath(path))
    try:
        fd, tmp = tempfile.mkstemp(prefix=".k3jax-", suffix=os.path.splitext(path)[1], dir=directory)
    except OSError as e:
        raise OSError(f"cannot write {path}: {e.strerror or e}") from None
    try:
        os.fchmod(fd, usual_mode(0o666))
        with os.fdopen(fd, mode) as f:
            write(f)
        os.replace(tmp, path)
    except BaseException as e:
        if os.path.exists(tmp):
            os.unlink(tmp)
        if isinstance(e, OSError):
            raise OSError(f"cannot write {path}: {e.strerror or e}") from None
        raise
