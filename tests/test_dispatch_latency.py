"""k3jax.tools.ep_destinations / dispatch_latency (the dispatch latency model
of EP across nodes), its committed auto table (k3jax/data/ep_dispatch_table.json),
the pure lookup k3jax.layout.ep_dispatch_choice and ``k3jax latency --nodes``: the
destination formulas against brute force and Monte Carlo, each form's bytes
against hand counts, the latency rule against NCCL's tuning model, and the
table's currency. Model-consistency checks: nothing here times anything."""

from __future__ import annotations

import itertools
import json
import math
import pathlib

import numpy as np
import pytest

from k3jax.cli import main
from k3jax.config import K3
from k3jax.layout import ep_dispatch_choice
from k3jax.layout import expert_placement as xp
from k3jax.tools import dispatch_latency as dl
from k3jax.tools import ep_destinations as ed
from k3jax.tools import layer_latency as ll
from k3jax.tools import ragged_xla as rx
from k3jax.tools.layer_schedule import NVLINK
from pallas_kernels.hardware import H200

pytestmark = pytest.mark.tiers(slow=["test_committed_table_is_the_models"])

E, K, L = K3.num_experts, K3.num_experts_per_token, K3.routed_expert_hidden_size
ROW = 2 * L + 8 * K                 # bf16 latent + int32 ids + float32 weights
SUMS = 4 * L
MULTI_NODE = [(16, 2), (32, 4), (64, 8)]
LAYOUTS = [(8, 1), *MULTI_NODE]


# -- hardware figures ------------------------------------------------------------
def test_link_figures_come_from_the_one_hardware_description():
    assert dl.INFINIBAND.bytes_per_s == H200.ib_bus_bytes_per_s == 48e9
    assert H200.ib_peak_bytes_per_s == 50e9 and H200.nics_per_node == H200.gpus_per_node == 8
    assert dl.INFINIBAND.latency_s == H200.ib_step_latency_s
    hw = dl.hardware()
    for key in ("ib_bus_bytes_per_s", "ib_peak_bytes_per_s", "nics_per_node", "ring_base_latency_s",
                "nvlink_step_latency_s", "ib_step_latency_s", "ib_lone_step_latency_s",
                "net_step_floor_s"):
        assert hw[key] == getattr(H200, key)
        assert hw["sources"][key] == H200.sources[key]
        assert "NVIDIA/nccl" in H200.sources[key] or "DGX" in H200.sources[key], key


def test_latency_follows_nccls_ring_model():
    """NCCL's LL ring: base + intra-node steps x hop + inter-node steps x net
    hop; on a ring across nodes every intra step takes at least the net
    overhead; one rank a node pays the exposed (Tree) network latency."""
    base, nv, ib, lone, floor = (H200.ring_base_latency_s, H200.nvlink_step_latency_s,
                                 H200.ib_step_latency_s, H200.ib_lone_step_latency_s,
                                 H200.net_step_floor_s)
    assert dl.latency_s(dl.RING, 8, 1) == pytest.approx(base + 7 * nv) == pytest.approx(10.8e-6)
    assert dl.latency_s(dl.RING, 32, 4) == pytest.approx(base + 28 * max(nv, floor) + 3 * ib)
    assert dl.latency_s(dl.RING, 4, 4) == pytest.approx(base + 3 * lone)
    assert dl.latency_s(dl.DIRECT, 8, 1) == pytest.approx(base + nv)
    assert dl.latency_s(dl.DIRECT, 2, 2) == pytest.approx(base + lone)
    with pytest.raises(ValueError, match="evenly"):
        dl.latency_s(dl.RING, 6, 4)


# -- destinations ----------------------------------------------------------------
def test_hit_probability_matches_brute_force():
    pool, k = 9, 3
    for held in range(pool + 1):
        hits = sum(any(e < held for e in c) for c in itertools.combinations(range(pool), k))
        assert ed.hit_probability(held, pool, k) == pytest.approx(hits / math.comb(pool, k))


