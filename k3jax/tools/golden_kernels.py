"""The figures the kernel cost model reads from the committed golden kernel
file (k3jax/data/sm90a_kernels.json, written by ``python -m
benchmarks.compile_table``): SASS counts of the sm_90a cubins, compiler
output, not measurements of time.
"""

from __future__ import annotations

import json
from pathlib import Path

# The MXFP4 fast kernel's dequant (mosaic_sm90_mxfp4.py, fast_dequant_tile):
# SASS instructions per weight element of its consumer K step, counted in the
# sm_90a cubin (k3jax.tools.kernel_sass) and committed in the golden kernel file
# (k3jax/data/sm90a_kernels.json, dequant_sass_per_weight: the bit
# sequence, the scale pairs, the x split, the bf16 tile's SMEM stores), one
# per CUDA-core lane and clock; a consumer warpgroup (128 lanes) dequantizes
# while its own WGMMAs wait (an assumption, not measured). Weights with a
# scale byte outside FAST_SCALES run the exact kernel (about 6x the count):
# the model does not cover them.
GOLDEN_KERNELS = Path(__file__).resolve().parents[1] / "data" / "sm90a_kernels.json"
# The row-major fast kernel the dispatch takes: the fused product past 48
# rows a group (mosaic_sm90_mxfp4_swap_ab.block_t_for); the plain product
# always takes the swap-AB kernel, so the golden file holds no count for it.
MXFP4_FAST_KERNELS = {2: "grouped_situ_glu_mxfp4_m64"}
# The swap-AB MXFP4 kernel (mosaic_sm90_mxfp4_swap_ab), by the prefix of its
# kernel names (block_t follows): the golden file holds it at block_t 8, 56
# and 48 (16 and 256 tokens at EP 8); the model takes the largest count.
MXFP4_SWAP_AB_KERNELS = {1: "grouped_matmul_mxfp4_swap_ab_t", 2: "grouped_situ_glu_mxfp4_swap_ab_t"}


def _golden_dequant_sass(kernels: dict[int, str], prefix: bool = False) -> dict[int, float]:
    """num_weights -> the largest dequant_sass_per_weight the golden file holds
    for that MXFP4 fast kernel (every kernel whose name starts with it where
    ``prefix``)."""
    configs = json.loads(GOLDEN_KERNELS.read_text())["configurations"]
    out = {}
    for num_weights, kernel in kernels.items():
        found = [e["dequant_sass_per_weight"] for entries in configs.values() for e in entries
                 if (e["kernel"].startswith(kernel) if prefix else e["kernel"] == kernel)
                 and "dequant_sass_per_weight" in e]
        if not found:
            raise ValueError(f"{GOLDEN_KERNELS} holds no dequant_sass_per_weight for {kernel}")
        out[num_weights] = max(found)
    return out


MXFP4_DEQUANT_SASS_PER_WEIGHT = _golden_dequant_sass(MXFP4_FAST_KERNELS)
MXFP4_SWAP_AB_DEQUANT_SASS_PER_WEIGHT = _golden_dequant_sass(MXFP4_SWAP_AB_KERNELS, prefix=True)
