"""How a K3 layer's routed experts are stored and split: the storage
(``ExpertStorage``), the padding rule of docs/spec.md §5
(``padded_moe_intermediate``) and the check that packed MXFP4 experts split
on whole 32-wide scale blocks (``check_mxfp4_shards``). k3jax.layout reads
all three when it decides a layer."""

from __future__ import annotations

import enum

from k3jax.config import K3Config
from k3jax.layout.placement import LayoutError
from pallas_kernels.mxfp4 import BLOCK_SIZE


class Mxfp4ShardError(LayoutError):
    """Packed MXFP4 experts cannot be split this way (a shard would cut a
    32-wide scale block); dense (dequantized) expert storage can."""


class ExpertStorage(enum.Enum):
    """How the routed experts' weights live in device memory.

    DENSE          w1_ELF, w3_ELF, w2_EFL in the Layout's dtype (random values,
                   or float experts read from a checkpoint)
    MXFP4          uint8 codes + UE8M0 scales, packed along each weight's input
                   axis (the codes [E, out, in/2] as the checkpoint stores them,
                   the scales [E, in/32, out]); the grouped matmuls dequantize
                   one active expert at a time
    MXFP4_DEQUANT  MXFP4 in the checkpoint, dequantized to the Layout's dtype
                   as it is loaded: in device memory exactly as DENSE
    """

    DENSE = "dense"
    MXFP4 = "mxfp4"
    MXFP4_DEQUANT = "mxfp4-dequant"

    @property
    def packed(self) -> bool:
        """Are the experts held as packed MXFP4 codes and scales?"""
        return self is ExpertStorage.MXFP4


def padded_moe_intermediate(intermediate: int, shards: int, min_per_partition: int) -> int:
    """docs/spec.md §5: the routed-expert intermediate after padding, for ``shards``
    devices splitting each expert's intermediate (1 under EP). Each shard takes
    ``intermediate // shards`` real columns, so ``shards`` must divide it."""
    if intermediate % shards:
        raise LayoutError(f"moe_intermediate_size {intermediate} is not divisible by the "
                         f"{shards} devices splitting each expert's intermediate")
    if shards > 1 and intermediate // shards < min_per_partition:
        return min_per_partition * shards
    return intermediate


def check_mxfp4_shards(cfg: K3Config, shards: int, padded: int) -> None:
    """Packed codes and scales run along each weight's input axis (L for w1/w3,
    F for w2), so the latent width and each shard's intermediate, real and
    padded, must be whole 32-wide scale blocks."""
    L, I = cfg.routed_expert_hidden_size, cfg.moe_intermediate_size
    for what, width in (("latent width", L), ("per-shard intermediate", I // shards),
                        ("padded per-shard intermediate", padded // shards)):
        if width % BLOCK_SIZE:
            raise Mxfp4ShardError(f"MXFP4 packed experts need the {what} ({width}) to be a "
                                  f"multiple of {BLOCK_SIZE}; store the experts dequantized instead")


__all__ = ["ExpertStorage", "Mxfp4ShardError", "check_mxfp4_shards", "padded_moe_intermediate"]
