"""Collectives in the compiled HLO of every layout (SPEC 4), 8 simulated devices.

The forward is compiled with abstract weights (AbstractSource: nothing is
allocated) and x_TD [64, D] already placed as the layout places token rows, so
only the layer's own collectives appear.
"""

from __future__ import annotations

import functools
import re
from collections import Counter

import pytest

from k3jax import TINY, MlpMode, MoEMode, SharedOverlap, make_layout
from k3jax.layout import Dispatch
from layout_cases import (
    EXTRA_LAYOUTS,
    LAYOUTS,
    UNOVERLAPPED,
    compiled_hlo,
    count_collectives,
    permute_axes,
)

T = 64                      # divides every layout's row blocks
LAYERS = {"dense": 0, "moe": 1}
AG, RS, AR, CP = "all-gather", "reduce-scatter", "all-reduce", "collective-permute"
ALL = {**LAYOUTS, **EXTRA_LAYOUTS}


@functools.cache
def hlo(name: str, layer: str) -> str:
    return compiled_hlo(TINY, name, LAYERS[layer], T)


def counts(name: str, layer: str) -> Counter:
    return count_collectives(hlo(name, layer))


def replica_axes(hlo_text: str, name: str) -> list[tuple[str, str]]:
    """[(opcode, "{'tensor'}")...]: the mesh axes each collective runs over
    (a collective-permute's from its source_target_pairs: layout_cases.permute_axes).

    Fails unless every collective of the text was parsed (a collective printed
    with another replica_groups syntax would otherwise be silently dropped)."""
    found = re.findall(r"\s((?:all-gather|reduce-scatter|all-reduce|all-to-all)"
                       r"(?:-start)?)\(.*?replica_groups=mesh\[[^\]]*\]\s*(\{[^}]*\})", hlo_text)
    found += [(CP, permute_axes(line, ALL[name])) for line in hlo_text.splitlines()
              if re.search(r"\scollective-permute(?:-start)?\(", line)]
    total = sum(count_collectives(hlo_text).values())
    assert len(found) == total == opcode_occurrences(hlo_text), (found, total)
    return [(op.removesuffix("-start"), group) for op, group in found]


def opcode_occurrences(hlo_text: str) -> int:
    """Crude count of collective opcodes ("all-gather(" ...) in the text: an
    independent check on count_collectives's line parser."""
    return len(re.findall(r"\s(?:all-gather|reduce-scatter|all-reduce|all-to-all|"
                          r"collective-permute)(?:-start)?\(", hlo_text))


# -- the counter itself ---------------------------------------------------------------
def test_counter_reads_opcodes_and_counts_async_pairs_once():
    text = """
HloModule m
%fused_computation.all-reduce.1 (p: f32[8]) -> f32[8] {
  %p = f32[8]{0} parameter(0)
  ROOT %all-reduce.name = f32[8]{0} add(%p, %p)
}
ENTRY %main (x: f32[8]) -> f32[64] {
  %x = f32[8]{0} parameter(0)
  %all-gather-start.1 = (f32[8]{0}, f32[64]{0}) all-gather-start(%x), replica_groups={}
  %all-gather-done.1 = f32[64]{0} all-gather-done(%all-gather-start.1)
  %ar = f32[8]{0} all-reduce(%x), to_apply=%add
  %ars = f32[8]{0} all-reduce-start(%x), to_apply=%add
  %ard = f32[8]{0} all-reduce-done(%ars)
  %fusion.all-gather = f32[8]{0} fusion(%x), kind=kLoop, calls=%fused_computation.all-reduce.1
  %reduce_scatter.2 = f32[1]{0} reduce-scatter(%x), dimensions={0}, to_apply=%add
  %cp = f32[8]{0} collective-permute(%x), source_target_pairs={{0,1}}
  ROOT %a2a = f32[64]{0} all-to-all(%all-gather-done.1), dimensions={0}
}
"""
    assert count_collectives(text) == Counter({AG: 1, AR: 2, RS: 1, "collective-permute": 1,
                                               "all-to-all": 1})