def test_uniform_destinations_match_the_closed_form():
    def miss(held):
        return math.comb(E - held, K) / math.comb(E, K)
    d16 = ed.expected(E, K, 16, 2)
    assert d16.remote_nodes == pytest.approx(1 - miss(448))
    assert d16.devices == pytest.approx(16 * (1 - miss(56)))
    assert d16.stage_b_rows == pytest.approx(d16.devices * 7 / 8)
    d32 = ed.expected(E, K, 32, 4)
    assert d32.nodes == pytest.approx(4 * (1 - miss(224)))
    assert d32.remote_nodes == pytest.approx(3 * (1 - miss(224)))
    # the figures docs/latency.md quotes
    assert (round(d16.devices, 2), round(d32.devices, 2), round(d32.remote_nodes, 2)) == \
        (10.35, 12.83, 2.97)


@pytest.mark.parametrize("ep, nodes", LAYOUTS)
@pytest.mark.parametrize("routing", [ed.UNIFORM, ed.SKEWED, ed.Routing(1.0)], ids=lambda r: r.name)
def test_destinations_match_monte_carlo(ep, nodes, routing):
    """Counted directly from sampled expert ids and owners: within 4 standard
    errors (plus 1e-3 where a figure barely varies)."""
    exact = ed.expected(E, K, ep, nodes, routing)
    mean, err = ed.monte_carlo(E, K, ep, nodes, routing, tokens=20_000, seed=ep + nodes)
    for name, value in exact.as_dict().items():
        assert abs(getattr(mean, name) - value) <= 4 * getattr(err, name) + 1e-3, (name, value,
                                                                                   mean, err)


def test_skew_concentrates_destinations():
    for ep, nodes in MULTI_NODE:
        uniform, skewed = ed.expected(E, K, ep, nodes), ed.expected(E, K, ep, nodes, ed.SKEWED)
        assert skewed.nodes < uniform.nodes and skewed.devices < uniform.devices
        one = ed.expected(E, K, ep, nodes, ed.Routing(1.0))
        assert one.nodes == 1 and one.remote_nodes == pytest.approx((nodes - 1) / nodes)
    with pytest.raises(ValueError, match="node_fraction"):
        ed.Routing(1.5)


# -- bytes of each form ------------------------------------------------------------
def _bytes(form, ep, nodes, rows, routing=ed.UNIFORM):
    dest = ed.expected(E, K, ep, nodes, routing)
    out, back = dl.transfers(K3, form, ep, nodes, rows, dest)
    moved = out + back
    return sum(t.ib_bytes for t in moved), sum(t.nvlink_bytes for t in moved), dest


@pytest.mark.parametrize("ep, nodes", MULTI_NODE)
def test_each_forms_bytes_match_a_hand_count(ep, nodes):
    R, G = 64, ep // nodes
    ib, nv, _ = _bytes("gather", ep, nodes, R)
    assert ib + nv == pytest.approx((ep - 1) * R * (ROW + SUMS))      # a ring's sends
    assert ib == pytest.approx((ep - 1) * R * (ROW + SUMS) / G)       # 1 / G through the NIC
    ib, nv, _ = _bytes("hierarchical", ep, nodes, R)
    assert ib == pytest.approx((nodes - 1) * R * (ROW + SUMS))        # each row once per node
    assert nv == pytest.approx((G - 1) * nodes * R * (ROW + SUMS))
    for routing in (ed.UNIFORM, ed.SKEWED):
        ib, nv, dest = _bytes("all-to-all", ep, nodes, R, routing)
        counts = (nodes - 1) * nodes * 4
        assert ib - counts == pytest.approx(R * dest.remote_nodes * (ROW + SUMS))
        assert nv - (G - 1) * G * 4 == pytest.approx(R * dest.stage_b_rows * (ROW + SUMS))


