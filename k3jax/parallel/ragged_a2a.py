"""``ragged_all_to_all`` inside ``jax.shard_map``, native or emulated.

XLA:CPU does not implement the ragged-all-to-all collective (UNIMPLEMENTED),
so on CPU devices (``Layout.ragged_emulated``; the test suite's simulated
devices) the same semantics are built from an all-gather and per-sender
selects. The emulation runs only there: on GPUs, and in every deviceless
H200 compile, the program holds the real collective.

Semantics (jax.lax.ragged_all_to_all), on each of the n devices of ``axes``
(device i of them, row-major):

    operand [N, ...], output [M, ...]; input_offsets, send_sizes,
    output_offsets, recv_sizes [n] int32.
    For every receiver j: operand[input_offsets[j] : + send_sizes[j]] lands
    on device j at output_j[output_offsets[j] : + send_sizes[j]] (the
    offset is in the RECEIVER's buffer); the rest of output_j keeps its
    values. recv_sizes[j] = what device j sends to me.

The emulation moves n times the operand through an all-gather: meant for
the small shapes of CPU checks, not for speed.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def ragged_all_to_all(operand: jax.Array, output: jax.Array, input_offsets: jax.Array,
                      send_sizes: jax.Array, output_offsets: jax.Array,
                      recv_sizes: jax.Array, axes: tuple[str, ...], *,
                      emulated: bool) -> jax.Array:
    """jax.lax.ragged_all_to_all over ``axes`` (module docstring), or its
    emulation when ``emulated``. Returns ``output`` with the received slices
    written in."""
    if not emulated:
        return jax.lax.ragged_all_to_all(operand, output, input_offsets, send_sizes,
                                         output_offsets, recv_sizes, axis_name=axes)
    return _emulated(operand, output, input_offsets, send_sizes, output_offsets, axes)


def _emulated(operand, output, input_offsets, send_sizes, output_offsets, axes):
    """Every sender's operand and offsets all-gathered; sender s's slice for
    me is operand_s[input_offsets_s[me] + (p - output_offsets_s[me])] at
    each output row p in [output_offsets_s[me], + send_sizes_s[me])."""
    n = jax.lax.axis_size(axes)
    me = jax.lax.axis_index(axes)
    operand_all = jax.lax.all_gather(operand, axes, axis=0)                  # [n, N, ...]
    meta = jnp.stack([input_offsets, send_sizes, output_offsets]).astype(jnp.int32)
    meta_all = jax.lax.all_gather(meta, axes, axis=0)[:, :, me]              # [n, 3]
    p = jnp.arange(output.shape[0], dtype=jnp.int32)
    trailing = (1,) * (output.ndim - 1)
    for s in range(n):
        start_in, size, start_out = meta_all[s, 0], meta_all[s, 1], meta_all[s, 2]
        take = (p >= start_out) & (p < start_out + size)
        src = jnp.clip(start_in + p - start_out, 0, operand.shape[0] - 1)
        output = jnp.where(take.reshape(-1, *trailing), operand_all[s][src], output)
    return output


__all__ = ["ragged_all_to_all"]
