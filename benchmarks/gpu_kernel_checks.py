"""Correctness of the Pallas kernels on the device, before anything is timed.

The benchmark sweep (benchmarks.kernel_sweep) runs bf16 at K3 shapes where the groups
cover every row. This pass covers what it does not, on the real backend:
float32 inputs (the bf16x3 path), rows past sum(group_sizes) poisoned with
NaN (the tail branch), empty groups, one group holding every row, fewer
rows than one tile, K and N that need padding, and the prefill tiles. Each
case runs twice and must give bitwise-identical outputs (a race that shows
only sometimes fails here), and is compared with a float64 numpy reference
(tests/kernels/kernel_cases.py, the test suite's shared base).

  python -m benchmarks.gpu_kernel_checks --json checks.json       # on the GPU
  python -m benchmarks.gpu_kernel_checks --backend interpret      # CPU, minutes

Exit status: 0 all cases pass, 1 some case failed, 2 usage error.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _REPO)
sys.path.insert(0, os.path.join(_REPO, "tests", "kernels"))

import kernel_cases as kc  # noqa: E402 -- the test suite's inputs and float64 references
from pallas_kernels import grouped_matmul, grouped_situ_glu, situ_mlp_up  # noqa: E402
from pallas_kernels.backend import PALLAS, resolve  # noqa: E402
from pallas_kernels.grouped_matmul import mosaic_sm90, mosaic_sm90_swap_ab  # noqa: E402

BF16, F32 = jnp.bfloat16, jnp.float32
SITU = {"beta": kc.BETA, "linear_beta": kc.LINEAR_BETA}


@dataclasses.dataclass(frozen=True)
class Case:
    """One kernel call: op "matmul" | "situ_glu" (grouped) | "mlp" (situ_mlp_up)."""

    op: str
    m: int
    k: int
    n: int
    groups: int
    pattern: str  # kernel_cases.group_pattern name; "mlp" for situ_mlp_up
    dtype: object
    num_ctas: int | None = None  # force the persistent grid size (None: every SM)
    swap_ab: mosaic_sm90_swap_ab.SwapABConfig | None = None  # force the swap-AB (weights-on-M) kernel

    @property
    def swap_ab_tiles(self) -> str:
        """" swap_ab wg.. t.. s.." naming the forced swap-AB tiles ("" without)."""
        d = self.swap_ab
        if not d:
            return ""
        return (f" swap_ab wg{d.num_compute_wgs}x{d.wg_block_w} t{d.block_t} s{d.split_k}"
                + (f" ctas={d.num_ctas}" if d.num_ctas else "")
                + (f" cluster={d.cluster}" if d.cluster > 1 else ""))

    @property
    def name(self) -> str:
        dtype = jnp.dtype(self.dtype).name
        ctas = f" ctas={self.num_ctas}" if self.num_ctas else ""
        return (f"{self.op} m={self.m} k={self.k} n={self.n} g={self.groups} {self.pattern} "
                f"{dtype}{ctas}{self.swap_ab_tiles}")

    def fn(self, backend: str):
        """The kernel on ``backend``: f(x, w, sizes) | f(x, w_gate, w_up, sizes) |
        f(x, gate_DF, up_DF) for "matmul" | "situ_glu" | "mlp"."""
        if self.swap_ab:  # the swap-AB kernel itself, with these tiles
            interpret = resolve(backend).interpret
            if self.op == "matmul":
                return lambda x, w, s: mosaic_sm90_swap_ab.grouped_matmul(
                    x, w, s, config=self.swap_ab, interpret=interpret)
            return lambda x, a, b, s: mosaic_sm90_swap_ab.grouped_situ_glu(
                x, a, b, s, config=self.swap_ab, interpret=interpret, **SITU)
        if self.num_ctas:  # the Mosaic kernel itself, on num_ctas CTAs (not interpret)
            num_w = 1 if self.op == "matmul" else 2
            cfg = dataclasses.replace(
                mosaic_sm90.default_config(self.m, self.groups, num_w), num_ctas=self.num_ctas)
            if self.op == "matmul":
                return lambda x, w, s: mosaic_sm90.grouped_matmul(x, w, s, config=cfg)
            return lambda x, a, b, s: mosaic_sm90.grouped_situ_glu(x, a, b, s, config=cfg, **SITU)
        if self.op == "matmul":
            return lambda x, w, s: grouped_matmul(x, w, s, backend=backend)
        if self.op == "situ_glu":
            return lambda x, a, b, s: grouped_situ_glu(x, a, b, s, backend=backend, **SITU)
        return lambda x, a, b: situ_mlp_up(x, a, b, backend=backend, **SITU)

    def arg_specs(self) -> tuple[jax.ShapeDtypeStruct, ...]:
        """Shapes and dtypes of fn's arguments."""
        S = jax.ShapeDtypeStruct
        x = S((self.m, self.k), self.dtype)
        if self.op == "mlp":
            return x, S((self.k, self.n), self.dtype), S((self.k, self.n), self.dtype)
        w = S((self.groups, self.k, self.n), self.dtype)
        sizes = S((self.groups,), jnp.int32)
        return (x, w, sizes) if self.op == "matmul" else (x, w, w, sizes)


