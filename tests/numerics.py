"""Shared numeric helpers for the tests (import as ``from numerics import ...``)."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


def rel_err(got, want) -> float:
    """max |got - want| / max |want| in float64; NaN or inf in ``got`` never passes."""
    got = np.asarray(got, np.float64)
    want = np.asarray(want, np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    assert np.all(np.isfinite(got)), "non-finite values"
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


def jitted(module):
    """x_TD -> float32 numpy y_TD through one jit of an NNX module."""
    graphdef, state = nnx.split(module)
    f = jax.jit(lambda state, x: nnx.merge(graphdef, state)(x).astype(jnp.float32))
    return lambda x: np.asarray(f(state, jnp.asarray(x)))
