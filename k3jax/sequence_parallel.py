"""Token rows under sequence parallelism (SPEC 4): pad T to a multiple of the
row blocks, and move rows between devices inside ``jax.shard_map``.

Device r of an axis group owns rows [r*L, (r+1)*L), L = ceil(T / blocks).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from k3jax.layout import padded_rows


def pad_rows(x_TD: jax.Array, row_shards: int) -> tuple[jax.Array, jax.Array]:
    """Zero-pad rows to a multiple of ``row_shards``.
    Returns (x padded [T', D], valid_T' bool: True for the original rows)."""
    T = x_TD.shape[0]
    Tp = padded_rows(T, row_shards)
    x_pad = jnp.pad(x_TD, ((0, Tp - T), (0, 0)))
    return x_pad, jnp.arange(Tp) < T


def gather_rows(x_TX: jax.Array, axes: str | tuple[str, ...]) -> jax.Array:
    """Inside shard_map: every device of ``axes`` gets all their rows, in order."""
    return jax.lax.all_gather(x_TX, axes, axis=0, tiled=True)


def scatter_rows(x_TX: jax.Array, axes: str | tuple[str, ...]) -> jax.Array:
    """Inside shard_map: sum partials over ``axes`` and keep this device's rows."""
    return jax.lax.psum_scatter(x_TX, axes, scatter_dimension=0, tiled=True)
