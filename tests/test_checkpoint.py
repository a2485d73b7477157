"""Checkpoint loading (SPEC 3): layers from a directory of config.json +
safetensors, every stored form the SPEC allows (split files, language_model.
prefix, nested config, F32 / BF16 / F16, MXFP4 experts), sharded reading under
several layouts, clear errors, and variants other tools may write. Every
output is checked against the float64 numpy reference on the stored values."""

from __future__ import annotations

import json
import os
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy
from flax import nnx

from k3jax.checkpoint import (
    CheckpointError,
    CheckpointReader,
    load_layer,
    make_synthetic_checkpoint,
    write_checkpoint,
)
from k3jax.checkpoint.names import layer_prefix
from k3jax.config import TINY, TINY_GROUPED, from_hf_config
from k3jax.layout import ParallelConfig, make_mesh
from k3jax.modules import KimiMLP, KimiMoE
from k3jax.variables import WEIGHTS
from numerics import jitted, rel_err
from pallas_kernels.mxfp4 import dequant_numpy, encode
from reference_np import np_mlp, np_moe, random_moe_tensors

BF16 = ml_dtypes.bfloat16
MOE = layer_prefix(1, True)       # "model.layers.1.block_sparse_moe."


# -- helpers ------------------------------------------------------------------
def tokens(num_tokens, hidden, seed=0):
    return np.random.default_rng(seed).standard_normal((num_tokens, hidden)).astype(np.float32)


def random_layers(cfg, seed):
    """{layer: {suffix: float64}} fresh random weights for every layer of cfg."""
    rng = np.random.default_rng(seed)
    out = {}
    for layer in range(cfg.num_hidden_layers):
        if cfg.is_moe_layer(layer):
            out[layer] = random_moe_tensors(cfg, rng, bias_scale=0.1)
        else:
            D, F = cfg.hidden_size, cfg.intermediate_size
            out[layer] = {"gate_proj.weight": rng.standard_normal((F, D)) / np.sqrt(D),
                          "up_proj.weight": rng.standard_normal((F, D)) / np.sqrt(D),
                          "down_proj.weight": rng.standard_normal((D, F)) / np.sqrt(F)}
    return out


def stored_items(cfg, layers, dtype=np.float32, mxfp4=False):
    """(items to write, {layer: {suffix: float64 of what a loader must see}}).

    Weights are stored in ``dtype`` (the router bias in float32); with
    ``mxfp4`` the routed experts are MXFP4 (weight_packed / weight_scale)."""
    items, seen = [], {}
    for layer, tensors in layers.items():
        prefix = layer_prefix(layer, cfg.is_moe_layer(layer))
        seen[layer] = {}
        for k, v in tensors.items():
            if mxfp4 and k.startswith("experts."):
                packed, scale = encode(v)
                items += [(prefix + k + "_packed", packed), (prefix + k + "_scale", scale)]
                seen[layer][k] = dequant_numpy(packed, scale).astype(np.float64)
                continue
            a = v.astype(np.float32 if k.endswith("bias") else dtype)
            items.append((prefix + k, a))
            seen[layer][k] = a.astype(np.float64)
    return items, seen


def reference(cfg, tensors, layer, x):
    t = tensors[layer]
    if cfg.is_moe_layer(layer):
        return np_moe(x, t, cfg)
    return np_mlp(x, t["gate_proj.weight"], t["up_proj.weight"], t["down_proj.weight"], cfg)


def check_layer(ckpt, cfg, tensors, layer, T=7, parallel=ParallelConfig(), tol=1e-5, **kw):
    mesh = make_mesh(parallel, jax.devices()[:parallel.num_devices])
    module = load_layer(ckpt, layer, parallel, mesh, backend="xla", **kw)
    x = tokens(T, cfg.hidden_size, seed=layer + T)
    got = jitted(module)(x)
    assert got.shape == (T, cfg.hidden_size)
    assert rel_err(got, reference(cfg, tensors, layer, x)) < tol, (layer, T, parallel)
    return module, got


# -- fixtures -----------------------------------------------------------------
@pytest.fixture(scope="module")
def f32(tmp_path_factory):
    """A float32 TINY checkpoint in one file: (dir, tensors)."""
    items, seen = stored_items(TINY, random_layers(TINY, seed=1))
    d = tmp_path_factory.mktemp("f32") / "ckpt"
    write_checkpoint(d, TINY, items)
    return d, seen


