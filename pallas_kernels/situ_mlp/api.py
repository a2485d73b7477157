"""Public fused MLP up-projection (gate/up + SiTU-GLU); down stays in the caller.

Dispatch: "xla" -> reference.py, "pallas" -> mosaic_sm90.py, "interpret" ->
mosaic_sm90.py in GPU interpret mode, "triton" -> triton_sm80.py (CUDA sm_80+),
"auto" -> "pallas" on sm_90, "triton" on other CUDA GPUs, else "xla".
Differentiable in x and both weights on every backend: vjp.py wraps the
dispatch below in a jax.custom_vjp.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.backend import Backend, resolve_backend
from pallas_kernels.grouped_matmul.api import triton_kernels
from pallas_kernels.selfcheck import gate as selfcheck
from pallas_kernels.situ import check_betas
from pallas_kernels.situ_mlp import mosaic_sm90, reference, vjp


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
    check (else the xla path).
    """
    validate_mlp(x_TD, gate_DF, up_DF)
    check_betas(beta, linear_beta)
    impl = selfcheck.mlp(x_TD, gate_DF, resolve_backend(backend), beta, linear_beta)
    return vjp.situ_mlp_up(_situ_mlp_up_forward, impl, x_TD, gate_DF, up_DF, beta, linear_beta)


def _situ_mlp_up_forward(x_TD, gate_DF, up_DF, beta, linear_beta, impl):
    """The forward dispatch of situ_mlp_up (validated inputs, resolved backend)."""
    if impl == "xla":
        return reference.situ_mlp_up(x_TD, gate_DF, up_DF, beta=beta, linear_beta=linear_beta)
    if impl == "triton":
        triton_kernels()  # a clear error without the triton extra
        from pallas_kernels.situ_mlp import triton_sm80
        return triton_sm80.situ_mlp_up(x_TD, gate_DF, up_DF, beta=beta, linear_beta=linear_beta)
    return mosaic_sm90.situ_mlp_up(x_TD, gate_DF, up_DF, beta=beta, linear_beta=linear_beta,
                                   interpret=impl == "interpret")
