"""Module-level contracts: a module refuses a mesh that is not its layout's,
the SP-sharded MLP sums its partials in float32 (bf16 output equal to the
replicated layout's up to the final bf16 rounding), the routed experts'
storage is passed explicitly, and EP on one device issues no collectives."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AbstractMesh, NamedSharding
from jax.sharding import PartitionSpec as P

from k3jax import TINY, KimiMLP, KimiMoE, MlpMode, ParallelConfig, SiTU, make_layout, make_mesh
from k3jax.formats import ExpertStorage, Mxfp4Format, get_format
from k3jax.layout import abstract_mesh
from k3jax.modules import AbstractSource, RandomSource, build_layer
from k3jax.tools.plan import make_plan
from numerics import rel_err
from pallas_kernels.mxfp4 import Mxfp4Dequant, Mxfp4Weights
from reference_np import np_mlp

ACT = SiTU.from_config(TINY)
SP8 = {shard: ParallelConfig(tp=8, sequence_parallel=True, shard_shared_expert=shard)
       for shard in (False, True)}


# -- the mesh must be the layout's ----------------------------------------------
@pytest.mark.parametrize("layout_par, mesh", [
    (ParallelConfig(tp=8), abstract_mesh(ParallelConfig(dp=8))),       # TP rows, mesh dp8
    (ParallelConfig(tp=8), abstract_mesh(ParallelConfig(dp=2, tp=4))),
    (SP8[True], abstract_mesh(ParallelConfig(dp=8))),
    (ParallelConfig(dp=8), AbstractMesh((8, 1), ("rows", "cols"))),    # wrong axis names
], ids=["tp8-on-dp8", "tp8-on-dp2tp4", "sp-shard-on-dp8", "axis-names"])
def test_modules_reject_a_mesh_that_is_not_their_layouts(layout_par, mesh):
    """The token axes and the mesh both come from the layout's ParallelConfig,
    so a TP MLP can no longer be given rows split over the tensor axis."""
    layout = make_layout(TINY, layout_par)
    with pytest.raises(ValueError, match=r"KimiMLP: mesh \{.*\} does not match the layout "
                                         rf"\({re.escape(layout_par.describe())}\)"):
        KimiMLP(layout, layout.shared_mlp, mesh, source=AbstractSource())
    with pytest.raises(ValueError, match=r"KimiMoE: mesh .* does not match the layout"):
        KimiMoE(layout, mesh, source=AbstractSource())


def test_mlp_rows_follow_the_layout(eight_devices):
    """With T a multiple of the row blocks the output stays split over the
    layout's token axes: (data, tensor) under SP, (data,) in plain TP (rows
    replicated over the tensor axis)."""
    x = jnp.asarray(np.random.default_rng(2).standard_normal((16, TINY.hidden_size)), jnp.float32)
    for par in (SP8[True], ParallelConfig(tp=8)):
        mesh = make_mesh(par, eight_devices)
        layout = make_layout(TINY, par, mesh, backend="xla")
        mlp = KimiMLP(layout, layout.shared_mlp, mesh, source=RandomSource(1))
        assert mlp.act == ACT
        assert mlp(x).sharding.is_equivalent_to(NamedSharding(mesh, layout.x_TD), 2)


# -- SP-sharded vs replicated in bf16 -----------------------------------------------
def bf16_ulp(v: np.ndarray) -> np.ndarray:
    """One bfloat16 ulp at |v| (8 significant bits)."""
    return np.exp2(np.floor(np.log2(np.maximum(np.abs(v), 1e-30))) - 7)


@pytest.mark.parametrize("hidden, width", [(96, 128), (512, 1024)])
def test_sp_sharded_bf16_equals_replicated_up_to_the_final_rounding(eight_devices, hidden, width):
    """The partial sums are reduce-scattered in float32, so the bf16 outputs of
    the two layouts differ only where the float32 sums round to neighbouring
    bf16 values. Measured (T = 61, tp = 8): D 96 / F 128 bit-identical; D 512 /
    F 1024 3 of 31232 entries differ, max diff 1.5e-3 * max|y|. With the old
    bf16 reduce-scatter: 41% / 42% of entries differ, 3.3e-3 / 3.0e-3 * max|y|,
    up to 530 ulps of an entry."""
    cfg = TINY.replace(hidden_size=hidden, moe_intermediate_size=width // 2)
    x = np.random.default_rng(0).standard_normal((61, hidden)).astype(np.float32)
    outs = {}
    for shard, par in SP8.items():
        mesh = make_mesh(par, eight_devices)
        layout = make_layout(cfg, par, mesh, backend="xla", dtype=jnp.bfloat16)
        assert layout.shared_mlp.mode is (MlpMode.SP_SHARDED if shard else MlpMode.REPLICATED)
        mlp = KimiMLP(layout, layout.shared_mlp, mesh, source=RandomSource(1))
        y = mlp(jnp.asarray(x))
        assert y.dtype == jnp.bfloat16
        outs[shard] = np.asarray(y.astype(jnp.float32), np.float64)
    sharded, replicated = outs[True], outs[False]
    diff = np.abs(sharded - replicated)
    scale = np.abs(replicated).max()
    assert np.count_nonzero(diff) <= 1e-3 * diff.size, np.count_nonzero(diff)
    assert np.all(diff <= bf16_ulp(replicated) + 1e-5 * scale), (diff / scale).max()
    # Both against float64 on the same bf16 inputs and weights (measured 4.0e-3).
    w = {k: np.asarray(v.astype(jnp.float32), np.float64) for k, v in mlp.weights().items()}
    x16 = np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32), np.float64)
    want = np_mlp(x16, w["gate_DF"].T, w["up_DF"].T, w["down_FD"].T, cfg)
    assert rel_err(sharded, want) < 1e-2 and rel_err(replicated, want) < 1e-2


# -- expert storage is explicit ------------------------------------------------------
def test_expert_weights_follow_the_declared_storage():
    """Each format hands the grouped matmuls its own weight objects
    (WeightFormat.kernel_weights): dense the arrays themselves, MXFP4
    Mxfp4Weights of the codes and scales with its dequant and K order."""
    E, L, F = 2, 64, 32
    rng = np.random.default_rng(4)
    dense = {"w1_ELF": jnp.ones((E, L, F)), "w3_ELF": jnp.ones((E, L, F)),
             "w2_EFL": jnp.ones((E, F, L))}
    kernel_weights = {s: s.format.kernel_weights for s in ExpertStorage}
    assert all(a is b for a, b in zip(kernel_weights[ExpertStorage.DENSE](dense, jnp.float32),
                                      dense.values()))
    u8 = lambda shape: jnp.asarray(rng.integers(100, 130, shape), jnp.uint8)  # noqa: E731
    packed = {}   # codes [E, out, in/2] as stored, scales [E, in/32, out]
    for w, codes, scales, n_in, n_out in (("w1", "EFL", "ELF", L, F), ("w3", "EFL", "ELF", L, F),
                                          ("w2", "ELF", "EFL", F, L)):
        packed[f"{w}_packed_{codes}"] = u8((E, n_out, n_in // 2))
        packed[f"{w}_scale_{scales}"] = u8((E, n_in // 32, n_out))
    w1, w3, w2 = Mxfp4Format(Mxfp4Dequant.FAST).kernel_weights(packed, jnp.float32)   # not dequantized
    assert all(isinstance(w, Mxfp4Weights) and w.dequant is Mxfp4Dequant.FAST for w in (w1, w3, w2))
    assert (w1.shape, w3.shape, w2.shape) == ((E, L, F), (E, L, F), (E, F, L))
    assert w1.packed_GNK is packed["w1_packed_EFL"] and w1.scale_GKN is packed["w1_scale_ELF"]
    assert w3.packed_GNK is packed["w3_packed_EFL"] and w3.scale_GKN is packed["w3_scale_ELF"]
    assert w2.packed_GNK is packed["w2_packed_ELF"] and w2.scale_GKN is packed["w2_scale_EFL"]
    with pytest.raises(KeyError):            # a packed dict is never mistaken for dense
        kernel_weights[ExpertStorage.DENSE](packed, jnp.float32)
    with pytest.raises(KeyError):            # nor a dense one for packed
        kernel_weights[ExpertStorage.MXFP4](dense, jnp.float32)
    with pytest.raises(ValueError, match="Mxfp4Format: dequant must be an Mxfp4Dequant, got None"):
        Mxfp4Format(None)
    assert {w.k_order_axis for w in (w1, w3, w2)} == {None}
    w1, w3, w2 = Mxfp4Format(Mxfp4Dequant.FAST, k_order=True).kernel_weights(packed, jnp.float32)
    assert (w1.k_order_axis, w3.k_order_axis, w2.k_order_axis) == (2, 2, 1)
    assert w1.packed_GNK is packed["w1_packed_EFL"] and w2.scale_GKN is packed["w2_scale_EFL"]


def test_packed_experts_run_in_k_order_on_the_mosaic_backends_only():
    """The bound Mxfp4Format's k_order: packed experts on pallas / interpret whose
    per-shard F is whole 128-chunks (K3 under EP and TP 8), never on xla /
    triton, dense experts, or TINY's F of 64."""
    from k3jax import K3
    par = ParallelConfig(tp=8, sequence_parallel=True, expert_parallel=True)
    mesh = abstract_mesh(par)
    for backend, want in (("pallas", True), ("interpret", True), ("xla", False),
                          ("triton", False)):
        lay = make_layout(K3, par, mesh, backend=backend, experts=ExpertStorage.MXFP4)
        assert lay.experts.k_order is want, backend
    tp = ParallelConfig(tp=8)
    assert make_layout(K3, tp, abstract_mesh(tp), backend="pallas",
                       experts=ExpertStorage.MXFP4).experts.k_order
    assert not hasattr(make_layout(K3, par, mesh, backend="pallas").experts, "k_order")
    assert not make_layout(TINY, ParallelConfig(), backend="interpret",
                           experts=ExpertStorage.MXFP4).experts.k_order


