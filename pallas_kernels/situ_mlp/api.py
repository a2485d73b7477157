"""Public fused MLP up-projection (gate/up + SiTU-GLU); down stays in the caller.

Validate, resolve the backend once, ask the first-use gate
(pallas_kernels.selfcheck.gate) which backend this configuration may run,
then run that backend's entry of dispatch.py's table (XLA reference.py,
Mosaic mosaic_sm90.py compiled or in the GPU interpret mode, Triton
triton_sm80.py on CUDA sm_80+; "auto" is Mosaic on sm_90, Triton on other
CUDA GPUs, else XLA). Differentiable in x and both weights on every
backend: vjp.py wraps the entry in a jax.custom_vjp.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.backend import Backend, resolve
from pallas_kernels.selfcheck import gate as selfcheck
from pallas_kernels.situ import check_betas
from pallas_kernels.situ_mlp import dispatch, vjp


def validate_mlp(x_TD, gate_DF, up_DF) -> None:
    """Raise ValueError naming the argument when shapes/dtypes do not fit."""
    for name, a in (("x_TD", x_TD), ("gate_DF", gate_DF), ("up_DF", up_DF)):
        if a.ndim != 2:
            raise ValueError(f"{name} must be 2-D, got shape {a.shape}")
        if not jnp.issubdtype(a.dtype, jnp.floating):
            raise ValueError(f"{name} must be a floating dtype, got {a.dtype}")
    if gate_DF.shape != up_DF.shape:
        raise ValueError(f"gate_DF shape {gate_DF.shape} != up_DF shape {up_DF.shape}")
    if x_TD.shape[1] != gate_DF.shape[0]:
        raise ValueError(
            f"x_TD D={x_TD.shape[1]} != gate_DF D={gate_DF.shape[0]} "
            f"(x_TD {x_TD.shape}, gate_DF {gate_DF.shape})")


def situ_mlp_up(x_TD: jax.Array, gate_DF: jax.Array, up_DF: jax.Array, *, beta: float,
                linear_beta: float | None, backend: Backend = "auto") -> jax.Array:
    """h_TF = situ_glu(x_TD @ gate_DF, x_TD @ up_DF); [T, D] x [D, F] -> [T, F], x dtype.

    Differentiable in all three arrays (vjp.situ_mlp_up: recomputes gate/up).
    The kernel runs once its configuration has passed pallas_kernels.selfcheck's
    check (else the XLA path).
    """
    validate_mlp(x_TD, gate_DF, up_DF)
    check_betas(beta, linear_beta)
    kernels = dispatch.kernels(selfcheck.mlp(x_TD, gate_DF, resolve(backend), beta, linear_beta))
    return vjp.situ_mlp_up(kernels, x_TD, gate_DF, up_DF, beta, linear_beta)

