"""Writing output files atomically: a failure never leaves a half-written file.

Every file is written to a temporary file in the directory it will live in,
then renamed over it. A path that is a symbolic link is followed: the file
written is the link's final target (created if the link dangles) and the
link itself stays as it was. A link loop, or a target whose directory does
not exist, is refused before anything is written (``check_writable``).
"""

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


def resolve_output(path: str) -> str:
    """The file a write to ``path`` replaces: ``path`` itself, or the final
    target of the symbolic link(s) it names (a dangling link's target, which
    the write creates). OSError for a link loop."""
    if not os.path.islink(path):
        return path
    target = os.path.realpath(path)
    if os.path.islink(target):   # realpath stops at a loop and returns a link
        raise OSError(f"{path} is a symbolic link loop")
    return target


def check_writable(path: str) -> str | None:
    """Why ``path`` cannot be written (an existing directory, a missing or
    unwritable parent directory, a link loop, a link to either), or None.
    A link is judged by its target (``resolve_output``)."""
    try:
        target = resolve_output(path)
    except OSError as e:
        return str(e)
    via = f" (the target of the link {path})" if target != path else ""
    if os.path.isdir(target):
        return f"{target} is a directory{via}"
    why = directory_problem(os.path.dirname(os.path.abspath(target)))
    return f"{why}{via}" if why else None


def directory_problem(directory: str) -> str | None:
    """Why no file can be created in ``directory`` (missing, unwritable), or
    None. Creates and removes a file there, so the answer holds for root and
    for read-only or virtual file systems too (unlike os.access)."""
    if not os.path.isdir(directory):
        if os.path.exists(directory):
            return f"not a directory: {directory}"
        return f"directory does not exist: {directory}"
    try:
        fd, probe = tempfile.mkstemp(prefix=".k3jax-probe-", dir=directory)
    except OSError as e:
        return f"cannot create files in {directory}: {e.strerror or e}"
    os.close(fd)
    os.unlink(probe)
    return None


def atomic_write(path: str, write: Callable[[Any], None], mode: str = "wb") -> None:
    """Call ``write(file)`` on a temporary file beside ``path`` (beside its
    target when ``path`` is a symbolic link: ``resolve_output``), then rename
    it over that file. The file gets the usual permissions (0666 less the
    umask). An OSError names ``path`` (not the temporary file); on any
    failure the old file stays as it was."""
    try:
        target = resolve_output(path)
    except OSError as e:
        raise OSError(f"cannot write {path}: {e}") from None
    directory = os.path.dirname(os.path.abspath(target))
    try:
        fd, tmp = tempfile.mkstemp(prefix=".k3jax-", suffix=os.path.splitext(target)[1],
                                   dir=directory)
    except OSError as e:
        raise OSError(f"cannot write {path}: {e.strerror or e}") from None
    try:
        os.fchmod(fd, usual_mode(0o666))
        with os.fdopen(fd, mode) as f:
            write(f)
        os.replace(tmp, target)
    except BaseException as e:
        if os.path.exists(tmp):
            os.unlink(tmp)
        if isinstance(e, OSError):
            raise OSError(f"cannot write {path}: {e.strerror or e}") from None
        raise