def test_packed_experts_dequant_is_the_layouts_and_random_scales_allow_fast():
    """The MXFP4 format's dequant: FAST unless stated (what abstract and
    random weights take), absent from formats that are not packed, named
    when not an Mxfp4Dequant, and in describe(). RandomSource's scale bytes
    lie in FAST_SCALES for every fan-in of TINY's and K3's experts (its
    centre 127 - 2 - round(log2(fan_in) / 2), +-1), so FAST is true of them."""
    from k3jax import K3
    from k3jax.formats.mxfp4 import random_scales
    from k3jax.modules.params import ParamDecl, _random_unpadded
    from pallas_kernels.mxfp4_fast import FAST_SCALES
    packed = make_layout(TINY, ParallelConfig(), experts=ExpertStorage.MXFP4)
    assert packed.experts.dequant is Mxfp4Dequant.FAST
    exact = make_layout(TINY, ParallelConfig(), experts=Mxfp4Format(Mxfp4Dequant.EXACT))
    assert exact.experts.dequant is Mxfp4Dequant.EXACT and exact != packed
    assert "MXFP4 experts' dequant: exact" in exact.describe()
    for storage in (ExpertStorage.DENSE, ExpertStorage.MXFP4_DEQUANT):
        lay = make_layout(TINY, ParallelConfig(), experts=storage)
        assert not hasattr(lay.experts, "dequant") and "dequant" not in lay.describe()
        assert lay.experts is get_format(storage)
    with pytest.raises(ValueError, match="dequant must be an Mxfp4Dequant, got 'fast'"):
        make_layout(TINY, ParallelConfig(), experts=Mxfp4Format("fast"))
    moe = KimiMoE(packed, make_mesh(ParallelConfig(), jax.devices()[:1]), source=RandomSource(3))
    for name in ("w1_scale_ELF", "w3_scale_ELF", "w2_scale_EFL"):
        assert Mxfp4Dequant.of_scales(getattr(moe, name)[...]) is Mxfp4Dequant.FAST, name
    for cfg in (TINY, K3):
        for fan_in in (cfg.routed_expert_hidden_size, cfg.moe_intermediate_size):
            decl = ParamDecl("s", (4096,), jnp.dtype(jnp.uint8), P(), random_scales, fan_in)
            got = np.asarray(_random_unpadded(jax.random.key(fan_in), decl, (4096,)))
            assert FAST_SCALES.start <= got.min() and got.max() < FAST_SCALES.stop, (fan_in, got)


