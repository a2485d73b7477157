"""Every parallel layout against the single-device result, on 8
simulated devices: the dense layer-0 KimiMLP and the layer-1 KimiMoE, built
from RandomSource(SEED) (the same logical weights in every layout).

fp32: max |err| / max |ref| < 1e-5. bf16: layout vs single-device bf16 < 1e-2,
and both vs fp32 < 1e-2 (measured max 6.3e-3, MoE under tp8 / sp_tp8_shard).
T = 5 does not divide tp, T = 1 leaves seven of eight SP row blocks pure padding.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from k3jax import TINY, TINY_GROUPED, MoEMode, make_layout
from layout_cases import (
    DENSE_LAYER,
    EXTRA_LAYOUTS,
    LAYOUTS,
    MOE_LAYER,
    MULTI_DEVICE,
    inputs,
    module,
    output,
    rel_err,
)
from reference_np import np_mlp, np_moe

FP32_TOL, BF16_VS_BF16_TOL, BF16_VS_FP32_TOL = 1e-5, 1e-2, 1e-2
LAYERS = {"dense": DENSE_LAYER, "moe": MOE_LAYER}
# Layouts also run at T = 1 and T = 64, and in bf16: one of each family.
SUBSET = ["tp8", "sp_tp8_shard", "sp_ep_dp2_tp4_shard", "ep_dp8"]
BF16_SUBSET = SUBSET  # one layout of each family, ep_dp8 included


def _check_finite(y, what):
    assert np.all(np.isfinite(y)), f"{what}: non-finite output"


# -- the single-device anchor ------------------------------------------------
def _np_tensors(moe) -> dict:
    """The single-device KimiMoE's weights as HF-named float64 tensors ([out, in])."""
    def f64(a):
        return np.asarray(a, np.float64)
    t = {"gate.weight": f64(moe.router_DE[...]).T,
         "gate.e_score_correction_bias": f64(moe.router_bias_E[...]),
         "routed_expert_down_proj.weight": f64(moe.lat_down_DL[...]).T,
         "routed_expert_up_proj.weight": f64(moe.lat_up_LD[...]).T,
         "routed_expert_norm.weight": f64(moe.lat_norm_L[...]),
         "shared_experts.gate_proj.weight": f64(moe.shared.gate_DF[...]).T,
         "shared_experts.up_proj.weight": f64(moe.shared.up_DF[...]).T,
         "shared_experts.down_proj.weight": f64(moe.shared.down_FD[...]).T}
    w1, w3, w2 = (f64(getattr(moe, n)[...]) for n in ("w1_ELF", "w3_ELF", "w2_EFL"))
    for e in range(w1.shape[0]):
        t[f"experts.{e}.w1.weight"] = w1[e].T
        t[f"experts.{e}.w3.weight"] = w3[e].T
        t[f"experts.{e}.w2.weight"] = w2[e].T
    return t


@pytest.mark.parametrize("cfg", [TINY, TINY_GROUPED], ids=["tiny", "tiny_grouped"])
def test_single_device_matches_float64_numpy(cfg):
    """The reference every layout is compared with is itself right (SPEC 2)."""
    T = 5
    x = np.asarray(inputs(cfg, T), np.float64)
    moe = module(cfg, "single", MOE_LAYER)[0]
    assert rel_err(output(cfg, "single", MOE_LAYER, T), np_moe(x, _np_tensors(moe), cfg)) < FP32_TOL
    if cfg is TINY:
        mlp = module(cfg, "single", DENSE_LAYER)[0]
        want = np_mlp(x, np.asarray(mlp.gate_DF[...]).T, np.asarray(mlp.up_DF[...]).T,
                      np.asarray(mlp.down_FD[...]).T, cfg)
        assert rel_err(output(cfg, "single", DENSE_LAYER, T), want) < FP32_TOL


# -- fp32 ---------------------------------------------------------------------
def _fp32_cases():
    cases = [(name, layer, 5) for name in MULTI_DEVICE for layer in LAYERS]
    cases += [(name, layer, T) for T in (1, 64) for name in SUBSET for layer in LAYERS]
    return [pytest.param(n, layer, T, id=f"{n}-{layer}-T{T}") for n, layer, T in cases]


