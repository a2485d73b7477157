"""The torch reference (k3jax.reference) against the float64 numpy reference."""

from __future__ import annotations

import numpy as np
import pytest
import safetensors.numpy
import torch

from k3jax.config import TINY, TINY_GROUPED
from k3jax.reference import (
    TorchKimiMLP,
    TorchKimiMoE,
    decode_mxfp4_torch,
    load_layer_from_safetensors,
    rms_norm,
    route,
    situ_glu,
)
from numerics import rel_err
from pallas_kernels.mxfp4 import dequant_numpy, encode
from reference_np import np_mlp, np_moe, np_rms_norm, np_route, np_situ, random_moe_tensors

CONFIGS = {"tiny": TINY, "tiny_grouped": TINY_GROUPED}
# bf16: inputs and weights bf16-rounded on both sides, torch computing in bf16
# (measured 3.8e-3..7.1e-3 for the MoE layer over seeds 0..8).
TOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 1e-2}
NP_DTYPE = {torch.float64: np.float64, torch.float32: np.float32}


def to_np(t: torch.Tensor) -> np.ndarray:
    return t.detach().to(torch.float64).numpy()


def rounded(tensors: dict, dtype: torch.dtype) -> dict:
    """The float64 weights after a round trip through ``dtype`` (bias stays float32+)."""
    out = {}
    for k, v in tensors.items():
        d = torch.float64 if dtype == torch.float64 else (
            torch.float32 if k.endswith("e_score_correction_bias") else dtype)
        out[k] = to_np(torch.from_numpy(v).to(d))
    return out


def build_moe(cfg, tensors, dtype) -> TorchKimiMoE:
    moe = TorchKimiMoE(cfg, dtype=dtype)
    moe.load_state_dict({k: torch.from_numpy(v) for k, v in tensors.items()}, strict=True)
    return moe


def sorted_by_id(ids, weights):
    order = np.argsort(ids, axis=1)
    return np.take_along_axis(ids, order, 1), np.take_along_axis(weights, order, 1)


def test_situ_and_rms_norm_match_numpy():
    rng = np.random.default_rng(0)
    g = 3.0 * rng.standard_normal((7, 40))
    u = 30.0 * rng.standard_normal((7, 40))              # large enough that linear_beta bites
    for lb in (25.0, None):
        want = np_situ(g, u, 4.0, lb)
        got64 = situ_glu(torch.from_numpy(g), torch.from_numpy(u), 4.0, lb)
        assert got64.dtype == torch.float64 and rel_err(to_np(got64), want) < 1e-13
        got32 = situ_glu(torch.from_numpy(g).float(), torch.from_numpy(u).float(), 4.0, lb)
        assert got32.dtype == torch.float32 and rel_err(to_np(got32), want) < 1e-6
        gb, ub = torch.from_numpy(g).bfloat16(), torch.from_numpy(u).bfloat16()
        gotbf = situ_glu(gb, ub, 4.0, lb)       # vs the formula on the bf16-rounded inputs
        want_bf = np_situ(to_np(gb), to_np(ub), 4.0, lb)
        assert gotbf.dtype == torch.bfloat16    # measured 2.7e-3 / 3.6e-3
        assert rel_err(to_np(gotbf), want_bf) < TOL[torch.bfloat16]
    assert rel_err(np_situ(g, u, 4.0, None), np_situ(g, u, 4.0, 25.0)) > 1e-2
    w = 1.0 + 0.1 * rng.standard_normal(40)
    want = np_rms_norm(g, w, 1e-5)
    assert rel_err(to_np(rms_norm(torch.from_numpy(g), torch.from_numpy(w), 1e-5)), want) < 1e-13
    assert rel_err(to_np(rms_norm(torch.from_numpy(g).float(), torch.from_numpy(w).float(),
                                  1e-5)), want) < 1e-6