@pytest.fixture(scope="module")
def mxfp4(tmp_path_factory):
    """BF16 weights with MXFP4 routed experts (the published mix): (dir, tensors)."""
    items, seen = stored_items(TINY, random_layers(TINY, seed=2), dtype=BF16, mxfp4=True)
    d = tmp_path_factory.mktemp("mxfp4") / "ckpt"
    write_checkpoint(d, TINY, items, num_files=2, language_model_prefix=True, nested_config=True)
    return d, seen


@pytest.fixture
def small(tmp_path):
    """A factory of float32 2-layer TINY checkpoints that tests may break:
    small(edit) -> dir, where edit(items) returns the items to write."""
    cfg = TINY.replace(num_hidden_layers=2)
    items, _ = stored_items(cfg, random_layers(cfg, seed=3))
    count = [0]

    def make(edit=lambda items: items, **kw):
        count[0] += 1
        d = tmp_path / f"ckpt{count[0]}"
        write_checkpoint(d, cfg, edit(list(items)), **kw)
        return d
    return make


# -- loading ------------------------------------------------------------------
def test_dense_layer_and_moe_layers(f32):
    d, tensors = f32
    reader = CheckpointReader(d)
    assert reader.config == TINY and reader.prefix == ""
    dense, _ = check_layer(reader, TINY, tensors, 0)
    assert isinstance(dense, KimiMLP)
    _, y1 = check_layer(reader, TINY, tensors, 1)
    moe2, y2 = check_layer(reader, TINY, tensors, 2, T=1)
    assert isinstance(moe2, KimiMoE)
    assert moe2.w1_ELF[...].shape == (16, 64, 64) and moe2.w1_ELF[...].dtype == jnp.float32
    # Layer 2 holds its own weights, not layer 1's.
    np.testing.assert_array_equal(np.asarray(moe2.router_DE[...]),
                                  tensors[2]["gate.weight"].T.astype(np.float32))


def test_split_files_language_model_prefix_nested_config(f32, tmp_path):
    """The same tensors behind the published naming: language_model. prefix,
    text_config-nested config.json, three files and an index."""
    d, tensors = f32
    items, _ = stored_items(TINY, {k: v for k, v in tensors.items()})
    nested = tmp_path / "nested"
    write_checkpoint(nested, TINY, items, num_files=3, language_model_prefix=True, nested_config=True)
    files = sorted(os.listdir(nested))
    assert "model.safetensors.index.json" in files
    assert sum(f.endswith(".safetensors") for f in files) == 3
    assert "text_config" in json.loads((nested / "config.json").read_text())
    reader = CheckpointReader(nested)
    assert reader.config == TINY and reader.prefix == "language_model."
    for layer in (0, 1):
        check_layer(reader, TINY, tensors, layer)


@pytest.mark.parametrize("dtype, code", [(np.float32, "F32"), (BF16, "BF16"), (np.float16, "F16")])
def test_stored_dtypes(tmp_path, dtype, code):
    cfg = TINY.replace(num_hidden_layers=2)
    items, tensors = stored_items(cfg, random_layers(cfg, seed=4), dtype=dtype)
    write_checkpoint(tmp_path / "c", cfg, items)
    reader = CheckpointReader(tmp_path / "c")
    assert reader.info(MOE + "experts.5.w3.weight") == (code, (64, 64))
    assert reader.info(MOE + "gate.e_score_correction_bias")[0] == "F32"
    for layer in (0, 1):      # loaded into float32: the stored values exactly
        check_layer(reader, cfg, tensors, layer)


