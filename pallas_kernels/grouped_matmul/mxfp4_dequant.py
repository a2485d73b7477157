"""The MXFP4 Mosaic kernel's fast dequantization (pallas_kernels.mxfp4_fast's
sequence) in its WGMMA register layout, on the GPU (inline PTX through
plgpu.inline_mgpu) and in interpret mode (the jnp emulation of the same ops).

    exact = needs_exact(scale_smems, flag_smem, interpret)   # K step, uniform
    lo, hi = fast_chunk(packed_MC, scale_smem, interpret)

Layout. ``packed_MC`` is uint8 [64, C] (C = DEQUANT_COLS, one column chunk of
a K step's packed tile) in plgpu.Layout.WGMMA: warp w of the consumer
warpgroup holds rows 16w..16w+15 (exactly scale block w), each thread two
rows (r, r + 8) x C/8 registers of two adjacent columns (c, c+1) = one
``q``. The thread loads its warp's scale bytes of (c, c+1) once per register
column (``sv``), shared by both rows. lo / hi: bf16 [64, C] in the same
layout, the low nibbles (even K) and the high ones (odd K). Exact for scale
bytes in mxfp4_fast.FAST_SCALES only: the launcher runs the exact kernel
when any byte is outside (mosaic_sm90_mxfp4.needs_exact).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, llvm, vector

from pallas_kernels import mxfp4_fast as fast

WARPGROUP_THREADS = 128
_ROWS = 64                 # packed rows of one K step (BLOCK_K / 2)
_BLOCK_ROWS = 16           # packed rows per scale block

_PAIR_ASM = fast.ptx(fast.SEQUENCE, fast.INPUTS["SEQUENCE"], fast.OUTPUTS["SEQUENCE"])
_SCALE_ASM = fast.ptx(fast.SCALE_SEQUENCE, fast.INPUTS["SCALE_SEQUENCE"],
                      fast.OUTPUTS["SCALE_SEQUENCE"])


def _i32(x: int):
    return mgpu_utils.c(x, ir.IntegerType.get_signless(32))


def _index(x):
    return arith.index_cast(ir.IndexType.get(), x)


def _word(v) -> ir.Value:
    """vector<N x i8> (N <= 4) -> i32, byte 0 in bits 0..7."""
    n = ir.VectorType(v.type).shape[0]
    as_int = mgpu_utils.bitcast(v, ir.IntegerType.get_signless(8 * n))
    return arith.extui(ir.IntegerType.get_signless(32), as_int) if n < 4 else as_int


def _asm(asm: str, n_out: int, *args):
    i32 = ir.IntegerType.get_signless(32)
    constraints = ",".join(["=r"] * n_out + ["r"] * len(args))
    if n_out == 1:
        return [llvm.inline_asm(i32, list(args), asm, constraints)]
    out = llvm.inline_asm(llvm.StructType.get_literal([i32] * n_out), list(args), asm,
                          constraints)
    return [llvm.extractvalue(i32, out, [i]) for i in range(n_out)]


def _fast_chunk_mgpu(cols: int):
    wgmma = plgpu.Layout.WGMMA
    out_t = plgpu.ShapeDtypeStruct((_ROWS, cols), jnp.bfloat16, layout=wgmma)

    @plgpu.inline_mgpu(arg_types=(wgmma, plgpu.RefType()), return_type=(out_t, out_t))
    def chunk(_ctx, packed, scale_ref):
        i8 = ir.IntegerType.get_signless(8)
        bf16x2 = ir.VectorType.get((2,), ir.BF16Type.get())
        tid = mgpu_utils.thread_idx()
        warp = arith.remui(arith.divui(tid, _i32(32)), _i32(WARPGROUP_THREADS // 32))
        pair_col = arith.muli(arith.remui(tid, _i32(4)), _i32(2))   # c within 8 columns
        regs = packed.registers
        if regs.shape[1] * 8 != cols or regs.size != 2 * regs.shape[1]:
            raise ValueError(f"unexpected WGMMA registers {regs.shape} for [{_ROWS}, {cols}]")
        scales = []
        for g in range(regs.shape[1]):   # register column g: columns 8g + c, +1
            col = arith.addi(pair_col, _i32(8 * g))
            sv = vector.load(ir.VectorType.get((2,), i8), scale_ref, [_index(warp), _index(col)])
            scales.append(_asm(_SCALE_ASM, 1, _word(sv))[0])
        lo, hi = np.empty_like(regs), np.empty_like(regs)
        for idx in np.ndindex(regs.shape):
            lo_w, hi_w = _asm(_PAIR_ASM, 2, _word(regs[idx]), scales[idx[1]])
            lo[idx] = mgpu_utils.bitcast(lo_w, bf16x2)
            hi[idx] = mgpu_utils.bitcast(hi_w, bf16x2)
        return (mgpu.FragmentedArray(_registers=lo, _layout=packed.layout, _is_signed=None),
                mgpu.FragmentedArray(_registers=hi, _layout=packed.layout, _is_signed=None))

    return chunk


def _fast_chunk_emulated(packed_MC, scale_smem):
    cols = packed_MC.shape[1]
    scale_RC = jnp.repeat(scale_smem[...], _BLOCK_ROWS, axis=0)
    p, s = packed_MC.astype(jnp.uint32), scale_RC.astype(jnp.uint32)
    lo, hi = fast.dequant_words(p[:, 0::2] | (p[:, 1::2] << 8), s[:, 0::2] | (s[:, 1::2] << 8))

    def unpair(w):   # [64, C/2] bf16x2 words -> bf16 [64, C]
        lanes = jnp.stack([w & 0xFFFF, w >> 16], axis=-1).reshape(_ROWS, cols)
        return lax.bitcast_convert_type(lanes.astype(jnp.uint16), jnp.bfloat16)

    return unpair(lo), unpair(hi)


def fast_chunk(packed_MC, scale_smem, interpret: bool):
    """uint8 [64, C] codes (WGMMA layout) of C columns of a K step and their
    uint8 [4, C] scales (an SMEM ref) -> (lo, hi) bf16 [64, C]. Exact for
    scale bytes in mxfp4_fast.FAST_SCALES (the caller checks)."""
    if interpret:
        return _fast_chunk_emulated(packed_MC, scale_smem)
    return _fast_chunk_mgpu(packed_MC.shape[1])(packed_MC, scale_smem)


__all__ = ["fast_chunk"]
