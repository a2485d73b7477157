"""Layouts over several nodes (ParallelConfig.nodes, EpDispatch) on 16
simulated CPU devices: the mesh and its node blocks, the Layout's decisions
and errors, and every dispatch form against the single device under
routings chosen to stress it (every token on one node's experts, every
token's experts on one device, half the experts empty), at awkward token
counts (37: not a multiple of the 16 row blocks; 5: most devices own only
padding rows).

On the CPU ragged all-to-all runs as its emulation (k3jax.parallel.ragged_a2a,
Layout.ragged_emulated); tests/test_aot_nodes.py compiles the real
collective for 2 x 8 and 4 x 8 H200s and checks the collectives there.
"""

from __future__ import annotations

import dataclasses
import functools
from collections import namedtuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tiers
from k3jax import TINY, ParallelConfig, RandomSource, SharedOverlap, build_layer, make_layout, make_mesh
from k3jax.layout import DATA, NODE, TENSOR, EpDispatch, EpDispatchError
from k3jax.layout.parallel import node_of_devices
from k3jax.tools.plan import dispatch_buffer_bytes, moe_collectives
from numerics import rel_err

CFG = dataclasses.replace(TINY, num_experts=64)     # 4 experts a device on 16 devices = top-k
E_LOCAL = 4
GATHER, HIER, A2A = EpDispatch.GATHER, EpDispatch.HIERARCHICAL, EpDispatch.ALL_TO_ALL


def sp_ep(dp, tp, nodes, form, **kw):
    kw = {"sequence_parallel": tp > 1, **kw}
    return ParallelConfig(dp=dp, tp=tp, nodes=nodes, expert_parallel=True, ep_dispatch=form, **kw)


# name -> (dp, tp, nodes, extra ParallelConfig fields)
LAYOUTS = {
    "n2_sp_dp2_tp8": (2, 8, 2, {}),
    "n4_sp_dp4_tp4_ring": (4, 4, 4, dict(shard_shared_expert=True,
                                         shared_overlap=SharedOverlap.RING)),
    "n2_ep_dp16": (16, 1, 2, {}),
    "n1_sp_dp2_tp8": (2, 8, 1, {}),
    "n2_tp_ep_dp2_tp8": (2, 8, 2, dict(sequence_parallel=False)),   # EP over plain TP
}


def parallel_of(name: str, form: EpDispatch) -> ParallelConfig:
    dp, tp, nodes, kw = LAYOUTS[name]
    return sp_ep(dp, tp, nodes, form, **kw)


# -- the mesh -------------------------------------------------------------------
def test_nodes_must_divide_dp_and_name_the_flag():
    with pytest.raises(ValueError, match=r"nodes 2 must divide dp 1"):
        ParallelConfig(tp=16, nodes=2)
    with pytest.raises(ValueError, match=r"nodes must be a positive integer"):
        ParallelConfig(dp=2, nodes=0)
    par = ParallelConfig(dp=4, tp=4, nodes=2, sequence_parallel=True)
    assert par.mesh_axes == (NODE, DATA, TENSOR) and par.mesh_shape == (2, 2, 4)
    assert par.data_axes == (NODE, DATA) and par.token_axes == (NODE, DATA, TENSOR)
    assert par.devices_per_node == 8 and par.row_shards == 16
    one = ParallelConfig(dp=2, tp=8)
    assert one.mesh_axes == (DATA, TENSOR) and one.data_axes == (DATA,)


def test_mesh_puts_each_nodes_devices_in_one_block(sixteen_devices):
    mesh = make_mesh(ParallelConfig(dp=4, tp=4, nodes=2), sixteen_devices)
    assert dict(mesh.shape) == {NODE: 2, DATA: 2, TENSOR: 4}
    ids = np.vectorize(lambda d: d.id)(mesh.devices)
    assert sorted(ids[0].ravel()) == [d.id for d in sixteen_devices[:8]]
    assert sorted(ids[1].ravel()) == [d.id for d in sixteen_devices[8:]]


FakeDevice = namedtuple("FakeDevice", "id process_index")


