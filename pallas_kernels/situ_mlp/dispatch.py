"""situ_mlp_up's implementations: one table, keyed by kernel family.

``IMPLEMENTATIONS`` maps each Family to the class that runs the fused
up-projection on it; ``kernels(backend)`` binds one to a resolved
KernelBackend (Mosaic's interpret mode is that value's flag). api.py runs
the entry after the first-use gate; pallas_kernels.selfcheck runs the same
entries to check them.

``up(x_TD, gate_DF, up_DF, beta, linear_beta)``: x_TD [T, D], gate_DF /
up_DF [D, F] floating, validated -> h_TF [T, F] = situ_glu(x @ gate,
x @ up) in x's dtype (f32 accumulation).

  XLA     reference.py (two jnp.dot); the backward's products are jnp.dot
          too (``dense_backward``; vjp.py)
  MOSAIC  mosaic_sm90.py: the grouped kernel with one group of every row
  TRITON  triton_sm80.py through jax-triton (imported on first use)

Kernel modules are looked up when a launch is traced, so a test's spy on a
module attribute sees the launch.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax

from pallas_kernels.backend import Family, KernelBackend
from pallas_kernels.grouped_matmul.dispatch import triton_kernels
from pallas_kernels.situ_mlp import mosaic_sm90, reference


@dataclasses.dataclass(frozen=True)
class MlpKernels:
    """The fused up-projection of one backend (a table entry bound to
    ``backend``). ``dense_backward``: the custom VJP's products are plain
    jnp.dot rather than the backend's grouped kernels. Frozen and hashable:
    the custom VJP takes it as a static argument."""

    backend: KernelBackend
    dense_backward: ClassVar[bool] = False

    def up(self, x_TD, gate_DF, up_DF, beta: float, linear_beta: float | None) -> jax.Array:
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class XlaMlp(MlpKernels):
    """Family.XLA: reference.py."""

    dense_backward: ClassVar[bool] = True

    def up(self, x_TD, gate_DF, up_DF, beta, linear_beta):
        return reference.situ_mlp_up(x_TD, gate_DF, up_DF, beta=beta, linear_beta=linear_beta)


@dataclasses.dataclass(frozen=True)
class MosaicMlp(MlpKernels):
    """Family.MOSAIC, compiled or (``backend.interpret``) in interpret mode."""

    def up(self, x_TD, gate_DF, up_DF, beta, linear_beta):
        return mosaic_sm90.situ_mlp_up(x_TD, gate_DF, up_DF, beta=beta, linear_beta=linear_beta,
                                       interpret=self.backend.interpret)


@dataclasses.dataclass(frozen=True)
class TritonMlp(MlpKernels):
    """Family.TRITON: triton_sm80.py."""

    def up(self, x_TD, gate_DF, up_DF, beta, linear_beta):
        triton_kernels()   # a clear error without the triton extra
        from pallas_kernels.situ_mlp import triton_sm80
        return triton_sm80.situ_mlp_up(x_TD, gate_DF, up_DF, beta=beta, linear_beta=linear_beta)


# The table: exactly one implementation per family.
IMPLEMENTATIONS: dict[Family, type[MlpKernels]] = {
    Family.XLA: XlaMlp,
    Family.MOSAIC: MosaicMlp,
    Family.TRITON: TritonMlp,
}


def kernels(backend: KernelBackend) -> MlpKernels:
    """The table's entry for ``backend``'s family, bound to ``backend``."""
    return IMPLEMENTATIONS[backend.family](backend)
