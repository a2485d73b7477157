"""Routed experts on local arrays: sort token-expert pairs by expert, two
grouped matmuls (the first with SiTU-GLU fused), weight, and scatter-add back."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from k3jax.ops.activation import SiTU
from pallas_kernels.backend import Backend
from pallas_kernels.grouped_matmul.api import grouped_matmul, grouped_situ_glu


def routed_experts(lat_TL: jax.Array, ids_TK: jax.Array, weights_TK: jax.Array,
                   w1_ELF: jax.Array, w3_ELF: jax.Array, w2_EFL: jax.Array, act: SiTU,
                   *, first_expert: jax.Array | int = 0,
                   backend: Backend = "auto") -> jax.Array:
    """sum_k weights_TK[t, k] * expert_{ids_TK[t, k]}(lat_TL[t]) over the experts
    held here, which are global ids [first_expert, first_expert + E_local).

    lat_TL [T, L]; ids_TK, weights_TK [T, K]; w1_ELF, w3_ELF [E_local, L, F];
    w2_EFL [E_local, F, L]. Pairs whose expert is not held here (another
    device's, or the out-of-range id of a padding row) contribute nothing.
    Returns the float32 partial sum [T, L] (partial over experts under EP and
    over F under TP; the caller reduces it).
    """
    T, K = ids_TK.shape
    num_local = w1_ELF.shape[0]
    local_P = ids_TK.reshape(T * K) - first_expert
    held_P = (local_P >= 0) & (local_P < num_local)
    local_P = jnp.where(held_P, local_P, num_local)          # not held -> sorts last
    order_P = jnp.argsort(local_P, stable=True)
    token_P = order_P // K
    group_sizes_E = jnp.zeros(num_local + 1, jnp.int32).at[local_P].add(1)[:num_local]

    x_PL = lat_TL[token_P]
    h_PF = grouped_situ_glu(x_PL, w1_ELF, w3_ELF, group_sizes_E, beta=act.beta,
                            linear_beta=act.linear_beta, backend=backend)
    y_PL = grouped_matmul(h_PF, w2_EFL, group_sizes_E, backend=backend)

    weight_P = jnp.where(held_P, weights_TK.reshape(T * K), 0.0)[order_P]
    contrib_PL = jnp.where(held_P[order_P][:, None],
                           y_PL.astype(jnp.float32) * weight_P[:, None], 0.0)
    return jnp.zeros((T, lat_TL.shape[1]), jnp.float32).at[token_P].add(contrib_PL)