@pytest.mark.parametrize("ep, nodes", MULTI_NODE)
def test_hierarchical_moves_fewer_infiniband_bytes_than_gather(ep, nodes):
    for tokens in (64, 8192):
        gather = dl.estimate(K3, tokens, ep, nodes, "gather")
        hier = dl.estimate(K3, tokens, ep, nodes, "hierarchical")
        a2a = dl.estimate(K3, tokens, ep, nodes, "all-to-all")
        assert hier.ib_bytes < gather.ib_bytes
        # all-to-all: each row to the remote nodes holding its experts (~ every node at k 16)
        assert a2a.ib_bytes < gather.ib_bytes and a2a.nvlink_bytes < hier.nvlink_bytes


def test_one_node_moves_nothing_over_infiniband():
    for form in dl.forms_for(1):
        assert dl.estimate(K3, 1024, 8, 1, form).ib_bytes == 0
    with pytest.raises(ValueError, match="form must be one of"):
        dl.transfers(K3, "hierarchical", 8, 1, 16, ed.expected(E, K, 8, 1))


def test_transfer_on_the_schedule_takes_its_own_time():
    t = dl.Transfer("x", "all-gather", 3e6, 1e6, 16, 2)
    assert t.seconds == pytest.approx(dl.latency_s(dl.RING, 16, 2)
                                      + max(3e6 / NVLINK.bytes_per_s, 1e6 / 48e9))
    op = t.op()
    assert op.wire_bytes / dl.SCHEDULE_LINK.bytes_per_s == pytest.approx(t.seconds)
    assert dl.SCHEDULE_LINK.latency_s == 0


def test_layer_figures_are_consistent():
    for ep, nodes in LAYOUTS:
        for tokens in (8, 4096):
            for form in dl.forms_for(nodes):
                e = dl.estimate(K3, tokens, ep, nodes, form)
                assert e.rows == math.ceil(tokens / ep)
                assert e.layer_s >= e.common_s > 0 and e.exposed_s >= 0
                assert e.dispatch_s == pytest.approx(sum(t.seconds for t in e.transfers) + e.own_s)
                assert (e.own_s > 0) == (form == "all-to-all")
    # the same common compute in every form
    commons = {dl.estimate(K3, 512, 16, 2, f).common_s for f in dl.FORMS}
    assert len(commons) == 1


def test_auto_prefers_the_earlier_form_within_the_tie_band():
    assert dl.auto_form({"gather": 1.0, "hierarchical": 1 / (1 + dl.TIE_REL / 2)}) == "gather"
    assert dl.auto_form({"gather": 1.0, "all-to-all": 1 / (1 + 2 * dl.TIE_REL)}) == "all-to-all"
    assert dl.auto_form({"gather": 1.0, "hierarchical": 0.5, "all-to-all": 0.499}) == "hierarchical"


def test_layout_errors_name_the_culprit():
    with pytest.raises(ValueError, match="token count"):
        dl.check_layout(K3, 16, 2, 0)
    with pytest.raises(ValueError, match="ep 24 does not divide the 896 experts"):
        dl.check_layout(K3, 24, 3, 8)
    with pytest.raises(ValueError, match="nodes 3 does not divide ep 16"):
        dl.check_layout(K3, 16, 3, 8)
    with pytest.raises(ValueError, match="16 devices on a node"):
        dl.check_layout(K3, 16, 1, 8)


