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

from k3jax.variables import PackedWeight


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
    format's integer arrays; None (the default) is nnx.Param for a floating
    dtype and PackedWeight for any other, which never trains. ``slots``: for a routed-expert parameter held
    in redundant expert slots (k3jax.layout.expert_placement), the logical
    expert of each entry along axis 0 (every expert in [0, max + 1) at
    least once); a source fills entry s with logical expert slots[s]'s
    values, so replicas are exact copies. None: entry e is expert e."""

    name: str
    shape: tuple[int, ...]
    dtype: jnp.dtype
    spec: P
    init: Union[Init, RandomInit] = Init.WEIGHT
    fan_in: int = 1
    padding: Padding | None = None
    variable: type[nnx.Variable] | None = None
    slots: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.variable is None:
            floating = jnp.issubdtype(self.dtype, jnp.floating)
            object.__setattr__(self, "variable", nnx.Param if floating else PackedWeight)

    @property
    def num_logical(self) -> int:
        """The logical experts behind axis 0: max(slots) + 1, else shape[0]."""
        return self.shape[0] if self.slots is None else max(self.slots) + 1


__all__ = ["Init", "Padding", "ParamDecl", "RandomInit"]
