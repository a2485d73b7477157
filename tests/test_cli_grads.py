"""``k3jax run --cotangent DY.npy --grads OUT.safetensors``: the
gradients a run writes, against float64 torch autograd through the reference
layer loaded from the same checkpoint; frozen tensors left out; usage errors.
(The two-process run is in tests/test_multiprocess.py.) Measured: 60 s wall
on the shared 2-core machine."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from k3jax.checkpoint import make_synthetic_checkpoint
from k3jax.checkpoint.names import layer_prefix
from k3jax.cli import main
from k3jax.config import TINY
from k3jax.reference.torch_reference import load_layer_from_safetensors
from numerics import rel_err

T = 11          # not a multiple of 8: padding rows under sequence parallelism
SP_EP = ["--devices", "8", "--tp", "8", "--sequence-parallel", "--expert-parallel",
         "--shard-shared-expert"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Float32 and MXFP4-expert checkpoints, fresh x and dy [11, 96]."""
    root = tmp_path_factory.mktemp("grads")
    make_synthetic_checkpoint(root / "f32", TINY, seed=21, dtype="float32")
    make_synthetic_checkpoint(root / "mx", TINY, seed=21, dtype="float32", experts="mxfp4")
    rng = np.random.default_rng(77)
    for name in ("x", "dy"):
        np.save(root / f"{name}.npy", rng.standard_normal((T, TINY.hidden_size)).astype(np.float32))
    return root


def torch_grads(ckpt, layer: int, x, dy) -> dict[str, np.ndarray]:
    """{"input": dx, checkpoint name: grad} by float64 torch autograd (experts
    no token reaches: zero)."""
    ref = load_layer_from_safetensors(ckpt, layer, TINY, torch.float64)
    xt = torch.from_numpy(x.astype(np.float64)).requires_grad_(True)
    ref(xt).backward(torch.from_numpy(dy.astype(np.float64)))
    prefix = layer_prefix(layer, TINY.is_moe_layer(layer))
    out = {"input": xt.grad.numpy()}
    for k, p in ref.named_parameters():
        if p.requires_grad:
            out[prefix + k] = (p.grad if p.grad is not None else torch.zeros_like(p)).numpy()
    return out


def run_grads(files, ckpt, layer, out, *flags):
    rc = main(["run", "--checkpoint", str(files / ckpt), "--layer", str(layer),
               "--input", str(files / "x.npy"), "--cotangent", str(files / "dy.npy"),
               "--grads", str(out), "--backend", "xla", *flags])
    assert rc == 0
    return load_file(out)


@pytest.mark.parametrize("layer, flags", [(1, SP_EP), (0, ["--devices", "8", "--tp", "8"]), (1, [])],
                         ids=["moe-sp-ep", "dense-tp8", "moe-single"])
def test_run_writes_gradients_matching_torch_autograd(eight_devices, files, tmp_path, layer, flags,
                                                      capsys):
    got = run_grads(files, "f32", layer, tmp_path / "g.safetensors", *flags)
    assert f"wrote {tmp_path / 'g.safetensors'}" in capsys.readouterr().out
    want = torch_grads(files / "f32", layer, np.load(files / "x.npy"), np.load(files / "dy.npy"))
    assert set(got) == set(want)                      # e_score_correction_bias: not trainable
    assert got["input"].shape == (T, TINY.hidden_size)
    for name, w in want.items():
        assert got[name].dtype == np.float32 and got[name].shape == w.shape, name
        if not np.any(w):
            assert not np.any(got[name]), name        # an expert no token reached
            continue
        assert rel_err(got[name], w) < 1e-5, name


def test_mxfp4_experts_get_no_gradient(eight_devices, files, tmp_path):
    """Packed MXFP4 experts are frozen; the rest (and the input) match torch
    with the decoded experts."""
    got = run_grads(files, "mx", 1, tmp_path / "g.safetensors", *SP_EP)
    assert not [k for k in got if ".experts." in k]
    want = torch_grads(files / "mx", 1, np.load(files / "x.npy"), np.load(files / "dy.npy"))
    want = {k: v for k, v in want.items() if ".experts." not in k}
    assert set(got) == set(want)
    for name, w in want.items():
        assert rel_err(got[name], w) < 1e-5, name


def one_line_error(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize("case, words, code", [
    ("no cotangent", "--grads needs --cotangent DY.npy", 2),
    ("no grads", "--cotangent needs --grads OUT.safetensors", 2),
    ("wrong shape", "must have the input's shape [11, 96], got [10, 96]", 1),
    ("float64", "must be float32, got float64", 1),
    ("nan", "contains NaN or inf", 1),
    ("unreadable", "cannot read it", 1),
    ("unwritable", "--grads {tmp}/missing/g.safetensors: directory does not exist", 2),
    ("same file", "--grads and --output name the same file", 2),
])
def test_gradient_flag_and_file_errors_name_the_flag(files, tmp_path, case, words, code, capsys):
    """Flags exit 2 (usage), a bad --cotangent file 1 (bad data)."""
    dy = np.load(files / "dy.npy")
    bad = tmp_path / "bad.npy"
    grads, out = str(tmp_path / "g.safetensors"), str(tmp_path / "y.npy")
    flags = ["--input", str(files / "x.npy"), "--cotangent", str(bad), "--grads", grads,
             "--output", out]
    if case == "no cotangent":
        flags = flags[:2] + flags[4:]
    elif case == "no grads":
        flags = flags[:4] + flags[6:]
    elif case == "unwritable":
        flags[5] = str(tmp_path / "missing" / "g.safetensors")
    elif case == "same file":
        flags[5] = out
    content = {"wrong shape": dy[:10], "float64": dy.astype(np.float64),
               "nan": np.where(np.arange(T)[:, None] == 3, np.nan, dy).astype(np.float32)}
    if case in content:
        np.save(bad, content[case])
    elif case == "unreadable":
        bad.write_text("not a numpy file")
    else:
        np.save(bad, dy)
    existing = set(os.listdir(tmp_path))
    assert main(["run", "--backend", "xla", *flags]) == code
    err = one_line_error(capsys.readouterr().err)
    assert words.format(tmp=tmp_path) in err, err
    assert "--grads" in err or "--cotangent" in err
    assert set(os.listdir(tmp_path)) == existing            # nothing written


def test_help_says_what_is_frozen(capsys):
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "e_score_correction_bias" in text and "MXFP4 routed experts kept packed" in text
