"""Dense routed experts: float arrays in the Layout's dtype.

    w1_ELF, w3_ELF [E, L, F]   F padded as the layout says (axis 2)
    w2_EFL         [E, F, L]   (axis 1)

The checkpoint holds each expert's ``experts.{e}.w1.weight`` [F, L] etc.
([out, in], transposed on load), as floats or in any registered codec's
tensors (e.g. MXFP4's), which the loader decodes to floats. The same format
named "mxfp4-dequant" (``decodes``) is the storage of a checkpoint whose
experts are all in that codec, dequantized as they are loaded: in device
memory it is dense. The grouped matmuls take the arrays as they are.
"""

from __future__ import annotations

import dataclasses

from k3jax.formats.base import ExpertLayout, StoredTensor, WeightFormat
from k3jax.formats.decl import Init, ParamDecl

PARAM_NAMES = ("w1_ELF", "w3_ELF", "w2_EFL")


@dataclasses.dataclass(frozen=True)
class DenseFormat(WeightFormat):
    """Float experts. ``decodes``: the codec format whose checkpoint tensors
    this storage is read from and dequantized (None: float tensors)."""

    name: str = "dense"
    decodes: str | None = None

    def param_decls(self, el: ExpertLayout) -> list[ParamDecl]:
        E, L, I, F = el.num_experts, el.latent, el.intermediate, el.padded
        w1, w3, w2 = el.specs
        return [ParamDecl("w1_ELF", (E, L, F), el.dtype, w1, Init.WEIGHT, L, el.padding(2)),
                ParamDecl("w3_ELF", (E, L, F), el.dtype, w3, Init.WEIGHT, L, el.padding(2)),
                ParamDecl("w2_EFL", (E, F, L), el.dtype, w2, Init.WEIGHT, I, el.padding(1))]

    def checkpoint_tensors(self) -> dict[str, StoredTensor]:
        return {name: StoredTensor(f"{name[:2]}.weight", True) for name in PARAM_NAMES}

    def kernel_weights(self, p, dtype):
        return tuple(p[name] for name in PARAM_NAMES)


__all__ = ["DenseFormat", "PARAM_NAMES"]
