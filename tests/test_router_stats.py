"""Router statistics (k3jax.modules.router_stats): what the MoE layer sows
when ``router_stats`` is on, against counts computed in numpy from the
routing ids of the whole input on one device, in three layouts (one
device; SP + EP over tp 8 with the gather; EP over 2 nodes of 8 with the
ragged all-to-all) and the two layouts without EP (where every device runs
its expert shards for all rows of its data group), at token counts that are
not multiples of the row blocks (padding rows must count nowhere). Off, the
compiled program holds no extra collective. ``k3jax run --expert-load``
writes them as JSON and prints the device imbalance."""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3jax import TINY, ParallelConfig, RandomSource, build_layer, make_layout, make_mesh
from k3jax.cli import main
from k3jax.layout import EpDispatch, MoEMode, padded_rows
from k3jax.layout.expert_placement import read_expert_load
from k3jax.modules import ExpertLoad, RouterStats, expert_loads
from k3jax.modules.moe import moe_forward
from k3jax.modules.router_stats import expert_load_json, imbalance
from k3jax.ops.routing import RoutingResult, route

CFG = dataclasses.replace(TINY, num_experts=64)      # 4 experts a device on 16, 8 on 8

LAYOUTS = {
    "one_device": ParallelConfig(),
    "sp_ep_tp8_gather": ParallelConfig(tp=8, sequence_parallel=True, expert_parallel=True,
                                       ep_dispatch=EpDispatch.GATHER),
    "ep_2_nodes_all_to_all": ParallelConfig(dp=2, tp=8, nodes=2, sequence_parallel=True,
                                            expert_parallel=True,
                                            ep_dispatch=EpDispatch.ALL_TO_ALL),
    "tp_sp_dp2_tp4": ParallelConfig(dp=2, tp=4, sequence_parallel=True),     # no EP
    "tp_dp2_tp4": ParallelConfig(dp=2, tp=4),                                 # no EP, plain TP
}


@functools.cache
def _module(name: str):
    parallel = LAYOUTS[name]
    mesh = make_mesh(parallel)
    module = build_layer(make_layout(CFG, parallel, mesh), 1, mesh, source=RandomSource(0))
    module.router_stats = True
    return module


def _x(T: int) -> jax.Array:
    return jax.random.normal(jax.random.key(T), (T, CFG.hidden_size), jnp.float32)


def _skew(module, on: bool) -> None:
    """A router bias that leaves the experts of every other device of 8
    experts (and so whole devices) without a token, or the random bias."""
    bias = np.random.default_rng(7).normal(size=CFG.num_experts).astype(np.float32) * 0.1
    if on:
        for d in range(1, 16, 2):
            bias[d * 4:(d + 1) * 4] -= 100.0
    old = module.router_bias_E[...]
    module.router_bias_E[...] = jax.device_put(jnp.asarray(bias), old.sharding)


