"""Hopper (sm_90) grouped matmul with MXFP4 weights dequantized inside the kernel (W4A16).

Same products and schedule as mosaic_sm90.py, on the shared persistent loop
(mosaic_skeleton.persistent_body, split_k = 1, tiles drain):
  * ``grouped_matmul_mxfp4``:   y_MN = x_MK @ W[group(row)]
  * ``grouped_situ_glu_mxfp4``: h_MN = situ_glu(x @ W_gate[g], x @ W_up[g])
with W an ``Mxfp4Weights`` (packed_GNK uint8 [G, N, K/2]: the checkpoint's
[out, in] orientation in the word layout, pallas_kernels.mxfp4_words, as
the loader places it; scale_GKN uint8 [G, K/32, N]).

Per K step (BLOCK_K = 128 K elements) the producer warpgroup TMA-streams the
x tile [64, 128] bf16 (K-permuted, below) and, per weight, the packed codes
[block_n, 64] uint8 (64 contiguous bytes of each weight row) and the scales
[4, block_n] uint8: the packed bytes are all the weight traffic. The
consumer warpgroup dequantizes them 64 rows at a time into a bf16
[block_n, 128] SMEM tile of its own, fences it (commit_smem) and issues the
bf16 WGMMA from SMEM with that tile read transposed (WGMMA's MN-major B).
One consumer warpgroup, 64-row x tiles, 128-column weight tiles (DEFAULT).

Two kernels, chosen at trace time by the weights' static dequant
(Mxfp4Weights.dequant, decided from the scale bytes when they were loaded:
no reduction over the scales runs in the program). Both read the codes in
the word layout in place and take x in mxfp4_dequant.k_order (one XLA
transpose of x, M x K bf16, small beside the weights at decode; the WGMMA
reads the pipeline's x tile as it lands):
  * fast (``..._mxfp4_m64``, every weight FAST): fast_dequant_tile,
    mxfp4_dequant.fast_chunk per 64 rows (pallas_kernels.mxfp4_fast's
    sequence on each word: inline PTX; its jnp emulation in interpret mode),
    whose fragment the tile stores. Exact when every scale byte is in
    FAST_SCALES (2..128).
  * exact (``..._mxfp4_exact_m64``, any weight EXACT): dequant_tile below,
    right for every scale byte (0, 1, 129..254 and 255 too). Per word of a
    thread's 16 bytes, mxfp4_dequant.code_bits_piece runs the fast
    sequence's bit permutation alone (inline PTX, 8 integer instructions a
    word) to put each code's bits in place, and the decode below turns
    them into exact bf16, the same tile and K order as the fast kernel's.
Weights in K order (Mxfp4Weights.k_order_axis, static): with 1 (K) x is
taken as it comes, already in k_order (the MoE's h, made so by its gate/up);
with 2 (N) the fast kernel at block_n 128 dequantizes each 128-row block's
rows in k_order (mxfp4_dequant.fast_chunk's n_chunk), so the product's
columns come out in it; the exact kernel, or a narrower N block, puts the
product in k_order in XLA instead.
Keeping the exact path out of the fast kernel's K loop matters: a per-step
branch to it makes ptxas serialize the WGMMAs (C7519) and spill the fused tile.

Exact dequant: the decisions of pallas_kernels.mxfp4 bit for bit (scale
byte 255 -> NaN, float32 overflow -> inf, results below 2**-126 -> signed
zero, then the exact cast to bf16). No float subnormal appears in any
operand, so a flush-to-zero multiply (XLA:CPU's, in interpret mode) gives
the same bits:
    magnitude: the float32 with bits ((c & 7) << 22) + (126 << 23) (the
      code's magnitude bits as code_bits_piece places them, plus a bias) is
      2**(e - 1) * (1 + m / 2), the E2M1 magnitude for e >= 1; codes 0 / 1
      (0.5 / 0.75 there) are corrected to 0 / 0.5 by 2x - 1 and a select;
    scale: per row and block, the int bits of 2**(max(b, 1) - 127) (a NaN for
      b = 255) with bit 0 flagging b = 0, whose magnitudes are halved;
    value = magnitude * scale (overflow -> inf), < 2**-126 -> 0, the code's
      sign or-ed into the bits, cvt to bf16 (exact: <= 2 significant bits).

float32 x runs as two bf16 planes (x = hi + lo, tiling.split_bf16) against
the one exact bf16 weight plane: two WGMMAs per K step, float32-accurate to
~1e-5 relative (x_lo carries the bits bf16(x) drops; the weights are exact).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.grouped_matmul import mosaic_skeleton as skeleton
from pallas_kernels.grouped_matmul import mosaic_sm90 as sm90
from pallas_kernels.grouped_matmul import mxfp4_dequant, tiling
from pallas_kernels.grouped_matmul.schedule import schedule, x_rows
from pallas_kernels.mxfp4 import BLOCK_SIZE, MIN_NORMAL_F32, SCALE_NAN, Mxfp4Dequant, Mxfp4Weights
from pallas_kernels.situ import situ_glu_f32

BLOCK_K = 128          # K elements per pipeline step: 64 code bytes a row, 4 scale rows
_WORDS = BLOCK_K // BLOCK_SIZE   # scale blocks a K step; also words of a thread's 16 bytes
EPILOGUE_COLS = 32   # fused SiTU epilogue: columns per chunk (registers)


def scale_bits(scale_row):
    """uint8 UE8M0 bytes -> int32 bits of the float32 2**(max(b, 1) - 127)
    (b = 255: a NaN), with bit 0 set for b = 0 (then halved: 2**-127 is a
    float32 subnormal, and a flush-to-zero multiply, e.g. XLA:CPU's in
    interpret mode, would lose it). One int per column carries both."""
    b = scale_row.astype(jnp.int32)
    return ((jnp.maximum(b, 1) << 23) | jnp.where(b == SCALE_NAN, jnp.int32(1 << 22), 0)
            | jnp.where(b == 0, jnp.int32(1), 0))


def dequant_code_bits(code_bits, scale_bits_):
    """E2M1 codes as mxfp4_dequant.code_bits holds them (int32 [r, N]:
    magnitude e1 e0 m at bits 22..24, sign at 31) x scale_bits [r, N] ->
    bf16 [r, N], exact (see the module docstring)."""
    mag_bits = code_bits & jnp.int32(7 << mxfp4_dequant.CODE_MAGNITUDE_SHIFT)
    # 2**(e - 1) * (1 + m / 2): the magnitude for e >= 1; 0.5 / 0.75 for codes 0 / 1
    normal = lax.bitcast_convert_type(mag_bits + jnp.int32(126 << 23), jnp.float32)
    mag = jnp.where(mag_bits < jnp.int32(2 << mxfp4_dequant.CODE_MAGNITUDE_SHIFT),
                    normal * 2.0 - 1.0, normal)
    scale = lax.bitcast_convert_type(scale_bits_ & jnp.int32(~1), jnp.float32)
    mag = jnp.where((scale_bits_ & 1) != 0, mag * 0.5, mag)
    value = mag * scale                           # float32 overflow -> inf; NaN scale -> NaN
    value = jnp.where(value < jnp.float32(MIN_NORMAL_F32), jnp.float32(0.0), value)
    sign = code_bits & jnp.int32(-(1 << 31))
    value = lax.bitcast_convert_type(lax.bitcast_convert_type(value, jnp.int32) | sign,
                                     jnp.float32)
    return value.astype(jnp.bfloat16)


def dequant_tile(packed_smem, scale_smem, w_smem, block_n: int, interpret: bool) -> None:
    """Dequantize one weight's K step of BLOCK_K = 128 exactly: packed uint8
    [block_n, 64] (weight rows n by code bytes, the word layout) and scales
    uint8 [4, block_n] (SMEM) -> bf16 [block_n, 128] in w_smem, in
    mxfp4_dequant.k_order's columns (fast_dequant_tile's tile, bit for bit
    where the scale bytes are in FAST_SCALES).

    Per 64 rows, the 4 scale blocks' bits (one WGMMA row vector each) and,
    per word of a thread's 16 bytes, one [64, 32] piece:
    mxfp4_dequant.code_bits_piece (the codes out of the word layout), the
    column's scale block (column 8j + 2l + L: block l) picked by selects,
    dequant_code_bits, stored at columns 32 word .. 32 word + 31. Unrolled."""
    wgmma = plgpu.Layout.WGMMA
    rows, cols = mxfp4_dequant.ROWS, BLOCK_K // _WORDS
    block_of_col = (lax.broadcasted_iota(jnp.int32, (rows, cols), 1) >> 1) & (_WORDS - 1)
    for r in range(block_n // rows):
        row_chunk = pl.ds(r * rows, rows)
        blocks = [jnp.broadcast_to(scale_bits(plgpu.load(scale_smem.at[b, row_chunk],
                                                         layout=wgmma.reduce(1)))[:, None],
                                   (rows, cols)) for b in range(_WORDS)]
        bits = jnp.where(block_of_col == 0, blocks[0],
                         jnp.where(block_of_col == 1, blocks[1],
                                   jnp.where(block_of_col == 2, blocks[2], blocks[3])))
        for word in range(_WORDS):
            codes = mxfp4_dequant.code_bits_piece(packed_smem.at[row_chunk, :], word, interpret)
            w_smem[row_chunk, pl.ds(word * cols, cols)] = dequant_code_bits(codes, bits)


def fast_dequant_tile(packed_smem, scale_smem, w_smem, block_n: int, interpret: bool,
                      n_k_order: bool = False) -> None:
    """dequant_tile's result by the fast sequence (mxfp4_dequant.fast_chunk),
    64 rows at a time, unrolled: exact when every scale byte of the step is
    in mxfp4_fast.FAST_SCALES. ``n_k_order`` (block_n a multiple of 128):
    each 128-row block's rows in mxfp4.k_order (tile row c holds weight row
    k_order_index(128)[c] of its block)."""
    rows = mxfp4_dequant.ROWS
    for r in range(block_n // rows):
        row_chunk = pl.ds(r * rows, rows)
        if n_k_order:
            block = pl.ds((r // 2) * 2 * rows, 2 * rows)
            chunk = mxfp4_dequant.fast_chunk(packed_smem.at[block, :], scale_smem.at[:, block],
                                             interpret, n_chunk=r % 2)
        else:
            chunk = mxfp4_dequant.fast_chunk(packed_smem.at[row_chunk, :],
                                             scale_smem.at[:, row_chunk], interpret)
        w_smem[row_chunk, :] = chunk


def pipeline(cfg: sm90.TileConfig, num_w: int, planes: int) -> skeleton.Pipeline:
    """Per K step: ``planes`` bf16 x tiles [block_m, BLOCK_K] (K-permuted)
    and, per weight, packed [block_n, BLOCK_K / 2] + scale [BLOCK_K / 32,
    block_n] uint8 tiles."""
    def in_specs(_first_k_step):
        x_spec = plgpu.BlockSpec((cfg.block_m, BLOCK_K), lambda k: (0, k))
        packed_spec = plgpu.BlockSpec((cfg.block_n, BLOCK_K // 2), lambda k: (0, k))
        scale_spec = plgpu.BlockSpec((BLOCK_K // BLOCK_SIZE, cfg.block_n), lambda k: (k, 0))
        return [x_spec] * planes + [packed_spec, scale_spec] * num_w
    return skeleton.Pipeline(in_specs, cfg.num_compute_wgs, cfg.max_concurrent_steps,
                             skeleton.memory_registers(cfg.num_compute_wgs))


def _make_body(*, epilogue: Callable, num_w: int, planes: int, cfg: sm90.TileConfig,
               num_rows: int, num_k_steps: int, num_n_blocks: int, out_dtype,
               fast: bool, interpret: bool, n_k_order: bool = False):
    """Kernel body(meta_4W, *x_planes_MK, (packed_GNK, scale_GKN) * num_w, o_MN).

    The row-major loop (split_k = 1, tiles drain) with the weight operand
    dequantized per K step into a bf16 SMEM tile per consumer warpgroup and
    weight: by fast_dequant_tile (``fast``; ``n_k_order``: its rows in
    k_order) or dequant_tile."""
    wg_m = cfg.wg_block_m
    scratch = {
        "o_smem": plgpu.SMEM((cfg.num_compute_wgs, wg_m, cfg.block_n), out_dtype),
        "w_smem": plgpu.SMEM((cfg.num_compute_wgs * num_w, cfg.block_n, BLOCK_K), jnp.bfloat16),
    }
    if num_w == 2:  # the fused tile's gate products are staged in f32 SMEM (its epilogue)
        scratch["g_smem"] = plgpu.SMEM((cfg.num_compute_wgs, wg_m, cfg.block_n), jnp.float32)

    def tile_order(num_items):
        def coords(index):
            item, n_block = plgpu.planar_snake(index, (num_items, num_n_blocks), 1,
                                               cfg.grid_block_n)
            return None, item, n_block
        return num_items * num_n_blocks, coords

    def tile_body(t: skeleton.Tile):
        wg, o_gmem = t.wg, t.o_gmems[0]
        o_smem, w_smem = t.scratch["o_smem"], t.scratch["w_smem"]
        lo = jnp.clip(t.offset - wg * wg_m, 0, wg_m)
        hi = jnp.clip(t.offset + t.count - wg * wg_m, 0, wg_m)

        def store_tile():
            skeleton.store_rows(o_smem.at[wg], o_gmem, row0=t.x_row0 + wg * wg_m, offset=lo,
                                count=hi - lo, col0=t.n_block * cfg.block_n,
                                block_n=cfg.block_n, max_rows=min(wg_m, num_rows))

        def store(tile):
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # previous tile's store
            o_smem[wg] = tile.astype(out_dtype)
            plgpu.commit_smem()
            store_tile()

        def mma(_, *rest):
            x_planes, w_refs, accs = skeleton.step_operands(rest, planes, 2)
            x_tiles = [x.at[pl.ds(wg * wg_m, wg_m)] for x in x_planes]

            @pl.when(hi > lo)  # no dequant and no WGMMA for a consumer without rows
            def _issue():
                for i, (acc, (packed_smem, scale_smem)) in enumerate(zip(accs, w_refs)):
                    tile = w_smem.at[wg * num_w + i]
                    if fast:
                        fast_dequant_tile(packed_smem, scale_smem, tile, cfg.block_n, interpret,
                                          n_k_order)
                    else:
                        dequant_tile(packed_smem, scale_smem, tile, cfg.block_n, interpret)
                    plgpu.commit_smem()   # the dequantized tile, visible to WGMMA
                    for x_tile in x_tiles[::-1]:   # lo plane (if any) first
                        plgpu.wgmma(acc, x_tile, tile.transpose((1, 0)))   # [K, N] from [N, K]
            # The pipeline slot is released when this step returns, and the
            # dequantized tile is rewritten next step: WGMMAs must be done with both.
            plgpu.wgmma_wait(0)
            return accs

        def finish(accs):
            if num_w == 1:
                store(epilogue(accs[0][...]))
                return
            # Fused: the gate products go to SMEM first (each thread
            # reads back what it wrote: no barrier), so the SiTU runs
            # on column chunks with one accumulator live, not two.
            g_smem = t.scratch["g_smem"]
            g_smem[wg] = accs[0][...]
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # previous store
            cols = min(EPILOGUE_COLS, cfg.block_n)
            for c in range(cfg.block_n // cols):
                chunk = pl.ds(c * cols, cols)
                gate = plgpu.load(g_smem.at[wg, :, chunk], layout=plgpu.Layout.WGMMA)
                o_smem[wg, :, chunk] = epilogue(gate, accs[1][:, chunk]).astype(out_dtype)
            plgpu.commit_smem()
            store_tile()

        compute_context = skeleton.scoped_accumulators((wg_m, cfg.block_n), num_w, finish)

        def tail():
            @pl.when((t.count > 0) & (t.group < 0) & (wg < cfg.num_compute_wgs))
            def _zeros():  # tail rows past sum(group_sizes): no matmul
                store(jnp.zeros((wg_m, cfg.block_n), out_dtype))

        return mma, compute_context, tail

    return skeleton.persistent_body(
        pipeline=pipeline(cfg, num_w, planes), num_x=planes, num_w=2 * num_w,
        num_k_steps=num_k_steps, split_k=None, x_tile_rows=cfg.block_m,
        w_tile_cols=cfg.block_n, scratch=scratch, tile_order=tile_order, tile_body=tile_body,
        no_drain=False, w_n_axes=(1, 2) * num_w)


def smem_bytes(cfg: sm90.TileConfig, num_weights: int, planes: int, out_bytes: int) -> int:
    """Shared memory of one launch: pipeline stages (x planes + packed codes +
    scales), the dequantized bf16 tiles (one per consumer and weight), the
    output tile and (fused) the f32 gate products the epilogue stages through
    SMEM."""
    stage = (cfg.block_m * BLOCK_K * 2 * planes
             + num_weights * (BLOCK_K // 2 + BLOCK_K // BLOCK_SIZE) * cfg.block_n)
    dequantized = cfg.num_compute_wgs * num_weights * BLOCK_K * cfg.block_n * 2
    out_tile = cfg.num_compute_wgs * cfg.wg_block_m * cfg.block_n * out_bytes
    gate_f32 = cfg.num_compute_wgs * cfg.wg_block_m * cfg.block_n * 4 if num_weights == 2 else 0
    return cfg.max_concurrent_steps * stage + dequantized + out_tile + gate_f32


# One consumer warpgroup (64-row tiles) for every M: each consumer dequantizes
# the weight tile it multiplies, so a taller tile would dequantize it once per
# 64 rows anyway. N is 128 for both products: a K step's WGMMA descriptors and
# pipeline bookkeeping are per HGMMA, not per weight, so a 128-wide tile
# spreads them over twice the weights a 64-wide one does. The fused product
# stages its gate products through SMEM (the SiTU on 32-column chunks) to
# keep one 64 x 128 f32 accumulator live in its epilogue; stages are then as
# many as SMEM holds.
DEFAULT = sm90.TileConfig(num_compute_wgs=1, block_n=128, block_k=BLOCK_K, max_concurrent_steps=8)


@dataclasses.dataclass(frozen=True)
class Mxfp4Plan:
    """The static shape of one MXFP4 launch: fitted tiles, x planes (1 bf16/f16,
    2 float32) and padded sizes (K to a multiple of BLOCK_K, N of block_n)."""

    cfg: sm90.TileConfig
    planes: int
    m_pad: int
    k_pad: int
    n_pad: int

    @property
    def num_k_steps(self) -> int:
        return self.k_pad // BLOCK_K

    @property
    def num_n_blocks(self) -> int:
        return self.n_pad // self.cfg.block_n


def plan_launch(m: int, k: int, n: int, num_groups: int, num_weights: int, x_dtype,
                cfg: sm90.TileConfig | None = None) -> Mxfp4Plan:
    """Fit the tiles of an [m, k] x num_weights x MXFP4 [G, k, n] launch:
    cfg (default DEFAULT) with block_k = BLOCK_K, then
    fewer stages (>= 2), then a narrower N block, until SMEM fits."""
    x_dtype = jnp.dtype(x_dtype)
    if x_dtype not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
        raise ValueError(f"the MXFP4 Mosaic kernel takes bfloat16 or float32 x, got {x_dtype}")
    planes = 2 if x_dtype == jnp.dtype(jnp.float32) else 1
    out_bytes = x_dtype.itemsize
    cfg = cfg or DEFAULT
    if cfg.split_k != 1:
        raise ValueError(f"the MXFP4 kernel has no split-K, got split_k={cfg.split_k}")
    min_n = mxfp4_dequant.ROWS   # the codes' dequant runs on 64-row WGMMA chunks
    cfg = dataclasses.replace(cfg, block_k=BLOCK_K,
                              block_n=tiling.block_for(n, cfg.block_n, min_n))
    fits = functools.partial(smem_bytes, num_weights=num_weights, planes=planes,
                             out_bytes=out_bytes)
    # fewer stages (>= 2), then a narrower N block at two stages
    cfg = tiling.fit_smem(tiling.fit_stages(cfg, fits), fits, min_n)
    return Mxfp4Plan(cfg=cfg, planes=planes, m_pad=x_rows(m, cfg.block_m),
                     k_pad=tiling.round_up(k, BLOCK_K), n_pad=tiling.round_up(n, cfg.block_n))


def pad_weight(w: Mxfp4Weights, k_pad: int, n_pad: int) -> tuple[jax.Array, jax.Array]:
    """(packed, scale) zero-padded to [G, n_pad, k_pad/2] / [G, k_pad/32, n_pad]
    (padded codes are 0 with scale byte 127: exact zeros). No-op for K3 shapes."""
    packed = tiling.pad_axis(tiling.pad_axis(w.packed_GNK, 2, k_pad // 2), 1, n_pad)
    scale = w.scale_GKN
    if scale.shape[1:] != (k_pad // BLOCK_SIZE, n_pad):
        scale = jnp.pad(scale, [(0, 0), (0, k_pad // BLOCK_SIZE - scale.shape[1]),
                                (0, n_pad - scale.shape[2])], constant_values=127)
    return packed, scale


def k_order_axis(weights: list[Mxfp4Weights]) -> int | None:
    """The launch's weights' common Mxfp4Weights.k_order_axis (ValueError
    when a fused pair disagrees)."""
    axes = {w.k_order_axis for w in weights}
    if len(axes) != 1:
        raise ValueError(f"MXFP4 weights of one launch must share k_order_axis, got {axes}")
    return axes.pop()


def kernel_operands(x_MK, weights: list[Mxfp4Weights], *, rows: int, k_pad: int, n_pad: int,
                    planes: int) -> tuple[list[jax.Array], list[jax.Array]]:
    """(x planes [rows, k_pad] in mxfp4_dequant.k_order, (packed, scale) per
    weight padded by pad_weight): the operands the MXFP4 kernels, fast and
    exact, stream (planes 2: float32 x as hi + lo bf16). The codes stay in
    the word layout they are held in (no copy for K3 shapes, which need no
    padding); x's permutation is one XLA transpose (M x K bf16, small beside
    the weights at decode), none for weights of k_order_axis 1, whose x comes
    in that order (K a multiple of 128: no padding)."""
    x_pad = tiling.pad_axis(tiling.pad_axis(x_MK, 0, rows), 1, k_pad)
    ordered = k_order_axis(weights) == 1
    x_planes = [p if ordered else mxfp4_dequant.k_order(p)
                for p in (tiling.split_bf16(x_pad) if planes == 2 else [x_pad])]
    w_refs = [a for w in weights for a in pad_weight(w, k_pad, n_pad)]
    return x_planes, w_refs


def row_major(x_MK, weights: list[Mxfp4Weights], group_sizes_G, *, epilogue,
              cfg: sm90.TileConfig | None, interpret, fast: bool) -> jax.Array:
    """One launch of the fast (``fast``) or the exact kernel: pad, put x in
    the kernel's K order, build the schedule, run it. y [m, n] in x's dtype
    (in k_order for weights of k_order_axis 2: in the kernel when fast at
    block_n 128, else by XLA)."""
    m, k, n, num_groups, num_w = skeleton.launch_dims(x_MK, weights)
    out_dtype = x_MK.dtype
    launch = plan_launch(m, k, n, num_groups, num_w, out_dtype, cfg)
    cfg = launch.cfg
    n_ordered = k_order_axis(weights) == 2
    in_kernel = n_ordered and fast and cfg.block_n % mxfp4_dequant.K_STEP == 0
    x_planes, w_refs = kernel_operands(x_MK, weights, rows=launch.m_pad, k_pad=launch.k_pad,
                                       n_pad=launch.n_pad, planes=launch.planes)
    meta_4W = schedule(group_sizes_G, m, cfg.block_m)
    name = "grouped_situ_glu" if num_w == 2 else "grouped_matmul"
    body = _make_body(epilogue=epilogue, num_w=num_w, planes=launch.planes, cfg=cfg,
                      num_rows=m, num_k_steps=launch.num_k_steps,
                      num_n_blocks=launch.num_n_blocks, out_dtype=out_dtype, fast=fast,
                      interpret=bool(interpret), n_k_order=in_kernel)
    variant = "mxfp4" if fast else "mxfp4_exact"
    kernel = skeleton.launch(
        body, out_type=jax.ShapeDtypeStruct((m, launch.n_pad), out_dtype),
        grid=(cfg.num_ctas or skeleton.num_sms(interpret),), interpret=interpret,
        num_compute_wgs=cfg.num_compute_wgs, kernel_name=f"{name}_{variant}_m{cfg.block_m}")
    y_MN = kernel(meta_4W, *x_planes, *w_refs)
    y_MN = y_MN if launch.n_pad == n else y_MN[:, :n]
    return mxfp4_dequant.k_order(y_MN) if n_ordered and not in_kernel else y_MN


def all_fast(weights: list[Mxfp4Weights]) -> bool:
    """Whether the fast kernel may run: every weight's dequant is FAST
    (static; a pair with one EXACT weight runs the exact kernel)."""
    return all(w.dequant is Mxfp4Dequant.FAST for w in weights)


def _mxfp4_call(x_MK, weights: list[Mxfp4Weights], group_sizes_G, *, epilogue,
                cfg: sm90.TileConfig | None, interpret):
    """The fast kernel, or the exact one for EXACT weights (module docstring)."""
    m, _, n, _, _ = skeleton.launch_dims(x_MK, weights)
    if m == 0 or n == 0:
        return jnp.zeros((m, n), x_MK.dtype)
    return row_major(x_MK, weights, group_sizes_G, epilogue=epilogue, cfg=cfg,
                     interpret=interpret, fast=all_fast(weights))


def grouped_matmul_mxfp4(x_MK, w_GKN: Mxfp4Weights, group_sizes_G, *,
                         config: sm90.TileConfig | None = None,
                         interpret: bool | plgpu.InterpretGPUParams = False):
    """y_MN = x_MK @ dequant(w_GKN)[group(row)] (f32 accumulate, x dtype); tail rows are 0.
    x_MK bf16 or float32 [M, K]; w_GKN Mxfp4Weights of logical shape [G, K, N]."""
    return _mxfp4_call(x_MK, [w_GKN], group_sizes_G, epilogue=lambda acc: acc,
                       cfg=config, interpret=interpret)


def grouped_situ_glu_mxfp4(x_MK, w_gate_GKN: Mxfp4Weights, w_up_GKN: Mxfp4Weights,
                           group_sizes_G, *, beta: float, linear_beta: float | None,
                           config: sm90.TileConfig | None = None,
                           interpret: bool | plgpu.InterpretGPUParams = False):
    """h_MN = situ_glu(x @ dequant(w_gate)[g], x @ dequant(w_up)[g]) fused; tail rows are 0."""
    epilogue = functools.partial(situ_glu_f32, beta=beta, linear_beta=linear_beta)
    return _mxfp4_call(x_MK, [w_gate_GKN, w_up_GKN], group_sizes_G, epilogue=epilogue,
                       cfg=config, interpret=interpret)
