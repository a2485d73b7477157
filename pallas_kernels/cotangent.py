"""Give a custom-VJP cotangent its primal's manual-axis type (inside shard_map).

Under ``jax.shard_map`` every value records the mesh axes it varies over, and a
custom_vjp's backward must return cotangents of exactly its inputs' types. A
Pallas kernel's output does not carry the variation of its inputs, and a
primal that is invariant over an axis may meet varying data inside the
op (an implicit ``pvary``, whose transpose is a ``psum``). ``like_primal``
fixes both: psum over axes the cotangent varies over but the primal does not,
pcast to varying over axes the primal varies over but the cotangent does not.
Outside shard_map both sets are empty and it returns ``ct`` unchanged.
"""

from __future__ import annotations

import jax


def _varying(a) -> frozenset:
    return jax.typeof(a).manual_axis_type.varying


def like_primal(ct: jax.Array, primal: jax.Array) -> jax.Array:
    """ct with primal's set of varying manual axes (psum / pcast as needed)."""
    have, want = _varying(ct), _varying(primal)
    extra, missing = tuple(sorted(have - want)), tuple(sorted(want - have))
    if extra:
        ct = jax.lax.psum(ct, extra)
    if missing:
        ct = jax.lax.pcast(ct, missing, to="varying")
    return ct
