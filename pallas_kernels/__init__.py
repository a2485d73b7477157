"""Pallas Mosaic GPU (Hopper, sm_90) kernels for k3jax, with XLA references.

Public API (the three matmul entry points take backend="auto" | "xla" |
"pallas" | "interpret" | "triton", the same as a BackendName, or a
resolved KernelBackend):
  grouped_matmul(x_MK, w_GKN, group_sizes_G)                       -> y_MN
  grouped_situ_glu(x_MK, w_gate_GKN, w_up_GKN, group_sizes_G, ...) -> h_MN
  situ_mlp_up(x_TD, gate_DF, up_DF, ...)                           -> h_TF
  situ_glu(gate, up, beta=..., linear_beta=...)   the one SiTU-GLU definition
  Mxfp4Weights(packed_GNK, scale_GKN, dequant)   an MXFP4 weight the grouped ops
      accept; dequant, an Mxfp4Dequant (FAST / EXACT), is what its scale bytes allow
  resolve(backend) -> KernelBackend(family: Family, interpret: bool)
  resolve_backend(backend) -> its name; parse_backend(backend) -> BackendName
"""

from pallas_kernels.backend import (
    Backend,
    BackendName,
    Family,
    KernelBackend,
    parse_backend,
    resolve,
    resolve_backend,
)
from pallas_kernels.grouped_matmul.api import grouped_matmul, grouped_situ_glu
from pallas_kernels.mxfp4 import Mxfp4Dequant, Mxfp4Weights
from pallas_kernels.situ import situ_glu
from pallas_kernels.situ_mlp.api import situ_mlp_up

__all__ = [
           "Backend",
           "BackendName",
           "Family",
           "KernelBackend",
           "Mxfp4Dequant",
           "Mxfp4Weights",
           "grouped_matmul",
           "grouped_situ_glu",
           "parse_backend",
           "resolve",
           "resolve_backend",
           "situ_glu",
           "situ_mlp_up",
]
