"""k3jax.tools.layer_latency / layer_schedule (the whole-layer latency model),
its committed auto table (k3jax/data/shared_overlap_table.json), the pure lookup
k3jax.layout.shared_overlap_choice and ``k3jax latency``: the model's arithmetic
against hand counts, its consistency with vLLM's published points within
the error it states, and the table's currency. Model-consistency checks,
not timing thresholds: nothing here times anything."""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib

import pytest

from k3jax.cli import main
from k3jax.config import K3
from k3jax.layout import shared_overlap_choice
from k3jax.tools import kernel_cost
from k3jax.tools import layer_latency as ll
from k3jax.tools import layer_schedule as ls
from pallas_kernels.hardware import H200

pytestmark = pytest.mark.tiers(slow=["test_committed_table_is_the_models_and_meets_the_target"])

LINK = ls.NVLINK


def test_constants_come_from_the_one_hardware_description():
    assert LINK.bytes_per_s == H200.nvlink_bus_bytes_per_s == 365e9
    assert LINK.latency_s == H200.collective_latency_s
    assert LINK.sm_share == H200.collective_sms / H200.num_sms
    assert LINK.hbm_bytes_per_s == H200.hbm_copy_bytes_per_s == kernel_cost.COPY_BYTES_PER_S
    hw = ll.hardware()
    for key in ("dense_bf16_flops_per_s", "hbm_copy_bytes_per_s", "nvlink_bus_bytes_per_s",
                "collective_latency_s", "collective_sms", "gpus_per_node"):
        assert hw[key] == getattr(H200, key) and hw["sources"][key] == H200.sources[key]
    # a reduce-scatter reads two operands and writes one: 3 HBM bytes per wire byte
    assert hw["collective_slowdown"]["reduce_scatter"] == pytest.approx(3 * 365e9 / 4.3e12)


def test_schedule_shares_the_link_and_slows_compute_under_a_collective():
    link = ls.Link(bytes_per_s=1e9, latency_s=0.0, sm_share=0.25, hbm_bytes_per_s=1e12)
    # two collectives of 1 GB each at once: each gets half the link, both end at 2 s
    two = ls.simulate([ls.collective("a", 1e9), ls.collective("b", 1e9)], link)
    assert two.spans["a"] == pytest.approx((0.0, 2.0)) and two.end_s == pytest.approx(2.0)
    # 1 s of compute under a 0.5 s collective: 0.5 s at 3/4 speed (0.375 s of work), then 0.625 s alone
    under = ls.simulate([ls.compute("c", 1.0), ls.collective("x", 0.5e9)], link)
    assert under.end_s == pytest.approx(0.5 + (1.0 - 0.75 * 0.5))
    assert under.exposed_s == pytest.approx(0.125)
    # a dependent chain is serial, latency included
    lat = dataclasses.replace(link, latency_s=0.1)
    chain = ls.simulate([ls.collective("g", 1e9), ls.compute("c", 1.0, "g")], lat)
    assert chain.spans["c"] == pytest.approx((1.1, 2.1))
    with pytest.raises(ValueError, match="unknown"):
        ls.simulate([ls.compute("c", 1.0, "nope")], link)
    with pytest.raises(ValueError, match="cycle"):
        ls.simulate([ls.compute("a", 1.0, "b"), ls.compute("b", 1.0, "a")], link)


def test_module_model_matches_a_hand_count():
    """Shared expert alone, tp 4, 1000 tokens: R = 250 rows. Replicated: up
    [250, 7168] -> 2 x [.., 6144] (SiTU fused) and down, each its roofline.
    None: the same FLOPs on 1000 rows with the 1536-wide shard, plus the
    all-gather (bf16) and float32 reduce-scatter, each latency + bytes / link."""
    T, tp, D, F = 1000, 4, K3.hidden_size, K3.shared_intermediate_size
    R, Fs = math.ceil(T / tp), F // tp
    roof = kernel_cost.roofline_s
    rep = (roof(2.0 * R * D * 2 * F, 2 * (R * D + 2 * D * F + R * F))
           + roof(2.0 * R * F * D, 2 * (R * F + F * D) + 2 * R * D))
    assert ll.module_latency(K3, T, tp, ll.Form.REPLICATED) == pytest.approx(rep)
    compute = (roof(2.0 * tp * R * D * 2 * Fs, 2 * (tp * R * D + 2 * D * Fs + tp * R * Fs))
               + roof(2.0 * tp * R * Fs * D, 2 * (tp * R * Fs + Fs * D) + 4 * tp * R * D))
    wire = (tp - 1) * R * D * (2 + 4)
    none = ll.module_latency(K3, T, tp, ll.Form.NONE, "float32")
    assert none == pytest.approx(compute + 2 * LINK.latency_s + wire / LINK.bytes_per_s)
    assert ll.mlp_flops(R, D, F) == 6.0 * R * D * F


