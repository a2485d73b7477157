"""Per-device parameter bytes, read from a module's placed (or abstract) arrays:
every weight it holds (k3jax.variables.WEIGHTS: nnx.Params, the router bias,
packed experts).

The planner and ``k3jax run`` both use this, so the bytes a plan reports are
the bytes the modules allocate.
"""

from __future__ import annotations

import math

import jax
import numpy as np
from flax import nnx

from k3jax.variables import WEIGHTS


def param_shard_shapes(module: nnx.Module) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """{"shared.gate_DF": (one device's shard shape, dtype), ...}. Works on real
    arrays and on ShapeDtypeStructs that carry a sharding."""
    out = {}
    for path, var in nnx.to_flat_state(nnx.state(module, WEIGHTS)):
        value = var.get_value()
        out[".".join(map(str, path))] = (tuple(value.sharding.shard_shape(tuple(value.shape))),
                                         np.dtype(value.dtype))
    return out


def param_shard_bytes(module: nnx.Module) -> dict[str, int]:
    """{"shared.gate_DF": bytes, ...}: one device's share of each parameter."""
    return {name: math.prod(shape) * dtype.itemsize
            for name, (shape, dtype) in param_shard_shapes(module).items()}


def addressable_bytes_per_device(module: nnx.Module) -> dict[jax.Device, int]:
    """Bytes of parameter shards actually resident on each local device."""
    totals: dict[jax.Device, int] = {}
    for _, var in nnx.to_flat_state(nnx.state(module, WEIGHTS)):
        for shard in var.get_value().addressable_shards:
            totals[shard.device] = totals.get(shard.device, 0) + shard.data.nbytes
    return totals


def format_bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"
