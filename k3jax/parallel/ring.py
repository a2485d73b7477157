"""Collective matmuls on a ring (the "collective matmul" decomposition of the
JAX shard_map documentation): an all-gather fused with the matmul that
consumes it, and a matmul fused with the reduce-scatter that sums it, each cut
into n row blocks passed between neighbours with ``jax.lax.ppermute``, so that
one block's transfer is in flight while another block's matmul runs.

All functions run inside ``jax.shard_map``; ``axis`` is a mesh axis of size n
(k3jax passes TENSOR) and device r of it owns row block r. Every ppermute
sends to the next device, r -> (r + 1) mod n, so at ring step s device r holds
(or works on) row block ``block_at_step(r, s)``:

    gather step s     block (r - s) mod n      s = 0 .. n - 1 (0: its own)
    scatter step s    block (r - s - 1) mod n  s = 0 .. n - 1 (n - 1: its own)

The scatter at step s needs the gather's output of step (s + 1) mod n, so the
two rings compose without reordering any rows. Bytes over the wire equal the
unfused collectives': n - 1 blocks each way per device, as a ring all-gather /
reduce-scatter moves.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp


def ring_pairs(n: int) -> list[tuple[int, int]]:
    """ppermute's source -> target pairs of the ring: r -> (r + 1) mod n."""
    return [(r, (r + 1) % n) for r in range(n)]


def ring_all_gather_map(x_TX: jax.Array, f: Callable[[jax.Array], jax.Array],
                        axis: str) -> list[jax.Array]:
    """f applied to every device's row block of x, the blocks passed around the ring.

    x_TX [T, X]: this device's rows; f: [T, X] -> [T, Y], row-wise (a matmul
    on the gathered rows, e.g. the MLP's gate/up + SiTU). Returns n arrays
    [T, Y] in step order: element s is f(row block (r - s) mod n). Step s's
    f runs while the block of step s + 1 travels (n - 1 ppermutes of [T, X]).
    """
    n = jax.lax.axis_size(axis)
    out = []
    block_TX = x_TX
    for step in range(n - 1):
        # The next block's transfer and this block's f are independent; the
        # barrier makes step s + 1's f wait for both, so XLA can neither merge
        # the n matmuls into one after the last transfer (its dot merger does,
        # without it) nor pull the transfer behind f.
        block_TX, y_TY = jax.lax.optimization_barrier(
            (jax.lax.ppermute(block_TX, axis, ring_pairs(n)), f(block_TX)))
        out.append(y_TY)
    out.append(f(block_TX))
    return out


def ring_reduce_scatter_map(h_by_gather_step: list[jax.Array],
                            g: Callable[[jax.Array], jax.Array], axis: str,
                            wire_dtype=jnp.float32) -> jax.Array:
    """sum over the ring of g(row block), each device keeping its own block's sum.

    h_by_gather_step: n arrays [T, Y] in ``ring_all_gather_map``'s step order
    (element s holds row block (r - s) mod n); g: [T, Y] -> [T, Z] float32 (a
    partial product over this device's shard, e.g. the MLP's down matmul).
    Returns [T, Z] float32: sum over the n devices of g(their h of row block
    r), the reduce-scatter of the partials. Scatter step s adds g of row block
    (r - s - 1) mod n (= gather step (s + 1) mod n) to the running sum
    received from device r - 1 and passes it on, so the transfer of one
    running sum overlaps the next block's g (n - 1 ppermutes of [T, Z] float32).
    """
    n = jax.lax.axis_size(axis)
    if len(h_by_gather_step) != n:
        raise ValueError(f"ring_reduce_scatter_map: {len(h_by_gather_step)} blocks for a ring "
                         f"of {n} devices over {axis!r}")
    h_of_step = [h_by_gather_step[(step + 1) % n] for step in range(n)]
    # Each barrier chains the g's (XLA's dot merger would otherwise make the
    # n independent matmuls one, after which nothing is left to overlap) and
    # holds one running sum's transfer across the next block's g.
    acc_TZ, h_TY = jax.lax.optimization_barrier((g(h_of_step[0]).astype(jnp.float32),
                                                 h_of_step[1 % n]))
    for step in range(1, n):
        following = h_of_step[step + 1] if step + 1 < n else h_TY
        received_TZ, part_TZ, h_TY = jax.lax.optimization_barrier(
            (jax.lax.ppermute(acc_TZ.astype(wire_dtype), axis, ring_pairs(n)),
             g(h_TY).astype(jnp.float32), following))
        acc_TZ = received_TZ.astype(jnp.float32) + part_TZ
    return acc_TZ


def ring_sp_mlp(x_TD: jax.Array, up: Callable[[jax.Array], jax.Array],
                down: Callable[[jax.Array], jax.Array], axis: str,
                wire_dtype=jnp.float32) -> jax.Array:
    """The SP-sharded MLP as two rings: all-gather + ``up`` (x [T, D] ->
    h [T, F/n], this device's F shard) and ``down`` (h -> float32 partial
    [T, D]) + reduce-scatter. x_TD [T, D]: this device's rows; returns the
    float32 sum [T, D] of this device's rows, as all_gather -> up -> down ->
    psum_scatter would (the sum's order differs: float32 rounding only; a
    bfloat16 ``wire_dtype`` rounds each running sum sent to bf16)."""
    return ring_reduce_scatter_map(ring_all_gather_map(x_TD, up, axis), down, axis, wire_dtype)


__all__ = ["ring_pairs", "ring_all_gather_map", "ring_reduce_scatter_map", "ring_sp_mlp"]
