"""k3jax.ops against the float64 numpy reference (tests/reference_np.py):
route (plain and grouped top-k, renormalize, scaling, padding rows), rms_norm,
SiTU (with and without linear_beta), situ_mlp and routed_experts."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.config import TINY, TINY_GROUPED
from k3jax.ops import SiTU, rms_norm, route, routed_experts, situ_mlp
from numerics import rel_err
from reference_np import np_mlp, np_rms_norm, np_route, np_situ, random_moe_tensors


def by_id(ids_TK, weights_TK):
    """Sort each row by expert id, so that id SETS compare equal."""
    order = np.argsort(ids_TK, axis=1)
    return np.take_along_axis(np.asarray(ids_TK), order, 1), np.take_along_axis(
        np.asarray(weights_TK, np.float64), order, 1)


def router_inputs(cfg, num_tokens, seed, bias_scale=0.1):
    rng = np.random.default_rng(seed)
    t = random_moe_tensors(cfg, rng, bias_scale=bias_scale)
    x_TD = rng.standard_normal((num_tokens, cfg.hidden_size)).astype(np.float32)
    gate_ED = t["gate.weight"].astype(np.float32)
    bias_E = t["gate.e_score_correction_bias"].astype(np.float32)
    return x_TD, gate_ED, bias_E


ROUTE_CASES = {
    "tiny": TINY,
    "grouped": TINY_GROUPED,
    "no-renormalize": TINY.replace(moe_renormalize=False),
    "scaled": TINY.replace(routed_scaling_factor=2.5),
    "grouped-scaled-no-renormalize": TINY_GROUPED.replace(moe_renormalize=False,
                                                          routed_scaling_factor=0.75),
    "grouped-8-keep-3": TINY.replace(num_experts=32, num_experts_per_token=6, num_expert_group=8,
                                     topk_group=3),
}


@pytest.mark.parametrize("num_tokens", [1, 33])
@pytest.mark.parametrize("name", sorted(ROUTE_CASES))
def test_route_matches_numpy(name, num_tokens):
    cfg = ROUTE_CASES[name]
    x_TD, gate_ED, bias_E = router_inputs(cfg, num_tokens, seed=num_tokens)
    ids, w = jax.jit(lambda x, r, b: route(x, r, b, cfg))(x_TD, gate_ED.T, bias_E)
    assert ids.dtype == jnp.int32 and w.dtype == jnp.float32
    assert ids.shape == w.shape == (num_tokens, cfg.num_experts_per_token)
    want_ids, want_w = by_id(*np_route(x_TD, gate_ED, bias_E, cfg))
    got_ids, got_w = by_id(np.asarray(ids), np.asarray(w))
    np.testing.assert_array_equal(got_ids, want_ids)
    np.testing.assert_allclose(got_w, want_w, rtol=0, atol=1e-6)
    total = got_w.sum(1)
    if cfg.moe_renormalize:
        np.testing.assert_allclose(total, cfg.routed_scaling_factor, rtol=1e-6)
    else:   # raw sigmoid scores: sums differ from token to token
        assert np.all(total < cfg.num_experts_per_token * cfg.routed_scaling_factor)


def test_route_rejects_mismatched_router_and_bias():
    cfg = TINY
    D, E = cfg.hidden_size, cfg.num_experts
    x_TD = jnp.ones((3, D))
    with pytest.raises(ValueError, match=rf"route: router_DE must be \[D, E\] = \[{D}, {E}\] .* "
                                         rf"got \[{E}, {D}\]"):
        route(x_TD, jnp.ones((E, D)), jnp.zeros(E), cfg)      # transposed: [E, D]
    with pytest.raises(ValueError, match=rf"router_DE .* got \[{D}, {E - 1}\]"):
        route(x_TD, jnp.ones((D, E - 1)), jnp.zeros(E), cfg)
    with pytest.raises(ValueError, match=rf"route: bias_E must be \[E\] = \[{E}\] .* got \[1\]"):
        route(x_TD, jnp.ones((D, E)), jnp.zeros(1), cfg)
    with pytest.raises(ValueError, match=r"route: valid_T must be \[T\] = \[3\], got \[4\]"):
        route(x_TD, jnp.ones((D, E)), jnp.zeros(E), cfg, jnp.ones(4, bool))


def test_route_bias_selects_but_does_not_weight():
    """The bias changes which experts win, but weights are the unbiased scores."""
    cfg = TINY.replace(moe_renormalize=False)
    x_TD, gate_ED, bias_E = router_inputs(cfg, 64, seed=3, bias_scale=0.3)
    ids, w = route(jnp.asarray(x_TD), jnp.asarray(gate_ED.T), jnp.asarray(bias_E), cfg)
    ids0, _ = route(jnp.asarray(x_TD), jnp.asarray(gate_ED.T), jnp.zeros_like(bias_E), cfg)
    assert not np.array_equal(by_id(ids, w)[0], by_id(ids0, w)[0])
    scores_TE = 1.0 / (1.0 + np.exp(-(x_TD.astype(np.float64) @ gate_ED.T.astype(np.float64))))
    np.testing.assert_allclose(np.asarray(w), np.take_along_axis(scores_TE, np.asarray(ids), 1),
                               atol=1e-6)


def test_grouped_route_keeps_topk_groups():
    cfg = TINY_GROUPED
    x_TD, gate_ED, bias_E = router_inputs(cfg, 64, seed=5)
    ids, _ = route(jnp.asarray(x_TD), jnp.asarray(gate_ED.T), jnp.asarray(bias_E), cfg)
    size = cfg.num_experts // cfg.num_expert_group
    groups_per_token = [len(set(row // size)) for row in np.asarray(ids)]
    assert max(groups_per_token) <= cfg.topk_group
    # Without grouping some tokens pick experts from more groups: grouping is not a no-op.
    flat, _ = route(jnp.asarray(x_TD), jnp.asarray(gate_ED.T), jnp.asarray(bias_E),
                    cfg.replace(num_expert_group=1, topk_group=1))
    assert max(len(set(row // size)) for row in np.asarray(flat)) > cfg.topk_group


def test_route_padding_rows_go_nowhere():
    cfg = TINY
    x_TD, gate_ED, bias_E = router_inputs(cfg, 6, seed=7)
    valid_T = jnp.asarray([True, True, False, True, False, False])
    ids, w = route(jnp.asarray(x_TD), jnp.asarray(gate_ED.T), jnp.asarray(bias_E), cfg, valid_T)
    ids, w = np.asarray(ids), np.asarray(w)
    assert np.all(ids[~np.asarray(valid_T)] == cfg.num_experts)
    assert np.all(w[~np.asarray(valid_T)] == 0.0)
    want_ids, want_w = by_id(*np_route(x_TD[[0, 1, 3]], gate_ED, bias_E, cfg))
    got_ids, got_w = by_id(ids[[0, 1, 3]], w[[0, 1, 3]])
    np.testing.assert_array_equal(got_ids, want_ids)
    np.testing.assert_allclose(got_w, want_w, atol=1e-6)


@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 1e-6), (jnp.bfloat16, 1e-2)])
def test_rms_norm(dtype, tol):
    rng = np.random.default_rng(11)
    x_TL = 3.0 * rng.standard_normal((5, 64)) + 0.5
    w_L = 1.0 + 0.1 * rng.standard_normal(64)
    for eps in (1e-5, 10.0):      # a large eps must show up in the result
        got = rms_norm(jnp.asarray(x_TL, dtype), jnp.asarray(w_L, dtype), eps)
        assert got.dtype == dtype and got.shape == (5, 64)
        x_rounded = np.asarray(jnp.asarray(x_TL, dtype), np.float64)
        w_rounded = np.asarray(jnp.asarray(w_L, dtype), np.float64)
        assert rel_err(got, np_rms_norm(x_rounded, w_rounded, eps)) < tol
    assert rel_err(np_rms_norm(x_TL, w_L, 10.0), np_rms_norm(x_TL, w_L, 1e-5)) > 0.1
    x16, w16 = jnp.asarray(x_TL, jnp.bfloat16), jnp.asarray(w_L, jnp.bfloat16)
    got32 = rms_norm(x16, w16, 1e-5, out_dtype=jnp.float32)
    assert got32.dtype == jnp.float32       # bf16 in, float32 math and output: fp32 accuracy
    want32 = np_rms_norm(np.asarray(x16, np.float64), np.asarray(w16, np.float64), 1e-5)
    assert rel_err(got32, want32) < 1e-6


def test_rms_norm_rejects_a_weight_of_the_wrong_shape():
    x_TL = jnp.ones((5, 64))
    for bad in ((1,), (63,), (5, 64)):
        with pytest.raises(ValueError, match=rf"rms_norm: weight_L must have shape \[64\] .* got "
                                             rf"\[{', '.join(map(str, bad))}\]"):
            rms_norm(x_TL, jnp.ones(bad), 1e-5)


@pytest.mark.parametrize("linear_beta", [25.0, None, 3.0])
def test_situ(linear_beta):
    rng = np.random.default_rng(13)
    gate = 3.0 * rng.standard_normal((7, 48))
    up = 30.0 * rng.standard_normal((7, 48))         # large enough that linear_beta bites
    act = SiTU(4.0, linear_beta)
    got = act(jnp.asarray(gate, jnp.float32), jnp.asarray(up, jnp.float32))
    assert got.dtype == jnp.float32
    want = np_situ(gate, up, 4.0, linear_beta)
    assert rel_err(got, want) < 2e-6
    other = np_situ(gate, up, 4.0, 25.0 if linear_beta is None else None)
    assert rel_err(other, want) > 1e-2
    gate16, up16 = jnp.asarray(gate, jnp.bfloat16), jnp.asarray(up, jnp.bfloat16)
    got_bf16 = act(gate16, up16)
    want_bf16 = np_situ(np.asarray(gate16, np.float64), np.asarray(up16, np.float64), 4.0, linear_beta)
    assert got_bf16.dtype == jnp.bfloat16 and rel_err(got_bf16, want_bf16) < 1e-2


def test_situ_from_config():
    assert SiTU.from_config(TINY) == SiTU(4.0, 25.0)
    assert SiTU.from_config(TINY.replace(activation_situ_linear_beta=None)) == SiTU(4.0, None)


@pytest.mark.parametrize("linear_beta", [25.0, None])
def test_situ_mlp(linear_beta):
    rng = np.random.default_rng(17)
    D, F = 96, 160
    x_TD = 2.0 * rng.standard_normal((9, D))
    gate_FD, up_FD = rng.standard_normal((F, D)) / np.sqrt(D), 4 * rng.standard_normal((F, D)) / np.sqrt(D)
    down_DF = rng.standard_normal((D, F)) / np.sqrt(F)
    act = SiTU(4.0, linear_beta)
    f = jax.jit(lambda *a: situ_mlp(*a, act, backend="xla"))
    got = f(*(jnp.asarray(a, jnp.float32) for a in (x_TD, gate_FD.T, up_FD.T, down_DF.T)))
    assert got.shape == (9, D) and got.dtype == jnp.float32
    want = np_mlp(x_TD, gate_FD, up_FD, down_DF, (4.0, linear_beta))
    assert rel_err(got, want) < 1e-5


def test_routed_experts_matches_loop_and_splits_over_experts():
    """sum_k w * expert_k(lat) per token; two halves of the experts (EP-style,
    via first_expert) add up to the whole; out-of-range ids contribute nothing."""
    rng = np.random.default_rng(19)
    T, K, E, L, F = 11, 3, 6, 64, 32
    lat_TL = rng.standard_normal((T, L))
    ids_TK = np.stack([rng.choice(E, K, replace=False) for _ in range(T)])
    ids_TK[4] = E                               # a padding row
    w_TK = rng.uniform(0.1, 1.0, (T, K))
    w1, w3 = rng.standard_normal((2, E, F, L)) / np.sqrt(L)
    w2 = rng.standard_normal((E, L, F)) / np.sqrt(F)
    act = SiTU(4.0, 25.0)
    want = np.zeros((T, L))
    for t in range(T):
        for k in range(K):
            e = ids_TK[t, k]
            if e < E:
                want[t] += w_TK[t, k] * np_mlp(lat_TL[t:t + 1], w1[e], w3[e], w2[e], (4.0, 25.0))[0]
    f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    w1_ELF, w3_ELF, w2_EFL = (f32(np.swapaxes(w, 1, 2)) for w in (w1, w3, w2))

    @jax.jit
    def run(first, w1_ELF, w3_ELF, w2_EFL):
        return routed_experts(f32(lat_TL), jnp.asarray(ids_TK, jnp.int32), f32(w_TK), w1_ELF,
                              w3_ELF, w2_EFL, act, first_expert=first, backend="xla")

    full = run(0, w1_ELF, w3_ELF, w2_EFL)
    assert full.dtype == jnp.float32 and rel_err(full, want) < 1e-5
    assert np.all(np.asarray(full)[4] == 0.0)
    h = E // 2
    halves = run(0, w1_ELF[:h], w3_ELF[:h], w2_EFL[:h]) + run(h, w1_ELF[h:], w3_ELF[h:], w2_EFL[h:])
    assert rel_err(halves, want) < 1e-5


@pytest.mark.parametrize("what, culprit", [
    ("lat rows", r"lat_TL has 5 rows but ids_TK has 4"),
    ("weights shape", r"weights_TK shape \[4, 2\] != ids_TK shape \[4, 3\]"),
    ("w1 latent", r"w1_ELF must be \[E, L=8, F\] \(L from lat_TL\), got \[2, 7, 6\]"),
    ("w3 shape", r"w3_ELF shape \[2, 8, 5\] != w1_ELF shape \[2, 8, 6\]"),
    ("w2 shape", r"w2_EFL must be \[E, F, L\] = \[2, 6, 8\] .* got \[2, 8, 6\]"),
    ("ids 1-D", r"lat_TL and ids_TK must be 2-D, got \[4, 8\] and \[12\]"),
])
def test_routed_experts_rejects_mismatched_shapes(what, culprit):
    """A mismatch would gather out of range (which JAX clamps silently)."""
    T, K, E, L, F = 4, 3, 2, 8, 6
    args = {"lat_TL": jnp.ones((T, L)), "ids_TK": jnp.zeros((T, K), jnp.int32),
            "weights_TK": jnp.ones((T, K)), "w1_ELF": jnp.ones((E, L, F)),
            "w3_ELF": jnp.ones((E, L, F)), "w2_EFL": jnp.ones((E, F, L))}
    name, shape = {"lat rows": ("lat_TL", (T + 1, L)), "weights shape": ("weights_TK", (T, K - 1)),
                   "w1 latent": ("w1_ELF", (E, L - 1, F)), "w3 shape": ("w3_ELF", (E, L, F - 1)),
                   "w2 shape": ("w2_EFL", (E, L, F)), "ids 1-D": ("ids_TK", (T * K,))}[what]
    args[name] = jnp.zeros(shape, args[name].dtype)
    with pytest.raises(ValueError, match=rf"routed_experts: {culprit}"):
        routed_experts(**args, act=SiTU(4.0, 25.0), backend="xla")
