"""Grouped matmul kernels in Triton (sm_80 and newer), called through jax-triton.

The portable twin of mosaic_sm90.py, for the CUDA GPUs that are not Hopper
(A100 sm_80, L40S sm_89, Blackwell sm_100 / sm_120; it also runs on H100/H200).
Two products, one kernel body (``_grouped_body``):
  * ``grouped_matmul``:   y_MN = x_MK @ w_GKN[group(row)]
  * ``grouped_situ_glu``: h_MN = situ_glu(x @ w_gate[g], x @ w_up[g]); both
    products accumulate in two f32 register tiles of the same program and the
    SiTU epilogue runs on those registers (no 2N-wide intermediate in HBM).
Each has an MXFP4 twin (``*_mxfp4``) taking the weights as packed E2M1 codes
and UE8M0 scales (docs/spec.md §3), as ``mxfp4.Mxfp4Weights`` holds them:
w_packed_GNH uint8 [G, N, K/2] (H = K/2; the checkpoint's [out, in] orientation, each column n's
K/2 bytes contiguous), packed along K in the word layout
(pallas_kernels.mxfp4_words: each 4 bytes one 32-bit word of 8 codes, K
elements 8w .. 8w + 7, its bits permuted), read in place, and w_scale_GSN
uint8 [G, K/32, N] (S = K/32). The weight tile is dequantized in registers:
each word's bits are put back in order by mxfp4_fast.INTEGER_SEQUENCE (the
fast Mosaic sequence's integer part: 8 operations a word), then shifts and
masks build the float32 bits of each E2M1 value, times 2**(byte - 127), the
same float32 math as ``dequant``, so bit-identical to it, fed to a bf16
tensor-core dot: W4A16. Right for every scale byte, so the weights' static
``dequant`` (FAST / EXACT) does not matter here. (``tl.dot_scaled`` would
need triton 3.9.)

Scheduling: the Mosaic kernels' work items (``schedule.work_items_4W``:
int32 [4, W] = group or -1 for the tail, the first x row of the item's tile,
the item's first row within the tile, row count). The grid is (W, N-blocks);
a program loads only its item's rows of x
(other rows masked to 0, so NaN past sum(group_sizes) never reaches a valid
row), runs ``cdiv(K, BLOCK_K)`` dot steps (0 for the tail and empty items) and
stores only its rows: every output row is written exactly once, and rows past
sum(group_sizes) are exact zeros (situ_glu(0, 0) = 0).

Dtypes: x in bf16 / f16 (native tensor-core dot) or float32 (``tf32x3``: three
tf32 products, ~float32 accuracy, for tests and debugging); dense weights in
x's dtype; MXFP4 weights dequantize to x's dtype (bf16 or float32; exact).
Output in x's dtype, accumulated in float32.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import jax_triton as jt
import triton
import triton.language as tl

from pallas_kernels import mxfp4_fast
from pallas_kernels.grouped_matmul.schedule import num_work_items, work_items_4W
from pallas_kernels.triton_target import target_capability

# -- tiles ---------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TritonTiles:
    """One kernel configuration: the program's tile and Triton's launch options."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int

    def smem_bytes(self, num_weights: int, x_bytes: int, mxfp4: bool) -> int:
        """Estimated pipeline shared memory: num_stages x (x tile + weight tiles).
        An MXFP4 weight tile is its codes plus scales (0.53125 B per element)."""
        w_tile = (self.block_k * self.block_n * 17 // 32 if mxfp4
                  else self.block_k * self.block_n * x_bytes)
        return self.num_stages * (self.block_m * self.block_k * x_bytes + num_weights * w_tile)