@pytest.mark.parametrize("linear_beta", [25.0, None])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_mlp_matches_numpy(dtype, linear_beta):
    rng = np.random.default_rng(1)
    h, f = 96, 160
    mlp = TorchKimiMLP(h, f, 4.0, linear_beta, dtype=dtype)
    assert sorted(mlp.state_dict()) == ["down_proj.weight", "gate_proj.weight", "up_proj.weight"]
    ws = {"gate_proj.weight": rng.standard_normal((f, h)) / np.sqrt(h),
          "up_proj.weight": rng.standard_normal((f, h)) / np.sqrt(h),
          "down_proj.weight": rng.standard_normal((h, f)) / np.sqrt(f)}
    ws = {k: v.astype(NP_DTYPE[dtype]) for k, v in ws.items()}
    mlp.load_state_dict({k: torch.from_numpy(v) for k, v in ws.items()})
    x = rng.standard_normal((7, h)).astype(NP_DTYPE[dtype])
    got = mlp(torch.from_numpy(x))
    assert got.dtype == dtype
    want = np_mlp(x, ws["gate_proj.weight"], ws["up_proj.weight"], ws["down_proj.weight"],
                  (4.0, linear_beta))
    assert np.abs(want).mean() > 0.1
    assert rel_err(to_np(got), want) < TOL[dtype]


def test_moe_state_dict_keys():
    moe = TorchKimiMoE(TINY)
    keys = set(moe.state_dict())
    want = {"gate.weight", "gate.e_score_correction_bias", "routed_expert_down_proj.weight",
            "routed_expert_norm.weight", "routed_expert_up_proj.weight",
            "shared_experts.gate_proj.weight", "shared_experts.up_proj.weight",
            "shared_experts.down_proj.weight"}
    want |= {f"experts.{e}.{w}.weight" for e in range(TINY.num_experts) for w in ("w1", "w2", "w3")}
    assert keys == want
    assert keys == set(random_moe_tensors(TINY, np.random.default_rng(0)))
    sd = TorchKimiMoE(TINY, dtype=torch.bfloat16).state_dict()
    assert sd["gate.e_score_correction_bias"].dtype == torch.float32
    assert sd["experts.3.w2.weight"].shape == (TINY.routed_expert_hidden_size,
                                               TINY.moe_intermediate_size)
    assert sd["shared_experts.gate_proj.weight"].shape == (2 * TINY.moe_intermediate_size,
                                                           TINY.hidden_size)


@pytest.mark.parametrize("num_tokens", [1, 7, 64])
@pytest.mark.parametrize("cfg_name", sorted(CONFIGS))
def test_route_matches_numpy(cfg_name, num_tokens):
    cfg = CONFIGS[cfg_name]
    rng = np.random.default_rng(num_tokens)
    t = random_moe_tensors(cfg, rng, bias_scale=0.1)
    x = rng.standard_normal((num_tokens, cfg.hidden_size))
    want_ids, want_w = sorted_by_id(*np_route(x, t["gate.weight"], t["gate.e_score_correction_bias"], cfg))
    for dtype in (torch.float64, torch.float32):
        xt = torch.from_numpy(x).to(dtype)
        ids, w = route(xt, torch.from_numpy(t["gate.weight"]).to(dtype),
                       torch.from_numpy(t["gate.e_score_correction_bias"]).float(), cfg)
        assert ids.dtype == torch.int64 and ids.shape == (num_tokens, cfg.num_experts_per_token)
        assert w.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
        got_ids, got_w = sorted_by_id(ids.numpy(), to_np(w))
        np.testing.assert_array_equal(got_ids, want_ids)
        np.testing.assert_allclose(got_w, want_w, rtol=0, atol=1e-6)
        np.testing.assert_allclose(got_w.sum(1), 1.0, atol=1e-6)     # renormalized


