"""Token rows under sequence parallelism (docs/spec.md §4): pad T to a multiple of the
row blocks, move rows between devices inside ``jax.shard_map``, and wrap a
per-device body into a global forward.

Device r of an axis group owns rows [r*L, (r+1)*L), L = ceil(T / blocks).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from k3jax.layout import ParallelConfig, padded_rows


def pad_rows(x_TD: jax.Array, row_shards: int) -> tuple[jax.Array, jax.Array]:
    """Zero-pad rows to a multiple of ``row_shards``.
    Returns (x padded [T', D], valid_T' bool: True for the original rows)."""
    T = x_TD.shape[0]
    Tp = padded_rows(T, row_shards)
    x_pad = jnp.pad(x_TD, ((0, Tp - T), (0, 0)))
    return x_pad, jnp.arange(Tp) < T


def gather_rows(x_TX: jax.Array, axes: str | tuple[str, ...]) -> jax.Array:
    """Inside shard_map: x_TX [T, X] (this device's rows) -> [T * n, X], the
    rows of all n devices of ``axes`` in device order (same on every one)."""
    return jax.lax.all_gather(x_TX, axes, axis=0, tiled=True)


def scatter_rows(x_TX: jax.Array, axes: str | tuple[str, ...]) -> jax.Array:
    """Inside shard_map: x_TX [T * n, X] (a partial sum on each of the n
    devices of ``axes``) -> [T, X], the sum of this device's block of rows.
    Sums in x's dtype."""
    return jax.lax.psum_scatter(x_TX, axes, scatter_dimension=0, tiled=True)


RowBody = Callable[[jax.Array, jax.Array, Any], jax.Array]


def row_sharded_forward(body: RowBody, mesh: Mesh, parallel: ParallelConfig, dtype,
                        weight_specs: Any) -> Callable[[jax.Array, Any], jax.Array]:
    """The jitted global forward (x_TD [T, D], weights) -> y_TD [T, D] of a
    per-device ``body(x_TD, valid_T, weights) -> y_TD``.

    x is cast to ``dtype``, zero-padded to a multiple of ``parallel.row_shards``
    and placed over ``parallel.token_axes``; the body sees this device's rows,
    x_TD [T'/row_shards, D] and valid_T [T'/row_shards] (False on padding
    rows), and weights placed with ``weight_specs``; the padding is dropped
    from its output (split over the token axes when T is a multiple of the
    row blocks; otherwise XLA chooses the placement of the sliced rows).
    """
    x_spec = P(parallel.token_axes, None)
    sharded = jax.shard_map(body, mesh=mesh, in_specs=(x_spec, P(parallel.token_axes), weight_specs),
                            out_specs=x_spec)

    @jax.jit
    def forward(x_TD, weights):
        x_pad, valid_T = pad_rows(x_TD.astype(dtype), parallel.row_shards)
        x_pad = jax.lax.with_sharding_constraint(x_pad, NamedSharding(mesh, x_spec))
        return sharded(x_pad, valid_T, weights)[:x_TD.shape[0]]

    return forward
