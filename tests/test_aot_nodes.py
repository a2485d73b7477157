"""K3's MoE layer compiled for 2 x 8 and 4 x 8 H200s without a GPU (the
compile-only topologies "1x2x8" and "1x4x8", one host a node): every EP
dispatch form compiles, its collectives run over the axes the Layout says
(hierarchical: the only gathers across nodes are over NODE alone; all-to-all:
real ragged-all-to-all collectives, between nodes over NODE and inside a node
over TENSOR), the compiler's weights are the planner's, and a sharded shared
expert's ring stays asynchronous under routed work across nodes too.
"""

from __future__ import annotations

import functools

import pytest

from k3jax.config import K3
from k3jax.layout import DATA, NODE, TENSOR, EpDispatch, ParallelConfig, SharedOverlap
from k3jax.modules.moe import ROUTED_SCOPE, SHARED_SCOPE
from k3jax.tools.compile import compile_layer
from k3jax.tools.hlo_schedule import in_scope

pytestmark = pytest.mark.compile

MOE, TOKENS = 1, 256
GATHER, HIER, A2A = EpDispatch.GATHER, EpDispatch.HIERARCHICAL, EpDispatch.ALL_TO_ALL


def parallel(nodes: int, form: EpDispatch, **kw) -> ParallelConfig:
    return ParallelConfig(dp=nodes, tp=8, nodes=nodes, sequence_parallel=True,
                          expert_parallel=True, ep_dispatch=form, **kw)


@functools.cache
def report(nodes: int, form: EpDispatch, ring: bool = False):
    kw = dict(shard_shared_expert=True, shared_overlap=SharedOverlap.RING) if ring else {}
    return compile_layer(K3, parallel(nodes, form, **kw), MOE, tokens=TOKENS, backend="xla",
                         dtype="bfloat16", expert_dtype="bfloat16")


def routed(r):
    """(kind, axes) of the collectives outside the shared expert's scope."""
    return [(c.kind, axes) for c, axes in zip(r.collectives, r.axes_of_collectives())
            if not in_scope(c.op_name, SHARED_SCOPE)]


@pytest.mark.parametrize("nodes", [2, 4])
def test_gather_and_hierarchical_cross_nodes_as_the_layout_says(nodes):
    flat = routed(report(nodes, GATHER))
    assert ("all-gather", (NODE, TENSOR)) in flat, flat      # DATA has size 1 here
    staged = routed(report(nodes, HIER))
    gathers = {axes for kind, axes in staged if kind == "all-gather"}
    scatters = {axes for kind, axes in staged if kind == "reduce-scatter"}
    assert (NODE,) in gathers and (TENSOR,) in gathers, staged
    assert (NODE,) in scatters and (TENSOR,) in scatters, staged
    # nothing of the routed rows spans node and tensor at once: each row crosses nodes once
    assert not any(NODE in axes and TENSOR in axes for _, axes in staged), staged


@pytest.mark.parametrize("nodes", [2, 4])
def test_all_to_all_holds_real_ragged_collectives(nodes):
    r = report(nodes, A2A)
    ragged = [axes for kind, axes in routed(r) if kind == "ragged-all-to-all"]
    # stage A out (rows, ids, weights) and back over NODE; stage B the same over TENSOR
    assert ragged.count((NODE,)) == 4 and ragged.count((TENSOR,)) == 4, routed(r)
    assert "ragged-all-to-all(" in r.hlo_text
    assert not any(kind == "reduce-scatter" for kind, _ in routed(r)), routed(r)


@pytest.mark.parametrize("nodes, form", [(2, GATHER), (2, HIER), (2, A2A), (4, A2A)])
def test_weights_are_the_planners_and_the_report_names_the_axes(nodes, form):
    r = report(nodes, form)
    assert r.per_device_bytes["weights"] == r.planner_weight_bytes
    d = r.to_dict()
    assert d["layout"]["mesh"] == {NODE: nodes, DATA: 1, TENSOR: 8}
    assert d["layout"]["ep_dispatch"] == form.value
    assert any(c["crosses_nodes"] for c in d["collectives"])
    assert all(c["crosses_nodes"] == (NODE in c["axes"]) for c in d["collectives"])


@pytest.mark.parametrize("form", [HIER, A2A])
def test_shared_expert_ring_overlap_is_what_the_layout_claims(form):
    """Under the hierarchical gather the ring's permutes all stay asynchronous
    with compute under them (Layout.shared_overlaps_routed is True); under
    the ragged all-to-all XLA runs the ring beside the exchange, some
    permutes synchronous with nothing under them, and the layout does not
    claim the overlap."""
    r = report(2, form, ring=True)
    shared = [c for c in r.collectives if in_scope(c.op_name, SHARED_SCOPE)]
    assert {c.kind for c in shared} == {"collective-permute"}, shared
    assert sum(c.parts for c in shared) == 2 * (8 - 1)
    kept = all(c.is_async and c.compute_between > 0 for c in shared)
    assert r.layout.shared_overlaps_routed == kept == (form is HIER), shared
    assert all(axes == (TENSOR,) for c, axes in zip(r.collectives, r.axes_of_collectives())
               if in_scope(c.op_name, SHARED_SCOPE))
    assert any(in_scope(c.op_name, ROUTED_SCOPE) for c in r.collectives)


def bytes_across_nodes(r) -> int:
    """Bytes of the routed collectives whose replica groups span NODE."""
    return sum(c.bytes for c, axes in zip(r.collectives, r.axes_of_collectives())
               if NODE in axes and not in_scope(c.op_name, SHARED_SCOPE))


@pytest.mark.parametrize("nodes", [2, 4])
def test_staged_forms_put_an_eighth_of_the_gathers_bytes_across_nodes(nodes):
    """benchmarks/results/compiled_nodes_h200.md: the flat gather sends every
    row to every device of the other nodes, the staged forms once per node:
    1/tp of the flat gather's bytes cross (the all-to-all's worst-case
    buffer, plus its counts, no more than the hierarchical gather's + 1%)."""
    flat, staged, a2a = (bytes_across_nodes(report(nodes, f)) for f in (GATHER, HIER, A2A))
    assert flat == 8 * staged, (flat, staged)
    assert staged <= a2a <= 1.01 * staged, (staged, a2a)


def test_k3_with_mxfp4_experts_fits_two_nodes():
    """The smallest K3 deployment (EP 16 over 2 x 8 H200s): the compiled
    layer's weights are the planner's, all 93 layers with their temporaries
    fit an H200, and the temporaries at 256 tokens stay near the measured
    0.123 GB (benchmarks/results/compiled_nodes_h200.md)."""
    r = compile_layer(K3, parallel(2, HIER), MOE, tokens=TOKENS, backend="xla",
                      dtype="bfloat16", expert_dtype="mxfp4")
    assert r.per_device_bytes["weights"] == r.planner_weight_bytes
    assert r.needed_bytes <= r.device_memory_bytes, (r.needed_bytes, r.device_memory_bytes)
    assert r.per_device_bytes["temporaries"] <= 0.15e9, r.per_device_bytes
