"""``k3jax run --backend interpret``: the Pallas Mosaic GPU kernels (grouped
gate/up + SiTU, grouped down, fused dense/shared MLP up) in GPU interpret mode,
end to end through the CLI (in-process, this process has 8 simulated CPU
devices), on tiny float32 synthetic checkpoints with an odd token count.

Each run is checked against the float64 numpy reference (tests/reference_np.py)
and against ``--backend xla`` (relative: max |err| / max |ref|). ``--backend
xla`` is plain float32 XLA: within 1e-5 (measured <= 5.9e-7). The kernels run
float32 as a split-bf16 (bf16x3) product: within TOL_KERNEL = 5e-5, the kernel
tests' TOL_F32_KERNEL (measured 5.6e-6..7.9e-6 here, vs the reference and vs
xla; a plain bf16 product, ~3e-3, fails). Layouts: one device; 2 devices with
sequence parallelism + expert parallelism + the TP-sharded shared expert
(8 local experts, 3 token rows and 64 or 80 intermediate columns per device);
2 devices of plain TP (columns split, 32 expert columns per device); 2 devices
of dp (token rows split: 3 per device, weights replicated).
"""

from __future__ import annotations

import glob
import os

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file

from k3jax.checkpoint import make_synthetic_checkpoint
from k3jax.cli import main
from k3jax.config import TINY
from numerics import rel_err
from pallas_kernels.grouped_matmul import (
    mosaic_sm90,
    mosaic_sm90_mxfp4,
    mosaic_sm90_mxfp4_swap_ab,
    mosaic_sm90_swap_ab,
)
from pallas_kernels.mxfp4 import dequant_numpy
from reference_np import np_mlp, np_moe, np_route

pytestmark = pytest.mark.slow

TOKENS = 5  # odd: pads to 6 rows under sequence parallelism over 2 devices
TOL_XLA = 1e-5      # float32 XLA vs float64 (measured <= 5.9e-7)
TOL_KERNEL = 5e-5   # bf16x3 kernels (measured <= 7.9e-6); = tests/kernels TOL_F32_KERNEL
LAYOUTS = {
    "single": ["--devices", "1"],
    # SP + EP on 2 devices (tests/test_interpret_hang_runs.py runs 8, in a fresh process)
    "sp_ep": ["--devices", "2", "--tp", "2", "--sequence-parallel", "--expert-parallel",
              "--shard-shared-expert"],
    # plain TP (experts and the dense/shared MLP column-sharded, one all-reduce)
    "tp": ["--devices", "2", "--tp", "2"],
    # data parallel: token rows split, weights replicated
    "dp": ["--devices", "2", "--dp", "2"],
}
PREFIXES = {0: "model.layers.0.mlp.", 1: "model.layers.1.block_sparse_moe."}


def layer_tensors(ckpt, layer: int) -> dict[str, np.ndarray]:
    """{checkpoint suffix: float64} of one layer, MXFP4 experts decoded."""
    prefix = PREFIXES[layer]
    raw = {}
    for path in glob.glob(os.path.join(ckpt, "*.safetensors")):
        raw.update({k[len(prefix):]: v for k, v in load_file(path).items() if k.startswith(prefix)})
    out = {}
    for name, value in raw.items():
        if name.endswith(".weight_packed"):
            weight = name[:-len("_packed")]
            out[weight] = dequant_numpy(value, raw[weight + "_scale"]).astype(np.float64)
        elif not name.endswith(".weight_scale"):
            out[name] = value.astype(np.float64)
    return out


