"""The overlapped SP-sharded MLP (SharedOverlap.RING).

- k3jax.parallel.ring on fresh random arrays against a float64 numpy
  reference (8 simulated devices);
- RING against the unoverlapped layout (SharedOverlap.NONE): float32 within
  1e-6 relative, bf16 within the layout tests' tolerance, T not divisible by tp;
- the compiled program for 8 H200s (k3jax.tools.aot, no GPU): the same bytes over
  the wire as the all-gather + reduce-scatter, and every ring transfer in
  flight (an async start/done pair) across a matmul, for the dense layer 0 and
  the shared expert of a MoE layer at K3's widths (k3jax.tools.hlo_schedule).

About 80 s on 2 cores (measured), half of it the four H200 compiles.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from k3jax import K3, TINY, AbstractSource, ParallelConfig, SharedOverlap, build_layer, make_layout
from k3jax.layout import DATA, TENSOR, make_mesh
from k3jax.parallel.ring import ring_all_gather_map, ring_reduce_scatter_map, ring_sp_mlp
from k3jax.tools.aot import h200_mesh
from k3jax.tools.hlo_schedule import collective_schedule
from k3jax.tools.plan import moe_collectives
from layout_cases import LAYOUTS, UNOVERLAPPED, output, rel_err

pytestmark = pytest.mark.tiers(
    compile=[
        "test_h200_every_ring_transfer_overlaps_a_matmul",
        "test_h200_ring_moves_the_bytes_of_the_all_gather_and_reduce_scatter",
        "test_h200_unoverlapped_dense_layer_runs_its_collectives_synchronously",
    ])

RING_VS_NONE_FP32_TOL = 1e-6
BF16_TOL = 1e-2                # test_layouts_numerics' bf16-vs-bf16 tolerance
LAYERS = {"dense": 0, "moe": 1}


# -- the ring functions on their own ---------------------------------------------------
def _shard_map(fn, parallel, in_specs, out_specs):
    return jax.jit(jax.shard_map(fn, mesh=make_mesh(parallel), in_specs=in_specs,
                                 out_specs=out_specs))


@pytest.mark.parametrize("dp, tp", [(1, 8), (2, 4)])
def test_ring_gather_visits_blocks_in_step_order(eight_devices, dp, tp):
    """Element s of ring_all_gather_map on device r is f(row block (r - s) mod tp),
    within r's data group."""
    parallel = ParallelConfig(dp=dp, tp=tp)
    rows, X = 3, 5
    x = np.random.default_rng(0).standard_normal((dp * tp * rows, X)).astype(np.float32)

    def body(x_TX):
        return jnp.stack(ring_all_gather_map(x_TX, lambda b: 2.0 * b, TENSOR))[None]

    got = _shard_map(body, parallel, P((DATA, TENSOR), None),
                     P((DATA, TENSOR), None, None, None))(x)       # [devices, tp, rows, X]
    blocks = x.reshape(dp, tp, rows, X)
    for d in range(dp):
        for r in range(tp):
            for s in range(tp):
                np.testing.assert_array_equal(got[d * tp + r, s], 2.0 * blocks[d, (r - s) % tp])


@pytest.mark.parametrize("dp, tp", [(1, 8), (2, 4)])
def test_ring_sp_mlp_matches_float64(eight_devices, dp, tp):
    """all-gather -> up -> down -> reduce-scatter, as rings, equals the float64
    product of the whole matrices (rows split over (DATA, TENSOR), F over TENSOR)."""
    parallel = ParallelConfig(dp=dp, tp=tp)
    rng = np.random.default_rng(1)
    T, D, F = dp * tp * 4, 24, 8 * tp
    x = rng.standard_normal((T, D)).astype(np.float32)
    w_up = (rng.standard_normal((D, F)) / np.sqrt(D)).astype(np.float32)
    w_down = (rng.standard_normal((F, D)) / np.sqrt(F)).astype(np.float32)
    hi = jax.lax.Precision.HIGHEST

    def body(x_TD, up_DF, down_FD):
        return ring_sp_mlp(x_TD, lambda b: jnp.tanh(jnp.dot(b, up_DF, precision=hi)),
                           lambda h: jnp.dot(h, down_FD, precision=hi), TENSOR)

    got = _shard_map(body, parallel, (P((DATA, TENSOR), None), P(None, TENSOR), P(TENSOR, None)),
                     P((DATA, TENSOR), None))(x, w_up, w_down)
    want = np.tanh(x.astype(np.float64) @ w_up) @ w_down
    assert got.dtype == jnp.float32 and np.all(np.isfinite(got))
    assert rel_err(np.asarray(got), want) < 1e-5


def test_ring_scatter_needs_one_block_per_device(eight_devices):
    def body(x_TD):
        return ring_reduce_scatter_map([x_TD] * 3, lambda h: h, TENSOR)
    with pytest.raises(ValueError, match="3 blocks for a ring of 8 devices over 'tensor'"):
        _shard_map(body, ParallelConfig(tp=8), P(TENSOR, None), P(TENSOR, None))(
            np.ones((8, 2), np.float32))


# -- RING vs NONE in the modules ---------------------------------------------------------
def _cases():
    out = [("sp_tp8_shard_none", "dense", 5), ("sp_tp8_shard_none", "dense", 13),
           ("sp_tp8_shard_none", "moe", 5), ("sp_dp2_tp4_shard_none", "dense", 5),
           ("sp_ep_dp2_tp4_shard_none", "moe", 5)]
    return [pytest.param(n, layer, T, id=f"{n}-{layer}-T{T}") for n, layer, T in out]


