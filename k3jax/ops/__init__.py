"""Pure functions on arrays (no parameters): SiTU-GLU, RMSNorm, routing, the
routed-expert dispatch/compute/combine, and the MLP. Kernel backends are
picked through ``pallas_kernels``."""

from k3jax.ops.activation import SiTU
from k3jax.ops.experts import routed_experts
from k3jax.ops.mlp import situ_mlp
from k3jax.ops.norm import rms_norm
from k3jax.ops.routing import route

__all__ = ["SiTU", "routed_experts", "situ_mlp", "rms_norm", "route"]
