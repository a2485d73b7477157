"""The word layout ``Mxfp4Weights`` holds MXFP4 codes in: the checkpoint's
bytes with the 32 bits of every 4 consecutive bytes of a row (one word, 8
codes, K elements 8w .. 8w + 7) permuted so that the fast dequantization
(pallas_kernels.mxfp4_fast.SEQUENCE) turns a word into four bf16x2 in 8
integer instructions.

    words = interleave_words(packed)      # checkpoint bytes -> word layout
    packed = deinterleave_words(words)    # and back (bit for bit)

Both take uint8 [..., n] (n a multiple of 4, the codes along the last axis),
numpy (host) or jax arrays (traced: a handful of fused shifts and masks), and
return the same shape and type. A word is little-endian (byte 0 in bits
0..7), as the GPU loads it; bit p of the interleaved word is bit
mxfp4_fast.WORD_SOURCE_BITS[p] of the checkpoint's, a permutation read off
the sequence itself, so the layout and the instructions cannot disagree.
Only the bits within a word move: which bytes hold which K elements, the
scales and every shape are the checkpoint's.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from pallas_kernels.mxfp4_fast import WORD_SOURCE_BITS

WORD_BYTES = 4


def _moves(source_bits: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """(shift, mask of source bits) per distinct shift: destination bit p takes
    source bit source_bits[p], so dest = OR of (src & mask) shifted by p - s."""
    masks: dict[int, int] = {}
    for p, s in enumerate(source_bits):
        masks[p - s] = masks.get(p - s, 0) | (1 << s)
    return tuple(sorted(masks.items()))


def _rotations(source_bits: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """(left rotation, mask of destination bits) per distinct rotation:
    destination bit p takes source bit source_bits[p], which the word rotated
    left by (p - s) mod 32 holds at p, so dest = OR of (rotl(src, r) & mask)."""
    masks: dict[int, int] = {}
    for p, s in enumerate(source_bits):
        r = (p - s) % 32
        masks[r] = masks.get(r, 0) | (1 << p)
    return tuple(sorted(masks.items()))


_INTERLEAVE = _moves(WORD_SOURCE_BITS)
_DEINTERLEAVE = _moves(tuple(np.argsort(WORD_SOURCE_BITS).tolist()))
_INTERLEAVE_ROTATIONS = _rotations(WORD_SOURCE_BITS)


def _xp(packed):
    return np if isinstance(packed, np.ndarray) else jnp


def words_of(packed, name: str = "words_of"):
    """uint8 [..., n] (n a multiple of 4) -> uint32 [..., n / 4], little-endian
    (byte 0 in bits 0..7), as the GPU loads a word; ValueError naming ``name``
    for anything else."""
    xp = _xp(packed)
    if packed.dtype != xp.uint8 or packed.ndim < 1 or packed.shape[-1] % WORD_BYTES:
        raise ValueError(f"{name} takes uint8 codes [..., n] with n a multiple of "
                         f"{WORD_BYTES}, got {packed.dtype} {tuple(packed.shape)}")
    b = packed.reshape(*packed.shape[:-1], packed.shape[-1] // WORD_BYTES, WORD_BYTES)
    b = b.astype(xp.uint32)
    return b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)


def _permute_bits(packed, moves, name: str):
    xp = _xp(packed)
    word = words_of(packed, name)
    out = xp.zeros_like(word)
    for shift, mask in moves:
        part = word & xp.uint32(mask)
        out = out | (part << shift if shift >= 0 else part >> -shift)
    out_bytes = xp.stack([(out >> (8 * i)) & xp.uint32(0xFF) for i in range(WORD_BYTES)], axis=-1)
    return out_bytes.astype(xp.uint8).reshape(packed.shape)


def interleave_words(packed):
    """Checkpoint codes uint8 [..., n] -> the word layout (module docstring)."""
    return _permute_bits(packed, _INTERLEAVE, "interleave_words")


def interleave_word_bits(words):
    """Checkpoint words uint32 [...] (``words_of``'s: little-endian, byte 0 in
    bits 0..7) -> the word layout's words, same shape; ``interleave_words``
    without the assembly from and split into bytes: bit p of a result is bit
    WORD_SOURCE_BITS[p] of its word. One rotation and one mask per distinct
    rotation distance (13 of them, where the shifts take 17 moves: a shift
    left and one right by 32 less the same distance are one rotation); on an
    AVX-512 host XLA:CPU makes 12 shifts or rotates and 12 ternary-logic ops
    of a vector of words of them (the shift form: 17 and 16). On a
    little-endian host a uint32 view of the codes' bytes is ``words_of`` them
    and a uint8 view of the result is ``interleave_words`` of them (the
    loader's host op on CPU devices, k3jax.checkpoint.slabs)."""
    xp = _xp(words)
    if words.dtype != xp.uint32:
        raise ValueError(f"interleave_word_bits takes uint32 words, got {words.dtype}")
    out = None
    for r, mask in _INTERLEAVE_ROTATIONS:
        rotated = words if r == 0 else (words << xp.uint32(r)) | (words >> xp.uint32(32 - r))
        part = rotated & xp.uint32(mask)
        out = part if out is None else out | part
    return out


def deinterleave_words(words):
    """The word layout uint8 [..., n] -> the checkpoint's codes (module docstring)."""
    return _permute_bits(words, _DEINTERLEAVE, "deinterleave_words")


__all__ = ["WORD_BYTES", "deinterleave_words", "interleave_word_bits", "interleave_words",
           "words_of"]