def test_route_scaling_and_no_renormalize():
    cfg = TINY.replace(moe_renormalize=False, routed_scaling_factor=2.5)
    rng = np.random.default_rng(3)
    t = random_moe_tensors(cfg, rng)
    x = rng.standard_normal((9, cfg.hidden_size))
    want_ids, want_w = sorted_by_id(*np_route(x, t["gate.weight"], t["gate.e_score_correction_bias"], cfg))
    ids, w = route(torch.from_numpy(x), torch.from_numpy(t["gate.weight"]),
                   torch.from_numpy(t["gate.e_score_correction_bias"]), cfg)
    got_ids, got_w = sorted_by_id(ids.numpy(), to_np(w))
    np.testing.assert_array_equal(got_ids, want_ids)
    np.testing.assert_allclose(got_w, want_w, rtol=1e-12)
    s = 1.0 / (1.0 + np.exp(-(x @ t["gate.weight"].T)))
    np.testing.assert_allclose(got_w, 2.5 * np.take_along_axis(s, got_ids, 1), rtol=1e-12)
    assert not np.allclose(got_w.sum(1), 2.5)    # not renormalized


def test_bias_selects_but_does_not_weight():
    cfg = TINY
    rng = np.random.default_rng(4)
    gate_w = rng.standard_normal((cfg.num_experts, cfg.hidden_size)) / np.sqrt(cfg.hidden_size)
    x = rng.standard_normal((5, cfg.hidden_size))
    bias = np.zeros(cfg.num_experts)
    forced = [3, 7, 11, 12]
    bias[forced] = 10.0                                   # dominates any sigmoid difference
    ids, w = route(torch.from_numpy(x), torch.from_numpy(gate_w), torch.from_numpy(bias), cfg)
    s = 1.0 / (1.0 + np.exp(-(x @ gate_w.T)))
    for t in range(5):
        assert sorted(ids[t].tolist()) == forced
        expect = s[t, ids[t].numpy()] / s[t, forced].sum()
        np.testing.assert_allclose(w[t].numpy(), expect, rtol=1e-12)


def test_grouped_topk_changes_the_selection():
    """Groups 0/1 each hold one top expert; groups 2/3 are uniformly good, so
    the 2 best groups (by top-2 sum) are 2 and 3 and grouping must drop 0 and 4."""
    cfg = TINY_GROUPED
    assert (cfg.num_experts, cfg.num_expert_group, cfg.topk_group) == (16, 4, 2)
    scores = np.array([0.99, 0.10, 0.11, 0.12,
                       0.98, 0.13, 0.14, 0.15,
                       0.72, 0.71, 0.70, 0.69,
                       0.62, 0.61, 0.60, 0.59])
    rng = np.random.default_rng(6)
    gate_w = 0.1 * rng.standard_normal((cfg.num_experts, cfg.hidden_size)) / np.sqrt(cfg.hidden_size)
    gate_w[:, 0] = np.log(scores / (1 - scores))          # logits for x = e_0
    x = np.zeros((2, cfg.hidden_size))
    x[:, 0] = 1.0
    x[1, 1:] = 0.1 * rng.standard_normal(cfg.hidden_size - 1)
    bias = np.zeros(cfg.num_experts)
    ids_g, w_g = route(torch.from_numpy(x), torch.from_numpy(gate_w), torch.from_numpy(bias), cfg)
    ids_flat, _ = route(torch.from_numpy(x), torch.from_numpy(gate_w), torch.from_numpy(bias),
                        cfg.replace(num_expert_group=1, topk_group=1))
    np_ids, np_w = np_route(x, gate_w, bias, cfg)
    for t in range(2):
        assert set(ids_g[t].tolist()) == {8, 9, 10, 11}
        assert set(np_ids[t].tolist()) == {8, 9, 10, 11}
        assert set(ids_flat[t].tolist()) == {0, 4, 8, 9}
        assert set(ids_g[t].tolist()) != set(ids_flat[t].tolist())
    got_ids, got_w = sorted_by_id(ids_g.numpy(), w_g.numpy())
    want_ids, want_w = sorted_by_id(np_ids, np_w)
    np.testing.assert_array_equal(got_ids, want_ids)
    np.testing.assert_allclose(got_w, want_w, rtol=1e-12)
    # groups are ranked by BIASED scores: lift group 0's second expert so group 0
    # (0.99 + 0.90 biased) beats group 3 (0.62 + 0.61), and expert 1 gets picked
    bias[1] = 0.8
    ids_b, _ = route(torch.from_numpy(x), torch.from_numpy(gate_w), torch.from_numpy(bias), cfg)
    for t in range(2):
        assert set(ids_b[t].tolist()) == {0, 1, 8, 9}
    np.testing.assert_array_equal(np.sort(ids_b.numpy(), 1),
                                  np.sort(np_route(x, gate_w, bias, cfg)[0], 1))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("num_tokens", [1, 7, 64])
