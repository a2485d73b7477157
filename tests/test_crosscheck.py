"""k3jax against the torch reference (k3jax.reference) and the independent
float64 numpy reference, on fresh random weights written to a synthetic
checkpoint that both sides load: the dense MLP, the router, the whole MoE
layer (float32 and bfloat16), T in {1, 7, 64}, plain and grouped top-k."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch

from k3jax.checkpoint import CheckpointReader, load_layer, write_checkpoint
from k3jax.checkpoint.names import layer_prefix
from k3jax.config import TINY, TINY_GROUPED
from k3jax.ops import route
from k3jax.reference import load_layer_from_safetensors
from k3jax.reference import route as torch_route
from numerics import jitted, rel_err
from reference_np import np_mlp, np_moe, random_moe_tensors

CONFIGS = {"tiny": TINY, "grouped": TINY_GROUPED}
TOKENS = (1, 7, 64)


def dense_tensors(cfg, rng):
    D, F = cfg.hidden_size, cfg.intermediate_size
    return {"gate_proj.weight": rng.standard_normal((F, D)) / np.sqrt(D),
            "up_proj.weight": rng.standard_normal((F, D)) / np.sqrt(D),
            "down_proj.weight": rng.standard_normal((D, F)) / np.sqrt(F)}


def write_random(directory, cfg, seed, dtype):
    """A checkpoint of ``cfg`` with fresh random weights stored in ``dtype``
    (router bias float32); returns {layer: {suffix: float64 of the stored values}}."""
    rng = np.random.default_rng(seed)
    layers = {}
    items = []
    for layer in range(cfg.num_hidden_layers):
        moe = cfg.is_moe_layer(layer)
        raw = random_moe_tensors(cfg, rng, bias_scale=0.1) if moe else dense_tensors(cfg, rng)
        stored = {k: v.astype(np.float32 if k.endswith("bias") else dtype) for k, v in raw.items()}
        layers[layer] = {k: v.astype(np.float64) for k, v in stored.items()}
        items += [(layer_prefix(layer, moe) + k, v) for k, v in stored.items()]
    write_checkpoint(directory, cfg, items, num_files=2)
    return layers


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{(config name, "float32" | "bfloat16"): (dir, cfg, float64 tensors per layer)}."""
    out = {}
    for i, (name, cfg) in enumerate(sorted(CONFIGS.items())):
        for dtype in ("float32", "bfloat16"):
            d = tmp_path_factory.mktemp(f"xcheck-{name}-{dtype}") / "ckpt"
            np_dtype = np.float32 if dtype == "float32" else ml_dtypes.bfloat16
            out[name, dtype] = d, cfg, write_random(d, cfg, seed=100 + i, dtype=np_dtype)
    return out


def tokens(num_tokens, hidden, seed, bf16=False):
    x = np.random.default_rng(seed).standard_normal((num_tokens, hidden)).astype(np.float32)
    return x.astype(ml_dtypes.bfloat16).astype(np.float32) if bf16 else x


def torch_forward(module, x):
    with torch.no_grad():
        return module(torch.from_numpy(x)).to(torch.float64).numpy()


def test_dense_mlp(checkpoints):
    d, cfg, layers = checkpoints["tiny", "float32"]
    ours = jitted(load_layer(d, 0, backend="xla"))
    theirs = load_layer_from_safetensors(d, 0, cfg, torch.float32)
    t = layers[0]
    for T in TOKENS:
        x = tokens(T, cfg.hidden_size, seed=T)
        want = np_mlp(x, t["gate_proj.weight"], t["up_proj.weight"], t["down_proj.weight"], cfg)
        got = ours(x)
        assert got.shape == (T, cfg.hidden_size)
        assert rel_err(got, want) < 1e-5
        assert rel_err(got, torch_forward(theirs, x)) < 1e-5


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_router(checkpoints, name):
    """Same id SETS and weights to 1e-6, from the weights each side loaded."""
    d, cfg, _ = checkpoints[name, "float32"]
    moe = load_layer(d, 1, backend="xla")
    theirs = load_layer_from_safetensors(d, 1, cfg, torch.float32)
    x = tokens(64, cfg.hidden_size, seed=5)
    ids, w = jax.jit(lambda x, r, b: route(x, r, b, cfg))(x, moe.router_DE[...], moe.router_bias_E[...])
    tids, tw = torch_route(torch.from_numpy(x), theirs.gate.weight, theirs.gate.e_score_correction_bias,
                           cfg)
    ids, w, tids, tw = np.asarray(ids), np.asarray(w), tids.numpy(), tw.detach().numpy()
    o, to = np.argsort(ids, 1), np.argsort(tids, 1)
    np.testing.assert_array_equal(np.take_along_axis(ids, o, 1), np.take_along_axis(tids, to, 1))
    np.testing.assert_allclose(np.take_along_axis(w, o, 1), np.take_along_axis(tw, to, 1), atol=1e-6)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_moe_float32(checkpoints, name):
    d, cfg, layers = checkpoints[name, "float32"]
    reader = CheckpointReader(d)
    for layer in (1, 2):
        ours = jitted(load_layer(reader, layer, backend="xla"))
        theirs = load_layer_from_safetensors(d, layer, cfg, torch.float32)
        for T in TOKENS if layer == 1 else (7,):
            x = tokens(T, cfg.hidden_size, seed=10 * layer + T)
            got = ours(x)
            assert got.shape == (T, cfg.hidden_size)
            want = np_moe(x, layers[layer], cfg)
            assert rel_err(got, want) < 1e-5, (layer, T)
            assert rel_err(got, torch_forward(theirs, x)) < 1e-5, (layer, T)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_moe_bfloat16_parameters(checkpoints, name):
    """bf16 parameters and activations vs float32 (torch) / float64 (numpy) on
    the same stored bf16 weights and bf16-representable inputs."""
    d, cfg, layers = checkpoints[name, "bfloat16"]
    moe = load_layer(d, 1, dtype=jnp.bfloat16, backend="xla")
    assert moe.w1_ELF[...].dtype == jnp.bfloat16 and moe.router_bias_E[...].dtype == jnp.float32
    ours = jitted(moe)
    theirs = load_layer_from_safetensors(d, 1, cfg, torch.float32)
    x = tokens(64, cfg.hidden_size, seed=21, bf16=True)
    got = ours(x)
    want32 = torch_forward(theirs, x)
    assert rel_err(want32, np_moe(x, layers[1], cfg)) < 1e-5
    err = rel_err(got, want32)
    assert 1e-5 < err < 1e-2, err     # bf16 rounding is visible, and small (measured ~4.0e-3)