# Decode (few rows per group: the kernel streams weights): 16-row tiles (the
# smallest bf16 mma M), wide K steps, 4 stages in flight. Prefill (>= 128 rows
# per group on average): 128-row tiles over 8 warps reuse each weight tile
# across 128 rows. Every config fits 99 KiB of shared memory (sm_86 / sm_89 /
# sm_120 opt-in limit; sm_80 has 163 KiB, sm_90 / sm_100 227 KiB) in bf16.
FUSED_DECODE = TritonTiles(block_m=16, block_n=64, block_k=64, num_warps=4, num_stages=4)
PLAIN_DECODE = TritonTiles(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=4)
FUSED_PREFILL = TritonTiles(block_m=128, block_n=64, block_k=32, num_warps=8, num_stages=4)
PLAIN_PREFILL = TritonTiles(block_m=128, block_n=128, block_k=32, num_warps=8, num_stages=4)
# MXFP4 decode: the dequantized weight tile lives in registers; 8 warps share
# it (4 warps: 160-230 registers and spills at sm_90; 8: 98-115, no spills).
MXFP4_DECODE = TritonTiles(block_m=16, block_n=64, block_k=64, num_warps=8, num_stages=4)
PREFILL_ROWS_PER_GROUP = 128
SMEM_BUDGET = 99 * 1024


def default_tiles(num_rows: int, num_groups: int, num_weights: int, x_bytes: int,
                  mxfp4: bool) -> TritonTiles:
    """Tiles from the average rows per group, with stages cut (to >= 2) until the
    estimate fits SMEM_BUDGET (float32 operands take twice the bytes)."""
    prefill = num_rows >= PREFILL_ROWS_PER_GROUP * num_groups
    if mxfp4 and not prefill:
        tiles = MXFP4_DECODE
    elif num_weights == 2:
        tiles = FUSED_PREFILL if prefill else FUSED_DECODE
    else:
        tiles = PLAIN_PREFILL if prefill else PLAIN_DECODE
    while tiles.num_stages > 2 and tiles.smem_bytes(num_weights, x_bytes, mxfp4) > SMEM_BUDGET:
        tiles = dataclasses.replace(tiles, num_stages=tiles.num_stages - 1)
    return tiles


# -- kernel body -----------------------------------------------------------------


@triton.jit
def _tanh(y):
    """tanh from exp (libdevice is absent in Triton's interpreter); odd, saturating."""
    e = tl.exp(-2.0 * tl.abs(y))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(y < 0, -t, t)


@triton.jit
def _situ_glu(gate, up, BETA: tl.constexpr, HAS_LINEAR_BETA: tl.constexpr,
              LINEAR_BETA: tl.constexpr):
    """float32 SiTU-GLU (docs/spec.md §2), the same formula as pallas_kernels.situ."""
    sigmoid = 1.0 / (1.0 + tl.exp(-gate))
    gate_act = BETA * _tanh(gate * (1.0 / BETA)) * sigmoid
    if HAS_LINEAR_BETA:
        up_act = LINEAR_BETA * _tanh(up * (1.0 / LINEAR_BETA))
    else:
        up_act = up
    return gate_act * up_act


@triton.jit
def _e2m1_ue8m0(codes, scale_bytes):
    """float32 value of E2M1 ``codes`` (int32, 0..15) times 2**(scale_bytes - 127),
    the float32 math of pallas_kernels.mxfp4.dequant (byte 255 -> NaN, results
    below 2**-126 flushed to a signed zero)."""
    exponent = (codes >> 1) & 3
    mantissa = codes & 1
    # |value| = 2**(e - 1) * (1 + m / 2) for e > 0, m / 2 for e = 0: float32 bits.
    magnitude = tl.where(exponent > 0, ((exponent + 126) << 23) | (mantissa << 22),
                         mantissa * (126 << 23))
    bits = magnitude.to(tl.uint32) | ((codes & 8).to(tl.uint32) << 28)
    value = bits.to(tl.float32, bitcast=True)
    scale_bits = tl.where(scale_bytes == 255, 0x7FC00000, tl.maximum(scale_bytes, 1) << 23)
    scale = scale_bits.to(tl.float32, bitcast=True)
    fix = tl.where(scale_bytes == 0, 0.5, 1.0)
    out = value * scale * fix
    return tl.where(tl.abs(out) < 1.1754943508222875e-38, value * 0.0, out)


