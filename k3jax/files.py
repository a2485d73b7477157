"""Writing output files atomically: a failure never leaves a half-written file."""

from __future__ import annotations

import os
import tempfile
from typing import Any, Callable


def atomic_write(path: str, write: Callable[[Any], None], mode: str = "wb") -> None:
    """Call ``write(file)`` on a temporary file beside ``path``, then rename it
    over ``path``. The file gets the usual permissions (0666 less the umask)."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".k3jax-", suffix=os.path.splitext(path)[1], dir=directory)
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)
        with os.fdopen(fd, mode) as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