@pytest.mark.parametrize("name, layer, T", _fp32_cases())
def test_layout_matches_single_device_fp32(eight_devices, name, layer, T):
    ref = output(TINY, "single", LAYERS[layer], T)
    got = output(TINY, name, LAYERS[layer], T)
    _check_finite(got, name)
    err = rel_err(got, ref)
    assert err < FP32_TOL, f"{name} {layer} T={T}: relative error {err:.3g}"


@pytest.mark.parametrize("name", ["dp2_tp4", "sp_ep_tp8_shard", "sp_ep_dp2_tp4_shard", "ep_dp2_tp4"])
def test_grouped_topk_layouts_match_single_device(eight_devices, name):
    """TINY_GROUPED (4 groups, keep 2): grouped routing is per row, so every
    layout must select the same experts."""
    ref = output(TINY_GROUPED, "single", MOE_LAYER, 5)
    got = output(TINY_GROUPED, name, MOE_LAYER, 5)
    _check_finite(got, name)
    assert rel_err(got, ref) < FP32_TOL


# -- bf16 ---------------------------------------------------------------------
@pytest.mark.parametrize("layer", list(LAYERS))
@pytest.mark.parametrize("name", BF16_SUBSET)
def test_layout_matches_single_device_bf16(eight_devices, name, layer):
    T = 5
    ref16 = output(TINY, "single", LAYERS[layer], T, jnp.bfloat16)
    got16 = output(TINY, name, LAYERS[layer], T, jnp.bfloat16)
    ref32 = output(TINY, "single", LAYERS[layer], T)
    _check_finite(got16, name)
    assert rel_err(got16, ref16) < BF16_VS_BF16_TOL
    assert rel_err(ref16, ref32) < BF16_VS_FP32_TOL
    assert rel_err(got16, ref32) < BF16_VS_FP32_TOL


# -- padding (SPEC 5) ---------------------------------------------------------
def test_tp8_pads_tiny_experts_with_zeros_and_same_logical_weights(eight_devices):
    """TINY at tp 8: 64 / 8 = 8 < 16 per partition -> padded 128; each of the 8
    F blocks holds the matching 8 real columns of the unpadded weight, then zeros."""
    layout = make_layout(TINY, LAYOUTS["tp8"])
    assert (layout.moe_mode, layout.expert_shards, layout.padded_moe_intermediate) == (
        MoEMode.TP, 8, 128)
    single, padded = module(TINY, "single", MOE_LAYER)[0], module(TINY, "tp8", MOE_LAYER)[0]
    for name, axis in (("w1_ELF", 2), ("w3_ELF", 2), ("w2_EFL", 1)):
        w = np.asarray(getattr(single, name)[...])
        p = np.asarray(getattr(padded, name)[...])
        assert w.shape[axis] == 64 and p.shape[axis] == 128
        blocks_w = np.split(w, 8, axis=axis)           # 8 real columns each
        blocks_p = np.split(p, 8, axis=axis)           # 16 columns each
        for bw, bp in zip(blocks_w, blocks_p):
            real, pad = np.split(bp, 2, axis=axis)
            np.testing.assert_array_equal(real, bw)
            assert not np.any(pad), f"{name}: padding is not zero"
    # ...and the padded layout's output is the unpadded one (T = 5 above, T = 64 here).
    assert rel_err(output(TINY, "tp8", MOE_LAYER, 64), output(TINY, "single", MOE_LAYER, 64)) < FP32_TOL


def test_pad_under_ep_changes_shapes_not_numerics(eight_devices):
    """pad_under_ep reproduces the old vLLM padding under EP (64 -> 8 x 16 = 128):
    zeros only, so the output equals the unpadded EP result."""
    layout = make_layout(TINY, EXTRA_LAYOUTS["ep_dp8_pad_under_ep"])
    assert layout.padded_moe_intermediate == 128 and layout.expert_shards == 1
    moe = module(TINY, "ep_dp8_pad_under_ep", MOE_LAYER)[0]
    assert moe.w1_ELF[...].shape == (16, 64, 128)
    got = output(TINY, "ep_dp8_pad_under_ep", MOE_LAYER, 5)
    assert rel_err(got, output(TINY, "single", MOE_LAYER, 5)) < FP32_TOL
