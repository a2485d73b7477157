"""Tile arithmetic shared by the Mosaic grouped kernels: block fitting, SMEM
fitting, padding and the bf16 planes of an operand.

Planes: bf16/f16 operands stream through SMEM as one plane; float32 operands
as two bf16 planes (hi, lo) = split_bf16(a), multiplied as bf16x3 (PRODUCTS):
x_lo w_hi + x_hi w_lo + x_hi w_hi, float32-accurate to ~1e-5 relative.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TypeVar

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.hardware import H200

MIN_BLOCK = 16  # bf16 WGMMA: K step of 16; SMEM swizzle needs >= 32 B rows.
SMEM_LIMIT = H200.smem_per_block_optin  # opt-in shared memory of one CTA
SMEM_RESERVE = 1024  # barriers and alignment
SMEM_BUDGET = SMEM_LIMIT - SMEM_RESERVE  # what a kernel's tiles may take

# (x plane, w plane) products per K step and weight. One plane: the native
# product. Two planes (hi, lo) of float32 operands: bf16x3, small terms first.
PRODUCTS = {1: ((0, 0),), 2: ((1, 0), (0, 1), (0, 0))}

Config = TypeVar("Config")


def fit_block(dim: int, preferred: int, minimum: int) -> int:
    """Largest power-of-two block in [minimum, preferred] dividing dim (0 if none)."""
    block = preferred
    while block >= minimum:
        if dim % block == 0:
            return block
        block //= 2
    return 0


def padded_block(dim: int, preferred: int, minimum: int) -> int:
    """Block for a dim no allowed block divides (dim is then zero-padded to a
    multiple of it): the smallest power of two >= dim in [minimum, preferred],
    so tiny per-device dims (e.g. 16 columns at tp 8) pad to one small block."""
    return min(preferred, max(minimum, 1 << max(dim - 1, 0).bit_length()))


def block_for(dim: int, preferred: int, minimum: int) -> int:
    """fit_block, or padded_block where no allowed block divides dim."""
    return fit_block(dim, preferred, minimum) or padded_block(dim, preferred, minimum)


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def pad_axis(a: jax.Array, axis: int, size: int) -> jax.Array:
    """Zero-pad ``a`` along ``axis`` up to ``size`` (no-op when already that size)."""
    if a.shape[axis] == size:
        return a
    widths = [(0, 0)] * a.ndim
    widths[axis] = (0, size - a.shape[axis])
    return jnp.pad(a, widths)


def fit_stages(cfg: Config, smem_bytes: Callable[[Config], int]) -> Config:
    """Drop cfg.max_concurrent_steps (to >= 2) until smem_bytes(cfg) fits SMEM_BUDGET."""
    while cfg.max_concurrent_steps > 2 and smem_bytes(cfg) > SMEM_BUDGET:
        cfg = dataclasses.replace(cfg, max_concurrent_steps=cfg.max_concurrent_steps - 1)
    return cfg


def fit_smem(cfg: Config, smem_bytes: Callable[[Config], int], min_block_n: int) -> Config:
    """fit_stages; if two stages still do not fit, halve cfg.block_n (>=
    min_block_n) and start over from cfg's stage count. A config that still
    does not fit is returned as is (Mosaic's SMEM check names the overflow)."""
    stages = cfg.max_concurrent_steps
    while True:
        fitted = fit_stages(cfg, smem_bytes)
        if smem_bytes(fitted) <= SMEM_BUDGET or cfg.block_n // 2 < min_block_n:
            return fitted
        cfg = dataclasses.replace(cfg, block_n=cfg.block_n // 2, max_concurrent_steps=stages)


def num_planes(dtype) -> int:
    """bf16 planes per input element: 1 for bf16/f16 (native WGMMA), 2 for
    float32 (bf16x3 split); other dtypes raise ValueError."""
    dtype = jnp.dtype(dtype)
    if dtype in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return 1
    if dtype == jnp.dtype(jnp.float32):
        return 2
    raise ValueError(f"Mosaic GPU kernels take bfloat16, float16 or float32 inputs, got {dtype}")


def split_bf16(a: jax.Array) -> tuple[jax.Array, jax.Array]:
    """float32 a -> (hi, lo) bf16 with hi = bf16(a), lo = bf16(a - hi).

    hi + lo carries ~16 of float32's 24 significand bits. Non-finite entries
    (and values that round to +-inf in bf16) get lo = 0, so inf stays inf.
    """
    a = a.astype(jnp.float32)
    hi = a.astype(jnp.bfloat16)
    hi_f32 = hi.astype(jnp.float32)
    lo = jnp.where(jnp.isfinite(hi_f32), a - hi_f32, 0.0).astype(jnp.bfloat16)
    return hi, lo


def to_planes(a: jax.Array, compute_dtype, planes: int) -> list[jax.Array]:
    """The operand's SMEM planes: [a in compute_dtype], or [hi, lo] bf16."""
    if planes == 1:
        return [a.astype(compute_dtype)]
    return list(split_bf16(a))


def swizzle_transforms(minor_elems: int, itemsize: int):
    """SMEM tiling + swizzle for a tile with ``minor_elems`` elements a row."""
    swizzle = plgpu.find_swizzle(minor_elems * itemsize * 8)
    return (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))
