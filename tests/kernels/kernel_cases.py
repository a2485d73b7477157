"""Shared test base for tests/kernels: inputs, group patterns, independent
float64 numpy references and the comparison helpers every kernel test uses.

Comparisons are relative: max |out - ref| / max |ref| (NaN anywhere -> inf, so
NaN never passes).
"""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _REPO_ROOT not in sys.path:  # pallas_kernels importable however pytest is launched
    sys.path.insert(0, _REPO_ROOT)

BETA, LINEAR_BETA = 4.0, 25.0  # K3's activation_situ_beta / activation_situ_linear_beta

# Tolerances on rel_err. TOL_F32: float32 XLA vs float64 numpy (measured
# <= 5e-7). TOL_F32_KERNEL: the Mosaic kernels on float32 inputs, a split-bf16
# (bf16x3) product accumulated in f32 (measured 4e-6..7e-6 in interpret mode;
# the old single-bf16 cast measured 2e-3..5e-3 and must fail it). TOL_BF16:
# bf16 inputs and output.
TOL_F32 = 1e-5
TOL_F32_KERNEL = 5e-5
TOL_BF16 = 1e-2


def kernel_tol(dtype) -> float:
    """Tolerance of a Mosaic kernel output vs the float32 reference, by input dtype."""
    return TOL_F32_KERNEL if jnp.dtype(dtype) == jnp.dtype(jnp.float32) else TOL_BF16


def rel_err(out, ref) -> float:
    """max |out - ref| / max |ref| in float64; inf when either holds a NaN/inf."""
    out64, ref64 = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    if out64.shape != ref64.shape:
        raise AssertionError(f"shape {out64.shape} != reference shape {ref64.shape}")
    if not (np.all(np.isfinite(out64)) and np.all(np.isfinite(ref64))):
        return float("inf")
    scale = max(float(np.max(np.abs(ref64), initial=0.0)), 1e-30)
    return float(np.max(np.abs(out64 - ref64), initial=0.0)) / scale


def assert_close(out, ref, tol: float, what: str = "") -> None:
    """Fail unless rel_err(out, ref) <= tol (NaN never passes)."""
    err = rel_err(out, ref)
    assert err <= tol, f"{what}: relative error {err:.3g} > {tol:.3g}"


def assert_grouped_output(out_MN, ref_MN, group_sizes, tol: float, what: str = "") -> None:
    """No NaN anywhere, rows >= sum(sizes) exactly 0, valid rows match ref."""
    out = np.asarray(out_MN, np.float64)
    total = int(np.sum(group_sizes))
    assert not np.isnan(out).any(), f"{what}: NaN in output (unwritten or leaked rows)"
    assert np.all(out[total:] == 0.0), f"{what}: rows >= {total} are not exact zeros"
    if total:
        assert_close(out[:total], np.asarray(ref_MN, np.float64)[:total], tol, what)


