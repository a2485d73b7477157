"""Writing checkpoints in the docs/spec.md §3 layout: synthetic ones for tests and
demos (``k3jax make-checkpoint``), with deterministic random weights."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Iterator, Literal

import numpy as np
from safetensors.numpy import save_file

from k3jax.checkpoint.names import LANGUAGE_MODEL_PREFIX, layer_prefix, layer_tensors
from k3jax.checkpoint.reader import INDEX_FILE
from k3jax.config import K3Config
from k3jax.files import usual_mode
from k3jax.formats import get_format
from pallas_kernels.mxfp4 import BLOCK_SIZE

WeightDtype = Literal["float32", "bfloat16", "float16"]
ExpertFormat = Literal["dense", "mxfp4"]


FAST_SCALE_BYTES = range(118, 128)
"""The MXFP4 scale bytes ``synthetic_tensors(..., fast=True)`` draws from:
scales 2**-9 .. 2**0, all within the fast dequant's bytes
(pallas_kernels.mxfp4_fast.FAST_SCALES)."""


def synthetic_tensors(cfg: K3Config, seed: int, *, dtype: WeightDtype = "bfloat16",
                      experts: ExpertFormat = "dense",
                      fast: bool = False) -> Iterator[tuple[str, np.ndarray]]:
    """(name, array) for every tensor of every layer, in the stored [out, in]
    layout. Weights are normal / sqrt(fan_in), the norm 1 + 0.1 normal, the
    router bias 0.05 normal (float32). ``experts="mxfp4"`` stores routed
    experts in that format's tensors (weight_packed / weight_scale: its
    stored_names and encode, k3jax.formats). ``fast=True`` fills the same
    tensors (names, shapes, dtypes) with random bits instead, many times
    faster to make (for loader benchmarks, which move bytes): float weights
    any finite value of magnitude below 2 (the exponent's top bit clear),
    MXFP4 codes any byte, scale bytes from FAST_SCALE_BYTES."""
    rng = np.random.default_rng(seed)
    codec = None if experts == "dense" else get_format(experts)
    np_dtype = np.dtype(dtype)
    D, L, E, I, F = (cfg.hidden_size, cfg.routed_expert_hidden_size, cfg.num_experts,
                     cfg.moe_intermediate_size, cfg.intermediate_size)
    S = cfg.shared_intermediate_size

    def weight(out: int, inp: int) -> np.ndarray:
        if fast:
            bits = np_dtype.itemsize * 8
            uint = np.dtype(f"uint{bits}")
            raw = np.frombuffer(rng.bytes(out * inp * np_dtype.itemsize), uint)
            return (raw & uint.type(~(1 << (bits - 2)) & ((1 << bits) - 1))).view(
                np_dtype).reshape(out, inp)
        return (rng.standard_normal((out, inp), np.float32) / np.sqrt(inp)).astype(np_dtype)

    def encoded(out: int, inp: int) -> tuple[np.ndarray, ...]:
        if fast:   # MXFP4's codes and scales
            packed = np.frombuffer(rng.bytes(out * inp // 2), np.uint8).reshape(out, inp // 2)
            return packed, rng.integers(FAST_SCALE_BYTES.start, FAST_SCALE_BYTES.stop,
                                        (out, inp // BLOCK_SIZE), dtype=np.uint8)
        return codec.encode(rng.standard_normal((out, inp), np.float32) / np.sqrt(inp))

    for layer in range(cfg.num_hidden_layers):
        is_moe = cfg.is_moe_layer(layer)
        prefix = layer_prefix(layer, is_moe)
        if not is_moe:
            yield prefix + "gate_proj.weight", weight(F, D)
            yield prefix + "up_proj.weight", weight(F, D)
            yield prefix + "down_proj.weight", weight(D, F)
            continue
        yield prefix + "gate.weight", weight(E, D)
        yield prefix + "gate.e_score_correction_bias", (0.05 * rng.standard_normal(E)).astype(np.float32)
        yield prefix + "routed_expert_down_proj.weight", weight(L, D)
        if cfg.latent_moe_use_norm:
            yield prefix + "routed_expert_norm.weight", (
                1 + 0.1 * rng.standard_normal(L)).astype(np_dtype)
        yield prefix + "routed_expert_up_proj.weight", weight(D, L)
        yield prefix + "shared_experts.gate_proj.weight", weight(S, D)
        yield prefix + "shared_experts.up_proj.weight", weight(S, D)
        yield prefix + "shared_experts.down_proj.weight", weight(D, S)
        for e in range(E):
            for w, (out, inp) in (("w1", (I, L)), ("w3", (I, L)), ("w2", (L, I))):
                name = f"{prefix}experts.{e}.{w}.weight"
                if codec is not None:
                    yield from zip(codec.stored_names(name), encoded(out, inp))
                else:
                    yield name, weight(out, inp)


def synthetic_tensor_count(cfg: K3Config, experts: ExpertFormat = "dense") -> int:
    """How many tensors ``synthetic_tensors(cfg, ..., experts=experts)`` yields."""
    per_moe = 7 + int(cfg.latent_moe_use_norm) + cfg.num_experts * 3 * (2 if experts == "mxfp4" else 1)
    moe = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    return moe * per_moe + (cfg.num_hidden_layers - moe) * 3


def checkpoint_bytes(cfg: K3Config, dtype: WeightDtype = "bfloat16",
                     experts: ExpertFormat = "dense") -> int:
    """Tensor bytes of ``synthetic_tensors(cfg, ..., dtype=dtype, experts=experts)``
    (without the file headers)."""
    item = np.dtype(dtype).itemsize
    D, L, E, I, F = (cfg.hidden_size, cfg.routed_expert_hidden_size, cfg.num_experts,
                     cfg.moe_intermediate_size, cfg.intermediate_size)
    S = cfg.shared_intermediate_size
    expert = 3 * I * L * (item if experts == "dense" else 1) // (1 if experts == "dense" else 2)
    if experts == "mxfp4":
        expert += 3 * I * L // 32
    moe = (E * D + 2 * L * D + int(cfg.latent_moe_use_norm) * L + 3 * S * D) * item + 4 * E \
        + E * expert
    return cfg.num_moe_layers * moe + cfg.num_dense_layers * 3 * F * D * item


def write_checkpoint(directory: str | os.PathLike, cfg: K3Config, tensors, *,
                     num_files: int = 1, language_model_prefix: bool = False,
                     nested_config: bool = False) -> None:
    """Write ``tensors`` ((name, array) pairs) and ``config.json`` to
    ``directory``, split over ``num_files`` files with an index when > 1.
    Everything is written to a temporary folder first and moved into place,
    so a failure leaves no half-written checkpoint; the files and folder get
    the usual permissions (0666 / 0777 less the umask)."""
    directory = os.fspath(directory)
    if os.path.exists(directory) and os.listdir(directory):
        raise FileExistsError(f"refusing to write into non-empty directory {directory}")
    if num_files < 1:
        raise ValueError(f"num_files must be >= 1, got {num_files}")
    parent = os.path.dirname(os.path.abspath(directory))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".k3jax-ckpt-", dir=parent)
    try:
        prefix = LANGUAGE_MODEL_PREFIX if language_model_prefix else ""
        items = [(prefix + name, np.ascontiguousarray(a)) for name, a in tensors]
        if num_files > len(items):
            raise ValueError(f"num_files {num_files} exceeds the number of tensors ({len(items)})")
        shards = [items[i::num_files] for i in range(num_files)]
        weight_map = {}
        for i, shard in enumerate(shards):
            file = ("model.safetensors" if num_files == 1
                    else f"model-{i + 1:05d}-of-{num_files:05d}.safetensors")
            save_file(dict(shard), os.path.join(tmp, file))
            weight_map.update({name: file for name, _ in shard})
        if num_files > 1:
            with open(os.path.join(tmp, INDEX_FILE), "w") as f:
                json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=1)
        config = cfg.to_hf_dict()
        if nested_config:
            config = {"model_type": "kimi_k3", "text_config": config}
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(config, f, indent=2)
        for file in os.listdir(tmp):
            os.chmod(os.path.join(tmp, file), usual_mode(0o666))
        os.chmod(tmp, usual_mode(0o777))   # mkdtemp made it 0700
        if os.path.exists(directory):
            os.rmdir(directory)
        os.replace(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def make_synthetic_checkpoint(directory: str | os.PathLike, cfg: K3Config, seed: int = 0, *,
                              dtype: WeightDtype = "bfloat16", experts: ExpertFormat = "dense",
                              num_files: int = 1, fast: bool = False) -> None:
    """A deterministic synthetic checkpoint of ``cfg`` in the docs/spec.md §3
    layout (``fast``: random bits, as ``synthetic_tensors`` says)."""
    write_checkpoint(directory, cfg, synthetic_tensors(cfg, seed, dtype=dtype, experts=experts,
                                                       fast=fast),
                     num_files=num_files)


__all__ = ["synthetic_tensors", "synthetic_tensor_count", "checkpoint_bytes", "write_checkpoint",
           "make_synthetic_checkpoint", "layer_tensors"]
