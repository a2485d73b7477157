"""k3jax.tools.hlo_schedule on small programs compiled for 8 H200s without a GPU
(compile-only devices from k3jax.tools.aot; nothing runs), and on the replica-group
spellings XLA prints. About 10 s on 2 cores (measured)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from k3jax.layout import DATA, TENSOR, ParallelConfig
from k3jax.tools.aot import h200_mesh
from k3jax.tools.hlo_schedule import collective_schedule, collective_table, in_scope, shape_bytes

pytestmark = pytest.mark.tiers(
    compile=[
        "test_gather_matmul_scatter_kinds_bytes_groups",
        "test_compute_between_counts_ops_and_dot_flops",
        "test_all_reduce_permute_all_to_all",
    ])

T, D, F = 2048, 1024, 4096      # per-device rows T/8; big enough for XLA to overlap


def _compile(fn, mesh, *specs_shapes) -> str:
    args = [jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))
            for spec, shape, dtype in specs_shapes]
    return jax.jit(fn).lower(*args).compile().as_text()


@functools.cache
def gather_matmul_scatter() -> str:
    """all-gather x over TENSOR -> x @ w (the "work" scope) -> reduce-scatter;
    an independent a @ b (the "indep" scope) added at the end."""
    mesh = h200_mesh(ParallelConfig(tp=8))

    def body(x_TD, w_DF, a_TD, b_DF):
        with jax.named_scope("work"):
            y_TF = jnp.dot(jax.lax.all_gather(x_TD, TENSOR, axis=0, tiled=True), w_DF,
                           preferred_element_type=jnp.float32)
        with jax.named_scope("indep"):
            z_TF = jnp.dot(a_TD, b_DF, preferred_element_type=jnp.float32)
        return jax.lax.psum_scatter(y_TF, TENSOR, scatter_dimension=0, tiled=True) + z_TF

    rows = P(TENSOR, None)
    fn = jax.shard_map(body, mesh=mesh, in_specs=(rows, P(), rows, P()), out_specs=rows)
    bf16 = jnp.bfloat16
    return _compile(fn, mesh, (rows, (T, D), bf16), (P(), (D, F), bf16), (rows, (T, D), bf16),
                    (P(), (D, F), bf16))


def test_gather_matmul_scatter_kinds_bytes_groups():
    sched = collective_schedule(gather_matmul_scatter())
    assert [c.kind for c in sched] == ["all-gather", "reduce-scatter"]
    ag, rs = sched
    assert ag.bytes == T * D * 2            # the gathered bf16 buffer
    assert rs.bytes == T * F * 4            # the float32 buffer before scattering
    assert ag.group == rs.group == 8
    assert ag.parts == rs.parts == 1
    assert "all_gather" in ag.op_name and in_scope(ag.op_name, "work")
    assert "reduce_scatter" in rs.op_name


def test_compute_between_counts_ops_and_dot_flops():
    """Whatever XLA scheduled between start and done: the count is the listed
    ops, and the FLOPs are 2*M*N*K of the dots among them (work's dot needs the
    gather, so only the independent one can sit under the all-gather)."""
    sched = collective_schedule(gather_matmul_scatter())
    indep_flops = 2.0 * (T // 8) * F * D
    work_flops = 2.0 * T * F * D
    for c in sched:
        assert c.compute_between == len(c.compute_ops)
        assert c.flops_between == sum(op.flops for op in c.compute_ops)
        assert all(op.opcode not in ("parameter", "bitcast", "get-tuple-element")
                   for op in c.compute_ops)
        for op in c.compute_ops:
            if in_scope(op.op_name, "indep") and op.flops:
                assert op.flops == indep_flops
            if in_scope(op.op_name, "work") and op.flops:
                assert op.flops == work_flops
    ag = sched[0]
    assert ag.flops_between_in("work") == 0.0
    # Something must overlap: the independent GEMM runs under one of the two collectives.
    assert any(c.is_async and c.flops_between_in("indep") == indep_flops for c in sched)


@functools.cache
def other_collectives() -> str:
    """psum over TENSOR (all-reduce), ppermute (collective-permute), all_to_all,
    on a dp 2 x tp 4 mesh."""
    mesh = h200_mesh(ParallelConfig(dp=2, tp=4))

    def body(x_TD):
        s = jax.lax.psum(x_TD, TENSOR)
        r = jax.lax.ppermute(s, TENSOR, [(i, (i + 1) % 4) for i in range(4)])
        return jax.lax.all_to_all(r, DATA, 0, 0, tiled=True)

    spec = P((DATA, TENSOR), None)
    fn = jax.shard_map(body, mesh=mesh, in_specs=(spec,), out_specs=spec)
    return _compile(fn, mesh, (spec, (64, 256), jnp.float32))


def test_all_reduce_permute_all_to_all():
    sched = collective_schedule(other_collectives())
    by_kind = {c.kind: c for c in sched}
    assert set(by_kind) == {"all-reduce", "collective-permute", "all-to-all"}
    assert by_kind["all-reduce"].group == 4
    assert by_kind["collective-permute"].group == 4
    assert by_kind["all-to-all"].group == 2
    for c in sched:
        assert c.bytes == 8 * 256 * 4         # [64/8, 256] float32 per device
    rows = collective_table(sched)
    assert [r["kind"] for r in rows] == [c.kind for c in sched]
    assert set(rows[0]) >= {"kind", "bytes", "group", "async", "compute_between"}


# -- text level: the spellings a compile here may not produce -------------------
_SYNC_TEXT = """HloModule m, is_scheduled=true, num_partitions=8

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

