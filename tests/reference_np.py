"""Float64 numpy reference of the K3 MLP / MoE math (SPEC section 2), for tests.

Plain loops, written independently of both k3jax and the torch reference.
Tensor dicts are keyed by the checkpoint suffixes under ``block_sparse_moe.``
(``gate.weight``, ``experts.3.w1.weight``, ...). All weights are [out, in].
"""

from __future__ import annotations

import math

import numpy as np


def _betas(cfg_or_betas):
    """(beta, linear_beta) from a K3Config or a (beta, linear_beta) pair."""
    if isinstance(cfg_or_betas, (tuple, list)):
        beta, linear_beta = cfg_or_betas
        return float(beta), (None if linear_beta is None else float(linear_beta))
    lb = cfg_or_betas.activation_situ_linear_beta
    return float(cfg_or_betas.activation_situ_beta), (None if lb is None else float(lb))


def _sigmoid(z):
    z = np.asarray(z, np.float64)
    return 1.0 / (1.0 + np.exp(-z))


def np_situ(gate, up, beta, linear_beta):
    """[..., n], [..., n] -> [..., n] float64."""
    g = np.asarray(gate, np.float64)
    u = np.asarray(up, np.float64)
    g_act = beta * np.tanh(g / beta) * _sigmoid(g)
    u_act = u if linear_beta is None else linear_beta * np.tanh(u / linear_beta)
    return g_act * u_act


def np_mlp(x, gate_proj, up_proj, down_proj, cfg_or_betas):
    """x [T, H]; gate_proj/up_proj [F, H]; down_proj [H, F] -> [T, H] float64."""
    beta, linear_beta = _betas(cfg_or_betas)
    x = np.asarray(x, np.float64)
    g = x @ np.asarray(gate_proj, np.float64).T
    u = x @ np.asarray(up_proj, np.float64).T
    return np_situ(g, u, beta, linear_beta) @ np.asarray(down_proj, np.float64).T


def np_rms_norm(x, weight, eps):
    """x [..., d], weight [d] -> [..., d] float64."""
    x = np.asarray(x, np.float64)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * np.asarray(weight, np.float64)


def np_route(x, gate_w, bias, cfg):
    """x [T, H], gate_w [E, H], bias [E] -> (ids [T, K] int64, weights [T, K] float64).

    Per token: sigmoid scores s; biased b = s + bias picks the experts (grouped
    top-k when num_expert_group > 1); weights are the unbiased s of the picks,
    renormalized if configured, times routed_scaling_factor. ids are in
    descending biased-score order."""
    x = np.asarray(x, np.float64)
    scores = _sigmoid(x @ np.asarray(gate_w, np.float64).T)
    bias = np.asarray(bias, np.float64)
    num_tokens, num_experts = scores.shape
    k = cfg.num_experts_per_token
    groups = cfg.num_expert_group
    size = num_experts // groups
    ids = np.zeros((num_tokens, k), np.int64)
    weights = np.zeros((num_tokens, k), np.float64)
    for t in range(num_tokens):
        biased = [float(scores[t, e] + bias[e]) for e in range(num_experts)]
        if groups > 1:
            group_scores = []
            for g in range(groups):
                members = sorted(biased[g * size:(g + 1) * size], reverse=True)
                group_scores.append(members[0] + members[1])
            kept = sorted(range(groups), key=lambda g: group_scores[g], reverse=True)
            kept = kept[:cfg.topk_group]
            candidates = [e for g in kept for e in range(g * size, (g + 1) * size)]
        else:
            candidates = list(range(num_experts))
        chosen = sorted(candidates, key=lambda e: biased[e], reverse=True)[:k]
        w = [float(scores[t, e]) for e in chosen]
        if cfg.moe_renormalize:
            total = math.fsum(w)
            w = [v / total for v in w]
        ids[t] = chosen
        weights[t] = [v * cfg.routed_scaling_factor for v in w]
    return ids, weights


def np_moe(x, tensors, cfg):
    """x [T, H], tensors {checkpoint suffix: array} -> y [T, H] float64.

    y = up_lat(RMSNorm(sum_j w_j expert_{id_j}(down_lat(x)))) + shared_mlp(x)."""
    x = np.asarray(x, np.float64)
    tw = {name: np.asarray(v, np.float64) for name, v in tensors.items()}
    betas = _betas(cfg)
    ids, weights = np_route(x, tw["gate.weight"], tw["gate.e_score_correction_bias"], cfg)
    latent = x @ tw["routed_expert_down_proj.weight"].T
    routed = np.zeros_like(latent)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            out = np_mlp(latent[t:t + 1], tw[f"experts.{e}.w1.weight"],
                         tw[f"experts.{e}.w3.weight"], tw[f"experts.{e}.w2.weight"], betas)
            routed[t] += weights[t, j] * out[0]
    if cfg.latent_moe_use_norm:
        routed = np_rms_norm(routed, tw["routed_expert_norm.weight"], cfg.rms_norm_eps)
    shared = np_mlp(x, tw["shared_experts.gate_proj.weight"], tw["shared_experts.up_proj.weight"],
                    tw["shared_experts.down_proj.weight"], betas)
    return routed @ tw["routed_expert_up_proj.weight"].T + shared


def random_moe_tensors(cfg, rng, bias_scale=0.05):
    """Fresh random float64 MoE weights keyed by checkpoint suffix, scaled
    normal / sqrt(fan_in) so activations stay O(1); the norm weight is near 1
    but not 1, and the bias is small random (it changes some selections)."""
    h, lat = cfg.hidden_size, cfg.routed_expert_hidden_size
    inter, shared = cfg.moe_intermediate_size, cfg.shared_intermediate_size

    def lin(out_dim, in_dim):
        return rng.standard_normal((out_dim, in_dim)) / np.sqrt(in_dim)

    t = {
        "gate.weight": lin(cfg.num_experts, h),
        "gate.e_score_correction_bias": bias_scale * rng.standard_normal(cfg.num_experts),
        "routed_expert_down_proj.weight": lin(lat, h),
        "routed_expert_up_proj.weight": lin(h, lat),
        "shared_experts.gate_proj.weight": lin(shared, h),
        "shared_experts.up_proj.weight": lin(shared, h),
        "shared_experts.down_proj.weight": lin(h, shared),
    }
    if cfg.latent_moe_use_norm:
        t["routed_expert_norm.weight"] = 1.0 + 0.1 * rng.standard_normal(lat)
    for e in range(cfg.num_experts):
        t[f"experts.{e}.w1.weight"] = lin(inter, lat)
        t[f"experts.{e}.w3.weight"] = lin(inter, lat)
        t[f"experts.{e}.w2.weight"] = lin(lat, inter)
    return t