# -- XLA's ragged-all-to-all paths ----------------------------------------------------
def test_cross_node_stage_takes_the_nccl_path_and_pays_its_host_work():
    """Stage A (one device a node, peers on other nodes) runs XLA's per-peer
    NCCL path: the offsets' exchange, 2 host synchronisations and 4
    device-to-host copies first, then 12 us a peer; stage B (inside a node,
    <= 8 peers) the one-shot kernel, nothing extra."""
    for ep, nodes in MULTI_NODE:
        out, back = dl.transfers(K3, "all-to-all", ep, nodes, 64, ed.expected(E, K, ep, nodes))
        for t in out + back:
            if t.kind != "ragged-all-to-all":
                assert t.path is None and t.meta_s == 0
            elif t.name.startswith("a."):
                assert t.path == rx.NCCL_FALLBACK and (t.ranks, t.nodes) == (nodes, nodes)
                assert t.meta_s == pytest.approx(dl.latency_s(dl.DIRECT, nodes, nodes) + 6 * 6e-6)
                assert t.latency_s == pytest.approx(dl.latency_s(dl.DIRECT, nodes, nodes)
                                                    + nodes * 12e-6)
                assert t.seconds == pytest.approx(t.meta_s + t.latency_s + t.wire_s)
            else:
                assert t.path == rx.ONE_SHOT and t.meta_s == 0 and t.ranks == 8
    one_node, _ = dl.transfers(K3, "all-to-all", 8, 1, 64, ed.expected(E, K, 8, 1))
    assert {t.path for t in one_node if t.kind == "ragged-all-to-all"} == {rx.ONE_SHOT}
    assert rx.ragged_path(16, 1) == rx.NCCL_FALLBACK      # > 8 peers: no one-shot kernel


def test_host_work_blocks_what_the_program_issues_after_it():
    """Nothing after an NCCL path's host work in program order starts before
    it ends (the host issues nothing meanwhile); work issued before runs on."""
    ops = [dl_op("a"), dl_op("x.meta", "a", wire=True), dl_op("x", "x.meta", wire=True),
           dl_op("b"), dl_op("c", "a")]
    ordered = rx.host_ordered(ops)
    assert [o.deps for o in ordered] == [(), ("a",), ("x.meta",), ("x.meta",), ("a", "x.meta")]
    e = dl.estimate(K3, 512, 32, 4, "all-to-all")
    spans = e.schedule.spans
    assert spans["a.rows.meta"][1] <= spans["a.rows"][0] + 1e-12
    # the stage-A host work is in the dispatch time, and hidden nowhere in the layer
    assert e.dispatch_s > sum(t.meta_s for t in e.transfers) > 4 * 36e-6


def dl_op(name, *deps, wire=False):
    from k3jax.tools.layer_schedule import collective, compute
    return collective(name, 1e3, *deps) if wire else compute(name, 1e-6, *deps)


def test_the_cross_node_charge_moves_the_table_off_the_all_to_all():
    """With stage A's host work and per-peer cost the all-to-all is never the
    fastest form across nodes (it was below 4096 tokens at EP 32); one node
    keeps the one-shot kernel and its old figures."""
    for ep, nodes in MULTI_NODE:
        assert "all-to-all" not in {form for _, form in ep_dispatch_choice.table()[(ep, nodes)]}
    assert ep_dispatch_choice.pick(32, 4, 512) == "hierarchical"
    assert ep_dispatch_choice.pick(32, 4, 8192) == "gather"
    hw = dl.hardware()
    for key in ("host_round_trip_s", "fallback_per_peer_s", "one_shot_max_peers"):
        assert hw[key] == rx.figures()[key] and hw["sources"][key] == rx.SOURCES[key]
    assert "46982" in hw["sources"]["fallback_per_peer_s"]


# -- the busiest device sets the time ------------------------------------------------
def test_the_busiest_device_sets_the_layer_time():
    """The same mean load, twice the max on one device: every form slows; the
    gathers' bytes do not change (every row goes everywhere), the busiest
    device's GEMMs do; the all-to-all's receive bytes grow with the skew."""
    skew = ed.Balance(device=2.0, node=1.25)
    for form in dl.FORMS:
        flat = dl.estimate(K3, 4096, 32, 4, form)
        hot = dl.estimate(K3, 4096, 32, 4, form, ed.UNIFORM, skew)
        assert hot.layer_s > flat.layer_s and hot.common_s > flat.common_s
        if form != "all-to-all":
            assert hot.ib_bytes == flat.ib_bytes and hot.nvlink_bytes == flat.nvlink_bytes
        else:
            assert hot.ib_bytes > flat.ib_bytes and hot.nvlink_bytes > flat.nvlink_bytes
    assert dl.busiest_gemm_s(K3, 128, 32, ed.BALANCED) == ll.routed_gemm_s(K3, 128, 32)
    up1, down1 = dl.busiest_gemm_s(K3, 128, 32, ed.Balance(device=1.0, slots_per_device=28))
    up2, down2 = dl.busiest_gemm_s(K3, 128, 32, ed.Balance(device=2.0, slots_per_device=28))
    assert up2 > up1 and down2 > down1
    with pytest.raises(ValueError, match="max / mean"):
        ed.Balance(device=0.5)
    with pytest.raises(ValueError, match="cannot exceed"):
        dl.estimate(K3, 64, 16, 2, "gather", ed.UNIFORM, ed.Balance(device=17.0))