def _grouped(op: str, m: int, k: int, n: int, g: int, patterns, dtypes) -> list[Case]:
    return [Case(op, m, k, n, g, p, d) for p in patterns for d in dtypes]


PATTERNS = ("uniform", "zeros_skewed", "one_group_all", "sum_lt_m", "all_empty")
CASES: list[Case] = [
    # decode tiles (M / G < 128): every group-size pattern, both dtypes
    *_grouped("matmul", 300, 256, 256, 8, PATTERNS, (BF16, F32)),
    *_grouped("situ_glu", 300, 256, 256, 8, ("zeros_skewed", "sum_lt_m"), (BF16, F32)),
    # fewer rows than one 64-row tile; K and N that no block divides (padded)
    *_grouped("matmul", 40, 256, 256, 4, ("sum_lt_m",), (BF16,)),
    *_grouped("situ_glu", 120, 96, 80, 4, ("sum_lt_m",), (BF16, F32)),
    # prefill tiles (M / G >= 128: two consumer warpgroups; f32 shrinks block_n)
    *_grouped("matmul", 1024, 512, 512, 4, ("uniform", "sum_lt_m"), (BF16, F32)),
    *_grouped("situ_glu", 1024, 512, 512, 4, ("sum_lt_m",), (BF16, F32)),
    # the fused dense MLP (one group holding every row)
    Case("mlp", 40, 256, 192, 1, "mlp", BF16), Case("mlp", 40, 256, 192, 1, "mlp", F32),
    Case("mlp", 512, 512, 256, 1, "mlp", BF16),
    # the persistent path: >= 1000 tiles with K >= 1024, so every CTA runs many
    # tiles and the stage ring wraps (K / 64 = 16 steps per tile)...
    Case("matmul", 4096, 1024, 8192, 8, "uniform", BF16),  # ~1300 prefill tiles
    Case("situ_glu", 2048, 1024, 4096, 64, "zeros_skewed", BF16),  # ~2000 tiles
    # ...on 3 CTAs (hundreds of tiles each), and split-K at every K range length
    Case("situ_glu", 1024, 1024, 1024, 4, "sum_lt_m", BF16, num_ctas=3),
    Case("mlp", 8, 7168, 768, 1, "mlp", BF16),  # the tp 8 decode MLP: split-K
    # the swap-AB (weights-on-M) kernel (mosaic_sm90_swap_ab): one and two consumers,
    # split-K, the NaN tail and empty groups, float32, and 4 CTAs running
    # hundreds of tiles each with K = 1024 (the stage ring wraps)
    # (tilings that compile without spills: tests/test_aot_kernels.py checks it)
    Case("matmul", 300, 1024, 512, 16, "zeros_skewed", BF16,
         swap_ab=mosaic_sm90_swap_ab.SwapABConfig(num_compute_wgs=2, wg_block_w=128, block_t=32)),
    Case("situ_glu", 300, 1024, 512, 16, "sum_lt_m", BF16,
         swap_ab=mosaic_sm90_swap_ab.SwapABConfig(num_compute_wgs=1, wg_block_w=128, block_t=16,
                                                split_k=2)),
    Case("situ_glu", 120, 512, 256, 8, "sum_lt_m", F32,
         swap_ab=mosaic_sm90_swap_ab.SwapABConfig(num_compute_wgs=1, wg_block_w=64, block_t=16)),
    Case("matmul", 1024, 1024, 4096, 64, "uniform", BF16,
         swap_ab=mosaic_sm90_swap_ab.SwapABConfig(num_compute_wgs=1, wg_block_w=128, block_t=24,
                                                num_ctas=4)),
    # ...with CTA clusters multicasting x (cluster 2 and 4; split-K and float32's
    # two x planes in a cluster; 2 clusters of 4 running hundreds of tiles each)
    Case("situ_glu", 300, 1024, 512, 16, "sum_lt_m", BF16,
         swap_ab=mosaic_sm90_swap_ab.SwapABConfig(num_compute_wgs=2, wg_block_w=64, block_t=48,
                                                cluster=2)),
    Case("situ_glu", 120, 512, 256, 8, "zeros_skewed", F32,
         swap_ab=mosaic_sm90_swap_ab.SwapABConfig(num_compute_wgs=2, wg_block_w=64, block_t=16,
                                                max_concurrent_steps=4, split_k=2, cluster=2)),
    Case("matmul", 1024, 1024, 4096, 64, "uniform", BF16,
         swap_ab=mosaic_sm90_swap_ab.SwapABConfig(num_compute_wgs=2, wg_block_w=64, block_t=32,
                                                num_ctas=8, cluster=4)),
    # ...whose last cluster group overhangs N (weights not padded: TMA zero fill
    # past N): down's N = 3584 in superblocks of 8 x 128 (4 of 32 N-blocks
    # wholly past N; the sweep's down EP 32 x 64-token x-lean tiling), and
    # float32 N = 448 in 4 x 128 (the last N-block half past N)
    Case("matmul", 1024, 1024, 3584, 28, "uniform", BF16,
         swap_ab=mosaic_sm90_swap_ab.SwapABConfig(num_compute_wgs=2, wg_block_w=64, block_t=64,
                                                cluster=8)),
    Case("situ_glu", 120, 512, 448, 8, "sum_lt_m", F32,
         swap_ab=mosaic_sm90_swap_ab.SwapABConfig(num_compute_wgs=2, wg_block_w=64, block_t=16,
                                                cluster=4)),
    # ...with 192 accumulator registers a consumer thread (a 24-register
    # producer, drained tiles: the sweep's gate/up EP 32 x 256-token x-lean
    # tiling, ~146 rows a group, two superblocks of 8 x 128 columns)
    Case("situ_glu", 2048, 1024, 2048, 14, "uniform", BF16,
         swap_ab=mosaic_sm90_swap_ab.SwapABConfig(num_compute_wgs=2, wg_block_w=64, block_t=192,
                                                cluster=8)),
]


