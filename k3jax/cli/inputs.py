"""The arrays a command reads (``run --input``, ``--cotangent``): .npy files.

The header is read and checked first (a .npy file, not an .npz archive or a
pickle; the shape and dtype asked for; the data it announces present in the
file and small enough for this machine's memory), then the data, then its
values (finite). Every problem is a ValueError whose one line names the flag
and the file: bad data, exit status 1.
"""

from __future__ import annotations

import math
import os

import numpy as np

from k3jax.cli.machine import memory_problem

ZIP_MAGIC = b"PK\x03\x04"


def describe_dtype(dtype: np.dtype) -> str:
    """A dtype's name as a user reads it; raw (void) dtypes say what they likely are."""
    if dtype.kind == "V" and dtype.fields is None:
        hint = (" (np.save writes bfloat16 arrays this way: save x.astype(np.float32))"
                if dtype.itemsize == 2 else "")
        return f"raw {dtype.itemsize}-byte records '{dtype.str}'{hint}"
    if dtype.fields is not None:
        return f"structured records {dtype.descr}"
    return str(dtype)


def _header(f, what: str) -> tuple[tuple[int, ...], bool, np.dtype]:
    fmt = np.lib.format
    start = f.read(len(ZIP_MAGIC))
    f.seek(0)
    if start == ZIP_MAGIC:
        raise ValueError(f"{what} is an .npz archive (np.savez), not a .npy file: save the one "
                         f"array with np.save")
    try:
        version = fmt.read_magic(f)
        if version == (1, 0):
            return fmt.read_array_header_1_0(f)
        return fmt.read_array_header_2_0(f) if version == (2, 0) else \
            fmt._read_array_header(f, version)
    except (ValueError, SyntaxError, TypeError, EOFError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"{what}: cannot read it: not a .npy file ({first})") from None


def read_npy(path: str, flag: str, *, shape_rule, shape_words: str) -> np.ndarray:
    """The float32 array in ``path`` (given by ``flag``), checked: its shape
    passes ``shape_rule(shape)`` (else an error "``shape_words``, got
    [...]"), its dtype is float32, the file holds its
    data, the data fits the available memory, every value is finite."""
    what = f"{flag} {path}"
    if os.path.isdir(path):
        raise ValueError(f"{what}: cannot read it: it is a directory, not a .npy file")
    try:
        f = open(path, "rb")
    except OSError as e:
        raise ValueError(f"{what}: cannot read it: {e.strerror or e}") from None
    with f:
        shape, fortran_order, dtype = _header(f, what)
        if not shape_rule(shape):
            raise ValueError(f"{what} {shape_words}, got {list(shape)}")
        if dtype != np.float32:
            raise ValueError(f"{what} must be float32, got {describe_dtype(dtype)}")
        nbytes = math.prod(shape) * dtype.itemsize
        held = os.fstat(f.fileno()).st_size - f.tell()
        if held < nbytes:
            raise ValueError(f"{what} is truncated: its header announces {dtype}{list(shape)}, "
                             f"{nbytes:,} bytes, and the file holds {held:,}")
        if why := memory_problem(nbytes, what):
            raise ValueError(why)
        data = np.fromfile(f, dtype=dtype, count=math.prod(shape))
    x = data.reshape(shape[::-1]).transpose() if fortran_order else data.reshape(shape)
    if not np.all(np.isfinite(x)):
        raise ValueError(f"{what} contains NaN or inf")
    return np.ascontiguousarray(x)


def load_input(path: str, hidden: int) -> np.ndarray:
    """--input: float32 [T, hidden], T >= 1."""
    return read_npy(path, "--input", shape_words=f"must be [T, {hidden}] with T >= 1",
                    shape_rule=lambda s: len(s) == 2 and s[1] == hidden and s[0] >= 1)


def load_cotangent(path: str, shape: tuple[int, ...]) -> np.ndarray:
    """--cotangent: float32 in the input's ``shape``."""
    return read_npy(path, "--cotangent", shape_words=f"must have the input's shape {list(shape)}",
                    shape_rule=lambda s: tuple(s) == tuple(shape))
