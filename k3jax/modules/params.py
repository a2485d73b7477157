"""How a module declares its parameters, and the sources that fill them.

A module lists ``ParamDecl`` values (global shape, dtype, PartitionSpec,
padding, random init; k3jax.formats.decl, re-exported here: the expert
formats declare with them too). A ``ParamSource`` turns one declaration
into an array placed with its NamedSharding: random values
(``RandomSource``), abstract shapes for the planner (``AbstractSource``),
or checkpoint slices (k3jax.checkpoint).
Construction therefore has one path, whatever fills the weights.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AbstractMesh, Mesh, NamedSharding

from k3jax.formats.decl import Init, Padding, ParamDecl


class ParamSource(Protocol):
    def __call__(self, decl: ParamDecl, sharding: NamedSharding) -> jax.Array | jax.ShapeDtypeStruct:
        """An array of ``decl.shape`` and ``decl.dtype`` placed with ``sharding``."""


class AbstractSource:
    """Shapes and shardings only: nothing is allocated (for the planner)."""

    def __call__(self, decl, sharding):
        return jax.ShapeDtypeStruct(decl.shape, decl.dtype, sharding=sharding)


class RandomSource:
    """Fresh random values, generated directly into their shards; padding is zero."""

    def __init__(self, seed: int = 0):
        self._key = jax.random.key(seed)
        self._count = 0

    def __call__(self, decl, sharding):
        self._count += 1
        key = jax.random.fold_in(self._key, self._count)
        return _random_generator(dataclasses.replace(decl, name=""), sharding)(key)


@functools.lru_cache(maxsize=512)
def _random_generator(decl: ParamDecl, sharding: NamedSharding):
    """One jitted generator per (shape, dtype, init, padding, sharding): the same
    declaration on the same mesh (w1/w3, gate/up, the replicated router and
    latent weights of every layout on that mesh) compiles once."""
    return jax.jit(functools.partial(_random_values, decl=decl), out_shardings=sharding)


def _random_values(key, decl: ParamDecl):
    """Values of the unpadded parameter, spread into the padded one, so the
    same seed gives the same logical weights in every layout."""
    shape = list(decl.shape)
    if decl.padding is not None:
        shape[decl.padding.axis] = decl.padding.real
    v = _random_unpadded(key, decl, tuple(shape))
    if decl.padding is not None:
        size = decl.shape[decl.padding.axis]
        src = [decl.padding.source_index(i, size) for i in range(size)]
        real = np.array([i is not None for i in src])
        v = jnp.take(v, np.array([i or 0 for i in src], np.int32), axis=decl.padding.axis)
        bshape = [size if a == decl.padding.axis else 1 for a in range(len(shape))]
        v = jnp.where(real.reshape(bshape), v, jnp.zeros((), v.dtype))
    return v.astype(decl.dtype)


def _random_unpadded(key, decl: ParamDecl, shape: tuple[int, ...]) -> jax.Array:
    if not isinstance(decl.init, Init):   # a format's own values (formats.decl.RandomInit)
        return decl.init(key, shape, decl.fan_in)
    z = jax.random.normal(key, shape, jnp.float32)
    if decl.init is Init.WEIGHT:
        return z / math.sqrt(decl.fan_in)
    if decl.init is Init.NORM:
        return 1.0 + 0.1 * z
    return 0.05 * z


def make_params(module: nnx.Module, decls: list[ParamDecl], mesh: Mesh | AbstractMesh,
                source: ParamSource) -> None:
    """Create ``module.<name> = nnx.Param(source(decl))`` for each declaration."""
    for decl in decls:
        sharding = NamedSharding(mesh, decl.spec)
        value = source(decl, sharding)
        if tuple(value.shape) != tuple(decl.shape) or value.dtype != decl.dtype:
            raise ValueError(f"parameter {decl.name}: source gave {value.dtype}{list(value.shape)}, "
                             f"expected {jnp.dtype(decl.dtype)}{list(decl.shape)}")
        setattr(module, decl.name.rsplit(".", 1)[-1], nnx.Param(value))


__all__ = ["AbstractSource", "Init", "Padding", "ParamDecl", "ParamSource", "RandomSource",
           "make_params"]
