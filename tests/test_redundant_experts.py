"""Redundant expert slots (ParallelConfig.redundant_experts, Layout.expert_placement)
on 16 simulated CPU devices over 2 nodes: the layer with R = 16 redundant
slots (5 a device) against the same layer without them, for every dispatch
form at an awkward T (37) and under skewed routing (most tokens to a few hot
experts, replicated by the balancer); R = 0 is today's layout and program;
random init, the loader (dense and MXFP4; each logical expert read once) and
rebalancing fill every slot with its logical expert's exact bytes; the
gradients under checkpoint names equal R = 0's; bad inputs name the culprit.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tiers
from k3jax import TINY, ParallelConfig, RandomSource, build_layer, make_layout, make_mesh
from k3jax.layout import EpDispatch, LayoutError
from k3jax.layout.expert_placement import (
    ExpertPlacement,
    PlacementError,
    place_experts,
    uniform_placement,
    write_placements,
)
from k3jax.layout.redundant import RedundantExpertsError
from numerics import rel_err

pytestmark = pytest.mark.tiers(slow=["test_rebalance_mxfp4_keeps_bytes_and_output"],
                               compile=["test_k3_on_2x8_h200_with_32_redundant_experts_fits"])

CFG = dataclasses.replace(TINY, num_experts=64)     # 4 experts a device on 16 devices
R, EP, NODES, T = 16, 16, 2, 37
GATHER, HIER, A2A = EpDispatch.GATHER, EpDispatch.HIERARCHICAL, EpDispatch.ALL_TO_ALL
HOT = (20, 21, 22, 23)                              # the skewed routing's experts (device 5's)


def parallel(form=A2A, redundant=R, sequence_parallel=True, tp=8) -> ParallelConfig:
    return ParallelConfig(dp=EP // tp, tp=tp, nodes=NODES, expert_parallel=True,
                          sequence_parallel=sequence_parallel, ep_dispatch=form,
                          redundant_experts=redundant)


def skewed_load() -> np.ndarray:
    """Tokens per expert under the skewed routing: the hot experts carry most."""
    load = np.ones(CFG.num_experts)
    load[list(HOT)] = 200.0
    return load


def skewed_placement() -> ExpertPlacement:
    """The balancer's placement for the skewed load: the hot experts replicated."""
    return place_experts(skewed_load(), R, NODES, EP)


def _bias(routing: str) -> np.ndarray:
    """Selection only: every token picks the hot experts (skewed) or as it likes."""
    bias = np.random.default_rng(7).normal(size=CFG.num_experts).astype(np.float32) * 0.1
    if routing == "skewed":
        bias[list(HOT)] += 100.0
    return bias


def _set_bias(module, bias: np.ndarray) -> None:
    old = module.router_bias_E[...]
    module.router_bias_E[...] = jax.device_put(jnp.asarray(bias), old.sharding)


@functools.cache
def _module(par: ParallelConfig, placement: ExpertPlacement | None = None, experts="dense"):
    mesh = make_mesh(par)
    layout = make_layout(CFG, par, mesh, experts=experts, expert_placement=placement)
    return build_layer(layout, 1, mesh, source=RandomSource(0))


def _x(T: int) -> jax.Array:
    return jax.random.normal(jax.random.key(T), (T, CFG.hidden_size), jnp.float32)


def _output(module, routing: str, T: int = T) -> np.ndarray:
    _set_bias(module, _bias(routing))
    return np.asarray(module(_x(T)))


def _expert_arrays(module) -> dict[str, np.ndarray]:
    return {n: np.asarray(getattr(module, n).get_value())
            for n in module.layout.experts.param_names()}


def _assert_slots_hold_their_experts(module, reference) -> None:
    """Every slot of ``module`` holds its logical expert's exact bytes, as the
    layer without redundant slots (``reference``) holds them."""
    slot_expert = module.layout.expert_placement.slot_expert
    want = _expert_arrays(reference)
    for name, got in _expert_arrays(module).items():
        assert got.shape[0] == CFG.num_experts + R
        for s, e in enumerate(slot_expert):
            assert got[s].tobytes() == want[name][e].tobytes(), (name, s, e)