ENTRY %main (p0: f32[64,32], p1: bf16[16,32]) -> f32[8,32] {
  %p0 = f32[64,32]{1,0} parameter(0)
  %p1 = bf16[16,32]{1,0} parameter(1)
  %ars = f32[64,32]{1,0} all-reduce-start(%p0), replica_groups=[2,4]<=[8], to_apply=%add, SYNC
  %f = f32[16,16]{1,0} fusion(%p1), kind=kLoop, calls=%add, metadata={op_name="jit(f)/shared_expert/mul"}
  %ard = f32[64,32]{1,0} all-reduce-done(%ars), SYNC
  %rs = f32[8,32]{1,0} reduce-scatter(%ard), replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0},
      to_apply=%add, metadata={op_name="jit(f)/shared_expert/reduce_scatter"}
  ROOT %ag = f32[64,32]{1,0} all-gather(%rs), channel_id=3, replica_groups={}, dimensions={0}
}
""".replace(",\n      to_apply", ", to_apply").replace(
    "SYNC", 'backend_config={"collective_backend_config":{"is_sync":true}}')


def test_sync_pairs_plain_ops_and_group_spellings():
    ars, rs, ag = collective_schedule(_SYNC_TEXT)
    assert (ars.kind, ars.is_async, ars.group, ars.compute_between) == ("all-reduce", False, 4, 1)
    assert (rs.kind, rs.is_async, rs.group, rs.bytes) == ("reduce-scatter", False, 8, 64 * 32 * 4)
    assert in_scope(rs.op_name, "shared_expert") and not in_scope(rs.op_name, "shared")
    combined = "jit(f)/shard_map/(routed_experts/all_gather:shared_expert/all_gather)"
    assert in_scope(combined, "shared_expert") and in_scope(combined, "routed_experts")
    assert not in_scope(combined, "all")
    assert (ag.kind, ag.group) == ("all-gather", 8)


def test_shape_bytes():
    assert shape_bytes("(bf16[4,8]{1,0}, f32[3]{0})") == 4 * 8 * 2 + 12
    assert shape_bytes("u8[112,1792,3072]{2,1,0}") == 112 * 1792 * 3072
    with pytest.raises(ValueError, match="unknown HLO element type"):
        shape_bytes("q7[2]")


def test_not_compiled_text_is_an_error():
    with pytest.raises(ValueError, match="no ENTRY computation"):
        collective_schedule("HloModule m\n")
