"""Parametrizations split over the test tiers (docs/testing.md).

A kernel test's cases each exercise a feature: a NaN tail, split-K, a
cluster, float32 as two bf16 planes. The everyday tier (``bin/test``) runs
the cases that between them cover the features; the others carry the
``slow`` mark, so ``bin/test --all`` (CI) runs every case.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax.numpy as jnp
import pytest


def slow(*values, id: str | None = None):
    """One parametrization in the slow tier: pytest.param(*values) marked slow
    (the parametrize's ``ids`` callable still names it unless ``id`` is given)."""
    return pytest.param(*values, id=id, marks=pytest.mark.slow)


def dtype_diagonal(cases: Sequence, dtypes: Sequence, case_id: Callable) -> list:
    """("case", "dtype") parametrizations of the grid cases x dtypes, with the
    ids two stacked parametrizes give ("{case_id(case)}-{bf16 | f32 | ...}").

    Case i runs in dtypes[i % len(dtypes)] in the everyday tier and in the
    other dtypes in the slow tier: every case and every dtype run everyday,
    the whole grid in --all."""
    names = {jnp.dtype(jnp.bfloat16): "bf16", jnp.dtype(jnp.float32): "f32"}
    params = []
    for i, case in enumerate(cases):
        for j, dtype in enumerate(dtypes):
            name = f"{case_id(case)}-{names.get(jnp.dtype(dtype), jnp.dtype(dtype).name)}"
            everyday = j == i % len(dtypes)
            params.append(pytest.param(case, dtype, id=name) if everyday
                          else slow(case, dtype, id=name))
    return params