@triton.jit
def _dense_w_tile(w_ptr, group, k0, cols, K: tl.constexpr, N: tl.constexpr,
                  BLOCK_K: tl.constexpr):
    """w[group, k0:k0+BLOCK_K, cols] of w [G, K, N] (out of range -> 0)."""
    ks = k0 + tl.arange(0, BLOCK_K)
    base = w_ptr + group.to(tl.int64) * (K * N)
    mask = (ks[:, None] < K) & (cols[None, :] < N)
    return tl.load(base + ks[:, None] * N + cols[None, :], mask=mask, other=0.0)


# mxfp4_fast.INTEGER_SEQUENCE, as _word_codes runs it: c0 = q & T, cj = rotr(q,
# ROTATE[j]) & T (j = 1, 2), c3 = ((q & REST) * MUL) & T. Checked against the
# sequence at import, so a change to it cannot pass here unnoticed.
_T = tl.constexpr(mxfp4_fast.TARGET_BITS)
_REST = tl.constexpr(mxfp4_fast.REST_BITS)
_MUL = tl.constexpr(mxfp4_fast.REST_MULTIPLIER)
_ROT1, _ROT2 = (tl.constexpr(op.imm[0]) for op in mxfp4_fast.INTEGER_SEQUENCE if op.name == "rotr")
_SEQ = mxfp4_fast.Op
if mxfp4_fast.INTEGER_SEQUENCE != (
        _SEQ("and", "c0", ("q",), (_T.value,)),
        _SEQ("rotr", "t1", ("q",), (_ROT1.value,)), _SEQ("and", "c1", ("t1",), (_T.value,)),
        _SEQ("rotr", "t2", ("q",), (_ROT2.value,)), _SEQ("and", "c2", ("t2",), (_T.value,)),
        _SEQ("and", "r3", ("q",), (_REST.value,)), _SEQ("mul", "t3", ("r3",), (_MUL.value,)),
        _SEQ("and", "c3", ("t3",), (_T.value,))):
    raise AssertionError("mxfp4_fast.INTEGER_SEQUENCE changed: update triton_sm80._word_codes")
# where a code's bits land in each 16-bit lane of cj (e1 e0 m adjacent)
_M_BIT = tl.constexpr(mxfp4_fast.LANE_TARGET[0])
_SIGN_BIT = tl.constexpr(mxfp4_fast.LANE_TARGET[3])
if mxfp4_fast.LANE_TARGET[1:3] != (_M_BIT.value + 1, _M_BIT.value + 2):
    raise AssertionError(f"mxfp4_fast.LANE_TARGET {mxfp4_fast.LANE_TARGET}: e1 e0 m not adjacent")


@triton.jit
def _lane_codes(c):
    """One cj (uint32) -> its two E2M1 codes (int32 0..15): lane 0, lane 1."""
    lo = ((c >> _M_BIT) & 7) | ((c >> (_SIGN_BIT - 3)) & 8)
    hi = ((c >> (_M_BIT + 16)) & 7) | ((c >> (_SIGN_BIT + 13)) & 8)
    return lo.to(tl.int32), hi.to(tl.int32)


