"""Sequence-parallel token rows (SPEC 4): zero padding to a multiple of the row
blocks, the row collectives, and padding rows routed to no expert and never
reaching the output."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import k3jax.modules.moe as moe_module
from k3jax import DATA, TENSOR, TINY, TINY_GROUPED, ParallelConfig, make_mesh, route
from k3jax.layout import padded_rows
from k3jax.ops import SiTU, routed_experts
from k3jax.parallel.sequence import gather_rows, pad_rows, scatter_rows
from layout_cases import MOE_LAYER, module, output, rel_err


def normal(key: int, shape) -> jax.Array:
    return jax.random.normal(jax.random.key(key), shape, jnp.float32)


@pytest.mark.parametrize("T, shards, Tp", [(5, 8, 8), (1, 8, 8), (64, 8, 64), (9, 8, 16),
                                           (7, 2, 8), (5, 1, 5)])
def test_pad_rows(T, shards, Tp):
    x = normal(T, (T, 12))
    x_pad, valid = pad_rows(x, shards)
    assert padded_rows(T, shards) == Tp
    assert x_pad.shape == (Tp, 12) and x_pad.dtype == x.dtype
    assert valid.shape == (Tp,) and valid.dtype == jnp.bool_
    np.testing.assert_array_equal(np.asarray(x_pad[:T]), np.asarray(x))
    assert not np.any(np.asarray(x_pad[T:]))
    np.testing.assert_array_equal(np.asarray(valid), np.arange(Tp) < T)


@pytest.mark.parametrize("dp, tp, axes", [(1, 8, TENSOR), (2, 4, TENSOR), (2, 4, (DATA, TENSOR))])
def test_gather_and_scatter_rows(eight_devices, dp, tp, axes):
    """Device r of the group owns rows [r*L, (r+1)*L): gather_rows returns the
    group's rows in order; scatter_rows sums partials and keeps own rows."""
    mesh = make_mesh(ParallelConfig(dp=dp, tp=tp), devices=eight_devices)
    L, X = 3, 5
    x = normal(1, (8 * L, X))
    spec = P((DATA, TENSOR))
    gathered = jax.shard_map(lambda a: gather_rows(a, axes), mesh=mesh, in_specs=spec,
                             out_specs=spec)(x)
    group = 8 if axes == (DATA, TENSOR) else tp
    # device d's output block is its group's concatenated rows
    want = np.concatenate([np.asarray(x).reshape(8 // group, group * L, X)[g]
                           for g in range(8 // group) for _ in range(group)])
    np.testing.assert_array_equal(np.asarray(gathered), want)

    partial = normal(2, (8 * group * L, X))        # each device: group*L rows of partials
    scattered = jax.shard_map(lambda a: scatter_rows(a, axes), mesh=mesh, in_specs=spec,
                              out_specs=spec)(partial)
    p = np.asarray(partial, np.float64).reshape(8 // group, group, group * L, X)
    want = p.sum(axis=1).reshape(8 // group, group, L, X).reshape(8 * L, X)
    np.testing.assert_allclose(np.asarray(scattered), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("cfg", [TINY, TINY_GROUPED], ids=["tiny", "tiny_grouped"])
def test_route_sends_padding_rows_to_no_expert(cfg):
    T, Tp = 5, 8
    x = normal(3, (Tp, cfg.hidden_size))
    router = normal(4, (cfg.hidden_size, cfg.num_experts)) / np.sqrt(cfg.hidden_size)
    bias = 0.05 * normal(5, (cfg.num_experts,))
    valid = jnp.arange(Tp) < T
    ids, w = route(x, router, bias, cfg, valid)
    ids_all, w_all = route(x, router, bias, cfg)
    assert ids.dtype == jnp.int32 and w.dtype == jnp.float32
    assert ids.shape == w.shape == (Tp, cfg.num_experts_per_token)
    ids, w, ids_all = np.asarray(ids), np.asarray(w), np.asarray(ids_all)
    assert np.all(ids[T:] == cfg.num_experts) and not np.any(w[T:])
    np.testing.assert_array_equal(ids[:T], ids_all[:T])
    np.testing.assert_array_equal(w[:T], np.asarray(w_all)[:T])
    assert np.all((ids[:T] >= 0) & (ids[:T] < cfg.num_experts))
    np.testing.assert_allclose(w[:T].sum(axis=1), cfg.routed_scaling_factor, rtol=1e-6)


@pytest.mark.parametrize("first_expert", [0, 4])
def test_padding_rows_contribute_nothing_even_if_not_finite(first_expert):
    """Rows routed to id == num_experts (padding) never reach the output: with
    NaN/inf in their latent the real rows are unchanged and the padding rows are 0."""
    T, Tp, L, F, E, E_local, K = 5, 8, 16, 8, 16, 4, 4
    lat = normal(6, (Tp, L))
    ids = jax.random.randint(jax.random.key(7), (Tp, K), 0, E, jnp.int32)
    ids = ids.at[:, 0].set(first_expert + jnp.arange(Tp) % E_local)    # every row hits a local one
    w = jax.nn.softmax(normal(8, (Tp, K)), axis=-1)
    valid = (jnp.arange(Tp) < T)[:, None]
    ids, w = jnp.where(valid, ids, E), jnp.where(valid, w, 0.0)
    w1, w3 = normal(9, (E_local, L, F)) / 4, normal(10, (E_local, L, F)) / 4
    w2 = normal(11, (E_local, F, L)) / 3
    act = SiTU.from_config(TINY)
    experts = jax.jit(lambda lat: routed_experts(lat, ids, w, w1, w3, w2, act,
                                                 first_expert=first_expert, backend="xla"))
    def run(lat):
        return np.asarray(experts(lat))
    clean = run(lat)
    poisoned = run(lat.at[T:].set(jnp.nan).at[T + 1].set(jnp.inf))
    assert np.all(np.isfinite(poisoned))
    np.testing.assert_array_equal(poisoned[:T], clean[:T])
    assert not np.any(poisoned[T:])
    assert np.any(clean[:T])


@pytest.mark.parametrize("name", ["sp_tp8_shard", "sp_ep_dp2_tp4_shard"])
@pytest.mark.parametrize("T", [1, 5])
def test_sp_output_has_only_real_rows(eight_devices, name, T):
    """T not divisible by the 8 row blocks: the output is [T, D], finite, and
    equal to the single device's (padding rows are dropped, not summed in)."""
    got = output(TINY, name, MOE_LAYER, T)
    assert got.shape == (T, TINY.hidden_size)
    assert np.all(np.isfinite(got))
    assert rel_err(got, output(TINY, "single", MOE_LAYER, T)) < 1e-5


def test_sp_rows_are_independent_of_padding(eight_devices):
    """Row t of a T = 5 run equals row t of a T = 8 run whose first 5 rows are the
    same: the 3 padding rows of T = 5 behave like absent tokens."""
    _, state, fn = module(TINY, "sp_tp8_shard", MOE_LAYER)
    x8 = normal(12, (8, TINY.hidden_size))
    y8 = np.asarray(fn(state, x8))
    y5 = np.asarray(fn(state, x8[:5]))
    np.testing.assert_allclose(y5, y8[:5], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["sp_tp8_shard", "sp_ep_dp2_tp4_shard", "dp2_tp4"])
def test_module_routes_its_padding_rows_to_no_expert(eight_devices, monkeypatch, request, name):
    """Inside the layer (T = 5 padded to the row blocks) the router sees the
    padding mask: every padding row gets id == num_experts and weight 0."""
    seen = []

    def check(ids, w, valid):
        seen.append((np.asarray(ids), np.asarray(w), np.asarray(valid)))

    def spy(x, router, bias, cfg, valid_T=None):
        assert valid_T is not None, "the layer routed without the padding mask"
        ids, w = route(x, router, bias, cfg, valid_T)
        jax.debug.callback(check, ids, w, valid_T)
        return ids, w

    monkeypatch.setattr(moe_module, "route", spy)
    moe_module.moe_forward.cache_clear()            # forwards are cached: retrace with the spy
    request.addfinalizer(moe_module.moe_forward.cache_clear)
    moe = module(TINY, name, MOE_LAYER)[0]
    graph, state = nnx.split(moe)
    y = jax.jit(lambda s, x: nnx.merge(graph, s)(x))(state, normal(13, (5, TINY.hidden_size)))
    jax.block_until_ready(y)
    valid = np.concatenate([v for _, _, v in seen])
    ids = np.concatenate([i for i, _, _ in seen])
    w = np.concatenate([w for _, w, _ in seen])
    assert (~valid).sum() > 0, "no padding rows: the test exercises nothing"
    assert np.all(ids[~valid] == TINY.num_experts) and not np.any(w[~valid])
    assert np.all(ids[valid] < TINY.num_experts) and np.all(w[valid].sum(axis=1) > 0.99)