# -- the layout ---------------------------------------------------------------------
def test_layout_holds_the_slots():
    lay = make_layout(CFG, parallel())
    p = lay.expert_placement
    assert (p.num_slots, lay.num_slots, lay.local_experts) == (80, 80, 5)
    assert p == uniform_placement(CFG.num_experts, R, EP, NODES)
    assert "5 per device (16 redundant slots)" in lay.describe()
    decls = {d.name: d for d in lay.experts.param_decls(lay.expert_layout)}
    assert decls["w1_ELF"].shape[0] == 80
    # E not divisible by ep: the balancer on a uniform load places the slots
    odd = make_layout(dataclasses.replace(CFG, num_experts=60), parallel(redundant=20))
    assert odd.expert_placement.num_slots == 80 and odd.local_experts == 5


def test_r0_is_todays_layout():
    today = make_layout(CFG, parallel(redundant=0))
    assert today.expert_placement is None and today.num_slots == CFG.num_experts
    identity = uniform_placement(CFG.num_experts, 0, EP, NODES)
    assert make_layout(CFG, parallel(redundant=0), expert_placement=identity) == today


def test_r0_program_is_todays(monkeypatch):
    """The slot mapping adds nothing to R = 0's program: its lowered text is
    the same with the mapping taken out; R > 0's is not."""
    from k3jax.modules import moe

    def text(module):
        moe.moe_forward.cache_clear()
        fwd = moe.moe_forward(module.layout.for_tokens(T), module.mesh)
        return jax.jit(fwd).lower(_x(T), module.weights()).as_text()

    for redundant in (0, R):
        module = _module(parallel(redundant=redundant))
        with_mapping = text(module)
        monkeypatch.setattr(moe, "slot_ids", lambda ids, layout: ids)
        without = text(module)
        monkeypatch.undo()
        assert (with_mapping == without) == (redundant == 0), redundant
    moe.moe_forward.cache_clear()


@pytest.mark.parametrize("make, match", [
    (lambda: ParallelConfig(dp=16, expert_parallel=True, redundant_experts=-1),
     r"--redundant-experts must be an integer >= 0, got -1"),
    (lambda: ParallelConfig(dp=16, redundant_experts=16), r"--redundant-experts 16 needs --expert-parallel"),
    (lambda: make_layout(CFG, parallel(redundant=3)),
     r"--redundant-experts 3: 64 experts \+ 3 = 67 slots do not divide over the EP size 16"),
    (lambda: make_layout(CFG, parallel(), expert_placement=uniform_placement(64, 16, 8, 2)),
     r"--expert-placement is for 8 EP devices, the layout has 16"),
    (lambda: make_layout(CFG, parallel(), expert_placement=uniform_placement(64, 16, 16, 1)),
     r"--expert-placement is for 1 nodes, the layout has 2"),
    (lambda: make_layout(CFG, parallel(), expert_placement=uniform_placement(64, 32, 16, 2)),
     r"for 32 redundant slots \(--redundant-experts\), the layout has 16"),
    (lambda: make_layout(CFG, ParallelConfig(dp=16), expert_placement=uniform_placement(64, 0, 16, 2)),
     r"--expert-placement needs --expert-parallel"),
    (lambda: ExpertPlacement(64, 16, 2, tuple(range(80))),
     r"slot 64 holds expert 64, not a logical expert in \[0, 64\)"),
    (lambda: ExpertPlacement(64, 16, 2, (0,) * 16 + tuple(range(16, 64)) + (1,) * 16),
     r"no slot holds logical expert\(s\) \[2, 3, 4"),
])
def test_bad_input_names_the_culprit(make, match):
    with pytest.raises((ValueError, PlacementError, LayoutError), match=match) as err:
        make()
    assert "\n" not in str(err.value)


