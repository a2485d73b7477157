"""Reading tensors, or slices of them, from a safetensors checkpoint directory.

A directory holds ``config.json`` and one or more ``*.safetensors`` files,
with ``model.safetensors.index.json`` when split. Names may carry the
``language_model.`` prefix; callers use the names without it.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Sequence

import numpy as np
from safetensors import safe_open

from k3jax.checkpoint.names import LANGUAGE_MODEL_PREFIX
from k3jax.config import K3Config, from_hf_config

INDEX_FILE = "model.safetensors.index.json"
FLOAT_DTYPES = {"F32": np.float32, "BF16": "bfloat16", "F16": np.float16}
SUPPORTED_DTYPES = {*FLOAT_DTYPES, "U8"}


class CheckpointError(ValueError):
    """A checkpoint problem; the message names the tensor or file."""


class CheckpointReader:
    """Random access to the tensors of one checkpoint directory."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = os.fspath(directory)
        if not os.path.isdir(self.directory):
            raise CheckpointError(f"checkpoint directory not found: {self.directory}")
        config_path = os.path.join(self.directory, "config.json")
        if not os.path.isfile(config_path):
            raise CheckpointError(f"checkpoint has no config.json: {config_path}")
        self.config: K3Config = from_hf_config(config_path)
        self._handles: dict[str, object] = {}
        self._file_of = self._index_tensors()
        self.prefix = (LANGUAGE_MODEL_PREFIX
                       if any(n.startswith(LANGUAGE_MODEL_PREFIX) for n in self._file_of) else "")

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
            for name in self._open(file).keys():
                file_of[name] = file
        return file_of

    def _open(self, file: str):
        if file not in self._handles:
            path = os.path.join(self.directory, file)
            try:
                self._handles[file] = safe_open(path, framework="numpy")
            except Exception as e:  # safetensors raises its own error types
                raise CheckpointError(f"cannot read safetensors file {path}: {e}") from None
        return self._handles[file]

    # -- tensors ----------------------------------------------------------------
    def full_name(self, name: str) -> str:
        return self.prefix + name

    def has(self, name: str) -> bool:
        return self.full_name(name) in self._file_of

    def info(self, name: str) -> tuple[str, tuple[int, ...]]:
        """(safetensors dtype string, shape) of ``name``; raises if missing."""
        sl = self._slice(name)
        return sl.get_dtype(), tuple(sl.get_shape())

    def _slice(self, name: str):
        full = self.full_name(name)
        if full not in self._file_of:
            raise CheckpointError(f"missing tensor {full} in checkpoint {self.directory}")
        file = self._file_of[full]
        try:
            return self._open(file).get_slice(full)
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(f"cannot read tensor {full} from {file}: {e}") from None

    def check(self, name: str, shape: Sequence[int], dtypes=SUPPORTED_DTYPES) -> str:
        """Raise unless ``name`` exists with ``shape`` and one of ``dtypes``; return its dtype."""
        dtype, got = self.info(name)
        if dtype not in dtypes:
            raise CheckpointError(f"tensor {self.full_name(name)} has unsupported dtype {dtype} "
                                  f"(expected one of {sorted(dtypes)})")
        if tuple(got) != tuple(shape):
            raise CheckpointError(f"tensor {self.full_name(name)} has shape {list(got)}, "
                                  f"expected {list(shape)}")
        return dtype

    def read(self, name: str, index: Sequence[slice] | None = None) -> np.ndarray:
        """The tensor, or its ``index`` (a tuple of step-1 slices), as numpy."""
        sl = self._slice(name)
        try:
            return np.asarray(sl[tuple(index)] if index is not None else sl[:])
        except Exception as e:
            raise CheckpointError(f"cannot read tensor {self.full_name(name)}: {e}") from None

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
