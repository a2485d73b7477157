"""The router: sigmoid scores, bias for selection only, (grouped) top-k,
renormalize, scale (docs/spec.md §2). Always float32."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from k3jax.config import K3Config


class RoutingResult(NamedTuple):
    """What ``route(..., with_scores=True)`` returns.

    ids_TK      int32 [T, K]: the selected experts (``num_experts`` on invalid rows)
    weights_TK  float32 [T, K]: their combine weights (0 on invalid rows)
    scores_TE   float32 [T, E]: every expert's sigmoid score, before the bias
                (the router's own output; invalid rows are not masked: the
                caller knows them)
    """

    ids_TK: jax.Array
    weights_TK: jax.Array
    scores_TE: jax.Array


def route(x_TD: jax.Array, router_DE: jax.Array, bias_E: jax.Array, cfg: K3Config,
          valid_T: jax.Array | None = None, *,
          with_scores: bool = False) -> tuple[jax.Array, jax.Array] | RoutingResult:
    """x_TD [T, D], router_DE [D, E], bias_E [E] -> (ids_TK int32, weights_TK float32),
    or with ``with_scores`` a RoutingResult that adds the sigmoid scores
    scores_TE [T, E] (the same ids and weights, bit for bit: the scores are
    computed either way).

    Rows where ``valid_T`` is False (sequence-parallel padding) are routed to
    no expert: their ids are ``num_experts`` (out of range) and weights 0.
    """
    D, E = x_TD.shape[-1], cfg.num_experts
    if router_DE.shape != (D, E):
        raise ValueError(f"route: router_DE must be [D, E] = {[D, E]} (D from x_TD "
                         f"{list(x_TD.shape)}, E = num_experts), got {list(router_DE.shape)}")
    if bias_E.shape != (E,):
        raise ValueError(f"route: bias_E must be [E] = {[E]} (num_experts), "
                         f"got {list(bias_E.shape)}")
    if valid_T is not None and valid_T.shape != x_TD.shape[:1]:
        raise ValueError(f"route: valid_T must be [T] = {list(x_TD.shape[:1])}, "
                         f"got {list(valid_T.shape)}")
    logits_TE = jnp.dot(x_TD.astype(jnp.float32), router_DE.astype(jnp.float32),
                        precision=jax.lax.Precision.HIGHEST)
    scores_TE = jax.nn.sigmoid(logits_TE)
    biased_TE = scores_TE + bias_E.astype(jnp.float32)
    if cfg.num_expert_group > 1:
        biased_TE = _mask_to_best_groups(biased_TE, cfg.num_expert_group, cfg.topk_group)
    _, ids_TK = jax.lax.top_k(biased_TE, cfg.num_experts_per_token)
    weights_TK = jnp.take_along_axis(scores_TE, ids_TK, axis=-1)
    if cfg.moe_renormalize:
        weights_TK = weights_TK / jnp.sum(weights_TK, axis=-1, keepdims=True)
    weights_TK = weights_TK * cfg.routed_scaling_factor
    ids_TK = ids_TK.astype(jnp.int32)
    if valid_T is not None:
        ids_TK = jnp.where(valid_T[:, None], ids_TK, cfg.num_experts)
        weights_TK = jnp.where(valid_T[:, None], weights_TK, 0.0)
    if with_scores:
        return RoutingResult(ids_TK, weights_TK, scores_TE)
    return ids_TK, weights_TK


def _mask_to_best_groups(biased_TE: jax.Array, groups: int, keep: int) -> jax.Array:
    """DeepSeek-V3 noaux_tc: score each of ``groups`` contiguous expert groups
    by the sum of its two best biased scores, keep the ``keep`` best groups,
    set every other expert to -inf."""
    T, E = biased_TE.shape
    grouped_TGX = biased_TE.reshape(T, groups, E // groups)
    group_score_TG = jnp.sum(jax.lax.top_k(grouped_TGX, 2)[0], axis=-1)
    _, best_TG = jax.lax.top_k(group_score_TG, keep)
    kept_TG = jnp.zeros((T, groups), bool).at[jnp.arange(T)[:, None], best_TG].set(True)
    masked_TGX = jnp.where(kept_TG[:, :, None], grouped_TGX, -jnp.inf)
    return masked_TGX.reshape(T, E)