# -- numerics: the same output as without redundant slots -------------------------------
NUMERIC_CASES = [(A2A, "skewed"), (HIER, "skewed"), (GATHER, "random"),
                 tiers.slow(A2A, "random"), tiers.slow(HIER, "random"), tiers.slow(GATHER, "skewed")]


@pytest.mark.parametrize("form, routing", NUMERIC_CASES)
def test_output_equals_the_layer_without_redundant_slots(form, routing):
    placement = skewed_placement() if routing == "skewed" else None
    want = _output(_module(parallel(form, redundant=0)), routing)
    got = _output(_module(parallel(form), placement), routing)
    assert rel_err(got, want) <= 1e-5, (form, routing, rel_err(got, want))


@pytest.mark.parametrize("form", [HIER, tiers.slow(GATHER)])
def test_ep_over_plain_tp_equals_the_layer_without_redundant_slots(form):
    """EP over plain TP (rows replicated over TENSOR, the all-reduce body):
    its rows' global index is over the data axes."""
    par = functools.partial(parallel, form, sequence_parallel=False)
    want = _output(_module(par(redundant=0)), "skewed")
    got = _output(_module(par(), skewed_placement()), "skewed")
    assert rel_err(got, want) <= 1e-5


def test_replicas_take_the_hot_experts_load():
    """Each replica of a hot expert computes some of its pairs: zeroing one
    replica's weights changes the output (and the router's ids are the same
    as without redundant slots, so nothing else could)."""
    placement = skewed_placement()
    hot_replicas = placement.replicas_of(HOT[0])
    assert len(hot_replicas) > 2
    module = _module(parallel(A2A), placement)
    base = _output(module, "skewed")
    for slot in hot_replicas:
        saved = {n: getattr(module, n).get_value() for n in module.layout.experts.param_names()}
        for n, v in saved.items():
            getattr(module, n).set_value(v.at[slot].set(0))
        changed = _output(module, "skewed")
        for n, v in saved.items():
            getattr(module, n).set_value(v)
        rows = np.flatnonzero(np.abs(changed - base).max(axis=1) > 1e-6)
        assert rows.size, slot
    assert np.array_equal(_output(module, "skewed"), base)


# -- weights in every slot -------------------------------------------------------------
def test_random_init_fills_each_slot_with_its_expert():
    _assert_slots_hold_their_experts(_module(parallel(A2A), skewed_placement()),
                                     _module(parallel(A2A, redundant=0)))


def _rebalance_case(experts: str):
    from k3jax.modules.rebalance import rebalance
    from k3jax.parallel.replicas import move_program

    par = parallel(A2A)
    mesh = make_mesh(par)
    module = build_layer(make_layout(CFG, par, mesh, experts=experts), 1, mesh,
                         source=RandomSource(0))
    reference = _module(parallel(A2A, redundant=0), None, experts)
    before = _output(module, "skewed")
    new = skewed_placement()
    names = module.layout.experts.param_names()
    program = move_program(module.layout, new, mesh, names)
    hlo = program.lower({n: getattr(module, n).get_value() for n in names}).compile().as_text()
    assert "collective-permute" in hlo and "all-gather" not in hlo and "all-to-all" not in hlo
    rebalance(module, new)
    assert module.layout.expert_placement == new
    _assert_slots_hold_their_experts(module, reference)
    assert rel_err(_output(module, "skewed"), before) <= 1e-5
    rebalance(module, uniform_placement(CFG.num_experts, R, EP, NODES))   # and back
    _assert_slots_hold_their_experts(module, reference)
    with pytest.raises(RedundantExpertsError, match="32 redundant slots"):
        rebalance(module, uniform_placement(CFG.num_experts, 32, EP, NODES))


def test_rebalance_moves_slots_in_place_and_keeps_the_output():
    _rebalance_case("dense")


