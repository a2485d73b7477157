"""MXFP4 routed experts, held packed: uint8 E2M1 codes (two a byte) and
UE8M0 scales (one per 32 inputs) along each weight's input axis, 0.53125 B
per parameter (docs/spec.md §3.1; the codec is pallas_kernels.mxfp4).

Parameters (F the padded intermediate, L the latent width):

    w1_packed_EFL, w3_packed_EFL  uint8 [E, F, L/2]  the stored [out, in/2] per
    w2_packed_ELF                 uint8 [E, L, F/2]  expert, in the word layout
                                                     (the loader interleaves)
    w1_scale_ELF, w3_scale_ELF    uint8 [E, L/32, F] the stored [out, in/32]
    w2_scale_EFL                  uint8 [E, F/32, L] transposed

A code array's spec is its weight's with the last two entries swapped (F's
padding moves with F); a scale array's is the weight's. The grouped matmuls
take ``Mxfp4Weights(codes, scales, dequant, k_order_axis)`` and dequantize
one active expert at a time; the uint8 arrays get no gradient (they are
k3jax.variables.PackedWeight, not nnx.Param).

Static facts, in the format the Layout holds: ``dequant`` (Mxfp4Dequant:
FAST when every stored scale byte is in 2..128, else EXACT; the loader reads
it off the scale bytes and every process agrees on it; random weights are
FAST by construction; abstract ones take what the caller states) and
``k_order`` (bind: whether w1 / w3 / w2 run in the Mosaic kernels' K order).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.formats.base import ExpertLayout, StoredTensor, WeightFormat, swap_last
from k3jax.formats.decl import ParamDecl
from k3jax.runtime.agreement import agree_mxfp4_dequant
from k3jax.variables import PackedWeight
from pallas_kernels.backend import Family
from pallas_kernels.mxfp4 import (
    BLOCK_SIZE,
    K_ORDER_CHUNK,
    SCALE_NAN,
    Mxfp4Dequant,
    Mxfp4Weights,
    dequant_numpy,
    encode,
    validate_scales,
)

# (codes, scales) per weight: codes [E, out, in/2] as stored, scales [E, in/32, out]
PARAM_NAMES = {w: (f"{w}_packed_{codes}", f"{w}_scale_{scales}")
               for w, codes, scales in (("w1", "EFL", "ELF"), ("w3", "EFL", "ELF"),
                                        ("w2", "ELF", "EFL"))}
SCALE_PARAMS = tuple(scales for _, scales in PARAM_NAMES.values())


def random_codes(key, shape, fan_in):
    """Uniform random bytes: two E2M1 codes each."""
    return jax.random.randint(key, shape, 0, 256, jnp.int32)


def random_scales(key, shape, fan_in):
    """UE8M0 bytes giving values of about 1 / sqrt(fan_in) (E2M1 magnitudes
    reach 6), all within the fast dequant's bytes for K3's and TINY's fan-ins."""
    centre = 127 - 2 - round(0.5 * math.log2(fan_in))
    return jax.random.randint(key, shape, centre - 1, centre + 2, jnp.int32)


def check_scales(scales: np.ndarray) -> None:
    """ValueError for a NaN scale byte (255); the full scan only when one may be there."""
    if scales.dtype == np.uint8 and (scales.size == 0 or scales.max() < SCALE_NAN):
        return
    validate_scales(scales)