@pytest.mark.parametrize("cfg_name", sorted(CONFIGS))
def test_moe_matches_numpy(cfg_name, num_tokens, dtype):
    cfg = CONFIGS[cfg_name]
    rng = np.random.default_rng(100 + num_tokens)
    tensors = rounded(random_moe_tensors(cfg, rng), dtype)
    x = rng.standard_normal((num_tokens, cfg.hidden_size)).astype(NP_DTYPE[dtype])
    moe = build_moe(cfg, tensors, dtype)
    with torch.no_grad():
        got = moe(torch.from_numpy(x))
    assert got.dtype == dtype and got.shape == x.shape
    want = np_moe(x, tensors, cfg)
    assert 0.2 < np.sqrt(np.mean(want ** 2)) < 5.0          # O(1) outputs
    assert rel_err(to_np(got), want) < TOL[dtype]


def test_moe_bf16_and_without_norm():
    cfg = TINY
    rng = np.random.default_rng(8)
    tensors = rounded(random_moe_tensors(cfg, rng), torch.bfloat16)
    x = to_np(torch.from_numpy(rng.standard_normal((16, cfg.hidden_size))).bfloat16())
    moe = build_moe(cfg, tensors, torch.bfloat16)
    with torch.no_grad():
        got = moe(torch.from_numpy(x).bfloat16())
    assert got.dtype == torch.bfloat16
    assert rel_err(to_np(got), np_moe(x, tensors, cfg)) < TOL[torch.bfloat16]
    # latent_moe_use_norm=False: no norm parameter, and the output changes
    cfg_nn = cfg.replace(latent_moe_use_norm=False)
    t64 = random_moe_tensors(cfg_nn, rng)
    assert "routed_expert_norm.weight" not in t64
    x = rng.standard_normal((7, cfg.hidden_size))
    with torch.no_grad():
        got = build_moe(cfg_nn, t64, torch.float64)(torch.from_numpy(x))
    assert rel_err(to_np(got), np_moe(x, t64, cfg_nn)) < 1e-10


def test_torch_mxfp4_decoder_matches_numpy_codec():
    rng = np.random.default_rng(9)
    packed = rng.integers(0, 256, (8, 64), dtype=np.uint8)
    packed[0, :] = np.arange(64, dtype=np.uint8) * 4 + 1
    scales = rng.integers(2, 253, (8, 4), dtype=np.uint8)     # float32-normal, finite range
    got = decode_mxfp4_torch(torch.from_numpy(packed), torch.from_numpy(scales))
    assert got.dtype == torch.float32 and got.shape == (8, 128)
    np.testing.assert_array_equal(got.numpy(), dequant_numpy(packed, scales))
    assert torch.isnan(decode_mxfp4_torch(torch.from_numpy(packed[:1]),
                                          torch.full((1, 4), 255, dtype=torch.uint8))).all()
    with pytest.raises(ValueError):
        decode_mxfp4_torch(torch.from_numpy(packed), torch.from_numpy(scales[:, :3]))


