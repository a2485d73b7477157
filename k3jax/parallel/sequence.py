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
from k3jax.layout.user_mesh import layer_spec


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


RowBody = Callable[[jax.Array, jax.Array, Any], Any]


def row_sharded_forward(body: RowBody, mesh: Mesh, parallel: ParallelConfig, dtype,
                        weight_specs: Any, aux_specs: Any = None) -> Callable[[jax.Array, Any], Any]:
    """The global forward (x_TD [T, D], weights) -> y_TD [T, D] of a
    per-device ``body(x_TD, valid_T, weights) -> y_TD``, jitted.

    x is cast to ``dtype``, zero-padded to a multiple of ``parallel.row_shards``
    and placed over ``parallel.token_axes``; the body sees this device's rows,
    x_TD [T'/row_shards, D] and valid_T [T'/row_shards] (False on padding
    rows), and weights placed with ``weight_specs``; the padding is dropped
    from its output (split over the token axes when T is a multiple of the
    row blocks; otherwise XLA chooses the placement of the sliced rows).

    ``aux_specs``: with it, the body returns (y_TD, aux) and the forward
    (y_TD, aux), aux a pytree placed by these out_specs (e.g. P() for values
    every device holds).

    ``mesh`` is the layer's mesh (k3jax.layout.check_mesh); the forward
    takes an x on the user's mesh too (``on_layer_mesh``).
    """
    x_spec = P(parallel.token_axes, None)
    out_specs = x_spec if aux_specs is None else (x_spec, aux_specs)
    sharded = jax.shard_map(body, mesh=mesh, in_specs=(x_spec, P(parallel.token_axes), weight_specs),
                            out_specs=out_specs)

    @jax.jit
    def forward(x_TD, weights):
        x_pad, valid_T = pad_rows(x_TD.astype(dtype), parallel.row_shards)
        x_pad = jax.lax.with_sharding_constraint(x_pad, NamedSharding(mesh, x_spec))
        out = sharded(x_pad, valid_T, weights)
        if aux_specs is None:
            return out[:x_TD.shape[0]]
        return out[0][:x_TD.shape[0]], out[1]

    return on_layer_mesh(forward, mesh, parallel)


def on_layer_mesh(f: Callable[..., Any], mesh: Mesh, parallel: ParallelConfig) -> Callable[..., Any]:
    """``f(x, *args)`` (traced or run on ``mesh``, the layer's mesh:
    k3jax.layout.check_mesh), callable with an x placed on another mesh over
    the same devices (the user's: Explicit axes, other names,
    ``parallel.axis_names``) and under another context mesh
    (``jax.set_mesh``), eagerly or inside the user's jax.jit.

    Such an x is moved onto ``mesh`` first (eagerly by device_put to the
    same placement under k3jax's names; traced by ``jax.sharding.reshard``
    to an unconstrained one, which the forward's own constraint then places:
    no data moves when the user's spec names the token axes' roles); f runs
    under ``mesh``'s abstract mesh; its output is placed back on x's mesh:
    the first leaf (the output [..., D], x's shape) like x, any other leaf
    (statistics) replicated. x already on ``mesh`` (or on no mesh) under no
    other context mesh: f(x, *args) as it is."""
    def call(x, *args):
        outer = _foreign_sharding(x, mesh)
        context = jax.sharding.get_abstract_mesh()
        if outer is None and (context.empty or context == mesh.abstract_mesh):
            return f(x, *args)
        traced = isinstance(x, jax.core.Tracer)
        if traced:
            x = jax.sharding.reshard(x, NamedSharding(mesh, P()))
        elif outer is not None:
            x = jax.device_put(x, NamedSharding(mesh, layer_spec(outer.spec, parallel)))
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            out = f(x, *args)
        if outer is None:
            return out
        leaves, tree = jax.tree.flatten(out)
        # concrete: device_put (the layer's mesh may order the devices otherwise)
        place = jax.sharding.reshard if isinstance(leaves[0], jax.core.Tracer) else jax.device_put
        replicated = NamedSharding(outer.mesh, P())
        return jax.tree.unflatten(tree, [place(a, outer if i == 0 else replicated)
                                         for i, a in enumerate(leaves)])

    return call


def _foreign_sharding(x: Any, mesh: Mesh) -> NamedSharding | None:
    """x's NamedSharding when it lies on a mesh other than ``mesh`` (another
    mesh's names or axis types; concrete for a concrete x), else None (not
    an array, a numpy array, a single-device or uncommitted array, x already
    on ``mesh``)."""
    if not isinstance(x, (jax.Array, jax.core.Tracer)):
        return None
    typed = getattr(jax.typeof(x), "sharding", None)
    if not isinstance(typed, NamedSharding) or typed.mesh.empty:
        return None
    if typed.mesh == mesh.abstract_mesh:
        return None
    concrete = None if isinstance(x, jax.core.Tracer) else getattr(x, "sharding", None)
    return concrete if isinstance(concrete, NamedSharding) else typed