def run_case(case: Case, backend: str, seed: int) -> dict:
    """Run the kernel twice on fresh random inputs; check against float64."""
    num_weights = 1 if case.op == "matmul" else 2
    x, ws = kc.grouped_inputs(seed, case.m, case.k, case.n, case.groups, case.dtype, num_weights)
    fn = jax.jit(case.fn(backend))
    if case.op == "mlp":
        sizes = np.array([case.m], np.int32)
        args = (x, ws[0][0], ws[1][0])
        ref = kc.np_grouped_situ_glu(x, ws[0], ws[1], sizes)
    else:
        sizes = kc.group_pattern(case.pattern, case.m, case.groups)
        x = kc.poison_tail(x, sizes)
        args = (x, *ws, jnp.asarray(sizes))
        ref = (kc.np_grouped_matmul(x, ws[0], sizes) if case.op == "matmul"
               else kc.np_grouped_situ_glu(x, ws[0], ws[1], sizes))
    first = np.asarray(jax.block_until_ready(fn(*args)))
    second = np.asarray(jax.block_until_ready(fn(*args)))
    if not np.array_equal(first.view(np.uint8), second.view(np.uint8)):
        raise AssertionError(f"{case.name}: two runs differ bitwise (a race?)")
    tol = kc.kernel_tol(case.dtype)
    kc.assert_grouped_output(first, ref, sizes, tol, case.name)
    valid = int(np.sum(sizes))
    return {"rel_err": kc.rel_err(first[:valid], ref[:valid]) if valid else 0.0, "tol": tol}


def run_checks(cases: list[Case], backend: str, log=print) -> list[dict]:
    """Every case, in order; a failing case is recorded and the rest still run."""
    rows = []
    for i, case in enumerate(cases):
        t0 = time.perf_counter()
        row = {"case": case.name}
        try:
            row.update(run_case(case, backend, seed=i))
            row["ok"] = True
            log(f"ok    {case.name:<48} rel err {row['rel_err']:.2e} (tol {row['tol']:.0e}), "
                f"2 runs identical, {time.perf_counter() - t0:.1f} s")
        except Exception as e:  # noqa: BLE001 -- report every failing case
            row.update(ok=False, error=f"{type(e).__name__}: {str(e)[:1000]}")
            log(f"FAIL  {case.name:<48} {row['error']}")
            if not isinstance(e, AssertionError):
                traceback.print_exc(limit=3)
        rows.append(row)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", choices=("pallas", "interpret"), default="pallas",
                   help="pallas (default; needs a Hopper GPU) or interpret (CPU)")
    p.add_argument("--json", metavar="PATH", help="write the per-case results as JSON")
    args = p.parse_args(argv)
    if args.json and not os.path.isdir(os.path.dirname(os.path.abspath(args.json))):
        p.error(f"--json {args.json}: the folder does not exist")
    if resolve(args.backend) == PALLAS and jax.default_backend() != "gpu":
        p.error("--backend pallas needs a GPU (use --backend interpret on the CPU)")
    device = jax.devices()[0]
    print(f"# {device.device_kind} jax {jax.__version__} backend {args.backend}: "
          f"{len(CASES)} cases")
    rows = run_checks(CASES, args.backend)
    failed = sum(not r["ok"] for r in rows)
    print(f"# {len(rows) - failed} of {len(rows)} cases pass")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device.device_kind, "jax_version": jax.__version__,
                       "backend": args.backend, "cases": rows}, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
