"""How a parameter is declared: ``ParamDecl`` (global shape, dtype,
PartitionSpec, random init, padding) and ``Padding``.

The routed-expert formats (k3jax.formats) declare their parameters with
these, and so do the modules for everything else; k3jax.modules.params
re-exports them beside the sources that fill a declaration (random,
abstract, checkpoint). They live here, below both, so that a format needs
nothing of the modules or the layout.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Callable, Union

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P


class Init(enum.Enum):
    """What random values suit a float parameter (k3jax.modules.params.RandomSource)."""

    WEIGHT = "weight"              # normal / sqrt(fan_in)
    NORM = "norm"                  # 1 + 0.1 * normal
    BIAS = "bias"                  # 0.05 * normal


RandomInit = Callable[[jax.Array, tuple, int], jax.Array]
"""A format's own random values: (key, unpadded shape, fan_in) -> an array
of that shape (cast to the declaration's dtype afterwards). A module-level
function, so that a declaration stays hashable (its generator is cached)."""


@dataclasses.dataclass(frozen=True)
class Padding:
    """``blocks`` equal blocks along ``axis``; each holds ``real // blocks``
    real entries at its front and zeros after them (docs/spec.md §5)."""

    axis: int
    blocks: int
    real: int

    def __post_init__(self) -> None:
        if self.real % self.blocks:
            raise ValueError(f"Padding: {self.real} real entries do not split into "
                             f"{self.blocks} equal blocks (axis {self.axis})")

    def source_index(self, padded_index: int, size: int) -> int | None:
        """Index into the unpadded tensor for a padded index, None for padding."""
        block = size // self.blocks
        shard, offset = divmod(padded_index, block)
        per_shard = self.real // self.blocks
        return shard * per_shard + offset if offset < per_shard else None


@dataclasses.dataclass(frozen=True)
class ParamDecl:
    """One parameter: ``name`` is its path in the module ("shared.gate_DF");
    ``init`` an Init or a format's RandomInit; ``padding`` None when every
    entry is real; ``variable`` the nnx.Variable type that holds it
    (k3jax.variables): nnx.Param for a weight that trains by gradient,
    RouterBias for the router's selection bias, PackedWeight for a packed
    format's integer arrays."""

    name: str
    shape: tuple[int, ...]
    dtype: jnp.dtype
    spec: P
    init: Union[Init, RandomInit] = Init.WEIGHT
    fan_in: int = 1
    padding: Padding | None = None
    variable: type[nnx.Variable] = nnx.Param


__all__ = ["Init", "Padding", "ParamDecl", "RandomInit"]