def reference(ckpt, layer: int, x) -> np.ndarray:
    t = layer_tensors(ckpt, layer)
    if layer == 0:
        return np_mlp(x, t["gate_proj.weight"], t["up_proj.weight"], t["down_proj.weight"], TINY)
    # The test is only meaningful when float32 rounding cannot change the routing.
    _, weights = np_route(x, t["gate.weight"], t["gate.e_score_correction_bias"], TINY)
    scores = 1.0 / (1.0 + np.exp(-(np.asarray(x, np.float64) @ t["gate.weight"].T)))
    biased = np.sort(scores + t["gate.e_score_correction_bias"], axis=1)[:, ::-1]
    k = TINY.num_experts_per_token
    assert np.min(biased[:, k - 1] - biased[:, k]) > 1e-4, "routing near a tie: pick another x"
    assert np.all(weights > 0)
    return np_moe(x, t, TINY)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Tiny float32 synthetic checkpoints: dense experts, and MXFP4-packed experts."""
    root = tmp_path_factory.mktemp("interpret")
    make_synthetic_checkpoint(root / "dense", TINY, 11, dtype="float32")
    make_synthetic_checkpoint(root / "mxfp4", TINY, 12, dtype="float32", experts="mxfp4")
    return {"dense": root / "dense", "mxfp4": root / "mxfp4"}


@pytest.fixture(scope="module")
def x_path(tmp_path_factory):
    x = np.random.default_rng(2024).standard_normal((TOKENS, TINY.hidden_size)).astype(np.float32)
    path = tmp_path_factory.mktemp("x") / "x.npy"
    np.save(path, x)
    return path


def _record_launches(monkeypatch, module, launcher: str, calls: list) -> None:
    """Wrap ``module.<launcher>(x_MK, weights, group_sizes_G, **kwargs)`` so each
    traced launch appends (weight count, x shape, weight shape) to ``calls``
    and must run in interpret mode."""
    original = getattr(module, launcher)

    def spy(x_MK, weights, group_sizes_G, **kwargs):
        assert kwargs["interpret"], "the interpret backend must run the kernel in interpret mode"
        calls.append((len(weights), tuple(x_MK.shape), tuple(weights[0].shape)))
        return original(x_MK, weights, group_sizes_G, **kwargs)

    monkeypatch.setattr(module, launcher, spy)


@pytest.fixture
def kernel_calls(monkeypatch):
    """Records (weight count, x shape, weight shape) of every Mosaic kernel launch
    traced: the row-major tiles (mosaic_sm90) and the weights-on-M decode tiles
    (mosaic_sm90_swap_ab, which the launcher picks at small rows per group)."""
    calls = []
    _record_launches(monkeypatch, mosaic_sm90, "_grouped_call", calls)
    _record_launches(monkeypatch, mosaic_sm90_swap_ab, "_grouped_call", calls)
    monkeypatch.delenv("K3JAX_SHARD_SP_SHARED_EXPERT", raising=False)
    return calls


def run(ckpt, layer: int, x_path, out, backend: str, flags, *extra) -> np.ndarray:
    argv = ["run", "--checkpoint", str(ckpt), "--layer", str(layer), "--input", str(x_path),
            "--output", str(out), "--backend", backend, "--dtype", "float32", *flags, *extra]
    assert main(argv) == 0, argv
    y = np.load(out)
    assert y.dtype == np.float32 and y.shape == (TOKENS, TINY.hidden_size)
    return y


@pytest.mark.parametrize("layer", [1, 0], ids=["moe", "dense"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_interpret_matches_reference_and_xla(checkpoints, x_path, tmp_path, layout, layer,
                                             kernel_calls, capsys):
    # the dense layer has no routed experts: --expert-parallel is a usage error there
    flags = [f for f in LAYOUTS[layout] if layer or f != "--expert-parallel"]
    y_kernel = run(checkpoints["dense"], layer, x_path, tmp_path / "k.npy", "interpret", flags)
    out = capsys.readouterr().out
    assert f"layer {layer} ({'MoE' if layer else 'dense MLP'}), T={TOKENS}" in out
    assert "backend=interpret" in out
    if layout != "single":
        assert "on 2 cpu device(s)" in out
    if layout == "sp_ep":
        assert ("expert-parallel (ep=2)" in out) if layer else ("dense MLP: sp-sharded" in out)
    elif layout == "tp":
        assert "dense MLP: tensor-parallel" in out
        assert "routed dispatch: all-reduce" in out or not layer
    elif layout == "dp":
        assert "mesh: {'data': 2, 'tensor': 1}" in out and "dense MLP: replicated" in out
    # The kernels really ran: fused gate/up (2 weights) + down (1) for the routed
    # experts and the fused up-projection of the shared expert / dense MLP.
    launched = {num_w for num_w, _, _ in kernel_calls}
    assert launched == ({1, 2} if layer else {2}), kernel_calls
    if layout == "sp_ep" and layer == 1:  # per-device shapes: 16 experts / 2 devices = 8 local
        assert any(num_w == 2 and w_shape[0] == 8 for num_w, _, w_shape in kernel_calls)
    if layout == "tp":  # per-device columns: experts 64 / 2, shared 128 / 2, dense 160 / 2
        want_n = {(2, 16, 32), (1, 16, 64), (2, 1, 64)} if layer else {(2, 1, 80)}
        assert {(num_w, w[0], w[2]) for num_w, _, w in kernel_calls} == want_n, kernel_calls
    if layout == "dp":  # 5 rows split over 2 devices: 3 each (MoE: 3 x top-k 4 routed rows)
        want_m = {12, 3} if layer else {3}
        assert {x[0] for _, x, _ in kernel_calls} == want_m, kernel_calls

    y_xla = run(checkpoints["dense"], layer, x_path, tmp_path / "x.npy", "xla", flags)
    want = reference(checkpoints["dense"], layer, np.load(x_path))
    err_kernel, err_xla = rel_err(y_kernel, want), rel_err(y_xla, want)
    assert err_kernel <= TOL_KERNEL, f"interpret vs float64 reference: {err_kernel:.3g}"
    assert err_xla <= TOL_XLA, f"xla vs float64 reference: {err_xla:.3g}"
    assert rel_err(y_kernel, y_xla) <= TOL_KERNEL


TOL_MXFP4 = {"float32": 1e-4, "bfloat16": 1e-2}


def _bf16(a: np.ndarray) -> np.ndarray:
    """float64 of a rounded to bfloat16 (what the bfloat16 run sees)."""
    return np.asarray(a, np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)


@pytest.fixture
def mxfp4_kernel_calls(monkeypatch):
    """Records (weight count, x shape, logical weight shape) of every MXFP4
    Mosaic kernel launch traced (mosaic_sm90_mxfp4._mxfp4_call, or
    mosaic_sm90_mxfp4_swap_ab._call: the kernel the dispatch takes)."""
    calls = []
    _record_launches(monkeypatch, mosaic_sm90_mxfp4, "_mxfp4_call", calls)
    _record_launches(monkeypatch, mosaic_sm90_mxfp4_swap_ab, "_call", calls)
    return calls


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("layout", ["single", "sp_ep"])
def test_interpret_with_packed_mxfp4_experts(checkpoints, x_path, tmp_path, kernel_calls,
                                             mxfp4_kernel_calls, capsys, layout, dtype):
    """Experts stay MXFP4-packed on the device; the routed grouped matmuls take
    them packed (Mxfp4Weights) into the MXFP4 Mosaic kernels (in-kernel decode:
    mosaic_sm90_mxfp4_swap_ab.py at these sizes; fused gate/up and down), and the shared expert's
    bf16 up-projection runs the plain Mosaic kernel."""
    flags = LAYOUTS[layout]
    argv = ["run", "--checkpoint", str(checkpoints["mxfp4"]), "--layer", "1", "--input",
            str(x_path), "--output", str(tmp_path / "y.npy"), "--backend", "interpret",
            "--dtype", dtype, *flags, "--mxfp4", "packed"]
    assert main(argv) == 0, argv
    y = np.load(tmp_path / "y.npy")
    out = capsys.readouterr().out
    assert "w1_packed_EFL" in out and "w2_scale_EFL" in out, out  # packed on the device
    assert {num_w for num_w, _, _ in kernel_calls} == {2}, kernel_calls
    assert {num_w for num_w, _, _ in mxfp4_kernel_calls} == {1, 2}, mxfp4_kernel_calls
    if layout == "sp_ep":  # per-device: 16 experts / 2 devices = 8 local
        assert all(w_shape[0] == 8 for _, _, w_shape in mxfp4_kernel_calls), mxfp4_kernel_calls
    x = np.load(x_path)
    if dtype == "bfloat16":   # the reference sees the bf16-rounded input and weights
        t = {k: _bf16(v) for k, v in layer_tensors(checkpoints["mxfp4"], 1).items()}
        want = np_moe(_bf16(x), t, TINY)
    else:
        want = reference(checkpoints["mxfp4"], 1, x)
    err = rel_err(y, want)
    assert err <= TOL_MXFP4[dtype], f"interpret (MXFP4 packed, {dtype}) vs float64: {err:.3g}"