def test_mxfp4_experts_packed_and_dequantized(mxfp4):
    d, tensors = mxfp4
    reader = CheckpointReader(d)
    assert reader.has(MOE + "experts.0.w1.weight_packed") and not reader.has(MOE + "experts.0.w1.weight")
    assert reader.info(MOE + "gate.weight")[0] == "BF16"
    packed, y_packed = check_layer(reader, TINY, tensors, 1, mxfp4="packed")
    assert not hasattr(packed, "w1_ELF")
    assert packed.w1_packed_EFL[...].dtype == jnp.uint8
    assert packed.w1_packed_EFL[...].shape == (16, 64, 32)     # [E, F, L/2]: as stored
    assert packed.w2_packed_ELF[...].shape == (16, 64, 32)     # [E, L, F/2]
    assert packed.w1_scale_ELF[...].shape == (16, 2, 64)       # [E, L/32, F]: transposed
    assert packed.w2_scale_EFL[...].shape == (16, 2, 64)
    dequantized, y_dense = check_layer(reader, TINY, tensors, 1, mxfp4="dequantize")
    assert dequantized.w1_ELF[...].dtype == jnp.float32
    np.testing.assert_allclose(y_packed, y_dense, rtol=0, atol=1e-6 * np.abs(y_dense).max())
    check_layer(reader, TINY, tensors, 0)         # the BF16 dense layer of the same checkpoint
    with pytest.raises(ValueError, match="mxfp4 must be"):
        load_layer(reader, 1, mxfp4="fp4")


def test_experts_mixing_plain_and_mxfp4(tmp_path):
    """Odd experts stored plain (BF16), even ones MXFP4, in one layer: loaded
    dequantized, also when packed storage is asked for (it cannot hold them)."""
    cfg = TINY.replace(num_hidden_layers=2)
    layers = random_layers(cfg, seed=5)
    plain, tensors = stored_items(cfg, layers, dtype=BF16)
    quant, quant_seen = stored_items(cfg, layers, dtype=BF16, mxfp4=True)
    even = tuple(f"experts.{e}." for e in range(0, cfg.num_experts, 2))
    items = [(n, a) for n, a in plain if not (MOE in n and any(o in n for o in even))]
    items += [(n, a) for n, a in quant if MOE in n and any(o in n for o in even)]
    tensors[1].update({k: v for k, v in quant_seen[1].items() if k.startswith(even)})
    write_checkpoint(tmp_path / "c", cfg, items, num_files=2)
    reader = CheckpointReader(tmp_path / "c")
    assert reader.has(MOE + "experts.0.w1.weight_packed") and reader.has(MOE + "experts.1.w1.weight")
    module, y = check_layer(reader, cfg, tensors, 1, mxfp4="dequantize")
    module, y_default = check_layer(reader, cfg, tensors, 1)
    assert module.w1_ELF[...].dtype == jnp.float32
    np.testing.assert_array_equal(y, y_default)


# -- sharded reading ------------------------------------------------------------
LAYOUTS = {
    "tp8-sp-ep": ParallelConfig(tp=8, sequence_parallel=True, expert_parallel=True),
    "tp8": ParallelConfig(tp=8),
    "dp2-tp4-sp-sharded": ParallelConfig(dp=2, tp=4, sequence_parallel=True, shard_shared_expert=True),
    "dp8-ep": ParallelConfig(dp=8, expert_parallel=True),
}


@pytest.fixture(scope="module")
def f32_single(f32):
    """Layer 1 of the f32 checkpoint on one device, T = 7."""
    d, tensors = f32
    return check_layer(d, TINY, tensors, 1, T=7)[1]


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_sharded_layouts_match_single_device(f32, f32_single, eight_devices, name):
    d, tensors = f32
    _, sharded = check_layer(d, TINY, tensors, 1, T=7, parallel=LAYOUTS[name])
    assert rel_err(sharded, f32_single) < 1e-5


def test_dense_layer_sharded(f32, eight_devices):
    d, tensors = f32
    for parallel in (ParallelConfig(tp=8), ParallelConfig(tp=8, sequence_parallel=True,
                                                          shard_shared_expert=True)):
        module, _ = check_layer(d, TINY, tensors, 0, T=5, parallel=parallel)
        gate = module.gate_DF[...]
        assert gate.sharding.shard_shape(gate.shape) == (96, 20)