def test_balance_comes_from_statistics_or_a_placement_and_takes_the_max():
    """From a load file's per-device counts, or a placement and a load:
    the max over the mean, not the mean; balancing the placement lowers it
    and the predicted layer time with it."""
    counts = np.ones(E, int) * 10
    counts[:8] = 2000                                         # eight hot experts on device 0
    before = xp.uniform_placement(E, 0, 16, 2)
    b0 = ed.Balance.from_placement(before, counts)
    dev = xp.device_loads(before, counts)
    assert b0.device == pytest.approx(dev.max() / dev.mean()) and b0.device > 3
    assert ed.Balance.from_loads(dev, dev.reshape(2, -1).sum(1)) == \
        ed.Balance(b0.device, b0.node, None, "measured")
    after = xp.place_experts(counts, 32, 2, 16)
    b1 = ed.Balance.from_placement(after, counts)
    assert b1.device < 1.2 < b0.device and b1.slots_per_device == 58
    t0 = dl.estimate(K3, 2048, 16, 2, "gather", ed.UNIFORM, b0).layer_s
    t1 = dl.estimate(K3, 2048, 16, 2, "gather", ed.UNIFORM, b1).layer_s
    assert t1 < t0


# -- the committed table and the lookup ----------------------------------------------
def test_pick_reads_the_committed_table():
    table = ep_dispatch_choice.table()
    assert set(table) == set(ep_dispatch_choice.tabulated()) == set(LAYOUTS)
    for (ep, nodes), entries in table.items():
        firsts = [first for first, _ in entries]
        assert firsts[0] == 1 and firsts == sorted(set(firsts))
        assert tuple(firsts) == ep_dispatch_choice.first_tokens(ep, nodes)
        for i, (first, form) in enumerate(entries):
            assert form in dl.forms_for(nodes)
            last = entries[i + 1][0] - 1 if i + 1 < len(entries) else 10**6
            for tokens in {first, (first + last) // 2, last}:
                assert ep_dispatch_choice.pick(ep, nodes, tokens) == form
    assert ep_dispatch_choice.FORMS == dl.FORMS


def test_the_table_file_names_its_writer_and_the_models_inputs():
    """The reader reads the package's data file, the one the writer writes,
    which names its command, the model's inputs and the hardware figures."""
    from scripts import write_dispatch_table as w

    assert pathlib.Path(str(ep_dispatch_choice.table_file())) == pathlib.Path(w.TABLE_PATH)
    doc = json.loads(pathlib.Path(w.TABLE_PATH).read_text())
    assert doc["generated_by"] == w.COMMAND
    header = "\n".join(doc["description"])
    assert "Model: K3" in header and "Hardware (NVIDIA H200 SXM)" in header
    assert doc["token_grid"] == list(w.TOKEN_GRID)


def test_untabulated_layouts_fall_back():
    assert ep_dispatch_choice.pick(16, 4, 256) == "hierarchical" == ep_dispatch_choice.fallback(4)
    assert ep_dispatch_choice.pick(16, 1, 256) == "gather" == ep_dispatch_choice.fallback(1)
    assert ep_dispatch_choice.first_tokens(16, 4) == (1,)
    for bad, match in (({"tokens": 0}, "tokens"), ({"ep": True}, "ep"), ({"nodes": 1.5}, "nodes"),
                       ({"ep": 16, "nodes": 3}, "nodes 3 must divide ep 16")):
        args = {"ep": 16, "nodes": 2, "tokens": 8, **bad}
        with pytest.raises(ValueError, match=match):
            ep_dispatch_choice.pick(**args)


@pytest.mark.parametrize("ep, nodes", LAYOUTS)
def test_picks_agree_with_the_model_where_they_change(ep, nodes):
    for first in ep_dispatch_choice.first_tokens(ep, nodes):
        assert ep_dispatch_choice.pick(ep, nodes, first) == dl.sweep(K3, ep, nodes, first)[1]


def test_committed_table_is_the_models():
    """Regenerating the table gives the committed file."""
    from scripts import write_dispatch_table as w

    with open(w.TABLE_PATH) as f:
        assert w.render(w.picks()) == f.read(), f"stale table: run {w.COMMAND}"


# -- the CLI ------------------------------------------------------------------------
def test_cli_json_has_the_documented_shape(capsys):
    assert main(["latency", "--nodes", "2", "--tokens", "8", "4096", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert "model prediction" in out["label"] and "not a measurement" in out["label"]
    assert out["hardware"]["ib_bus_bytes_per_s"] == 48e9 and out["hardware"]["sources"]
    assert out["routing"] == {"name": "uniform", "node_fraction": 0.0}
    (lay,) = out["layouts"]
    assert (lay["ep"], lay["nodes"], lay["tp"], lay["dp"]) == (16, 2, 8, 2)
    assert lay["destinations"] == pytest.approx(ed.expected(E, K, 16, 2).as_dict())
    assert {r["form"] for r in out["rows"]} == set(dl.FORMS)
    for r in out["rows"]:
        assert {"tokens", "rows", "layer_s", "dispatch_s", "exposed_s", "ib_bytes",
                "nvlink_bytes", "transfers"} <= set(r)
        assert r["ib_bytes"] == pytest.approx(sum(t["ib_bytes"] for t in r["transfers"]))
    for a in out["auto"]:
        assert a["pick"] == ep_dispatch_choice.pick(16, 2, a["tokens"]) == a["fastest"]
        assert a["tabulated"]


def test_cli_tables_are_labelled_and_the_one_node_tables_stay(capsys):
    assert main(["latency", "--nodes", "4", "--tokens", "8", "--routing-skew", "0.5"]) == 0
    text = capsys.readouterr().out
    assert text.count("model prediction") >= 3 and "skewed (50% of tokens on one node)" in text
    assert "EP 32 (dp 4 x tp 8) over 4 node(s)" in text
    assert main(["latency", "--tp", "4", "--tokens", "8", "--layer", "moe", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["rows"][0]["tp"] == 4


@pytest.mark.parametrize("argv, names", [
    (["--nodes", "3"], "ep 24 does not divide the 896 experts"),
    (["--nodes", "2", "--dp", "3"], "--nodes 2 does not divide --dp 3"),
    (["--nodes", "1", "--dp", "2"], "16 devices on a node"),
    (["--routing-skew", "0.5"], "--routing-skew 0.5: needs --nodes"),
    (["--nodes", "2", "--layer", "dense"], "--layer dense"),
    (["--nodes", "2", "--tokens", "0"], "--tokens 0"),
])
def test_cli_bad_input_exits_2_naming_it(argv, names, capsys):
    assert main(["latency", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and names in err, err


@pytest.mark.parametrize("argv, names", [
    (["--nodes", "0"], "argument --nodes: expected a positive integer"),
    (["--nodes", "2", "--routing-skew", "1.5"], "argument --routing-skew: expected a fraction"),
])
def test_cli_bad_flag_values_exit_2_naming_the_flag(argv, names, capsys):
    with pytest.raises(SystemExit) as e:
        main(["latency", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and names in err, err