def _write_checkpoint(path, cfg, rng):
    """A 3-layer TINY checkpoint in two files: layer 0 dense (plain, with the
    language_model. prefix), layers 1-2 MoE with MXFP4 routed experts."""
    h, f = cfg.hidden_size, cfg.intermediate_size
    dense = {"gate_proj.weight": rng.standard_normal((f, h)) / np.sqrt(h),
             "up_proj.weight": rng.standard_normal((f, h)) / np.sqrt(h),
             "down_proj.weight": rng.standard_normal((h, f)) / np.sqrt(f)}
    dense = {k: v.astype(np.float32) for k, v in dense.items()}
    file_a = {f"language_model.model.layers.0.mlp.{k}": v for k, v in dense.items()}
    file_b = {}
    moe_tensors = {}
    for layer in (1, 2):
        t = random_moe_tensors(cfg, rng)
        logical = {}
        for k, v in t.items():
            name = f"model.layers.{layer}.block_sparse_moe.{k}"
            if k.startswith("experts."):
                packed, scales = encode(v)
                target = file_a if (layer == 1 and k.endswith("w2.weight")) else file_b
                target[name.replace(".weight", ".weight_packed")] = packed
                target[name.replace(".weight", ".weight_scale")] = scales
                logical[k] = dequant_numpy(packed, scales).astype(np.float64)
            else:
                file_b[name] = v.astype(np.float32)
                logical[k] = v.astype(np.float32).astype(np.float64)
        moe_tensors[layer] = logical
    safetensors.numpy.save_file(file_a, str(path / "model-00001-of-00002.safetensors"))
    safetensors.numpy.save_file(file_b, str(path / "model-00002-of-00002.safetensors"))
    return dense, moe_tensors


def test_load_layer_from_safetensors(tmp_path):
    cfg = TINY
    rng = np.random.default_rng(10)
    dense, moe_tensors = _write_checkpoint(tmp_path, cfg, rng)
    x = rng.standard_normal((7, cfg.hidden_size))

    mlp = load_layer_from_safetensors(tmp_path, 0, cfg, dtype=torch.float64)
    assert isinstance(mlp, TorchKimiMLP)
    with torch.no_grad():
        got = mlp(torch.from_numpy(x))
    want = np_mlp(x, dense["gate_proj.weight"], dense["up_proj.weight"], dense["down_proj.weight"], cfg)
    assert rel_err(to_np(got), want) < 1e-10

    for layer in (1, 2):
        moe = load_layer_from_safetensors(tmp_path, layer, cfg, dtype=torch.float64)
        assert isinstance(moe, TorchKimiMoE)
        with torch.no_grad():
            got = moe(torch.from_numpy(x))
        assert rel_err(to_np(got), np_moe(x, moe_tensors[layer], cfg)) < 1e-10
    # the two MoE layers hold different weights, and the loader did not mix them up
    assert rel_err(np_moe(x, moe_tensors[1], cfg), np_moe(x, moe_tensors[2], cfg)) > 0.1

    moe32 = load_layer_from_safetensors(tmp_path, 1, cfg)
    assert moe32.experts[0].w1.weight.dtype == torch.float32
    with torch.no_grad():
        got = moe32(torch.from_numpy(x).float())
    assert rel_err(to_np(got), np_moe(x, moe_tensors[1], cfg)) < 1e-5


def test_load_layer_errors(tmp_path):
    cfg = TINY
    rng = np.random.default_rng(11)
    _write_checkpoint(tmp_path, cfg, rng)
    with pytest.raises(ValueError, match="out of range"):
        load_layer_from_safetensors(tmp_path, 3, cfg)
    with pytest.raises(KeyError, match="missing"):        # a config with more experts
        load_layer_from_safetensors(tmp_path, 1, cfg.replace(num_experts=20))
    with pytest.raises(ValueError, match="shape"):
        load_layer_from_safetensors(tmp_path, 1, cfg.replace(moe_intermediate_size=32))
    with pytest.raises(FileNotFoundError):
        load_layer_from_safetensors(tmp_path / "nowhere", 1, cfg)


def test_reference_and_config_import_without_jax():
    """The torch reference is independent of the JAX code: importing it (or
    k3jax.config) loads neither jax nor flax; the package's public names load
    their submodule on first use."""
    import subprocess
    import sys

    probe = ("import sys, k3jax.reference, k3jax.config; "
             "assert 'jax' not in sys.modules and 'flax' not in sys.modules, 'eager import'; "
             "import k3jax; from k3jax import *; "
             "missing = [n for n in k3jax.__all__ if n not in dir()]; assert not missing, missing; "
             "assert 'jax' in sys.modules; print('ok')")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]
