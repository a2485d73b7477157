"""Collectives in the compiled HLO of every layout (SPEC 4), 8 simulated devices.

The forward is compiled with abstract weights (AbstractSource: nothing is
allocated) and x_TD [64, D] already placed as the layout places token rows, so
only the layer's own collectives appear. ``pytest -s`` prints the table.
"""

from __future__ import annotations

import functools
import re
from collections import Counter

import pytest

from k3jax import TINY, MlpMode, MoEMode, make_layout
from layout_cases import COLLECTIVES, LAYOUTS, compiled_hlo, count_collectives

T = 64                      # divides every layout's row blocks
LAYERS = {"dense": 0, "moe": 1}
AG, RS, AR = "all-gather", "reduce-scatter", "all-reduce"


@functools.cache
def hlo(name: str, layer: str) -> str:
    return compiled_hlo(TINY, name, LAYERS[layer], T)


def counts(name: str, layer: str) -> Counter:
    return count_collectives(hlo(name, layer))


def replica_axes(hlo_text: str) -> list[tuple[str, str]]:
    """[(opcode, "{'tensor'}")...]: the mesh axes each collective runs over."""
    found = re.findall(r"\s((?:all-gather|reduce-scatter|all-reduce|all-to-all|collective-permute)"
                       r"(?:-start)?)\(.*?replica_groups=mesh\[[^\]]*\]\s*(\{[^}]*\})", hlo_text)
    return found


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
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_dense_mlp_collectives_match_its_layout(eight_devices, name):
    mlp = make_layout(TINY, LAYOUTS[name]).dense_mlp
    got = counts(name, "dense")
    assert got == Counter(mlp.collectives), f"{name} ({mlp.mode.value}): {dict(got)}"
    if mlp.mode is MlpMode.SP_SHARDED:
        assert got == Counter({AG: 1, RS: 1}) and got[AR] == 0
    elif mlp.mode is MlpMode.REPLICATED:
        assert sum(got.values()) == 0
    else:
        assert got == Counter({AR: 1})


def test_sp_sharded_mlp_collectives_run_over_the_tensor_axis_only(eight_devices):
    """dp2 x tp4: the gather and scatter stay inside each data group."""
    axes = replica_axes(hlo("sp_dp2_tp4_shard", "dense"))
    assert sorted(op for op, _ in axes) == [AG, RS]
    assert all(group == "{'tensor'}" for _, group in axes), axes


# -- MoE: the robust facts ---------------------------------------------------------------
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_moe_collectives(eight_devices, name):
    layout = make_layout(TINY, LAYOUTS[name])
    got = counts(name, "moe")
    if layout.moe_mode is MoEMode.LOCAL:
        assert sum(got.values()) == 0, dict(got)
    elif layout.moe_mode is MoEMode.EP or layout.parallel.sequence_parallel:
        # rows (and routing) gathered over dispatch_axes, routed latent reduce-scattered
        assert got[AG] >= 1 and got[RS] >= 1 and got[AR] == 0, dict(got)
    else:
        # plain TP: the routed latent and the shared partial share ONE all-reduce
        # (which is why Layout.shared_overlaps_routed is False there)
        assert got == Counter({AR: 1}), dict(got)
        assert layout.shared_overlaps_routed is False
    assert got["all-to-all"] == 0 and got["collective-permute"] == 0


@pytest.mark.parametrize("replicated, sharded", [("sp_tp8_repl", "sp_tp8_shard"),
                                                 ("sp_ep_tp8_repl", "sp_ep_tp8_shard")])
def test_sharding_the_shared_expert_adds_one_gather_and_one_scatter(eight_devices, replicated,
                                                                    sharded):
    assert counts(sharded, "moe") - counts(replicated, "moe") == Counter({AG: 1, RS: 1})
    assert counts(replicated, "moe") - counts(sharded, "moe") == Counter()


def test_ep_collectives_span_both_mesh_axes(eight_devices):
    """EP over dp2 x tp4: the dispatch gathers and the latent scatter cover
    every device; the sharded shared expert's stay on the tensor axis."""
    axes = replica_axes(hlo("sp_ep_dp2_tp4_shard", "moe"))
    both = [op for op, group in axes if group == "{'data','tensor'}"]
    tensor = [op for op, group in axes if group == "{'tensor'}"]
    assert len(both) + len(tensor) == len(axes), axes
    assert RS in both and AG in both
    assert sorted(tensor) == [AG, RS]


def test_print_collective_table(eight_devices):
    """The observed counts of every layout (pytest -s shows them)."""
    header = f"{'layout':<22}{'layer':<7}" + "".join(f"{c:>20}" for c in COLLECTIVES)
    lines = [f"\ncompiled HLO collectives, TINY, T={T}", header]
    for name in LAYOUTS:
        for layer in LAYERS:
            got = counts(name, layer)
            assert set(got) <= set(COLLECTIVES)
            lines.append(f"{name:<22}{layer:<7}" + "".join(f"{got[c]:>20}" for c in COLLECTIVES))
    print("\n".join(lines))
    assert len(lines) == 2 + 2 * len(LAYOUTS)