# -- dense MLP: exactly the collectives its MlpLayout declares -----------------------
@pytest.mark.parametrize("name", list(LAYOUTS) + list(UNOVERLAPPED))
def test_dense_mlp_collectives_match_its_layout(eight_devices, name):
    mlp = make_layout(TINY, ALL[name]).dense_mlp
    got = counts(name, "dense")
    assert got == Counter(mlp.collectives), f"{name} ({mlp.mode.value}): {dict(got)}"
    assert sum(got.values()) == opcode_occurrences(hlo(name, "dense"))
    if mlp.mode is MlpMode.SP_SHARDED and mlp.overlap is SharedOverlap.RING:
        assert got == Counter({CP: 2 * (ALL[name].tp - 1)})
    elif mlp.mode is MlpMode.SP_SHARDED:
        assert got == Counter({AG: 1, RS: 1}) and got[AR] == 0
    elif mlp.mode is MlpMode.REPLICATED:
        assert sum(got.values()) == 0
    else:
        assert got == Counter({AR: 1})


@pytest.mark.parametrize("name, expected", [("sp_dp2_tp4_shard_none", Counter({AG: 1, RS: 1})),
                                            ("sp_dp2_tp4_shard", Counter({CP: 6}))])
def test_sp_sharded_mlp_collectives_run_over_the_tensor_axis_only(eight_devices, name, expected):
    """dp2 x tp4: the gather and scatter (or the ring's 2 x 3 permutes) stay
    inside each data group."""
    axes = replica_axes(hlo(name, "dense"), name)
    assert Counter(op for op, _ in axes) == expected
    assert all(group == "{'tensor'}" for _, group in axes), axes


# -- MoE: exactly the collectives the design issues -----------------------------------
# Rows dispatched over ``dispatch_axes`` (SP or EP): 3 all-gathers (latent rows,
# top-k ids, top-k weights) and 1 reduce-scatter (the routed latent's partial
# sums). An SP-sharded shared expert adds exactly 1 all-gather (its input rows)
# and 1 reduce-scatter (its partial sums) over TENSOR, or in its default ring
# form (SharedOverlap.RING) 2 (tp - 1) collective-permutes. Plain TP: the
# routed latent and the shared partial share ONE all-reduce. LOCAL: none.
DISPATCH = Counter({AG: 3, RS: 1})
SHARDED_SHARED = Counter({AG: 1, RS: 1})


def ring(tp: int) -> Counter:
    return Counter({CP: 2 * (tp - 1)})


MOE_EXPECTED = {
    "single": Counter(),
    "dp8": Counter(),
    "tp8": Counter({AR: 1}),
    "dp2_tp4": Counter({AR: 1}),
    "sp_tp8_repl": DISPATCH,
    "sp_tp8_shard": DISPATCH + ring(8),
    "sp_dp2_tp4_shard": DISPATCH + ring(4),
    "sp_ep_tp8_repl": DISPATCH,
    "sp_ep_tp8_shard": DISPATCH + ring(8),
    "sp_ep_dp2_tp4_shard": DISPATCH + ring(4),
    "ep_dp8": DISPATCH,
    "ep_tp8": Counter({AR: 1}),
    "ep_dp2_tp4": DISPATCH + Counter({AR: 1}),
    **{name: DISPATCH + SHARDED_SHARED for name in UNOVERLAPPED},
}


def test_moe_expectations_cover_every_layout():
    assert set(MOE_EXPECTED) == set(LAYOUTS) | set(UNOVERLAPPED)


