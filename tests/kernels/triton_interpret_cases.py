"""Runs the Triton kernel bodies in Triton's interpreter (CPU, torch tensors)
and saves their outputs next to the float32 XLA reference's.

Started in a subprocess by test_triton_kernels.py (TRITON_INTERPRET must be set
before triton is imported, and must not leak into other tests):

    python tests/kernels/triton_interpret_cases.py CASES_JSON OUT.npz

CASES_JSON: a list of {name, op ("matmul" | "situ" | "mxfp4_decode"), mxfp4,
m, k, n, g, pattern, poison, seed}. "mxfp4_decode" multiplies one-hot rows
of x by an MXFP4 weight whose scale bytes span 0..252: the output rows are
the kernel's dequantized weight rows, ``ref`` is dequant's. OUT.npz
gets, per case, ``NAME/out``, ``NAME/ref`` (float32), ``NAME/sizes`` and
``NAME/block_m``. Outputs start as NaN, so a row the kernel never
writes shows up as NaN.
"""

from __future__ import annotations

import json
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernel_cases import BETA, LINEAR_BETA, group_pattern, grouped_inputs, poison_tail  # noqa: E402
from pallas_kernels.grouped_matmul import reference, triton_sm80  # noqa: E402
from pallas_kernels.grouped_matmul.schedule import work_items_4W  # noqa: E402
from pallas_kernels.mxfp4 import dequant  # noqa: E402
from pallas_kernels.mxfp4_words import interleave_words  # noqa: E402


def dequant_GKN(packed_GNH, scale_GSN):
    """float32 [g, k, n] of packed uint8 [g, n, k/2] and scales uint8 [g, k/32, n]
    (mxfp4.dequant along K, the packed codes' last axis)."""
    scale_GNS = jnp.swapaxes(jnp.asarray(scale_GSN), 1, 2)
    return jnp.swapaxes(dequant(jnp.asarray(packed_GNH), scale_GNS), 1, 2)


def mxfp4_weights(seed: int, g: int, k: int, n: int):
    """Random MXFP4 weight as the kernels take it: (packed uint8 [g, n, k/2]
    in the word layout, scales uint8 [g, k/32, n], decoded float32 [g, k, n]
    of the checkpoint codes); scale bytes 120..130 keep values O(1)."""
    rng = np.random.default_rng(seed)
    packed_GNH = rng.integers(0, 256, (g, n, k // 2), dtype=np.uint8)
    scale_GSN = rng.integers(120, 131, (g, k // 32, n), dtype=np.uint8)
    return interleave_words(packed_GNH), scale_GSN, dequant_GKN(packed_GNH, scale_GSN)


def run_decode_case(case: dict) -> dict[str, np.ndarray]:
    """x = the k x k identity (one group): out = the dequantized weight."""
    k, n = case["k"], case["n"]
    rng = np.random.default_rng(case["seed"])
    packed = rng.integers(0, 256, (1, n, k // 2), dtype=np.uint8)
    edge_bytes = np.array([0, 1, 2, 100, 126, 127, 128, 200, 252], np.uint8)  # 253+ overflow
    scale = rng.choice(edge_bytes, (1, k // 32, n)).astype(np.uint8)
    dense = dequant_GKN(packed, scale)
    launch = triton_sm80.plan(num_rows=k, k=k, n=n, num_groups=1, x_dtype=jnp.float32,
                              fused=False, mxfp4=True)
    sizes = np.array([k], np.int32)
    meta_4W = np.asarray(work_items_4W(jnp.asarray(sizes), k, launch.tiles.block_m))
    out = torch.full((k, n), float("nan"), dtype=torch.float32)
    args = [torch.from_numpy(np.array(a)) for a in (np.eye(k, dtype=np.float32),
                                                      interleave_words(packed), scale, meta_4W)]
    launch.kernel[launch.grid](*args, out, **launch.constexprs)
    return {"out": out.numpy(), "ref": np.asarray(dense[0]), "sizes": sizes,
            "block_m": np.int32(launch.tiles.block_m)}


def run_case(case: dict) -> dict[str, np.ndarray]:
    if case["op"] == "mxfp4_decode":
        return run_decode_case(case)
    m, k, n, g = case["m"], case["k"], case["n"], case["g"]
    fused = case["op"] == "situ"
    num_w = 2 if fused else 1
    x, dense_ws = grouped_inputs(case["seed"], m, k, n, g, jnp.float32, num_weights=num_w)
    kernel_ws = [np.asarray(w) for w in dense_ws]
    if case["mxfp4"]:
        kernel_ws, dense_ws = [], []
        for i in range(num_w):
            packed, scale, dense = mxfp4_weights(case["seed"] * 10 + i, g, k, n)
            kernel_ws += [packed, scale]
            dense_ws.append(dense)
    sizes = group_pattern(case["pattern"], m, g)
    x_in = poison_tail(x, sizes) if case["poison"] else x

    launch = triton_sm80.plan(num_rows=m, k=k, n=n, num_groups=g, x_dtype=jnp.float32,
                              fused=fused, mxfp4=case["mxfp4"], beta=BETA,
                              linear_beta=LINEAR_BETA)
    meta_4W = np.asarray(work_items_4W(jnp.asarray(sizes), m, launch.tiles.block_m))
    out = torch.full((m, n), float("nan"), dtype=torch.float32)
    args = [torch.from_numpy(np.array(a)) for a in (x_in, *kernel_ws, meta_4W)]
    launch.kernel[launch.grid](*args, out, **launch.constexprs)

    if fused:
        ref = reference.grouped_situ_glu(x, *dense_ws, jnp.asarray(sizes), beta=BETA,
                                         linear_beta=LINEAR_BETA)
    else:
        ref = reference.grouped_matmul(x, dense_ws[0], jnp.asarray(sizes))
    return {"out": out.numpy(), "ref": np.asarray(ref), "sizes": sizes,
            "block_m": np.int32(launch.tiles.block_m)}


def main(cases_json: str, out_path: str) -> int:
    results = {}
    for case in json.loads(cases_json):
        for key, value in run_case(case).items():
            results[f"{case['name']}/{key}"] = value
    np.savez(out_path, **results)
    return 0


if __name__ == "__main__":
    jax.config.update("jax_platforms", "cpu")
    sys.exit(main(*sys.argv[1:]))