@dataclasses.dataclass(frozen=True)
class Mxfp4Format(WeightFormat):
    """Packed MXFP4 experts (module docstring). ``k_order`` is set by bind."""

    dequant: Mxfp4Dequant = Mxfp4Dequant.FAST
    k_order: bool = False

    name = "mxfp4"
    packed = True
    codec = True
    fact_params = SCALE_PARAMS

    def __post_init__(self) -> None:
        if not isinstance(self.dequant, Mxfp4Dequant):
            raise ValueError(f"Mxfp4Format: dequant must be an Mxfp4Dequant, got {self.dequant!r}")

    def describe(self) -> str:
        return f"MXFP4 experts' dequant: {self.dequant.value}"

    def split_refusal(self, el: ExpertLayout) -> str | None:
        """Codes and scales run along each weight's input axis (L for w1/w3, F
        for w2): the latent width and each shard's intermediate, real and
        padded, must be whole 32-wide scale blocks."""
        for what, width in (("latent width", el.latent),
                            ("per-shard intermediate", el.intermediate // el.shards),
                            ("padded per-shard intermediate", el.padded // el.shards)):
            if width % BLOCK_SIZE:
                return (f"MXFP4 packed experts need the {what} ({width}) to be a multiple of "
                        f"{BLOCK_SIZE}; store the experts dequantized instead")
        return None

    def bind(self, el: ExpertLayout) -> Mxfp4Format:
        """K order (pallas_kernels.mxfp4.k_order) on the Mosaic backends with
        each shard's F whole 128-chunks: w1 / w3 with k_order_axis 2, w2 with
        1, so h leaves the gate/up in the order the down projection's kernel
        takes, with no transposed copy of h; the product is the same."""
        local_f = el.padded // el.shards
        k_order = el.backend.family is Family.MOSAIC and local_f % K_ORDER_CHUNK == 0
        return dataclasses.replace(self, k_order=bool(k_order))

    def param_decls(self, el: ExpertLayout) -> list[ParamDecl]:
        E, L, I, F = el.num_experts, el.latent, el.intermediate, el.padded
        u8 = jnp.dtype(jnp.uint8)
        decls = []
        for w, spec in (("w1", el.specs[0]), ("w3", el.specs[1])):   # F is the output axis
            codes, scales = PARAM_NAMES[w]
            decls += [ParamDecl(codes, (E, F, L // 2), u8, swap_last(spec, 3), random_codes, L,
                                el.padding(1), PackedWeight),
                      ParamDecl(scales, (E, L // BLOCK_SIZE, F), u8, spec, random_scales, L,
                                el.padding(2), PackedWeight)]
        codes, scales = PARAM_NAMES["w2"]   # F is the (packed) input axis
        spec = el.specs[2]
        return decls + [
            ParamDecl(codes, (E, L, F // 2), u8, swap_last(spec, 3), random_codes, I,
                      el.padding(2, I // 2), PackedWeight),
            ParamDecl(scales, (E, F // BLOCK_SIZE, L), u8, spec, random_scales, I,
                      el.padding(1, I // BLOCK_SIZE), PackedWeight)]

    def checkpoint_tensors(self) -> dict[str, StoredTensor]:
        out = {}
        for w, (codes, scales) in PARAM_NAMES.items():
            out[codes] = StoredTensor(f"{w}.weight_packed", False, True, ("U8",), interleave=True)
            out[scales] = StoredTensor(f"{w}.weight_scale", True, True, ("U8",), check=check_scales)
        return out

    def kernel_weights(self, p, dtype):
        """Mxfp4Weights of the codes and scales, with this format's dequant
        and, under ``k_order``, k_order_axis 2 for w1 / w3 and 1 for w2."""
        axes = {"w1": 2, "w3": 2, "w2": 1} if self.k_order else {}
        return tuple(Mxfp4Weights(p[codes], p[scales], self.dequant, axes.get(w))
                     for w, (codes, scales) in PARAM_NAMES.items())

    # -- the codec ------------------------------------------------------------------
    def stored_names(self, weight_name: str) -> tuple[str, str]:
        """``...w1.weight`` -> (``...w1.weight_packed``, ``...w1.weight_scale``)."""
        if not weight_name.endswith(".weight"):
            raise ValueError(f"not a weight name: {weight_name}")
        return weight_name + "_packed", weight_name + "_scale"

    def check_stored(self, check, weight_name: str, out: int, n_in: int) -> None:
        if n_in % BLOCK_SIZE:
            raise ValueError(f"MXFP4 needs the input width {n_in} to be a multiple of {BLOCK_SIZE}")
        packed, scale = self.stored_names(weight_name)
        check(packed, (out, n_in // 2), {"U8"})
        check(scale, (out, n_in // BLOCK_SIZE), {"U8"})

    def decode(self, read, weight_name: str, rows: slice, cols: slice) -> np.ndarray:
        """Reads the whole 32-wide blocks that cover ``cols``, checks their
        scales, dequantizes them (float32) and keeps ``cols``."""
        packed_name, scale_name = self.stored_names(weight_name)
        first, last = cols.start // BLOCK_SIZE, math.ceil(cols.stop / BLOCK_SIZE)
        packed = read(packed_name, [rows, slice(first * BLOCK_SIZE // 2, last * BLOCK_SIZE // 2)])
        scales = read(scale_name, [rows, slice(first, last)], check=check_scales)
        offset = first * BLOCK_SIZE
        return dequant_numpy(packed, scales)[:, cols.start - offset: cols.stop - offset]

    def encode(self, w_out_in: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return encode(w_out_in)

    # -- the dequant, read off the stored scale bytes ------------------------------
    def fact_of(self, block: np.ndarray) -> Mxfp4Dequant:
        return Mxfp4Dequant.of_scales(block)

    def combine_facts(self, facts) -> Mxfp4Dequant:
        return Mxfp4Dequant.combine(facts)

    def agree_facts(self, local) -> list[Mxfp4Dequant]:
        return agree_mxfp4_dequant(local)

    def with_fact(self, fact: Mxfp4Dequant) -> Mxfp4Format:
        return dataclasses.replace(self, dequant=fact)


__all__ = ["Mxfp4Format", "PARAM_NAMES", "SCALE_PARAMS", "check_scales", "random_codes",
           "random_scales"]