@pytest.mark.parametrize("unoverlapped, layer, T", _cases())
def test_ring_matches_unoverlapped_fp32(eight_devices, unoverlapped, layer, T):
    """T = 5 and 13 do not divide tp: padding rows travel the ring like the rest."""
    ring = unoverlapped.removesuffix("_none")
    assert make_layout(TINY, UNOVERLAPPED[unoverlapped]).shared_mlp.overlap is SharedOverlap.NONE
    assert make_layout(TINY, LAYOUTS[ring]).shared_mlp.overlap is SharedOverlap.RING
    got = output(TINY, ring, LAYERS[layer], T)
    want = output(TINY, unoverlapped, LAYERS[layer], T)
    assert np.all(np.isfinite(got))
    err = rel_err(got, want)
    assert err < RING_VS_NONE_FP32_TOL, f"{ring} {layer} T={T}: {err:.3g}"


def test_ring_matches_unoverlapped_bf16(eight_devices):
    got = output(TINY, "sp_tp8_shard", LAYERS["dense"], 5, jnp.bfloat16)
    want = output(TINY, "sp_tp8_shard_none", LAYERS["dense"], 5, jnp.bfloat16)
    assert np.all(np.isfinite(got))
    assert rel_err(got, want) < BF16_TOL


# -- the compiled 8 x H200 program (K3 widths) --------------------------------------------
def _sp_shard(overlap: SharedOverlap) -> ParallelConfig:
    return ParallelConfig(tp=8, sequence_parallel=True, expert_parallel=True,
                          shard_shared_expert=True, shared_overlap=overlap)


# The MoE layer compiles with K3's widths but 16 experts (2 per device): the
# shared expert is K3's, and the compile takes seconds rather than minutes.
K3_FEW_EXPERTS = K3.replace(num_experts=16)


@functools.cache
def h200_schedule(overlap: SharedOverlap, layer: int, T: int):
    """collective_schedule of layer ``layer``'s bf16 forward compiled for 8 H200s
    (abstract weights; x_TD [T, 7168] in the layout's row sharding)."""
    cfg = K3 if layer == 0 else K3_FEW_EXPERTS
    parallel = _sp_shard(overlap)
    mesh = h200_mesh(parallel)
    layout = make_layout(cfg, parallel, mesh, backend="xla", dtype=jnp.bfloat16)
    module = build_layer(layout, layer, mesh, source=AbstractSource())
    graph, state = nnx.split(module)
    x = jax.ShapeDtypeStruct((T, cfg.hidden_size), jnp.bfloat16,
                             sharding=NamedSharding(mesh, layout.x_TD))
    text = jax.jit(lambda s, x_TD: nnx.merge(graph, s)(x_TD)).lower(state, x).compile().as_text()
    return collective_schedule(text)


def _wire_bytes(c) -> int:
    """Bytes one device sends for a scheduled collective (ring algorithms)."""
    if c.kind == "collective-permute":
        return c.bytes
    assert c.kind in ("all-gather", "reduce-scatter"), c
    return (c.group - 1) * c.bytes // c.group


@pytest.mark.parametrize("layer, T", [(0, 256), (0, 8192), (1, 256)],
                         ids=["dense-T256", "dense-T8192", "moe-T256"])
def test_h200_every_ring_transfer_overlaps_a_matmul(layer, T):
    """Every collective-permute of the ring stays an async start/done pair
    with at least one matmul (dot FLOPs > 0) scheduled between; the 14 blocks
    (7 bf16 input blocks, 7 float32 running sums of [T/8, 7168]) all travel,
    however XLA's combiner groups them."""
    permutes = [c for c in h200_schedule(SharedOverlap.RING, layer, T)
                if c.kind == "collective-permute"]
    assert permutes
    for c in permutes:
        assert c.is_async, f"{c.name} runs synchronously"
        assert any(op.is_matmul for op in c.compute_ops), f"{c.name}: no matmul under the transfer"
        assert c.group == 8
    assert sum(c.parts for c in permutes) == 14
    block = T // 8 * 7168
    assert sum(c.bytes for c in permutes) == 7 * block * 2 + 7 * block * 4


def test_h200_ring_moves_the_bytes_of_the_all_gather_and_reduce_scatter():
    """Same bytes over the wire: the ring's permutes (dense layer 0, T 8192)
    vs the unoverlapped program's all-gather + reduce-scatter, each summed
    from the compiled HLO; and both equal the planner's figure."""
    ring = h200_schedule(SharedOverlap.RING, 0, 8192)
    none = h200_schedule(SharedOverlap.NONE, 0, 8192)
    assert sorted(c.kind for c in none) == ["all-gather", "reduce-scatter"]
    assert {c.kind for c in ring} == {"collective-permute"}
    ring_bytes = sum(_wire_bytes(c) for c in ring)
    assert ring_bytes == sum(_wire_bytes(c) for c in none) == 7 * 1024 * 7168 * (2 + 4)
    layout = make_layout(K3, _sp_shard(SharedOverlap.RING), dtype=jnp.bfloat16)
    planned = [c for c in moe_collectives(layout, 8192)
               if c.kind == "collective-permute"]
    assert sum(c.wire_bytes for c in planned) == ring_bytes


def test_h200_unoverlapped_dense_layer_runs_its_collectives_synchronously():
    """Why RING is the default: left to XLA, the dense layer's
    all-gather and reduce-scatter have nothing scheduled under them."""
    none = h200_schedule(SharedOverlap.NONE, 0, 256)
    assert sorted(c.kind for c in none) == ["all-gather", "reduce-scatter"]
    assert all(c.flops_between == 0 for c in none), none
