"""How a module declares its parameters, and the sources that fill them.

A module lists ``ParamDecl`` values (global shape, dtype, PartitionSpec,
padding, random init, nnx.Variable type; k3jax.formats.decl, re-exported
here: the expert formats declare with them too). A ``ParamSource`` turns one
declaration into an array placed with its NamedSharding: random values from
an ``nnx.Rngs`` (``RngsSource``, what ``rngs=`` builds) or a seed
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


class RngsSource:
    """Random values drawn from an ``nnx.Rngs``: one key from its ``params``
    stream (its default stream when it has none) per declaration, in
    declaration order, each generated directly into its shards as
    ``RandomSource`` does (padding zero; the same logical weights in every
    layout for the same Rngs). Works under ``nnx.eval_shape`` (nothing is
    allocated then)."""

    def __init__(self, rngs: nnx.Rngs):
        if not isinstance(rngs, nnx.Rngs):
            raise TypeError(f"rngs must be an nnx.Rngs, got {type(rngs).__name__}")
        self.rngs = rngs

    def __call__(self, decl, sharding):
        return _random_generator(dataclasses.replace(decl, name=""), sharding)(self.rngs.params())


def source_of(who: str, rngs: nnx.Rngs | None, source: ParamSource | None) -> ParamSource:
    """The ParamSource a module constructor fills its weights from: ``rngs``
    (an nnx.Rngs, Flax's way) or ``source`` (RandomSource, AbstractSource,
    a checkpoint), exactly one of them; TypeError naming ``who`` otherwise."""
    if (rngs is None) == (source is None):
        raise TypeError(f"{who}: pass exactly one of rngs=nnx.Rngs(seed) (random weights) or "
                        f"source= (RandomSource, AbstractSource, a checkpoint's)")
    return RngsSource(rngs) if rngs is not None else source


@functools.lru_cache(maxsize=512)
def _random_generator(decl: ParamDecl, sharding: NamedSharding):
    """One jitted generator per (shape, dtype, init, padding, sharding): the same
    declaration on the same mesh (w1/w3, gate/up, the replicated router and
    latent weights of every layout on that mesh) compiles once."""
    return jax.jit(functools.partial(_random_values, decl=decl), out_shardings=sharding)


def _random_values(key, decl: ParamDecl):
    """Values of the unpadded parameter, spread into the padded one, so the
    same seed gives the same logical weights in every layout. With redundant
    expert slots (``decl.slots``) the logical experts are drawn and each
    slot takes its expert's values: the same as without them."""
    shape = list(decl.shape)
    if decl.padding is not None:
        shape[decl.padding.axis] = decl.padding.real
    if decl.slots is not None:
        shape[0] = decl.num_logical
    v = _random_unpadded(key, decl, tuple(shape))
    if decl.slots is not None:
        v = jnp.take(v, np.asarray(decl.slots, np.int32), axis=0)
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
    """Create ``module.<name> = decl.variable(source(decl))`` for each
    declaration (nnx.Param, RouterBias or PackedWeight, k3jax.variables),
    with Flax's sharding metadata (``out_sharding`` the declaration's
    PartitionSpec, ``mesh``; the value is placed already, so no eager
    sharding): ``nnx.get_partition_spec`` reads it, and ``nnx.eval_shape``
    gives each abstract weight its NamedSharding."""
    for decl in decls:
        sharding = NamedSharding(mesh, decl.spec)
        value = source(decl, sharding)
        if tuple(value.shape) != tuple(decl.shape) or value.dtype != decl.dtype:
            raise ValueError(f"parameter {decl.name}: source gave {value.dtype}{list(value.shape)}, "
                             f"expected {jnp.dtype(decl.dtype)}{list(decl.shape)}")
        setattr(module, decl.name.rsplit(".", 1)[-1],
                decl.variable(value, eager_sharding=False, out_sharding=decl.spec, mesh=mesh))


__all__ = ["AbstractSource", "Init", "Padding", "ParamDecl", "ParamSource", "RandomSource",
           "RngsSource", "make_params", "source_of"]