def test_weight_traffic_meets_token_traffic_where_the_issue_says():
    """Weights: (tp - 1) / tp x 264,241,152 B whatever T; token-side:
    (tp - 1) / tp x T x 7168 x (2 + s). Equal at 6144 tokens (float32 scatter)
    and 9216 (bf16), at every tp."""
    def wire(form, tokens, tp, scatter=None):
        ops = ll.mlp_ops(form, tokens // tp, tp, K3.hidden_size, K3.shared_intermediate_size,
                         scatter, "")
        return sum(op.wire_bytes for op in ops if op.is_collective)
    for tp in (2, 4, 8):
        weights = wire(ll.Form.WEIGHTS, 8 * tp, tp)
        assert weights == pytest.approx((tp - 1) / tp * 264_241_152)
        assert wire(ll.Form.WEIGHTS, 1024 * tp, tp) == weights
        assert wire(ll.Form.NONE, 6144, tp, "float32") == pytest.approx(weights)
        assert wire(ll.Form.RING, 6144, tp, "float32") == pytest.approx(weights)
        assert wire(ll.Form.NONE, 9216, tp, "bfloat16") == pytest.approx(weights)


def test_module_model_stays_within_its_stated_error_against_vllm():
    """The unoverlapped module (none, float32 scatter) against vLLM's tp 4
    points: within MODULE_ERROR_PP everywhere, and that bound is not padded
    (the worst point is within 5 pp of it)."""
    rows = ll.vllm_validation(K3)
    assert [r["tokens"] for r in rows] == [t for t, _, _ in ll.VLLM_POINTS]
    errors = [r["error_pp"] for r in rows]
    assert all(math.isfinite(e) for e in errors)
    assert max(errors) <= ll.MODULE_ERROR_PP
    assert max(errors) > ll.MODULE_ERROR_PP - 5
    # the shape vLLM measured: faster at small counts, slower from 512 on
    assert all(r["predicted_pct"] < 0 for r in rows if r["tokens"] <= 128)
    assert all(r["predicted_pct"] > 0 for r in rows if r["tokens"] >= 512)


def test_layout_errors_name_the_culprit():
    with pytest.raises(ValueError, match="token count"):
        ll.check_layout(K3, 4, 1, 0)
    with pytest.raises(ValueError, match="tp 5 does not divide the shared expert's MLP width 6144"):
        ll.check_layout(K3, 5, 1, 8)
    with pytest.raises(ValueError, match="one node"):
        ll.check_layout(K3, 8, 2, 8)


def test_auto_prefers_the_float32_scatter_within_the_tie_band():
    est = {choice: 1.0 for choice in ll.CHOICES}
    est[(ll.Form.NONE, "bfloat16")] = 1.0 / (1 + ll.TIE_REL / 2)
    assert ll.auto_choice(est) == (ll.Form.NONE, "float32")
    est[(ll.Form.NONE, "bfloat16")] = 1.0 / (1 + 2 * ll.TIE_REL)
    assert ll.auto_choice(est) == (ll.Form.NONE, "bfloat16")
    est[(ll.Form.WEIGHTS, None)] = 0.5
    assert ll.auto_choice(est) == (ll.Form.WEIGHTS, None)


