"""The SiTU-GLU MLP on local arrays: y = down(situ_glu(x @ gate, x @ up))."""

import jax

from k3jax.ops.activation import SiTU
from k3jax.ops.matmul import matmul
from pallas_kernels.backend import Backend
from pallas_kernels.situ_mlp.api import situ_mlp_up


def situ_mlp(x_TD: jax.Array, gate_DF: jax.Array, up_DF: jax.Array, down_FD: jax.Array,
             act: SiTU, *, backend: Backend = "auto", out_dtype=None) -> jax.Array:
    """x_TD [T, D]; gate_DF, up_DF [D, F]; down_FD [F, D] -> [T, D].

    With F-sharded weights this is the partial sum of a tensor-parallel MLP.
    ``out_dtype`` lets a caller keep partial sums in float32 before reducing.
    """
    h_TF = situ_mlp_up(x_TD, gate_DF, up_DF, beta=act.beta, linear_beta=act.linear_beta,
                       backend=backend)
    return matmul(h_TF, down_FD, out_dtype=out_dtype or x_TD.dtype)