# -- one device under EP: nothing to exchange -----------------------------------------
def test_ep_on_one_device_issues_and_plans_no_collectives(eight_devices):
    par = ParallelConfig(expert_parallel=True)
    mesh = make_mesh(par, eight_devices[:1])
    layout = make_layout(TINY, par, mesh, backend="xla")
    assert layout.dispatch_axes == ()
    assert make_plan(TINY, par).collectives == ()
    module = build_layer(layout, 1, mesh, source=RandomSource(0))
    graphdef, state = nnx.split(module)
    forward = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))
    text = forward.lower(state, jnp.ones((32, TINY.hidden_size))).compile().as_text()
    assert not re.findall(r"all-gather|reduce-scatter|all-reduce|collective-permute", text)


@pytest.mark.parametrize("parallel", [ParallelConfig(), ParallelConfig(
    dp=1, tp=2, sequence_parallel=True, expert_parallel=True)], ids=["single", "sp-ep2"])
def test_a_k_ordered_moe_layer_gives_the_stored_orders_output(eight_devices, parallel):
    """A whole MoE layer whose packed experts run in K order (TINY with F =
    128, interpret: the format's k_order) gives what the same stored
    experts give on "xla" (no K order): h leaves the gate/up in k_order and
    the down projection takes it so, the product unchanged. Float32
    activations on fresh random weights and tokens."""
    cfg = TINY.replace(moe_intermediate_size=128)
    mesh = make_mesh(parallel, jax.devices()[:parallel.num_devices])
    x = jax.random.normal(jax.random.key(11), (16, cfg.hidden_size), jnp.float32)

    def forward(backend):
        layout = make_layout(cfg, parallel, mesh, backend=backend, experts=ExpertStorage.MXFP4,
                             dtype=jnp.float32)
        module = build_layer(layout, 1, mesh, source=RandomSource(seed=7))
        return layout, np.asarray(nnx.jit(lambda m, x: m(x))(module, x), np.float64)
    ordered, got = forward("interpret")
    stored, want = forward("xla")
    assert ordered.experts.k_order and not stored.experts.k_order
    assert np.isfinite(got).all() and np.abs(want).max() > 0
    assert rel_err(got, want) <= 1e-5