def test_pick_reads_the_committed_table():
    table = shared_overlap_choice.table()
    for (layer, tp, dp), entries in table.items():
        firsts = [e[0] for e in entries]
        assert firsts[0] == 1 and firsts == sorted(set(firsts))
        for i, (first, form, scatter) in enumerate(entries):
            assert form in ("none", "ring", "weights") and scatter in ("float32", "bfloat16")
            last = entries[i + 1][0] - 1 if i + 1 < len(entries) else 10**6
            for tokens in {first, (first + last) // 2, last}:
                assert shared_overlap_choice.pick(tp, dp, tokens, layer=layer) == (form, scatter)
    assert set(shared_overlap_choice.tabulated()) == {(tp, dp) for _, tp, dp in table}
    assert shared_overlap_choice.pick(16, 1, 256) == shared_overlap_choice.FALLBACK
    assert shared_overlap_choice.pick(4, 4, 256) == shared_overlap_choice.FALLBACK
    for bad in ({"tokens": 0}, {"tp": 0}, {"dp": True}, {"tokens": 1.5}):
        args = {"tp": 4, "dp": 1, "tokens": 8, **bad}
        with pytest.raises(ValueError, match=next(iter(bad))):
            shared_overlap_choice.pick(**args)
    with pytest.raises(ValueError, match="layer"):
        shared_overlap_choice.pick(4, 1, 8, layer="attention")


def test_the_table_file_names_its_writer_and_the_models_inputs():
    """The reader reads the package's data file, the one the writer writes,
    which names its command, the model's inputs and the hardware figures."""
    from scripts import write_overlap_table as w

    assert pathlib.Path(str(shared_overlap_choice.table_file())) == pathlib.Path(w.TABLE_PATH)
    doc = json.loads(pathlib.Path(w.TABLE_PATH).read_text())
    assert doc["generated_by"] == w.COMMAND
    header = "\n".join(doc["description"])
    assert "Model: K3" in header and "Hardware (NVIDIA H200 SXM)" in header
    assert doc["token_grid"] == list(w.TOKEN_GRID)


def test_committed_table_is_the_models_and_meets_the_target():
    """Regenerating the table gives the committed file, and by the model
    auto / replicated <= 1.05 for the MoE layer at tp 4 and tp 8, dp 1,
    at every grid token count."""
    from scripts import write_overlap_table as w

    picks = w.picks()
    with open(w.TABLE_PATH) as f:
        assert w.render(picks) == f.read(), f"stale table: run {w.COMMAND}"
    for tp in (4, 8):
        ratios = [row.ratio for row in picks[("moe", tp, 1)]]
        assert max(ratios) <= 1.05, ratios


def test_cli_json_has_the_documented_shape(capsys):
    assert main(["latency", "--tp", "4", "--tokens", "8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert "not a measurement" in out["label"]
    assert out["hardware"]["nvlink_bus_bytes_per_s"] == 365e9 and out["hardware"]["sources"]
    forms = {(r["form"], r["scatter_dtype"]) for r in out["rows"] if r["layer"] == "moe"}
    assert forms == {("replicated", None), ("weights", None)} | {
        (f, s) for f in ("none", "ring") for s in ("float32", "bfloat16")}
    for r in out["rows"]:
        assert {"tp", "dp", "tokens", "form", "scatter_dtype", "layer_s"} <= set(r)
        assert r["layer_s"] > 0
    for a in out["auto"]:
        assert {"tp", "dp", "tokens", "pick", "layer_s", "replicated_s", "ratio"} <= set(a)
        assert a["ratio"] == pytest.approx(a["layer_s"] / a["replicated_s"])
        assert (a["pick"], a["scatter_dtype"] or "float32") == shared_overlap_choice.pick(
            a["tp"], a["dp"], a["tokens"], layer=a["layer"])
    assert [v["tokens"] for v in out["vllm_validation"]] == [t for t, _, _ in ll.VLLM_POINTS]


@pytest.mark.parametrize("argv, names", [
    (["--tokens", "8", "0"], "--tokens 0"),
    (["--tp", "5"], "tp 5 does not divide the shared expert's MLP width 6144"),
    (["--tp", "3"], "tp 3"),
    (["--tp", "8", "--dp", "2"], "one node"),
])
def test_cli_bad_input_exits_2_naming_it(argv, names, capsys):
    assert main(["latency", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and names in err, err
