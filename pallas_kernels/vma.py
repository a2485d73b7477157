"""Manual-axis types (shard_map's "varying" axes) of the custom VJPs' values.

Under ``jax.shard_map`` every value records the mesh axes it varies over.
jax 0.11.2 types a Pallas kernel's output as invariant (no axes) even when its
inputs vary, and the types drive autodiff: an output typed invariant but
returned under a sharded out_spec gets an implicit pvary, whose transpose
psums the cotangent over the devices before the backward sees it (measured:
wrong gradients, no error). So the custom VJPs

* type each forward output as varying over its inputs' axes
  (``varying_like_inputs``), as an XLA op would, and
* return each cotangent with exactly its primal's axes (``like_primal``), as
  custom_vjp requires: psum over axes the cotangent varies over but the
  primal does not (the transpose of the implicit pvary of an invariant
  primal meeting varying data), pcast to varying over the missing ones.

Outside shard_map every set is empty and both return their input unchanged.
"""

from __future__ import annotations

import jax


def _varying(a) -> frozenset:
    return jax.typeof(a).manual_axis_type.varying


def varying_like_inputs(out: jax.Array, *inputs: jax.Array) -> jax.Array:
    """out, typed varying over every axis any of ``inputs`` varies over."""
    want = frozenset().union(*(_varying(a) for a in inputs))
    missing = tuple(sorted(want - _varying(out)))
    return jax.lax.pcast(out, missing, to="varying") if missing else out


def like_primal(ct: jax.Array, primal: jax.Array) -> jax.Array:
    """ct with primal's set of varying manual axes (psum / pcast as needed)."""
    have, want = _varying(ct), _varying(primal)
    extra, missing = tuple(sorted(have - want)), tuple(sorted(want - have))
    if extra:
        ct = jax.lax.psum(ct, extra)
    if missing:
        ct = jax.lax.pcast(ct, missing, to="varying")
    return ct