def test_tp8_reads_slices_into_padded_blocks(f32, eight_devices, monkeypatch):
    """Plain TP at tp 8 pads TINY's intermediate 64 -> 128 (8 real + 8 zero
    per shard) and each device reads only its 8 rows of each expert."""
    d, tensors = f32
    reader = CheckpointReader(d)
    reads = []
    original = reader.read
    monkeypatch.setattr(reader, "read", lambda name, index=None, **kw: (
        reads.append((name, index)), original(name, index, **kw))[1])
    parallel = ParallelConfig(tp=8)
    moe = load_layer(reader, 1, parallel, make_mesh(parallel, eight_devices), backend="xla")
    w1 = moe.w1_ELF[...]
    assert w1.shape == (16, 64, 128) and w1.sharding.shard_shape(w1.shape) == (16, 64, 16)
    want = np.zeros((16, 64, 128), np.float32)
    for e in range(16):
        stored = tensors[1][f"experts.{e}.w1.weight"]          # [I=64, L=64]
        for r in range(8):
            want[e, :, 16 * r:16 * r + 8] = stored[8 * r:8 * (r + 1)].T
    np.testing.assert_array_equal(np.asarray(w1), want)
    w2 = np.asarray(moe.w2_EFL[...])                            # [E, F, L], padding rows zero
    assert np.all(w2[:, 8:16] == 0) and np.all(w2[:, 120:128] == 0)
    np.testing.assert_array_equal(w2[0, 0:8], tensors[1]["experts.0.w2.weight"].T[0:8])
    np.testing.assert_array_equal(w2[3, 16:24], tensors[1]["experts.3.w2.weight"].T[8:16])
    np.testing.assert_array_equal(w2[15, 112:120], tensors[1]["experts.15.w2.weight"].T[56:64])
    w1_reads = [idx for name, idx in reads if name.endswith(".w1.weight")]
    assert len(w1_reads) == 16 * 8
    assert all(idx[0].stop - idx[0].start == 8 and (idx[1].start, idx[1].stop) == (0, 64)
               for idx in w1_reads)
    x = tokens(7, 96, seed=8)
    assert rel_err(jitted(moe)(x), np_moe(x, tensors[1], TINY)) < 1e-5


def test_ep_reads_only_local_experts(f32, eight_devices, monkeypatch):
    d, _ = f32
    reader = CheckpointReader(d)
    reads = []
    original = reader.read
    monkeypatch.setattr(reader, "read", lambda name, index=None, **kw: (
        reads.append(name), original(name, index, **kw))[1])
    parallel = ParallelConfig(tp=8, sequence_parallel=True, expert_parallel=True)
    moe = load_layer(reader, 1, parallel, make_mesh(parallel, eight_devices), backend="xla")
    w3 = moe.w3_ELF[...]
    assert w3.sharding.shard_shape(w3.shape) == (2, 64, 64)
    # Each expert tensor is read exactly once (one device holds it).
    w3_reads = [n for n in reads if n.endswith(".w3.weight")]
    assert sorted(w3_reads) == sorted(f"{MOE}experts.{e}.w3.weight" for e in range(16))


@pytest.mark.parametrize("parallel", [ParallelConfig(tp=8, sequence_parallel=True, expert_parallel=True),
                                      ParallelConfig(dp=8, expert_parallel=True)],
                         ids=["tp8-sp-ep", "dp8-ep"])
def test_mxfp4_expert_parallel_packed(mxfp4, eight_devices, parallel):
    d, tensors = mxfp4
    check_layer(d, TINY, tensors, 1, T=9, parallel=parallel, mxfp4="packed")


def test_mxfp4_packed_tensor_parallel_with_padding(tmp_path, eight_devices):
    """Packed MXFP4 split over tp 4 with padding: I 128 -> 256 (min 64 per
    shard), so each shard reads 32 real rows of w1/w3 and 32 real inputs
    (one scale block) of w2 into a 64-wide block."""
    cfg = TINY.replace(moe_intermediate_size=128, min_moe_intermediate_per_partition=64,
                       num_hidden_layers=2)
    items, tensors = stored_items(cfg, random_layers(cfg, seed=10), dtype=BF16, mxfp4=True)
    write_checkpoint(tmp_path / "c", cfg, items, num_files=2)
    parallel = ParallelConfig(dp=2, tp=4)
    module, _ = check_layer(tmp_path / "c", cfg, tensors, 1, T=5, parallel=parallel, mxfp4="packed")
    assert module.layout.padded_moe_intermediate == 256
    w2s = module.w2_scale_EFL[...]
    assert w2s.shape == (16, 8, 64) and w2s.sharding.shard_shape(w2s.shape) == (16, 2, 64)
    assert np.all(np.asarray(w2s)[:, 1::2] == 0)         # the padding blocks
    # the codes as stored, [E, out, in/2]: F is split (and padded) along w1's
    # axis 1 and w2's (packed) axis 2
    w1p, w2p = module.w1_packed_EFL[...], module.w2_packed_ELF[...]
    assert w1p.shape == (16, 256, 32) and w1p.sharding.shard_shape(w1p.shape) == (16, 64, 32)
    assert w2p.shape == (16, 64, 128) and w2p.sharding.shard_shape(w2p.shape) == (16, 64, 32)
    assert np.all(np.asarray(w1p).reshape(16, 4, 64, 32)[:, :, 32:] == 0)
    assert np.all(np.asarray(w2p).reshape(16, 64, 4, 32)[..., 16:] == 0)