def test_processes_are_dealt_to_nodes_in_blocks():
    devices = [FakeDevice(i, i // 4) for i in range(16)]          # 4 processes of 4 devices
    assert node_of_devices(devices, 2) == [0] * 8 + [1] * 8
    assert node_of_devices(devices, 4) == [i // 4 for i in range(16)]
    with pytest.raises(ValueError, match=r"4 processes cannot be split evenly over 3 nodes"):
        node_of_devices(devices, 3)


# -- the layout -----------------------------------------------------------------
def test_layout_stages_and_exchange_axes():
    lay = make_layout(CFG, sp_ep(2, 8, 2, HIER))
    assert lay.expert_axes == (NODE, DATA, TENSOR)
    assert lay.dispatch_stages == ((NODE,), (DATA, TENSOR))
    assert make_layout(CFG, sp_ep(2, 8, 2, GATHER)).dispatch_stages == ((NODE, DATA, TENSOR),)
    a2a = make_layout(CFG, sp_ep(2, 8, 2, A2A))
    assert a2a.dispatch_stages == () and a2a.exchange_axes == ((NODE,), (TENSOR,))
    assert make_layout(CFG, sp_ep(16, 1, 2, A2A)).exchange_axes == ((NODE,), (DATA,))
    assert make_layout(CFG, sp_ep(2, 8, 1, A2A)).exchange_axes == ((), (DATA, TENSOR))
    # EP over plain TP: rows replicated on TENSOR, gathered over the data axes in two stages
    plain = make_layout(CFG, ParallelConfig(dp=2, tp=8, nodes=2, expert_parallel=True,
                                            ep_dispatch=HIER))
    assert plain.dispatch_stages == ((NODE,), (DATA,))


@pytest.mark.parametrize("parallel, match", [
    (ParallelConfig(dp=2, tp=8, expert_parallel=True, sequence_parallel=True, ep_dispatch=HIER),
     r"hierarchical needs --nodes > 1"),
    (ParallelConfig(dp=2, tp=8, nodes=2, expert_parallel=True, ep_dispatch=A2A),
     r"all-to-all needs each device to own its rows"),
    (ParallelConfig(dp=2, tp=8, nodes=2, ep_dispatch=A2A), r"needs --expert-parallel"),
    (sp_ep(2, 8, 2, A2A, shard_shared_expert=True, shared_overlap=SharedOverlap.WEIGHTS),
     r"does not combine with --shared-overlap weights"),
])
def test_a_form_the_layout_cannot_run_is_refused(parallel, match):
    with pytest.raises(EpDispatchError, match=match):
        make_layout(CFG, parallel)


def test_auto_resolves_per_token_count_to_a_form_the_layout_runs():
    one_node = make_layout(CFG, sp_ep(2, 8, 1, EpDispatch.AUTO))
    assert one_node.for_tokens(64).ep_dispatch is GATHER
    weights = make_layout(CFG, sp_ep(2, 8, 2, EpDispatch.AUTO, shard_shared_expert=True,
                                     shared_overlap=SharedOverlap.WEIGHTS))
    for tokens in (1, 8, 64, 512, 4096, 16384):
        assert weights.for_tokens(tokens).ep_dispatch in (GATHER, HIER)   # never all-to-all
        assert make_layout(CFG, sp_ep(2, 8, 2, EpDispatch.AUTO)).for_tokens(tokens).ep_dispatch \
            is not EpDispatch.AUTO


def test_planner_lists_the_staged_and_ragged_collectives():
    T, L, K = 256, CFG.routed_expert_hidden_size, CFG.num_experts_per_token
    hier = moe_collectives(make_layout(CFG, sp_ep(2, 8, 2, HIER)), T)
    assert [(c.kind, c.axes, c.group, c.shape[0]) for c in hier if c.what == "latent rows"] == [
        ("all-gather", (NODE,), 2, 32), ("all-gather", (DATA, TENSOR), 8, 256)]
    assert [(c.axes, c.crosses_nodes) for c in hier if c.kind == "reduce-scatter"] == [
        ((DATA, TENSOR), False), ((NODE,), True)]
    a2a = make_layout(CFG, sp_ep(2, 8, 2, A2A))
    ragged = [c for c in moe_collectives(a2a, T) if c.kind == "ragged-all-to-all"]
    assert [(c.axes, c.shape) for c in ragged if "latent" in c.what] == [
        ((NODE,), (32, L)), ((TENSOR,), (256, L)), ((TENSOR,), (256, L)), ((NODE,), (32, L))]
    buffers = dispatch_buffer_bytes(a2a, T)     # worst case: 16 own rows to 2 nodes, then 8 devices
    assert buffers["stage_a_send_rows"] == 32 * (L * 4 + K * 8)
    assert buffers["stage_b_recv_latent_float32"] == 256 * L * 4


@pytest.mark.parametrize("argv, culprit", [
    (["--tp", "8", "--nodes", "2"], "--nodes 2 does not divide --dp 1"),
    (["--dp", "3", "--nodes", "2"], "--nodes 2 does not divide the 3 devices"),
    (["--dp", "2", "--tp", "4", "--nodes", "4"], "--nodes 4 does not divide --dp 2"),
])
def test_cli_usage_errors_name_the_flag(argv, culprit, capsys):
    from k3jax.cli import main
    assert main(["plan", "--preset", "tiny", "--expert-parallel", *argv]) == 2
    assert culprit in capsys.readouterr().err


# -- numerics against the single device ------------------------------------------
def _bias(routing: str, nodes: int) -> np.ndarray:
    """A router bias that forces the routing (selection only: the weights
    still come from the unbiased scores)."""
    rng = np.random.default_rng(7)
    bias = rng.normal(size=CFG.num_experts).astype(np.float32) * 0.1
    if routing == "one_node":           # every token's experts on node 0
        bias[:CFG.num_experts // nodes] += 100.0
    elif routing == "one_device":       # every token's 4 experts on device 5
        bias[5 * E_LOCAL:6 * E_LOCAL] += 100.0
    elif routing == "half_empty":       # the experts of odd devices receive no token
        for d in range(1, 16, 2):
            bias[d * E_LOCAL:(d + 1) * E_LOCAL] -= 100.0
    return bias


def _set_bias(module, bias: np.ndarray) -> None:
    old = module.router_bias_E[...]
    module.router_bias_E[...] = jax.device_put(jnp.asarray(bias), old.sharding)


@functools.cache
def _module(parallel: ParallelConfig):
    mesh = make_mesh(parallel)
    return build_layer(make_layout(CFG, parallel, mesh), 1, mesh, source=RandomSource(0))


def _x(T: int) -> jax.Array:
    return jax.random.normal(jax.random.key(T), (T, CFG.hidden_size), jnp.float32)


def _output(parallel: ParallelConfig, routing: str, nodes: int, T: int) -> np.ndarray:
    module = _module(parallel)
    _set_bias(module, _bias(routing, nodes))
    return np.asarray(module(_x(T)))


ROUTINGS = ("random", "one_node", "one_device", "half_empty")
CASES = [("n2_sp_dp2_tp8", HIER, 37), ("n2_sp_dp2_tp8", A2A, 37),
         tiers.slow("n2_sp_dp2_tp8", GATHER, 37), tiers.slow("n2_sp_dp2_tp8", A2A, 5),
         tiers.slow("n4_sp_dp4_tp4_ring", HIER, 37), tiers.slow("n4_sp_dp4_tp4_ring", A2A, 37),
         tiers.slow("n2_ep_dp16", A2A, 37), tiers.slow("n2_ep_dp16", HIER, 5),
         tiers.slow("n1_sp_dp2_tp8", A2A, 37), ("n2_tp_ep_dp2_tp8", HIER, 37),
         tiers.slow("n2_tp_ep_dp2_tp8", GATHER, 5)]


@pytest.mark.parametrize("name, form, T", CASES)
def test_every_form_equals_the_single_device(name, form, T):
    parallel = parallel_of(name, form)
    layout = _module(parallel).layout
    assert layout.ragged_emulated                      # CPU devices: the emulation
    for routing in ROUTINGS:
        want = _output(ParallelConfig(), routing, parallel.nodes, T)
        got = _output(parallel, routing, parallel.nodes, T)
        assert rel_err(got, want) < 1e-5, (name, form, routing, rel_err(got, want))


def test_forced_routing_really_is_skewed():
    """The routings above do what they say: one node's experts, one device's."""
    from k3jax.ops import route
    x = _x(37)
    module = _module(ParallelConfig())
    for routing, allowed in (("one_node", range(32)), ("one_device", range(20, 24))):
        ids, _ = route(x, module.router_DE[...], jnp.asarray(_bias(routing, 2)), CFG,
                       jnp.ones(37, bool))
        assert set(np.asarray(ids).ravel()) <= set(allowed), routing


GRAD_CASES = [("n2_sp_dp2_tp8", A2A), tiers.slow("n2_sp_dp2_tp8", HIER),
              tiers.slow("n2_ep_dp16", A2A)]


@pytest.mark.parametrize("name, form", GRAD_CASES)
def test_gradients_equal_the_single_device(name, form):
    """The VJP through every form (the ragged exchange's transpose sends the
    latent's cotangent back the way the rows came) equals the single
    device's: the input's gradient and every weight's."""
    from k3jax.grads import layer_grads
    parallel = parallel_of(name, form)
    T = 37
    x = _x(T)
    dy = jax.random.normal(jax.random.key(99), x.shape, jnp.float32)
    for routing in ("random", "one_device"):
        single, multi = _module(ParallelConfig()), _module(parallel)
        for m in (single, multi):
            _set_bias(m, _bias(routing, parallel.nodes))
        want, got = layer_grads(single, x, dy), layer_grads(multi, x, dy)
        assert rel_err(got.dx_TD, want.dx_TD) < 1e-5, (routing, "input")
        assert set(got.weights) == set(want.weights)
        for path, g in want.weights.items():
            assert rel_err(got.weights[path], g) < 1e-5, (routing, path, rel_err(got.weights[path], g))
