"""k3jax.tools.kernel_ptxas: our grouped launches found in a traced program, and
tokamax.ragged_dot (the peer) compiled for their shapes for one H200 (sm_90a,
deviceless). About 40 s on the loaded 2-core machine (two tokamax compiles)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from k3jax.tools.kernel_ptxas import (
    TOKAMAX_PEER,
    GroupedLaunch,
    grouped_launches,
    tokamax_peer_reports,
)
from pallas_kernels.grouped_matmul import mosaic_sm90

pytestmark = pytest.mark.tiers(
    compile=["test_tokamax_peer_reports_registers_or_the_shape_it_rejects"])

S = jax.ShapeDtypeStruct


def _moe(x_MK, w_gate_GKN, w_up_GKN, w_down_GNK, sizes_G):
    h = mosaic_sm90.grouped_situ_glu(x_MK, w_gate_GKN, w_up_GKN, sizes_G, beta=4.0,
                                     linear_beta=25.0)
    return mosaic_sm90.grouped_matmul(h, w_down_GNK, sizes_G)


def test_grouped_launches_are_found_inside_shard_map_with_their_shapes():
    """Both launches of an expert MLP (fused gate/up, then down) under jit and
    shard_map (per-device shapes), bf16 and float32 (two bf16 planes)."""
    mesh = jax.make_mesh((2,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    P = jax.sharding.PartitionSpec
    fn = jax.shard_map(_moe, mesh=mesh, in_specs=(P("x"), P(), P(), P(), P()), out_specs=P("x"))
    for dtype, name in ((jnp.bfloat16, "bfloat16"), (jnp.float32, "float32")):
        jaxpr = jax.jit(fn).trace(S((512, 256), dtype), S((4, 256, 128), dtype),
                                  S((4, 256, 128), dtype), S((4, 128, 256), dtype),
                                  S((4,), jnp.int32)).jaxpr
        block_m = mosaic_sm90.default_config(256, 4, 2).block_m
        assert grouped_launches(jaxpr) == [
            GroupedLaunch(f"grouped_situ_glu_m{block_m}", 256, 256, 128, 4, 2, name),
            GroupedLaunch(f"grouped_matmul_m{mosaic_sm90.default_config(256, 4, 1).block_m}",
                          256, 128, 256, 4, 1, name)]


def test_tokamax_peer_reports_registers_or_the_shape_it_rejects():
    ok = GroupedLaunch("grouped_matmul_m64", 256, 128, 128, 2, 1, "bfloat16")
    odd_k = GroupedLaunch("grouped_matmul_m64", 64, 96, 64, 1, 1, "bfloat16")
    peers = tokamax_peer_reports([ok, odd_k])
    assert [p.launch for p in peers] == [ok, odd_k]
    assert all(p.peer == TOKAMAX_PEER for p in peers)
    assert peers[0].report is not None and peers[0].error is None
    assert 0 < peers[0].report.registers <= 255 and peers[0].report.spill_bytes == 0
    assert peers[0].report.grid and peers[0].report.smem_bytes > 0
    assert peers[1].report is None and "96" in peers[1].error