def test_rebalance_mxfp4_keeps_bytes_and_output():
    _rebalance_case("mxfp4")


def test_gradients_under_checkpoint_names_equal_the_layer_without_redundant_slots():
    """A replica's weight gradient is summed into its logical expert; an
    expert no token chose has an exact zero gradient either way."""
    from k3jax.grads import checkpoint_tensors, layer_grads

    x = _x(T)
    dy = jax.random.normal(jax.random.key(99), x.shape, jnp.float32)
    plain, redundant = _module(parallel(A2A, redundant=0)), _module(parallel(A2A), skewed_placement())
    host = lambda g: {k: np.asarray(v) for k, v in g.weights.items()}   # noqa: E731
    for routing in ("skewed", "random"):
        for m in (plain, redundant):
            _set_bias(m, _bias(routing))
        want, got = layer_grads(plain, x, dy), layer_grads(redundant, x, dy)
        assert rel_err(got.dx_TD, want.dx_TD) <= 1e-5
        want_named = checkpoint_tensors(plain, 1, host(want))
        got_named = checkpoint_tensors(redundant, 1, host(got), replicas="sum")
        assert set(got_named) == set(want_named)
        for name, g in want_named.items():
            if not np.any(g):
                assert not np.any(got_named[name]), (routing, name)
            else:
                assert rel_err(got_named[name], g) <= 1e-5, (routing, name)
    with pytest.raises(ValueError, match="holds redundant expert slots: pass replicas="):
        checkpoint_tensors(redundant, 1, host(got))


# -- the loader -------------------------------------------------------------------------
@pytest.mark.parametrize("experts", ["dense", "mxfp4"])
def test_loader_fills_slots_reading_each_expert_once(experts, tmp_path):
    from k3jax.checkpoint import load_layer, make_synthetic_checkpoint
    from k3jax.checkpoint.reader import CheckpointReader

    make_synthetic_checkpoint(tmp_path / "ckpt", CFG, seed=0, dtype="float32", experts=experts)

    def load(par, placement=None):
        reader = CheckpointReader(tmp_path / "ckpt")
        reads = collections.Counter()
        read = reader.read

        def spy(name, *args, **kwargs):
            reads[name] += 1
            return read(name, *args, **kwargs)
        reader.read = spy
        return load_layer(reader, 1, par, expert_placement=placement), reads

    plain, plain_reads = load(parallel(A2A, redundant=0))
    module, reads = load(parallel(A2A), skewed_placement())
    assert reads == plain_reads            # no tensor read more often than without replicas
    assert any(".experts." in name for name in reads)
    _assert_slots_hold_their_experts(module, plain)
    assert rel_err(_output(module, "skewed"), _output(plain, "skewed")) <= 1e-5


# -- the planner and the CLI --------------------------------------------------------------
def test_planner_shows_the_replica_bytes():
    from k3jax.tools.plan import COMPONENTS, make_plan

    with_r = make_plan(CFG, parallel()).per_device_bytes
    without = make_plan(CFG, parallel(redundant=0)).per_device_bytes
    assert "redundant_experts" in COMPONENTS and without["redundant_experts"] == 0
    assert with_r["routed_experts"] == without["routed_experts"]           # 4 experts' worth
    assert with_r["redundant_experts"] * 4 == without["routed_experts"]     # + 1 slot a device
    assert with_r["total"] == without["total"] + with_r["redundant_experts"]


def _plan_args(*extra):
    return ["plan", "--preset", "tiny", "--dp", "8", "--nodes", "2", "--expert-parallel",
            "--json", *extra]


def test_cli_takes_the_flags_and_the_placement_file(tmp_path, capsys):
    from k3jax.cli import main

    assert main(_plan_args("--redundant-experts", "8")) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["parallel"]["redundant_experts"] == 8 and doc["layout"]["local_experts"] == 3
    path = tmp_path / "placement.json"
    write_placements(str(path), {1: place_experts(np.arange(1.0, 17.0), 8, 2, 8),
                                 2: uniform_placement(16, 8, 8, 2)})
    assert main(_plan_args("--expert-placement", str(path))) == 0    # R from the file
    assert json.loads(capsys.readouterr().out)["parallel"]["redundant_experts"] == 8