@pytest.mark.parametrize("name", list(LAYOUTS) + list(UNOVERLAPPED))
def test_moe_collectives(eight_devices, name):
    layout = make_layout(TINY, ALL[name])
    got = counts(name, "moe")
    assert got == MOE_EXPECTED[name], f"{name}: {dict(got)}"
    assert sum(got.values()) == opcode_occurrences(hlo(name, "moe"))
    # the expectation follows from the layout's modes (not just from the name)
    if layout.moe_mode is MoEMode.LOCAL:
        assert not got
    elif layout.dispatch is Dispatch.ALL_REDUCE:
        # plain TP, or EP over plain TP: one all-reduce over TENSOR, plus the
        # row dispatch over DATA when EP has more than one data group
        assert got == (DISPATCH if layout.dispatch_axes else Counter()) + Counter({AR: 1})
        assert layout.shared_overlaps_routed is False
    elif layout.dispatch_axes:
        shared = Counter()
        if layout.shared_mlp.overlap is SharedOverlap.RING:
            shared = ring(layout.parallel.tp)
        elif layout.shared_mlp.mode is MlpMode.SP_SHARDED:
            shared = SHARDED_SHARED
        assert got == DISPATCH + shared
        assert layout.shared_mlp.mode in (MlpMode.SP_SHARDED, MlpMode.REPLICATED)
    else:
        raise AssertionError(f"{name}: a layout this test does not know")


@pytest.mark.parametrize("replicated, sharded, added_ops", [
    ("sp_tp8_repl", "sp_tp8_shard_none", Counter({AG: 1, RS: 1})),
    ("sp_ep_tp8_repl", "sp_ep_tp8_shard_none", Counter({AG: 1, RS: 1})),
    ("sp_tp8_repl", "sp_tp8_shard", Counter({CP: 14})),
    ("sp_ep_tp8_repl", "sp_ep_tp8_shard", Counter({CP: 14}))])
def test_sharding_the_shared_expert_adds_one_gather_and_one_scatter(eight_devices, replicated,
                                                                    sharded, added_ops):
    """Unoverlapped: one all-gather and one reduce-scatter; ring: 2 x 7 permutes."""
    assert counts(replicated, "moe") == DISPATCH, dict(counts(replicated, "moe"))
    assert counts(sharded, "moe") == DISPATCH + added_ops, dict(counts(sharded, "moe"))
    # ... and what is added runs over the tensor axis only
    added = (Counter(replica_axes(hlo(sharded, "moe"), sharded))
             - Counter(replica_axes(hlo(replicated, "moe"), replicated)))
    assert added == Counter({(op, "{'tensor'}"): n for op, n in added_ops.items()}), added


def test_ep_collectives_span_both_mesh_axes(eight_devices):
    """EP over dp2 x tp4: the dispatch gathers and the latent scatter cover
    every device; the sharded shared expert's stay on the tensor axis."""
    for name, shared in (("sp_ep_dp2_tp4_shard_none", [AG, RS]), ("sp_ep_dp2_tp4_shard", [CP] * 6)):
        axes = replica_axes(hlo(name, "moe"), name)
        both = [op for op, group in axes if group == "{'data','tensor'}"]
        tensor = [op for op, group in axes if group == "{'tensor'}"]
        assert len(both) + len(tensor) == len(axes), axes
        assert RS in both and AG in both
        assert sorted(tensor) == shared


def test_ep_over_plain_tp_dispatches_over_data_and_reduces_over_tensor(eight_devices):
    """EP over dp2 x tp4 without SP: rows of the other data group reach the
    experts here by all-gathers over DATA, their latent returns by a
    reduce-scatter over DATA, and the routed latent + shared partial share one
    all-reduce over TENSOR. With dp 1 (ep_tp8) only the all-reduce remains."""
    axes = Counter(replica_axes(hlo("ep_dp2_tp4", "moe"), "ep_dp2_tp4"))
    assert axes == Counter({(AG, "{'data'}"): 3, (RS, "{'data'}"): 1, (AR, "{'tensor'}"): 1}), axes
    assert Counter(replica_axes(hlo("ep_tp8", "moe"), "ep_tp8")) == Counter({(AR, "{'tensor'}"): 1})