def normal(key, shape, dtype, scale: float = 1.0) -> jax.Array:
    """N(0, scale^2) array of the given dtype (generated in f32, then cast)."""
    return (scale * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


def grouped_inputs(seed: int, m: int, k: int, n: int, g: int, dtype, num_weights: int = 1):
    """x [m, k] ~ N(0, 1) and num_weights weights [g, k, n] ~ N(0, 1/k) (O(1) outputs)."""
    keys = jax.random.split(jax.random.key(seed), 1 + num_weights)
    x = normal(keys[0], (m, k), dtype)
    ws = [normal(kk, (g, k, n), dtype, scale=k ** -0.5) for kk in keys[1:]]
    return x, ws


def mxfp4_from_kn(packed_GKN, scale_GKN):
    """Mxfp4Weights from checkpoint codes packed along axis 1 of [G, K/2, N]
    (the layout the tests' numpy decoders read) and scales [G, K/32, N]: the
    codes are moved to the container's [G, N, K/2] and interleaved into its
    word layout (Mxfp4Weights.from_checkpoint)."""
    from pallas_kernels.mxfp4 import Mxfp4Weights
    return Mxfp4Weights.from_checkpoint(jnp.swapaxes(jnp.asarray(packed_GKN), 1, 2),
                                        jnp.asarray(scale_GKN))


def random_mxfp4(rng: np.random.Generator, g: int, k: int, n: int, lo: int = 120,
                 hi: int = 134) -> tuple[np.ndarray, np.ndarray]:
    """Random codes uint8 [G, K/2, N] (packed along K) and scale bytes uint8
    [G, K/32, N] in [lo, hi)."""
    return (rng.integers(0, 256, (g, k // 2, n), dtype=np.uint8),
            rng.integers(lo, hi, (g, k // 32, n), dtype=np.uint8))


def decode_mxfp4_gkn(packed_GKN, scale_GKN) -> np.ndarray:
    """float64 [G, K, N] of codes packed along axis 1 (random_mxfp4's layout),
    through the codec (which decodes along the last axis)."""
    from pallas_kernels.mxfp4 import dequant_numpy
    return np.swapaxes(dequant_numpy(np.swapaxes(packed_GKN, 1, 2), np.swapaxes(scale_GKN, 1, 2)),
                       1, 2).astype(np.float64)


def group_pattern(name: str, m: int, g: int) -> np.ndarray:
    """int32 [g] group sizes for a named pattern over m rows."""
    if name == "uniform":
        sizes = np.full(g, m // g)
        sizes[: m - sizes.sum()] += 1
    elif name == "zeros_skewed":  # empty first/last/every other group + one big group
        sizes = np.zeros(g, np.int64)
        sizes[2:g - 1:2] = 3
        sizes[1] = m - sizes.sum()
    elif name == "one_group_all":
        sizes = np.zeros(g, np.int64)
        sizes[g // 2] = m
    elif name == "sum_lt_m":  # trailing rows belong to no group and must be 0
        sizes = np.full(g, (m * 3 // 5) // g)
        sizes[0] += 1
    elif name == "all_empty":
        sizes = np.zeros(g, np.int64)
    else:
        raise ValueError(name)
    assert sizes.sum() <= m and (sizes >= 0).all(), (name, sizes)
    return sizes.astype(np.int32)


def poison_tail(x_MK: jax.Array, group_sizes) -> jax.Array:
    """x with every row >= sum(group_sizes) set to NaN."""
    total = int(np.sum(group_sizes))
    rows = jnp.arange(x_MK.shape[0])[:, None]
    return jnp.where(rows >= total, jnp.nan, x_MK).astype(x_MK.dtype)


def np_situ_glu(gate, up, beta: float = BETA, linear_beta: float | None = LINEAR_BETA):
    """float64 numpy SiTU-GLU straight from SPEC section 2."""
    gate, up = np.asarray(gate, np.float64), np.asarray(up, np.float64)
    gate_act = beta * np.tanh(gate / beta) / (1.0 + np.exp(-gate))
    up_act = up if linear_beta is None else linear_beta * np.tanh(up / linear_beta)
    return gate_act * up_act


def np_grouped_matmul(x, w, group_sizes) -> np.ndarray:
    """float64 loop over groups; rows past sum(group_sizes) stay 0."""
    x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
    out = np.zeros((x64.shape[0], w64.shape[2]))
    start = 0
    for g, size in enumerate(np.asarray(group_sizes)):
        for r in range(start, start + int(size)):
            out[r] = x64[r] @ w64[g]
        start += int(size)
    return out


def group_rows(group_sizes):
    """(g, slice of group g's rows) for each group, in row order."""
    start = 0
    for g, size in enumerate(np.asarray(group_sizes)):
        yield g, slice(start, start + int(size))
        start += int(size)


def np_tgmm(x, dy, group_sizes) -> np.ndarray:
    """float64 per-group x_g^T @ dy_g [G, K, N]; empty groups 0."""
    x64, dy64 = np.asarray(x, np.float64), np.asarray(dy, np.float64)
    out = np.zeros((len(group_sizes), x64.shape[1], dy64.shape[1]))
    for g, rows in group_rows(group_sizes):
        out[g] = x64[rows].T @ dy64[rows]
    return out


def np_grouped_situ_glu(x, w_gate, w_up, group_sizes, beta=BETA, linear_beta=LINEAR_BETA):
    """float64 reference of the fused grouped gate/up + SiTU-GLU."""
    gate = np_grouped_matmul(x, w_gate, group_sizes)
    up = np_grouped_matmul(x, w_up, group_sizes)
    return np_situ_glu(gate, up, beta, linear_beta)  # situ(0, 0) == 0 keeps the tail 0


def f32(a) -> jax.Array:
    """Upcast to float32 (the reference sees exactly the kernel's input values)."""
    return jnp.asarray(a).astype(jnp.float32)


def lower_for_sm90(fn, *arg_specs) -> str:
    """Lower fn for the CUDA platform on any host (runs the Mosaic GPU Python
    pipeline: Pallas lowering, layout inference, SMEM budget check for sm_90)."""
    traced = jax.jit(fn).trace(*arg_specs)
    return traced.lower(lowering_platforms=("cuda",)).as_text()


def swap_ab_case_id(case) -> str:
    """Test id of a mosaic_sm90_swap_ab case (m, k, n, sizes, dtype, SwapABConfig)."""
    m, k, n, sizes, dtype, cfg = case
    return (f"{m}x{k}x{n}_{jnp.dtype(dtype).name}_wg{cfg.num_compute_wgs}x{cfg.wg_block_w}"
            f"_t{cfg.block_t}_s{cfg.split_k}" + (f"_c{cfg.cluster}" if cfg.cluster > 1 else ""))


def check_swap_ab_products(case, seed: int) -> None:
    """Both products of a swap-AB case in interpret mode (the plain and the
    fused kernel) against the float64 loop on fresh inputs; tail rows exactly
    0, no NaN from the poisoned tail of x."""
    from pallas_kernels.grouped_matmul import mosaic_sm90_swap_ab as dec

    m, k, n, sizes, dtype, cfg = case
    sizes = np.asarray(sizes, np.int32)
    x, (wg, wu) = grouped_inputs(seed, m, k, n, len(sizes), dtype, 2)
    x = poison_tail(x, sizes)
    sizes_j = jnp.asarray(sizes)
    y = dec.grouped_matmul(x, wg, sizes_j, config=cfg, interpret=True)
    assert y.shape == (m, n) and y.dtype == dtype
    assert_grouped_output(y, np_grouped_matmul(f32(x), f32(wg), sizes), sizes,
                          kernel_tol(dtype), "plain " + swap_ab_case_id(case))
    h = dec.grouped_situ_glu(x, wg, wu, sizes_j, config=cfg, interpret=True,
                             beta=BETA, linear_beta=LINEAR_BETA)
    assert_grouped_output(h, np_grouped_situ_glu(f32(x), f32(wg), f32(wu), sizes), sizes,
                          kernel_tol(dtype), "fused " + swap_ab_case_id(case))


def spy_swap_ab_launches(monkeypatch) -> list:
    """The SwapABConfig of every mosaic_sm90_swap_ab launch from now on (the
    launcher's choice), recorded while the kernel still runs."""
    from pallas_kernels.grouped_matmul import mosaic_sm90_swap_ab as dec

    calls = []
    orig = dec._grouped_call

    def spy(*args, **kwargs):
        calls.append(kwargs["cfg"])
        return orig(*args, **kwargs)
    monkeypatch.setattr(dec, "_grouped_call", spy)
    return calls


def use_tile_rows(monkeypatch, rows: dict) -> None:
    """Replace the launchers' committed tile table with ``rows`` ({key: config
    or None for the row-major tiles}) for one test."""
    import dataclasses
    import functools

    from pallas_kernels.grouped_matmul import mosaic_sm90_swap_ab, tile_choice

    def entry(cfg):
        if cfg is None:
            return {"kernel": tile_choice.ROW_MAJOR}
        kind = (tile_choice.SWAP_AB if isinstance(cfg, mosaic_sm90_swap_ab.SwapABConfig)
                else tile_choice.MLP)
        return {"kernel": kind, **dataclasses.asdict(cfg)}
    patched = {key: entry(cfg) for key, cfg in rows.items()}
    monkeypatch.setattr(tile_choice, "tiles", lambda: patched)
    # a fresh index over the patched rows; the committed table's comes back after the test
    monkeypatch.setattr(tile_choice, "_index", functools.cache(tile_choice._index.__wrapped__))
