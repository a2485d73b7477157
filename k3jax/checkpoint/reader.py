"""Reading tensors, or slices of them, from a safetensors checkpoint directory.

A directory holds ``config.json`` and one or more ``*.safetensors`` files,
with ``model.safetensors.index.json`` when split. Names may carry the
``language_model.`` prefix; callers use the names without it.

Each file's header (8-byte little-endian length, JSON table of dtype, shape
and data offsets) is parsed here and checked against the file's size when
the file is first opened, so a truncated or malformed file is named before
any tensor data is read. Reads go straight from the file (``os.preadv`` at
the tensor's offsets) into the caller's buffer: one system call per
contiguous run of the region, no intermediate copy. Reads are thread-safe.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import threading
import weakref
from typing import Sequence

import numpy as np

from k3jax.checkpoint.host import CHUNK_BYTES, Workers
from k3jax.checkpoint.names import LANGUAGE_MODEL_PREFIX
from k3jax.config import MATH_KEYS, TENSOR_KEYS, K3Config, describe_defaults, read_hf_config

INDEX_FILE = "model.safetensors.index.json"
FLOAT_DTYPES = {"F32": np.float32, "BF16": "bfloat16", "F16": np.float16}
SUPPORTED_DTYPES = {*FLOAT_DTYPES, "U8"}
STORED_DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_), "U8": np.dtype(np.uint8), "I8": np.dtype(np.int8),
    "U16": np.dtype(np.uint16), "I16": np.dtype(np.int16), "F16": np.dtype(np.float16),
    "BF16": np.dtype("bfloat16"), "U32": np.dtype(np.uint32), "I32": np.dtype(np.int32),
    "F32": np.dtype(np.float32), "U64": np.dtype(np.uint64), "I64": np.dtype(np.int64),
    "F64": np.dtype(np.float64)}
"""Every safetensors dtype a header may name, as numpy (bfloat16 from ml_dtypes)."""
MAX_HEADER_BYTES = 100 << 20


class CheckpointError(ValueError):
    """A checkpoint problem; the message names the tensor or file."""


class TensorEntry:
    """One tensor of a header: safetensors dtype string, shape, and the
    absolute byte offset of its row-major data in ``file``."""

    __slots__ = ("file", "dtype", "shape", "offset")

    def __init__(self, file: str, dtype: str, shape: tuple[int, ...], offset: int):
        self.file, self.dtype, self.shape, self.offset = file, dtype, shape, offset


class CheckpointReader:
    """Random access to the tensors of one checkpoint directory.

    ``config_defaults``: {key: value used} for each key of
    k3jax.config.TENSOR_KEYS / MATH_KEYS that config.json lacks;
    ``math_defaults`` those the tensors cannot confirm (a caller warns about
    them). A tensor that is missing or has another shape names the absent
    TENSOR_KEYS, whose defaults may be the cause."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = os.fspath(directory)
        if not os.path.isdir(self.directory):
            if os.path.exists(self.directory):
                raise CheckpointError(f"checkpoint {self.directory} is not a directory (a "
                                      f"checkpoint is a directory holding config.json and "
                                      f"*.safetensors files)")
            raise CheckpointError(f"checkpoint directory not found: {self.directory}")
        config_path = os.path.join(self.directory, "config.json")
        if not os.path.isfile(config_path):
            raise CheckpointError(f"checkpoint has no config.json: {config_path}")
        self.config: K3Config
        self.config, self.config_defaults = read_hf_config(config_path)
        self._lock = threading.Lock()
        self._fds: dict[str, int] = {}
        weakref.finalize(self, _close_all, self._fds)
        self._headers: dict[str, dict[str, TensorEntry]] = {}
        self._file_of = self._index_tensors()
        self.prefix = (LANGUAGE_MODEL_PREFIX
                       if any(n.startswith(LANGUAGE_MODEL_PREFIX) for n in self._file_of) else "")

    @property
    def math_defaults(self) -> dict:
        """{key: default used} for the absent keys that change the math (MATH_KEYS)."""
        return {k: v for k, v in self.config_defaults.items() if k in MATH_KEYS}

    def _defaults_note(self) -> str:
        """A note naming the absent TENSOR_KEYS and their defaults, for an
        error about a tensor those keys size; "" when none is absent."""
        keys = [k for k in TENSOR_KEYS if k in self.config_defaults]
        if not keys:
            return ""
        return (f" ({os.path.join(self.directory, 'config.json')} has "
                f"{describe_defaults(keys, self.config_defaults)})")

    def close(self) -> None:
        """Close the open files (reads after this reopen them)."""
        with self._lock:
            _close_all(self._fds)

    # -- discovery ------------------------------------------------------------
    def _index_tensors(self) -> dict[str, str]:
        index_path = os.path.join(self.directory, INDEX_FILE)
        if os.path.isfile(index_path):
            try:
                with open(index_path) as f:
                    weight_map = json.load(f)["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise CheckpointError(f"{index_path}: not a valid safetensors index ({e})") from None
            for file in set(weight_map.values()):
                if not os.path.isfile(os.path.join(self.directory, file)):
                    raise CheckpointError(f"{index_path} names {file}, which does not exist")
            return dict(weight_map)
        files = sorted(f for f in os.listdir(self.directory) if f.endswith(".safetensors"))
        if not files:
            raise CheckpointError(f"no .safetensors files in {self.directory}")
        file_of = {}
        for file in files:
            for name in self._header(file):
                file_of[name] = file
        return file_of

    def _header(self, file: str) -> dict[str, TensorEntry]:
        """The parsed, size-checked header of ``file`` (cached)."""
        with self._lock:
            if file not in self._headers:
                self._headers[file] = _parse_header(self.directory, file)
            return self._headers[file]

    def _fd(self, file: str) -> int:
        with self._lock:
            if file not in self._fds:
                self._fds[file] = os.open(os.path.join(self.directory, file), os.O_RDONLY)
            return self._fds[file]

    # -- tensors ----------------------------------------------------------------
    def full_name(self, name: str) -> str:
        return self.prefix + name

    def has(self, name: str) -> bool:
        return self.full_name(name) in self._file_of

    def entry(self, name: str) -> TensorEntry:
        """The header entry of ``name``; raises if missing."""
        full = self.full_name(name)
        if full not in self._file_of:
            raise CheckpointError(f"missing tensor {full} in checkpoint {self.directory}"
                                  + self._defaults_note())
        file = self._file_of[full]
        header = self._header(file)
        if full not in header:
            raise CheckpointError(f"cannot read tensor {full} from {file}: the file's header "
                                  f"does not hold it")
        return header[full]

    def info(self, name: str) -> tuple[str, tuple[int, ...]]:
        """(safetensors dtype string, shape) of ``name``; raises if missing."""
        e = self.entry(name)
        return e.dtype, e.shape

    def check(self, name: str, shape: Sequence[int], dtypes=SUPPORTED_DTYPES) -> str:
        """Raise unless ``name`` exists with ``shape`` and one of ``dtypes``; return its dtype."""
        dtype, got = self.info(name)
        if dtype not in dtypes:
            raise CheckpointError(f"tensor {self.full_name(name)} has unsupported dtype {dtype} "
                                  f"(expected one of {sorted(dtypes)})")
        if tuple(got) != tuple(shape):
            raise CheckpointError(f"tensor {self.full_name(name)} has shape {list(got)}, "
                                  f"expected {list(shape)}" + self._defaults_note())
        return dtype

    def _region(self, name: str, index) -> tuple[TensorEntry, list[tuple[int, int]]]:
        e = self.entry(name)
        index = [slice(None)] * len(e.shape) if index is None else list(index)
        if len(index) != len(e.shape) or any(s.step not in (None, 1) for s in index):
            raise CheckpointError(f"cannot read tensor {self.full_name(name)}: index {index} "
                                  f"for shape {list(e.shape)}")
        return e, [s.indices(n)[:2] for s, n in zip(index, e.shape)]

    def runs(self, name: str, index: Sequence[slice] | None = None,
             contiguous_out: bool = True) -> tuple[str, list[tuple[tuple[int, ...], int, int]]]:
        """(file, [(leading index, file offset, bytes)]): the contiguous runs
        of file bytes behind region ``index`` of ``name`` in row-major order,
        one per leading index (trailing axes merged while the region spans
        them and ``contiguous_out``)."""
        e, bounds = self._region(name, index)
        itemsize = STORED_DTYPES[e.dtype].itemsize
        region = [max(0, b - a) for a, b in bounds]
        if math.prod(region) == 0:
            return e.file, []
        strides = [math.prod(e.shape[d + 1:]) * itemsize for d in range(len(e.shape))]
        k = len(e.shape) - 1 if e.shape else 0
        while contiguous_out and k > 0 and bounds[k] == (0, e.shape[k]):
            k -= 1
        base = e.offset + (bounds[k][0] * strides[k] if e.shape else 0)
        run = math.prod(region[k:]) * itemsize
        return e.file, [(outer, base + sum((a + i) * s for (a, _), i, s in zip(bounds, outer, strides)),
                         run) for outer in itertools.product(*map(range, region[:k]))]

    def read(self, name: str, index: Sequence[slice] | None = None,
             out: np.ndarray | None = None, workers: Workers | None = None) -> np.ndarray:
        """The tensor, or its ``index`` (a tuple of step-1 slices), as numpy
        in the stored dtype; read into ``out`` when given (its shape must be
        the region's, its dtype the stored one, its last axis contiguous).
        ``workers`` split a large read into CHUNK_BYTES pieces read in parallel."""
        e, bounds = self._region(name, index)
        full = self.full_name(name)
        dtype = STORED_DTYPES[e.dtype]
        region = tuple(max(0, b - a) for a, b in bounds)
        if out is None:
            out = np.empty(region, dtype)
        elif out.shape != region or out.dtype != dtype:
            raise ValueError(f"read {full}: out is {out.dtype}{list(out.shape)}, the region is "
                             f"{dtype}{list(region)}")
        if out.size == 0:
            return out
        if not out.flags.c_contiguous and out.strides[-1] != dtype.itemsize:
            raise ValueError(f"read {full}: out's last axis is not contiguous")
        file, runs = self.runs(name, index, contiguous_out=out.flags.c_contiguous)
        fd = self._fd(file)
        if workers is not None and out.nbytes <= CHUNK_BYTES:
            workers = None
        pieces = []
        for outer, offset, _ in runs:
            view = memoryview((out[outer] if outer else out).reshape(-1).view(np.uint8))
            if workers is None:
                _pread_into(fd, view, offset, full, file)
                continue
            pieces += [(view[lo:lo + CHUNK_BYTES], offset + lo)
                       for lo in range(0, len(view), CHUNK_BYTES)]
        if pieces:
            batch = max(1, len(pieces) // (4 * workers.count))
            workers.run([lambda group=pieces[i:i + batch]: [_pread_into(fd, v, o, full, file)
                                                            for v, o in group]
                         for i in range(0, len(pieces), batch)])
        return out

    def fingerprint(self) -> str:
        """A short identity of the checkpoint, equal across processes that read
        the same files: config, tensor names and files, file sizes, and sampled
        bytes of every file (its first, middle and last FINGERPRINT_WINDOW
        bytes: the header and tensor values there). Cheap at any checkpoint
        size; two checkpoints that differ only outside the windows look equal."""
        h = hashlib.sha256(json.dumps(self.config.to_hf_dict(), sort_keys=True).encode())
        for name in sorted(self._file_of):
            h.update(f"{name}:{self._file_of[name]}\n".encode())
        for file in sorted(set(self._file_of.values())):
            h.update(f"{file}:".encode())
            h.update(_sampled_bytes(os.path.join(self.directory, file)))
        return h.hexdigest()[:16]


def _close_all(fds: dict[str, int]) -> None:
    while fds:
        os.close(fds.popitem()[1])


def _pread_into(fd: int, view: memoryview, offset: int, name: str, file: str) -> None:
    """Fill ``view`` from ``fd`` at ``offset``; a short file is a CheckpointError."""
    done = 0
    while done < len(view):
        try:
            n = os.preadv(fd, [view[done:]], offset + done)
        except OSError as e:
            raise CheckpointError(f"cannot read tensor {name} from {file}: {e}") from None
        if n == 0:
            raise CheckpointError(f"cannot read tensor {name} from {file}: the file ends "
                                  f"before its data (truncated while reading?)")
        done += n


def _parse_header(directory: str, file: str) -> dict[str, TensorEntry]:
    """{name: TensorEntry} of one safetensors file, every entry checked:
    a known dtype, a shape of non-negative ints, data offsets that hold
    exactly shape x itemsize bytes, inside the file."""
    path = os.path.join(directory, file)

    def bad(why: str) -> CheckpointError:
        return CheckpointError(f"cannot read safetensors file {path}: {why}")
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise bad(f"{size} bytes, shorter than the 8-byte header length")
            n = int.from_bytes(head, "little")
            if n > min(size - 8, MAX_HEADER_BYTES):
                raise bad(f"header length {n} does not fit the file ({size} bytes)")
            text = f.read(n)
    except OSError as e:
        raise bad(str(e)) from None
    try:
        header = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad(f"header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise bad("header is not a JSON object")
    base = 8 + n
    entries = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (start, stop) = info["dtype"], info["shape"], info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise bad(f"tensor {name}: header entry {info!r} lacks dtype/shape/data_offsets") from None
        if dtype not in STORED_DTYPES:
            raise bad(f"tensor {name}: unknown dtype {dtype!r}")
        if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
            raise bad(f"tensor {name}: bad shape {shape!r}")
        if not (isinstance(start, int) and isinstance(stop, int) and 0 <= start <= stop):
            raise bad(f"tensor {name}: bad data_offsets {[start, stop]!r}")
        want = math.prod(shape) * STORED_DTYPES[dtype].itemsize
        if stop - start != want:
            raise bad(f"tensor {name}: data_offsets {[start, stop]} hold {stop - start} bytes, "
                      f"its {dtype}{shape} needs {want}")
        if base + stop > size:
            raise bad(f"tensor {name}: its data ends at byte {base + stop}, beyond the file's "
                      f"{size} bytes (truncated?)")
        entries[name] = TensorEntry(file, dtype, tuple(shape), base + start)
    return entries


FINGERPRINT_WINDOW = 1 << 16


def _sampled_bytes(path: str) -> bytes:
    """The size of the file, then its first, middle and last FINGERPRINT_WINDOW bytes."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        parts = [str(size).encode()]
        for offset in sorted({0, max(0, size // 2 - FINGERPRINT_WINDOW // 2),
                              max(0, size - FINGERPRINT_WINDOW)}):
            f.seek(offset)
            parts.append(f.read(FINGERPRINT_WINDOW))
    return b"|".join(parts)
