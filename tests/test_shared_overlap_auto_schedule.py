"""SharedOverlap.AUTO in the compiled 8 x H200 schedule: K3's MoE layer 1 at
full size (bf16, MXFP4 experts, XLA backend, GPU_COMPILER_OPTIONS), SP +
EP with the shared expert sharded, at one token count inside every range of
the committed table's picks for tp 4, tp 8 and dp 2 x tp 4 (each pick of
each layout compiled once).

Checked, for the form the table picks there:
- the compiled program runs that form (its collectives, and its scatter
  dtype's bytes for the token-side forms);
- every shared-expert collective is asynchronous, uncombined, outside the
  routed scope, with routed-expert dot FLOPs between its start and done
  (RING: with work under every block transfer and a GEMM under most, as
  tests/test_aot_layouts.py holds RING);
- the compile report's JSON records the pick.
"""

from __future__ import annotations

import functools

import pytest

from k3jax import K3, ParallelConfig, SharedOverlap
from k3jax.layout import shared_overlap_choice
from k3jax.modules.moe import ROUTED_SCOPE, SHARED_SCOPE
from k3jax.tools.compile import CompileReport, compile_layer
from k3jax.tools.hlo_schedule import in_scope

pytestmark = pytest.mark.compile

MOE = 1
D, F = K3.hidden_size, K3.shared_intermediate_size
MESHES = {"tp4": (1, 4), "tp8": (1, 8), "dp2_tp4": (2, 4)}
# one token count inside each pick's range of the committed table (at most 8192)
CASES = [(mesh, max(first, 256)) for mesh, (dp, tp) in MESHES.items()
         for first in shared_overlap_choice.first_tokens(tp, dp) if first <= 8192]


@functools.cache
def report(mesh: str, tokens: int) -> CompileReport:
    dp, tp = MESHES[mesh]
    parallel = ParallelConfig(dp=dp, tp=tp, sequence_parallel=True, expert_parallel=True,
                              shard_shared_expert=True, shared_overlap=SharedOverlap.AUTO)
    return compile_layer(K3, parallel, MOE, tokens=tokens, backend="xla")


def test_every_pick_range_is_covered():
    """CASES holds one token count per table entry, so a regenerated table
    with a new pick is compiled too."""
    for mesh, (dp, tp) in MESHES.items():
        picks = {shared_overlap_choice.pick(tp, dp, t) for m, t in CASES if m == mesh}
        firsts = [t for t in shared_overlap_choice.first_tokens(tp, dp) if t <= 8192]
        assert len(picks) == len({shared_overlap_choice.pick(tp, dp, t) for t in firsts}), mesh


@pytest.mark.parametrize("mesh, tokens", [
    pytest.param(m, t, id=f"{m}-T{t}", marks=pytest.mark.xdist_group(f"auto-{m}-{t}"))
    for m, t in CASES])
def test_the_pick_keeps_its_collectives_under_routed_work(mesh, tokens):
    dp, tp = MESHES[mesh]
    form, scatter = shared_overlap_choice.pick(tp, dp, tokens)
    r = report(mesh, tokens)
    assert r.layout.shared_mlp.overlap is SharedOverlap(form)
    assert r.layout.shared_mlp.scatter == scatter
    forms = r.to_dict()["layout"]["overlap_forms"]
    assert forms["shared_expert"] == form and forms["shared_expert_scatter_dtype"] == scatter
    assert r.to_dict()["layout"]["shared_overlap"] == "auto"
    assert r.layout.shared_overlaps_routed is True

    shared = [c for c in r.collectives if in_scope(c.op_name, SHARED_SCOPE)]
    for c in shared:
        print(f"{mesh} T={tokens} {form}/{scatter}: {c.kind} {c.bytes} B async={c.is_async} "
              f"parts={c.parts} ops under={c.compute_between} routed dot FLOPs under="
              f"{c.flops_between_in(ROUTED_SCOPE):.3g}")
        assert c.is_async and c.parts == 1 and not in_scope(c.op_name, ROUTED_SCOPE), c
        assert c.compute_between > 0, c
    rows = tokens // (dp * tp)
    if form == "weights":
        assert [(c.kind, c.bytes) for c in shared] == [("all-gather", 2 * D * F * 2),
                                                       ("all-gather", F * D * 2)]
        assert all(c.flops_between_in(ROUTED_SCOPE) > 0 for c in shared)
    elif form == "ring":
        assert {c.kind for c in shared} == {"collective-permute"}
        assert sum(c.parts for c in shared) == 2 * (tp - 1)
        assert sum(any(op.is_matmul for op in c.compute_ops) for c in shared) * 2 > len(shared)
    else:
        assert sorted(c.kind for c in shared) == ["all-gather", "reduce-scatter"]
        scatter_bytes = {"float32": 4, "bfloat16": 2}[scatter]
        (rs,) = [c for c in shared if c.kind == "reduce-scatter"]
        assert rs.bytes == tp * rows * D * scatter_bytes, rs
        assert all(c.flops_between_in(ROUTED_SCOPE) > 0 for c in shared)