def _expected(module, x) -> dict:
    """The statistics in numpy, from the routing ids of the whole input
    routed on one device (float32), and the layout's definitions."""
    layout, par = module.layout, module.layout.parallel
    E, K, T = CFG.num_experts, CFG.num_experts_per_token, x.shape[0]
    router = np.asarray(module.router_DE[...])
    bias = np.asarray(module.router_bias_E[...])
    ids, _ = route(jnp.asarray(x), jnp.asarray(router), jnp.asarray(bias), CFG)
    ids = np.asarray(ids)
    per_expert = np.bincount(ids.ravel(), minlength=E)
    if layout.moe_mode is MoEMode.EP:
        per_device = per_expert.reshape(par.ep, E // par.ep).sum(1)
    else:   # data group g owns rows [g Tg, (g + 1) Tg) of the padded rows; all tp devices run them
        group_rows = padded_rows(T, par.row_shards) // par.dp
        per_group = [K * max(0, min(T, (g + 1) * group_rows) - g * group_rows)
                     for g in range(par.dp)]
        per_device = np.repeat(per_group, par.tp)
    per_node = per_device.reshape(par.nodes, -1).sum(1)
    scores = 1 / (1 + np.exp(-(np.asarray(x, np.float64) @ router.astype(np.float64))))
    return {"tokens_per_expert": per_expert, "tokens_per_device": per_device,
            "tokens_per_node": per_node, "mean_score_per_expert": scores.mean(0),
            "imbalance_device": per_device.max() / per_device.mean(),
            "imbalance_node": per_node.max() / per_node.mean()}


CASES = [("one_device", 37), ("sp_ep_tp8_gather", 37), ("ep_2_nodes_all_to_all", 37),
         ("ep_2_nodes_all_to_all", 5), ("tp_sp_dp2_tp4", 37), ("tp_dp2_tp4", 37)]


@pytest.mark.parametrize("name, T", CASES)
def test_statistics_equal_numpy_counts_of_the_routing(name, T):
    module = _module(name)
    x = _x(T)
    for skewed in (False, True):
        _skew(module, skewed)
        y, stats = nnx.capture(module, RouterStats)(x)
        load = expert_loads(stats)[()]
        want = _expected(module, x)
        for field in ("tokens_per_expert", "tokens_per_device", "tokens_per_node"):
            got = np.asarray(getattr(load, field))
            assert got.dtype == np.int32, field
            np.testing.assert_array_equal(got, want[field], err_msg=f"{name} {field} {skewed}")
        assert len(load.tokens_per_device) == module.layout.parallel.num_devices
        np.testing.assert_allclose(load.mean_score_per_expert, want["mean_score_per_expert"],
                                   rtol=1e-5, atol=1e-6)
        for field in ("imbalance_device", "imbalance_node"):
            np.testing.assert_allclose(float(getattr(load, field)), want[field], rtol=1e-6)
        module.router_stats = False        # the statistics change nothing in the output
        try:
            np.testing.assert_array_equal(np.asarray(module(x)), np.asarray(y))
        finally:
            module.router_stats = True
    if name == "ep_2_nodes_all_to_all" and T == 37:   # the skew left whole devices idle
        assert (np.asarray(load.tokens_per_device)[1::2] == 0).all()


def test_every_device_holds_the_same_statistics():
    module = _module("sp_ep_tp8_gather")
    _, stats = nnx.capture(module, RouterStats)(_x(37))
    for field in expert_loads(stats)[()]:
        assert field.sharding.is_fully_replicated


def _all_reduces(module, stats: bool, T: int = 37) -> int:
    layout = module.layout.for_tokens(T)
    forward = moe_forward(layout, module.mesh, stats)
    hlo = jax.jit(forward).lower(_x(T), module.weights()).compile().as_text()
    return len(re.findall(r"= \S+ all-reduce(?:-start)?\(", hlo))


@pytest.mark.parametrize("name", ["sp_ep_tp8_gather", "ep_2_nodes_all_to_all"])
def test_off_the_program_holds_no_extra_collective(name):
    """These layouts' bodies all-reduce nothing (gathers, reduce-scatters,
    ragged exchanges); the statistics add exactly their two all-reduces."""
    module = _module(name)
    assert _all_reduces(module, stats=False) == 0
    assert _all_reduces(module, stats=True) == 2


def test_route_returns_the_scores_on_request_with_the_same_ids_and_weights():
    x = _x(11)
    router = jax.random.normal(jax.random.key(1), (CFG.hidden_size, CFG.num_experts)) * 0.1
    bias = jnp.zeros(CFG.num_experts)
    valid = jnp.arange(11) < 9
    ids, w = route(x, router, bias, CFG, valid)
    result = route(x, router, bias, CFG, valid, with_scores=True)
    assert isinstance(result, RoutingResult)
    np.testing.assert_array_equal(result.ids_TK, ids)
    np.testing.assert_array_equal(result.weights_TK, w)
    np.testing.assert_allclose(result.scores_TE, jax.nn.sigmoid(x @ router), rtol=1e-5)


def test_sow_outside_capture_and_the_json_form():
    module = _module("one_device")
    _skew(module, False)
    x = _x(9)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)   # Flax: sow outside nnx.capture
        module(x)
        module(x)
    popped = nnx.pop(module, RouterStats)
    assert len(popped["expert_load"].get_value()) == 2        # one entry per call
    load = expert_loads(popped)[()]
    assert isinstance(load, ExpertLoad)
    as_json = expert_load_json(load)
    assert set(as_json) == {"tokens_per_expert", "tokens_per_device", "tokens_per_node",
                            "mean_score_per_expert", "imbalance"}
    assert sum(as_json["tokens_per_expert"]) == 9 * CFG.num_experts_per_token
    assert as_json["tokens_per_device"] == as_json["tokens_per_node"] == [36]
    assert as_json["imbalance"] == {"device": 1.0, "node": 1.0}
    assert not hasattr(module, "expert_load")
    assert float(imbalance(jnp.zeros(4, jnp.int32))) == 1.0


def test_cli_writes_the_expert_load_json(tmp_path, capsys):
    out = tmp_path / "load.json"
    argv = ["run", "--devices", "8", "--tp", "8", "--sequence-parallel", "--expert-parallel",
            "--layers", "0:3", "--backend", "xla", "--expert-load", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    data = json.loads(out.read_text())
    assert sorted(data) == ["1", "2"]                  # the MoE layers of TINY's three
    for i, stats in data.items():
        assert len(stats["tokens_per_expert"]) == len(stats["mean_score_per_expert"]) == 16
        assert sum(stats["tokens_per_expert"]) == 7 * TINY.num_experts_per_token
        assert len(stats["tokens_per_device"]) == 8 and len(stats["tokens_per_node"]) == 1
        assert sum(stats["tokens_per_device"]) == sum(stats["tokens_per_expert"])  # EP
        per_device = np.array(stats["tokens_per_device"])
        assert stats["imbalance"]["device"] == pytest.approx(per_device.max() / per_device.mean())
        assert stats["imbalance"]["node"] == 1.0
        assert f"layer {i} device imbalance: {stats['imbalance']['device']:.2f}" in printed
    assert f"wrote {out}" in printed
    loads = read_expert_load(str(out), 16)                 # what k3jax balance --load reads
    assert {i: list(v) for i, v in loads.items()} == {
        int(i): stats["tokens_per_expert"] for i, stats in data.items()}


def test_cli_expert_load_needs_an_moe_layer(tmp_path, capsys):
    out = tmp_path / "load.json"
    assert main(["run", "--devices", "1", "--layer", "0", "--backend", "xla",
                 "--expert-load", str(out)]) == 2
    assert "--expert-load" in capsys.readouterr().err and not out.exists()
    assert main(["run", "--devices", "1", "--backend", "xla"]) == 0
    assert re.search(r"^device imbalance: 1\.00 ", capsys.readouterr().out, re.M)