def test_mxfp4_tp8_padded(mxfp4, eight_devices):
    """At tp 8 a shard holds 8 of 64 intermediate rows: too few for packed
    MXFP4 blocks of 32 (a clear error); dequantized on load it works."""
    d, tensors = mxfp4
    parallel = ParallelConfig(tp=8)
    with pytest.raises(ValueError, match="multiple of 32"):
        load_layer(d, 1, parallel, make_mesh(parallel, eight_devices), mxfp4="packed")
    check_layer(d, TINY, tensors, 1, T=6, parallel=parallel, mxfp4="dequantize")


# -- errors -------------------------------------------------------------------
def drop(name):
    return lambda items: [(n, a) for n, a in items if n != name]


def replace(name, value):
    return lambda items: [(n, value if n == name else a) for n, a in items]


@pytest.mark.parametrize("layer, suffix", [
    (1, "shared_experts.down_proj.weight"), (1, "experts.3.w2.weight"),
    (1, "gate.e_score_correction_bias"), (1, "routed_expert_norm.weight"), (0, "up_proj.weight"),
])
def test_missing_tensor_is_named(small, layer, suffix):
    name = layer_prefix(layer, layer > 0) + suffix
    d = small(drop(name), num_files=2)
    with pytest.raises(CheckpointError, match=f"missing tensor {name.replace('.', '[.]')}"):
        load_layer(d, layer, backend="xla")


def test_wrong_shape_is_named(small):
    name = MOE + "gate.weight"
    d = small(replace(name, np.ones((16, 97), np.float32)))
    with pytest.raises(CheckpointError, match=rf"tensor {name} has shape \[16, 97\], expected \[16, 96\]"):
        load_layer(d, 1)
    name = MOE + "experts.7.w1.weight"
    d = small(replace(name, np.ones((64, 32), np.float32)))
    with pytest.raises(CheckpointError, match=rf"{name} has shape \[64, 32\]"):
        load_layer(d, 1)


@pytest.mark.parametrize("dtype, code", [(np.int32, "I32"), (np.float64, "F64")])
def test_unsupported_dtype_is_named(small, dtype, code):
    name = MOE + "routed_expert_up_proj.weight"
    d = small(replace(name, np.ones((96, 64), dtype)))
    with pytest.raises(CheckpointError, match=f"tensor {name} has unsupported dtype {code}"):
        load_layer(d, 1)


def test_unreadable_files_are_named(small):
    d = small(num_files=2)                       # with an index: opened lazily
    victim = "model-00002-of-00002.safetensors"
    (d / victim).write_bytes(b"\x13\x37 not a safetensors file at all")
    with pytest.raises(CheckpointError, match=f"cannot read safetensors file .*{victim}"):
        load_layer(d, 1)
    d = small()                                  # without an index: opened when scanning
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])     # truncated
    with pytest.raises(CheckpointError, match="model.safetensors"):
        CheckpointReader(d)


def test_index_naming_a_missing_file(small):
    d = small(num_files=2)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    index["weight_map"][MOE + "gate.weight"] = "model-00009-of-00009.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="names model-00009-of-00009.safetensors, which does not exist"):
        CheckpointReader(d)


def test_layer_out_of_range(small):
    d = small()
    for layer in (2, 93, -1):
        with pytest.raises(CheckpointError, match=f"layer {layer} is out of range.*2 layers"):
            load_layer(d, layer)