@triton.jit
def _mxfp4_w_tile(packed_ptr, scale_ptr, group, k0, cols, K: tl.constexpr, N: tl.constexpr,
                  BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, dtype: tl.constexpr):
    """The same tile dequantized from packed [G, N, K/2] in the word layout
    (word (g, n, w), 4 bytes at g*N*K/2 + n*K/2 + 4w: K elements 8w .. 8w + 7,
    loaded as one uint32) and scales [G, K/32, N] (word w's block: w // 4)."""
    words = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    tile_ok = (words[:, None] < K // 8) & (cols[None, :] < N)
    word_base = packed_ptr.to(tl.pointer_type(tl.uint32)) + group.to(tl.int64) * (N * (K // 8))
    q_WN = tl.load(word_base + cols[None, :] * (K // 8) + words[:, None], mask=tile_ok, other=0)
    scale_base = scale_ptr + group.to(tl.int64) * (K // 32 * N)
    scales_WN = tl.load(scale_base + (words // 4)[:, None] * N + cols[None, :],
                        mask=tile_ok, other=127).to(tl.int32)
    # INTEGER_SEQUENCE: cj holds K elements 8w + 2j (lane 0) and 8w + 2j + 1 (lane 1)
    e0, e1 = _lane_codes(q_WN & _T)
    e2, e3 = _lane_codes(((q_WN >> _ROT1) | (q_WN << (32 - _ROT1))) & _T)
    e4, e5 = _lane_codes(((q_WN >> _ROT2) | (q_WN << (32 - _ROT2))) & _T)
    e6, e7 = _lane_codes(((q_WN & _REST) * _MUL) & _T)
    v0 = _e2m1_ue8m0(e0, scales_WN).to(dtype)
    v1 = _e2m1_ue8m0(e1, scales_WN).to(dtype)
    v2 = _e2m1_ue8m0(e2, scales_WN).to(dtype)
    v3 = _e2m1_ue8m0(e3, scales_WN).to(dtype)
    v4 = _e2m1_ue8m0(e4, scales_WN).to(dtype)
    v5 = _e2m1_ue8m0(e5, scales_WN).to(dtype)
    v6 = _e2m1_ue8m0(e6, scales_WN).to(dtype)
    v7 = _e2m1_ue8m0(e7, scales_WN).to(dtype)
    # [W, N, 2, 2, 2]: index (p, q, r) holds element 4p + 2q + r of word w; then
    # [W, 8, N] -> [BLOCK_K, BLOCK_N], row 8w + 4p + 2q + r
    even = tl.join(tl.join(v0, v4), tl.join(v2, v6))
    odd = tl.join(tl.join(v1, v5), tl.join(v3, v7))
    w_WNi = tl.reshape(tl.join(even, odd), (BLOCK_K // 8, BLOCK_N, 8))
    return tl.reshape(tl.permute(w_WNi, (0, 2, 1)), (BLOCK_K, BLOCK_N))


@triton.jit
def _grouped_body(x_ptr, a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, meta_ptr, o_ptr,
                  K: tl.constexpr, N: tl.constexpr, NUM_ITEMS: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  FUSED: tl.constexpr, MXFP4: tl.constexpr, PRECISION: tl.constexpr,
                  BETA: tl.constexpr, HAS_LINEAR_BETA: tl.constexpr, LINEAR_BETA: tl.constexpr):
    """One (work item, N-block) tile. Weights: a (and b when FUSED); the scale
    pointers are read only when MXFP4."""
    item = tl.program_id(0)
    group = tl.load(meta_ptr + item)
    x_row0 = tl.load(meta_ptr + NUM_ITEMS + item)
    offset = tl.load(meta_ptr + 2 * NUM_ITEMS + item)
    count = tl.load(meta_ptr + 3 * NUM_ITEMS + item)

    local = tl.arange(0, BLOCK_M)
    row_ok = (local >= offset) & (local < offset + count)
    rows = x_row0.to(tl.int64) + local
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    x_dtype = x_ptr.dtype.element_ty

    acc_a = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    acc_b = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    num_k_steps = tl.where((count > 0) & (group >= 0), tl.cdiv(K, BLOCK_K), 0)
    for step in range(0, num_k_steps):
        k0 = step * BLOCK_K
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rows[:, None] * K + ks[None, :],
                    mask=row_ok[:, None] & (ks[None, :] < K), other=0.0)
        if MXFP4:
            w_a = _mxfp4_w_tile(a_ptr, a_scale_ptr, group, k0, cols, K, N, BLOCK_K, BLOCK_N,
                                x_dtype)
        else:
            w_a = _dense_w_tile(a_ptr, group, k0, cols, K, N, BLOCK_K)
        acc_a = tl.dot(x, w_a, acc_a, input_precision=PRECISION)
        if FUSED:
            if MXFP4:
                w_b = _mxfp4_w_tile(b_ptr, b_scale_ptr, group, k0, cols, K, N, BLOCK_K, BLOCK_N,
                                    x_dtype)
            else:
                w_b = _dense_w_tile(b_ptr, group, k0, cols, K, N, BLOCK_K)
            acc_b = tl.dot(x, w_b, acc_b, input_precision=PRECISION)

    if FUSED:
        out = _situ_glu(acc_a, acc_b, BETA, HAS_LINEAR_BETA, LINEAR_BETA)
    else:
        out = acc_a
    tl.store(o_ptr + rows[:, None] * N + cols[None, :], out.to(o_ptr.dtype.element_ty),
             mask=row_ok[:, None] & (cols[None, :] < N))


@triton.jit
def grouped_matmul_kernel(x_ptr, w_ptr, meta_ptr, o_ptr,
                          K: tl.constexpr, N: tl.constexpr, NUM_ITEMS: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          PRECISION: tl.constexpr):
    """o [M, N] = x [M, K] @ w [G, K, N] per work item in meta [4, NUM_ITEMS]."""
    _grouped_body(x_ptr, w_ptr, w_ptr, w_ptr, w_ptr, meta_ptr, o_ptr, K, N, NUM_ITEMS,
                  BLOCK_M, BLOCK_N, BLOCK_K, False, False, PRECISION, 1.0, False, 1.0)


@triton.jit
def grouped_matmul_mxfp4_kernel(x_ptr, w_packed_ptr, w_scale_ptr, meta_ptr, o_ptr,
                                K: tl.constexpr, N: tl.constexpr, NUM_ITEMS: tl.constexpr,
                                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    """As grouped_matmul_kernel with MXFP4 w: packed [G, N, K/2], scales [G, K/32, N]."""
    _grouped_body(x_ptr, w_packed_ptr, w_scale_ptr, w_packed_ptr, w_scale_ptr, meta_ptr, o_ptr,
                  K, N, NUM_ITEMS, BLOCK_M, BLOCK_N, BLOCK_K, False, True, PRECISION,
                  1.0, False, 1.0)


@triton.jit
def grouped_situ_glu_kernel(x_ptr, w_gate_ptr, w_up_ptr, meta_ptr, o_ptr,
                            K: tl.constexpr, N: tl.constexpr, NUM_ITEMS: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                            PRECISION: tl.constexpr, BETA: tl.constexpr,
                            HAS_LINEAR_BETA: tl.constexpr, LINEAR_BETA: tl.constexpr):
    """o [M, N] = situ_glu(x @ w_gate[g], x @ w_up[g]), both [G, K, N]."""
    _grouped_body(x_ptr, w_gate_ptr, w_gate_ptr, w_up_ptr, w_up_ptr, meta_ptr, o_ptr, K, N,
                  NUM_ITEMS, BLOCK_M, BLOCK_N, BLOCK_K, True, False, PRECISION,
                  BETA, HAS_LINEAR_BETA, LINEAR_BETA)


@triton.jit
def grouped_situ_glu_mxfp4_kernel(x_ptr, gate_packed_ptr, gate_scale_ptr, up_packed_ptr,
                                  up_scale_ptr, meta_ptr, o_ptr,
                                  K: tl.constexpr, N: tl.constexpr, NUM_ITEMS: tl.constexpr,
                                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                  BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
                                  BETA: tl.constexpr, HAS_LINEAR_BETA: tl.constexpr,
                                  LINEAR_BETA: tl.constexpr):
    """As grouped_situ_glu_kernel with MXFP4 gate / up weights."""
    _grouped_body(x_ptr, gate_packed_ptr, gate_scale_ptr, up_packed_ptr, up_scale_ptr, meta_ptr,
                  o_ptr, K, N, NUM_ITEMS, BLOCK_M, BLOCK_N, BLOCK_K, True, True, PRECISION,
                  BETA, HAS_LINEAR_BETA, LINEAR_BETA)


# -- launch plans ----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LaunchPlan:
    """Everything but the arrays: which kernel, its grid and constexprs, and
    Triton's launch options. Shared by the jax-triton call, the interpreter
    tests (torch tensors) and the cubin compile report."""

    kernel: triton.JITFunction
    grid: tuple[int, int]
    constexprs: dict
    tiles: TritonTiles

    @property
    def name(self) -> str:
        return self.kernel.fn.__name__


_KERNELS = {(False, False): grouped_matmul_kernel, (False, True): grouped_matmul_mxfp4_kernel,
            (True, False): grouped_situ_glu_kernel, (True, True): grouped_situ_glu_mxfp4_kernel}


def plan(*, num_rows: int, k: int, n: int, num_groups: int, x_dtype, fused: bool, mxfp4: bool,
         beta: float = 1.0, linear_beta: float | None = None,
         tiles: TritonTiles | None = None) -> LaunchPlan:
    """The launch for x [num_rows, k] and weights of G = num_groups, [k, n] each."""
    x_dtype = jnp.dtype(x_dtype)
    if x_dtype not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32)):
        raise ValueError(f"Triton kernels take bfloat16, float16 or float32 x, got {x_dtype}")
    if mxfp4 and x_dtype == jnp.dtype(jnp.float16):
        raise ValueError("MXFP4 weights need bfloat16 or float32 x (float16 cannot hold "
                         "every scaled E2M1 value)")
    tiles = tiles or default_tiles(num_rows, num_groups, 1 + fused, x_dtype.itemsize, mxfp4)
    if mxfp4 and tiles.block_k % 32:
        raise ValueError(f"MXFP4 needs block_k a multiple of 32, got {tiles.block_k}")
    num_items = num_work_items(num_rows, num_groups, tiles.block_m)
    constexprs = dict(K=k, N=n, NUM_ITEMS=num_items, BLOCK_M=tiles.block_m,
                      BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
                      PRECISION="tf32x3" if x_dtype == jnp.dtype(jnp.float32) else "ieee")
    if fused:
        constexprs.update(BETA=float(beta), HAS_LINEAR_BETA=linear_beta is not None,
                          LINEAR_BETA=float(linear_beta or 1.0))
    return LaunchPlan(kernel=_KERNELS[fused, mxfp4], grid=(num_items, triton.cdiv(n, tiles.block_n)),
                      constexprs=constexprs, tiles=tiles)


def _call(launch: LaunchPlan, x_MK, weights: list[jax.Array], group_sizes_G, n: int):
    m = x_MK.shape[0]
    meta_4W = work_items_4W(group_sizes_G.astype(jnp.int32), m, launch.tiles.block_m)
    return jt.triton_call(
        x_MK, *weights, meta_4W, kernel=launch.kernel,
        out_shape=jax.ShapeDtypeStruct((m, n), x_MK.dtype), grid=launch.grid,
        num_warps=launch.tiles.num_warps, num_stages=launch.tiles.num_stages,
        compute_capability=target_capability(), name=launch.name, **launch.constexprs)


def _check_mxfp4(name: str, packed_GNH, scale_GSN, k: int, n: int, g: int,
                 group_sizes_G) -> None:
    """ValueError naming the culprit unless the MXFP4 pair fits x's K and G groups."""
    if group_sizes_G.shape != (g,) or not jnp.issubdtype(group_sizes_G.dtype, jnp.integer):
        raise ValueError(f"{name}: group_sizes_G must be int [G={g}], got "
                         f"{group_sizes_G.dtype}{list(group_sizes_G.shape)}")
    if packed_GNH.dtype != jnp.uint8 or scale_GSN.dtype != jnp.uint8:
        raise ValueError(f"{name}: MXFP4 packed codes and scales must be uint8, got "
                         f"{packed_GNH.dtype} and {scale_GSN.dtype}")
    if k % 32:
        raise ValueError(f"{name}: MXFP4 needs K a multiple of 32, got K={k}")
    if packed_GNH.shape != (g, n, k // 2) or scale_GSN.shape != (g, k // 32, n):
        raise ValueError(f"{name}: MXFP4 weights must be packed [G, N, K/2] = {[g, n, k // 2]} "
                         f"and scales [G, K/32, N] = {[g, k // 32, n]}, got "
                         f"{list(packed_GNH.shape)} and {list(scale_GSN.shape)}")


# -- entry points (same signatures as mosaic_sm90's, minus interpret) ---------------


def grouped_matmul(x_MK, w_GKN, group_sizes_G, *, config: TritonTiles | None = None):
    """y_MN = x_MK @ w_GKN[group(row)] (f32 accumulate, x dtype); tail rows are 0."""
    (m, k), n = x_MK.shape, w_GKN.shape[2]
    if m == 0 or n == 0 or k == 0:
        return jnp.zeros((m, n), x_MK.dtype)
    launch = plan(num_rows=m, k=k, n=n, num_groups=w_GKN.shape[0], x_dtype=x_MK.dtype,
                  fused=False, mxfp4=False, tiles=config)
    return _call(launch, x_MK, [w_GKN.astype(x_MK.dtype)], group_sizes_G, n)


def grouped_situ_glu(x_MK, w_gate_GKN, w_up_GKN, group_sizes_G, *, beta: float,
                     linear_beta: float | None, config: TritonTiles | None = None):
    """h_MN = situ_glu(x @ w_gate[g], x @ w_up[g]) fused in one kernel; tail rows are 0."""
    (m, k), n = x_MK.shape, w_gate_GKN.shape[2]
    if m == 0 or n == 0 or k == 0:
        return jnp.zeros((m, n), x_MK.dtype)
    launch = plan(num_rows=m, k=k, n=n, num_groups=w_gate_GKN.shape[0], x_dtype=x_MK.dtype,
                  fused=True, mxfp4=False, beta=beta, linear_beta=linear_beta, tiles=config)
    return _call(launch, x_MK, [w_gate_GKN.astype(x_MK.dtype), w_up_GKN.astype(x_MK.dtype)],
                 group_sizes_G, n)


def grouped_matmul_mxfp4(x_MK, w_packed_GNH, w_scale_GSN, group_sizes_G, *,
                         config: TritonTiles | None = None):
    """y_MN = x_MK @ decode(w)[group(row)]; w as MXFP4 packed uint8 [G, N, K/2]
    (H = K/2, packed along K in the word layout: Mxfp4Weights.packed_GNK,
    read in place) and UE8M0 scales uint8 [G, K/32, N] (S = K/32),
    dequantized in the kernel. x bf16 or float32; tail rows are 0."""
    (m, k), (g, _, n) = x_MK.shape, w_scale_GSN.shape
    _check_mxfp4("grouped_matmul_mxfp4 w", w_packed_GNH, w_scale_GSN, k, n, g, group_sizes_G)
    if m == 0 or n == 0:
        return jnp.zeros((m, n), x_MK.dtype)
    launch = plan(num_rows=m, k=k, n=n, num_groups=g, x_dtype=x_MK.dtype, fused=False,
                  mxfp4=True, tiles=config)
    return _call(launch, x_MK, [w_packed_GNH, w_scale_GSN], group_sizes_G, n)


def grouped_situ_glu_mxfp4(x_MK, gate_packed_GNH, gate_scale_GSN, up_packed_GNH, up_scale_GSN,
                           group_sizes_G, *, beta: float, linear_beta: float | None,
                           config: TritonTiles | None = None):
    """h_MN = situ_glu(x @ decode(gate)[g], x @ decode(up)[g]), MXFP4 gate / up
    as in grouped_matmul_mxfp4; tail rows are 0."""
    (m, k), (g, _, n) = x_MK.shape, gate_scale_GSN.shape
    _check_mxfp4("grouped_situ_glu_mxfp4 gate", gate_packed_GNH, gate_scale_GSN, k, n, g,
                 group_sizes_G)
    _check_mxfp4("grouped_situ_glu_mxfp4 up", up_packed_GNH, up_scale_GSN, k, n, g,
                 group_sizes_G)
    if m == 0 or n == 0:
        return jnp.zeros((m, n), x_MK.dtype)
    launch = plan(num_rows=m, k=k, n=n, num_groups=g, x_dtype=x_MK.dtype, fused=True,
                  mxfp4=True, beta=beta, linear_beta=linear_beta, tiles=config)
    return _call(launch, x_MK, [gate_packed_GNH, gate_scale_GSN, up_packed_GNH, up_scale_GSN],
                 group_sizes_G, n)
