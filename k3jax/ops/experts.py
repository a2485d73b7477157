"""Routed experts on local arrays: sort token-expert pairs by expert, two
grouped matmuls (the first with SiTU-GLU fused), weight, and scatter-add back."""

from __future__ import annotations

from typing import NamedTuple, Protocol

import jax
import jax.numpy as jnp

from k3jax.ops.activation import SiTU
from pallas_kernels.backend import Backend, Family, resolve
from pallas_kernels.grouped_matmul.api import grouped_situ_glu
from pallas_kernels.grouped_matmul.combine import grouped_matmul_combine
from pallas_kernels.vma import varying_like_inputs


class ExpertWeight(Protocol):
    """One routed-expert weight of logical shape [E, K, N] as the grouped
    matmuls take it: an array, or the weight object (a pytree) a packed
    format hands them (k3jax/formats/: WeightFormat.kernel_weights)."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def ndim(self) -> int: ...


class ExpertPairs(NamedTuple):
    """The (token, expert) pairs of T rows, sorted by the local expert they go to.

    order_P [P]    pair index (t * K + k) of each sorted position, P = T * K
    token_P [P]    its token, order_P // K
    group_sizes_E [E_local]  pairs per local expert (pairs not held here sort
                   last, past their sum)
    weights_P [P]  the top-k weight of each pair, in pair order (not sorted)
    """

    order_P: jax.Array
    token_P: jax.Array
    group_sizes_E: jax.Array
    weights_P: jax.Array


def routed_experts(lat_TL: jax.Array, ids_TK: jax.Array, weights_TK: jax.Array,
                   w1_ELF: ExpertWeight, w3_ELF: ExpertWeight, w2_EFL: ExpertWeight, act: SiTU,
                   *, first_expert: jax.Array | int = 0,
                   backend: Backend = "auto") -> jax.Array:
    """sum_k weights_TK[t, k] * expert_{ids_TK[t, k]}(lat_TL[t]) over the experts
    held here, which are global ids [first_expert, first_expert + E_local).

    lat_TL [T, L]; ids_TK, weights_TK [T, K]; w1_ELF, w3_ELF [E_local, L, F];
    w2_EFL [E_local, F, L]; each an array or a packed format's weight object
    (ExpertWeight; dequantized inside the grouped matmuls to lat's dtype, one
    active expert at a time). Pairs whose expert is not held here (another
    device's, or the out-of-range id of a padding row) contribute nothing.
    Returns the float32 partial sum [T, L] (partial over experts under EP and
    over F under TP; the caller reduces it).

    The three stages (sort_pairs, experts_up, experts_down_combined) are
    public so a caller can place other work between them.
    """
    _check_shapes(lat_TL, ids_TK, weights_TK, w1_ELF, w3_ELF, w2_EFL)
    pairs = sort_pairs(ids_TK, weights_TK, w1_ELF.shape[0], first_expert)
    h_PF = experts_up(lat_TL, pairs, w1_ELF, w3_ELF, act, backend)
    return experts_down_combined(h_PF, pairs, w2_EFL, lat_TL.shape[0], backend)


def sort_pairs(ids_TK: jax.Array, weights_TK: jax.Array, num_local: int,
               first_expert: jax.Array | int = 0) -> ExpertPairs:
    """ids_TK, weights_TK [T, K] -> ExpertPairs over the ``num_local`` experts
    held here (global ids [first_expert, first_expert + num_local))."""
    T, K = ids_TK.shape
    local_P = ids_TK.reshape(T * K) - first_expert
    held_P = (local_P >= 0) & (local_P < num_local)
    local_P = jnp.where(held_P, local_P, num_local)          # not held -> sorts last
    # jax 0.11.2 types argsort's result as invariant under shard_map even when
    # local_P varies (EP: first_expert from axis_index); autodiff then psums
    # cotangents it must not. Restore the varying type (pallas_kernels.vma).
    order_P = varying_like_inputs(jnp.argsort(local_P, stable=True), local_P)
    group_sizes_E = jnp.zeros(num_local + 1, jnp.int32).at[local_P].add(1)[:num_local]
    return ExpertPairs(order_P, order_P // K, group_sizes_E, weights_TK.reshape(T * K))


def experts_up(lat_TL: jax.Array, pairs: ExpertPairs, w1_ELF: ExpertWeight,
               w3_ELF: ExpertWeight, act: SiTU, backend: Backend = "auto") -> jax.Array:
    """The first grouped matmul: each sorted pair's latent row through its
    expert's gate/up + SiTU-GLU -> h_PF [P, F] in lat's dtype.

    On "xla", under autodiff, the backward gathers x_PL = lat_TL[token_P] again
    instead of holding its P = T * K rows from the forward (the recomputed h_PF
    is unused there and XLA drops it). On the kernel backends the compiled
    temporaries are lower without that in some layouts
    (benchmarks/results/training_memory.md)."""
    def gate_up(lat_TL, w1_ELF, w3_ELF):
        return grouped_situ_glu(lat_TL[pairs.token_P], w1_ELF, w3_ELF, pairs.group_sizes_E,
                                beta=act.beta, linear_beta=act.linear_beta, backend=backend)
    on_xla = resolve(backend).family is Family.XLA
    return (jax.checkpoint(gate_up) if on_xla else gate_up)(lat_TL, w1_ELF, w3_ELF)


def experts_down_combined(h_PF: jax.Array, pairs: ExpertPairs, w2_EFL: ExpertWeight, T: int,
                          backend: Backend = "auto", *, pinned=None):
    """The down projection of every pair and the weighted scatter-add of its
    row into its token, as one op (grouped_matmul_combine): h_PF [P, F] ->
    float32 [T, L]. On "xla" its backward
    gathers the latent's cotangent per row block, so no [P, L] cotangent of
    y_PL is held beside h_PF and its gradient. ``pinned`` (arrays held
    beside y_PL by an optimization barrier, then returned: (r_TL, pinned))
    as grouped_matmul_combine's."""
    return grouped_matmul_combine(h_PF, w2_EFL, pairs.group_sizes_E, pairs.token_P,
                                  pairs.weights_P[pairs.order_P], T, backend=backend,
                                  pinned=pinned)


def _check_shapes(lat_TL, ids_TK, weights_TK, w1_ELF, w3_ELF, w2_EFL) -> None:
    """ValueError naming the first argument whose shape disagrees with the others
    (a mismatch would otherwise gather out of range, which JAX silently clamps)."""
    if lat_TL.ndim != 2 or ids_TK.ndim != 2:
        raise ValueError(f"routed_experts: lat_TL and ids_TK must be 2-D, got "
                         f"{list(lat_TL.shape)} and {list(ids_TK.shape)}")
    if lat_TL.shape[0] != ids_TK.shape[0]:
        raise ValueError(f"routed_experts: lat_TL has {lat_TL.shape[0]} rows but ids_TK has "
                         f"{ids_TK.shape[0]} ({list(lat_TL.shape)} vs {list(ids_TK.shape)})")
    if weights_TK.shape != ids_TK.shape:
        raise ValueError(f"routed_experts: weights_TK shape {list(weights_TK.shape)} != ids_TK "
                         f"shape {list(ids_TK.shape)}")
    if w1_ELF.ndim != 3 or w1_ELF.shape[1] != lat_TL.shape[1]:
        raise ValueError(f"routed_experts: w1_ELF must be [E, L={lat_TL.shape[1]}, F] "
                         f"(L from lat_TL), got {list(w1_ELF.shape)}")
    E, L, F = w1_ELF.shape
    if w3_ELF.shape != w1_ELF.shape:
        raise ValueError(f"routed_experts: w3_ELF shape {list(w3_ELF.shape)} != w1_ELF shape "
                         f"{list(w1_ELF.shape)}")
    if w2_EFL.shape != (E, F, L):
        raise ValueError(f"routed_experts: w2_EFL must be [E, F, L] = {[E, F, L]} to match "
                         f"w1_ELF {list(w1_ELF.shape)}, got {list(w2_EFL.shape)}")