def test_directory_problems(small, tmp_path):
    with pytest.raises(CheckpointError, match="checkpoint directory not found"):
        CheckpointReader(tmp_path / "nope")
    d = small()
    os.remove(d / "config.json")
    with pytest.raises(CheckpointError, match="has no config.json"):
        CheckpointReader(d)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text(json.dumps(TINY.to_hf_dict()))
    with pytest.raises(CheckpointError, match="no .safetensors files"):
        CheckpointReader(empty)


def test_mxfp4_problems_are_named(tmp_path):
    cfg = TINY.replace(num_hidden_layers=2)
    items, _ = stored_items(cfg, random_layers(cfg, seed=6), mxfp4=True)
    scale = MOE + "experts.2.w3.weight_scale"
    nan_scale = [(n, np.full_like(a, 255) if n == scale else a) for n, a in items]
    write_checkpoint(tmp_path / "nan", cfg, nan_scale)
    for mode in ("dequantize", "packed"):
        with pytest.raises(CheckpointError, match=f"tensor {scale}: MXFP4 scales hold"):
            load_layer(tmp_path / "nan", 1, mxfp4=mode)
    half = MOE + "experts.4.w1.weight_packed"
    write_checkpoint(tmp_path / "half", cfg, [(n, a) for n, a in items if n != half])
    for mode in ("dequantize", "packed"):
        with pytest.raises(CheckpointError, match=f"missing tensor {half}"):
            load_layer(tmp_path / "half", 1, mxfp4=mode)


# -- variants other tools write in the SPEC layout ---------------------------------
NON_K3 = TINY.replace(hidden_size=80, routed_expert_hidden_size=32, moe_intermediate_size=48,
                      intermediate_size=72, num_experts=12, num_experts_per_token=3,
                      num_shared_experts=1, num_hidden_layers=4, first_k_dense_replace=2)

VARIANTS = {
    "scaling-2.5": TINY.replace(routed_scaling_factor=2.5),
    "no-renormalize": TINY.replace(moe_renormalize=False),
    "linear-beta-null": TINY.replace(activation_situ_linear_beta=None),
    "no-latent-norm": TINY.replace(latent_moe_use_norm=False),
    "grouped-scaled-no-renormalize": TINY_GROUPED.replace(moe_renormalize=False,
                                                          routed_scaling_factor=0.5),
    "non-k3-sizes": NON_K3,
}


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_variants_match_numpy(tmp_path, name):
    cfg = VARIANTS[name]
    items, tensors = stored_items(cfg, random_layers(cfg, seed=len(name)))
    write_checkpoint(tmp_path / "c", cfg, items)
    reader = CheckpointReader(tmp_path / "c")
    assert reader.config == cfg
    if not cfg.latent_moe_use_norm:
        assert not reader.has(MOE + "routed_expert_norm.weight")
    check_layer(reader, cfg, tensors, cfg.first_k_dense_replace, T=5)
    if name in ("non-k3-sizes", "linear-beta-null"):
        check_layer(reader, cfg, tensors, cfg.first_k_dense_replace, T=1)
        check_layer(reader, cfg, tensors, 0, T=3)


@pytest.mark.parametrize("parallel", [ParallelConfig(tp=4), ParallelConfig(
    dp=2, tp=4, sequence_parallel=True, expert_parallel=True)], ids=["tp4-padded", "ep8"])
def test_non_k3_sizes_sharded(tmp_path, eight_devices, parallel):
    """12 experts / intermediate 48 on 4 or 8 devices (TP pads 48 -> 64)."""
    cfg = NON_K3 if parallel.tp == 4 and not parallel.expert_parallel else NON_K3.replace(
        num_experts=16)
    items, tensors = stored_items(cfg, random_layers(cfg, seed=7))
    write_checkpoint(tmp_path / "c", cfg, items, num_files=2)
    module, _ = check_layer(tmp_path / "c", cfg, tensors, 3, T=7, parallel=parallel)
    if not parallel.expert_parallel:
        assert module.layout.padded_moe_intermediate == 64