@pytest.mark.parametrize("extra, code, culprit", [
    (["--redundant-experts", "3"], 2, "--redundant-experts 3: 16 experts + 3 = 19 slots"),
    (["--redundant-experts", "-1"], 2, "--redundant-experts: expected an integer >= 0"),
    (["--expert-placement", "MISSING"], 1, "missing.json: cannot read"),
    (["--expert-placement", "WRONG_EP"], 1, "is placed for 4 EP devices, and the layout has 8"),
    (["--expert-placement", "BAD"], 1, "no slot holds logical expert"),
])
def test_cli_bad_input_is_one_line_naming_the_culprit(extra, code, culprit, tmp_path, capsys):
    from k3jax.cli import main

    wrong = tmp_path / "wrong_ep.json"
    write_placements(str(wrong), {1: uniform_placement(16, 8, 4, 2), 2: uniform_placement(16, 8, 4, 2)})
    bad = tmp_path / "bad.json"
    doc = json.loads(json.dumps({"format": "k3jax-expert-placements", "version": 1,
                                 "layers": {"1": uniform_placement(16, 8, 8, 2).to_json()}}))
    doc["layers"]["1"]["slot_expert"] = [0] * 24
    bad.write_text(json.dumps(doc))
    files = {"MISSING": str(tmp_path / "missing.json"), "WRONG_EP": str(wrong), "BAD": str(bad)}
    extra = [files.get(a, a) for a in extra]
    try:
        got = main(_plan_args(*extra))
    except SystemExit as e:     # argparse's usage errors
        got = e.code
    err = capsys.readouterr().err
    assert got == code and culprit in err, err
    assert len(err.strip().splitlines()) == 1 or code == 2 and "usage:" in err


def test_k3_on_2x8_h200_with_32_redundant_experts_fits(capsys):
    """K3 with MXFP4 experts and R = 32 on 2 x 8 H200s (deviceless compile):
    (896 + 32) / 16 = 58 slots a device, the compiled weights are the planner's, and every
    layer's weights plus this layer's working memory fit one H200."""
    from k3jax.cli import main

    assert main(["compile", "--preset", "k3", "--nodes", "2", "--dp", "2", "--tp", "8",
                 "--sequence-parallel", "--expert-parallel", "--redundant-experts", "32",
                 "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["layout"]["redundant_experts"] == 32
    assert doc["per_device_bytes"]["weights"] == doc["planner_weight_bytes"]
    assert doc["fits_h200"] and doc["fit"]["needed_bytes"] < doc["fit"]["device_memory_bytes"]


def test_router_statistics_count_the_pairs_each_device_computes():
    """With redundant slots the router's per-expert counts are the layer's
    without them; the per-device counts are of the slots the pairs go to:
    the balancer's placement spreads the hot experts' pairs."""
    from flax import nnx

    from k3jax.modules import RouterStats, expert_loads

    loads = {}
    for key, module in (("plain", _module(parallel(A2A, redundant=0))),
                        ("redundant", _module(parallel(A2A), skewed_placement()))):
        _set_bias(module, _bias("skewed"))
        before, module.router_stats = module.router_stats, True
        try:
            _, stats = nnx.capture(module, RouterStats)(_x(T))
        finally:
            module.router_stats = before
        loads[key] = expert_loads(stats)[()]
    plain, redundant = loads["plain"], loads["redundant"]
    assert np.array_equal(redundant.tokens_per_expert, plain.tokens_per_expert)
    assert int(np.sum(redundant.tokens_per_device)) == T * CFG.num_experts_per_token
    assert float(redundant.imbalance_device) < float(plain.imbalance_device) / 2