def test_float_keys_in_config_json(tmp_path):
    cfg = TINY.replace(num_hidden_layers=2, routed_scaling_factor=2.0)
    items, tensors = stored_items(cfg, random_layers(cfg, seed=8))
    write_checkpoint(tmp_path / "c", cfg, items)
    raw = json.loads((tmp_path / "c" / "config.json").read_text())
    for key in ("hidden_size", "moe_intermediate_size", "routed_expert_hidden_size", "num_experts",
                "num_experts_per_token", "num_hidden_layers", "num_shared_experts"):
        raw[key] = float(raw[key])
    raw["routed_scaling_factor"] = 2
    text = json.dumps(raw)
    assert '"hidden_size": 96.0' in text and '"num_experts": 16.0' in text
    (tmp_path / "c" / "config.json").write_text(text)
    reader = CheckpointReader(tmp_path / "c")
    assert reader.config == cfg
    check_layer(reader, cfg, tensors, 1, T=4)


@pytest.mark.parametrize("with_index", [True, False])
def test_tensors_scattered_across_files(tmp_path, with_index):
    """Tensors of one layer spread over files in shuffled order (experts of a
    layer interleaved with other layers'), with and without an index."""
    cfg = TINY.replace(num_hidden_layers=2)
    items, tensors = stored_items(cfg, random_layers(cfg, seed=9), dtype=np.float16)
    rng = np.random.default_rng(0)
    order = rng.permutation(len(items))
    d = tmp_path / "c"
    d.mkdir()
    weight_map = {}
    for f in range(4):
        file = f"part-{f}.safetensors"
        shard = {items[i][0]: items[i][1] for i in order[f::4]}
        safetensors.numpy.save_file(shard, str(d / file))
        weight_map.update({n: file for n in shard})
    if with_index:
        (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (d / "config.json").write_text(json.dumps({"text_config": cfg.to_hf_dict()}))
    experts_files = {weight_map[MOE + f"experts.{e}.w1.weight"] for e in range(16)}
    assert len(experts_files) > 1
    for layer in (0, 1):
        check_layer(d, cfg, tensors, layer, T=3)


def test_make_synthetic_checkpoint_is_loadable_and_deterministic(tmp_path):
    cfg = TINY.replace(num_hidden_layers=2)
    make_synthetic_checkpoint(tmp_path / "a", cfg, seed=7, dtype="float32", num_files=2)
    make_synthetic_checkpoint(tmp_path / "b", cfg, seed=7, dtype="float32", num_files=2)
    make_synthetic_checkpoint(tmp_path / "c", cfg, seed=8, dtype="float32", num_files=2)
    ra, rb, rc = (CheckpointReader(tmp_path / s) for s in "abc")
    name = MOE + "experts.9.w2.weight"
    np.testing.assert_array_equal(ra.read(name), rb.read(name))
    assert not np.array_equal(ra.read(name), rc.read(name))
    assert from_hf_config(tmp_path / "a") == cfg
    tensors = {1: {}}
    for full in ra._file_of:
        if full.startswith(MOE):
            tensors[1][full[len(MOE):]] = ra.read(full).astype(np.float64)
    check_layer(ra, cfg, tensors, 1, T=3)
    with pytest.raises(FileExistsError):
        make_synthetic_checkpoint(tmp_path / "a", cfg, seed=7)


def test_fingerprint_sees_values_not_only_names(small, tmp_path):
    """Equal for byte-identical copies; different when tensor values differ
    (another seed, same names and sizes) or a byte flips in a sampled window."""
    from k3jax.checkpoint.reader import FINGERPRINT_WINDOW

    first, second = small(), small()
    assert CheckpointReader(first).fingerprint() == CheckpointReader(second).fingerprint()
    cfg = TINY.replace(num_hidden_layers=2)
    reseeded = tmp_path / "reseeded"
    write_checkpoint(reseeded, cfg, stored_items(cfg, random_layers(cfg, seed=4))[0])
    file = "model.safetensors"
    assert (reseeded / file).stat().st_size == (first / file).stat().st_size
    assert CheckpointReader(reseeded).fingerprint() != CheckpointReader(first).fingerprint()

    size = (first / file).stat().st_size
    assert size > 3 * FINGERPRINT_WINDOW
    for offset in (size // 2, size - 1):          # a tensor byte in the middle / last window
        data = bytearray((second / file).read_bytes())
        data[offset] ^= 0x01
        (second / file).write_bytes(bytes(data))
        assert CheckpointReader(second).fingerprint() != CheckpointReader(first).fingerprint()
        data[offset] ^= 0x01
        (second / file).write_bytes(bytes(data))
        assert CheckpointReader(second).fingerprint() == CheckpointReader(first).fingerprint()


@pytest.mark.parametrize("suffix, value", [("gate.weight", np.nan), ("experts.5.w3.weight", np.inf),
                                           ("gate.e_score_correction_bias", -np.inf)])
@pytest.mark.parametrize("dtype", [np.float32, BF16])
def test_nan_or_inf_weights_are_named(small, suffix, value, dtype):
    name = MOE + suffix

    def poison(items):
        out = []
        for n, a in items:
            if n == name:
                a = a.astype(dtype if a.ndim == 2 else np.float32)   # the bias stays float32
                a[(3,) * a.ndim] = value
            out.append((n, a))
        return out
    d = small(poison)
    index = [3] * (1 if "bias" in suffix else 2)
    with pytest.raises(CheckpointError, match=re.escape(f"tensor {name} holds NaN or inf "
                                                        f"(the first at index {index})")):
        load_layer(d, 1, backend="xla")


def test_nan_found_in_a_sharded_block_names_the_global_index(small, eight_devices):
    name = MOE + "shared_experts.gate_proj.weight"     # stored [128, 96]; tp=8 reads row slices

    def poison(items):
        out = [(n, a.copy()) for n, a in items]
        dict(out)[name][50, 3] = np.nan
        return out
    d = small(poison)
    with pytest.raises(CheckpointError, match=re.escape(f"{name} holds NaN or inf (the first at "
                                                        f"index [50, 3])")):
        load_layer(d, 1, ParallelConfig(tp=8), backend="xla")


@pytest.mark.parametrize("suffix", ["experts.15.w2.weight", "shared_experts.down_proj.weight"])
def test_every_header_is_checked_before_any_data_is_read(small, monkeypatch, suffix):
    """A tensor missing late in the layer (the last expert, the shared expert,
    read after the routed experts) fails before a single byte of data is read."""
    name = MOE + suffix
    d = small(drop(name))
    reads = []
    real_read = CheckpointReader.read
    monkeypatch.setattr(CheckpointReader, "read",
                        lambda self, *a, **k: reads.append(a[0]) or real_read(self, *a, **k))
    with pytest.raises(CheckpointError, match=f"missing tensor {re.escape(name)}"):
        load_layer(d, 1, backend="xla")
    assert reads == []


def test_progress_counts_the_bytes_read(small, monkeypatch, eight_devices):
    """The bar's total is the bytes of this process's distinct blocks, and
    every block read advances it by its size."""
    import tqdm

    bars = []

    class Recording:
        def __init__(self, total, unit, **kwargs):
            self.total, self.unit, self.seen = total, unit, 0
            bars.append(self)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def update(self, n):
            self.seen += n

    monkeypatch.setattr(tqdm, "tqdm", Recording)
    d = small()
    module = load_layer(d, 1, ParallelConfig(tp=8), backend="xla", progress=True)
    (bar,) = bars
    assert bar.unit == "B" and bar.seen == bar.total
    # tp=8: the MoE's replicated parameters once, the rest in eight distinct slices
    total = sum(v.get_value().nbytes for _, v in nnx.to_flat_state(nnx.state(module, WEIGHTS)))
    assert bar.total == total


def test_written_checkpoints_get_the_usual_permissions(tmp_path):
    umask = os.umask(0o022)
    try:
        make_synthetic_checkpoint(tmp_path / "c", TINY.replace(num_hidden_layers=2), num_files=2)
    finally:
        os.umask(umask)
    assert (tmp_path / "c").stat().st_mode & 0o777 == 0o755
    for file in (tmp_path / "c").iterdir():
        assert file.stat().st_mode & 0o777 == 0o644, file


def test_more_files_than_tensors_is_refused(tmp_path):
    from k3jax.checkpoint.writer import synthetic_tensor_count, synthetic_tensors

    cfg = TINY.replace(num_hidden_layers=2)
    for experts in ("dense", "mxfp4"):
        assert synthetic_tensor_count(cfg, experts) == sum(
            1 for _ in synthetic_tensors(cfg, 0, experts=experts))
    count = synthetic_tensor_count(cfg)
    with pytest.raises(ValueError, match=f"num_files {count + 1} exceeds the number of tensors"):
        make_synthetic_checkpoint(tmp_path / "c", cfg, num_files=count + 1)
    assert os.listdir(tmp_path) == []
