"""Correctness of the kernels' backward passes (custom VJPs) on the device.

jax.grad of sum(op(...) * cotangent) for grouped_matmul, grouped_situ_glu and
situ_mlp_up on the chosen backend, against float64 numpy gradients
(tests/kernels/test_kernels_vjp.py: per-group products, SiTU-GLU derivative
by complex step): float32 (bf16x3 kernels) within 5e-5 relative, bf16 within
1e-2; NaN in x and in the cotangent past sum(group_sizes), empty groups,
fewer rows than one tile, a group spanning several row blocks, then K3-sized
expert shapes in bf16. Each case runs twice and must repeat bitwise.

  python -m benchmarks.gpu_grad_checks --json grad_checks.json     # on the GPU
  python -m benchmarks.gpu_grad_checks --backend interpret --quick  # CPU smoke

Exit status: 0 all cases pass, 1 some case failed, 2 usage error.
"""

from __future__ import annotations

import argparse
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

import test_kernels_vjp as refs  # noqa: E402 -- float64 gradient references

import kernel_cases as kc  # noqa: E402
from pallas_kernels import grouped_matmul, grouped_situ_glu, situ_mlp_up  # noqa: E402

BF16, F32 = jnp.bfloat16, jnp.float32
SITU = refs.SITU

# (op, m, k, n, groups, pattern, dtype, poison); op "mlp" ignores groups/pattern.
QUICK = [("matmul", 70, 64, 64, 4, "sum_lt_m", F32, True)]
CASES = QUICK + [
    ("situ_glu", 70, 64, 64, 4, "sum_lt_m", F32, True),
    ("matmul", 20, 64, 128, 5, "zeros_skewed", F32, False),
    ("situ_glu", 300, 128, 192, 2, "sum_lt_m", BF16, True),
    ("mlp", 40, 96, 128, 1, "mlp", F32, False),
    ("matmul", 2048, 3072, 3584, 28, "uniform", BF16, False),
    ("situ_glu", 2048, 3584, 3072, 28, "zeros_skewed", BF16, True),
    ("mlp", 256, 7168, 768, 1, "mlp", BF16, False),
]


def case_name(case) -> str:
    op, m, k, n, g, pattern, dtype, poison = case
    return (f"{op} m={m} k={k} n={n} g={g} {pattern} {jnp.dtype(dtype).name}"
            + (" nan-tail" if poison else ""))


def run_case(case, backend: str) -> dict:
    """Gradients twice on ``backend``; relative errors vs float64 numpy."""
    op, m, k, n, g, pattern, dtype, poison = case
    if op == "mlp":
        x, (gate, up) = kc.grouped_inputs(m + n, m, k, n, 1, dtype, 2)
        args, cot = (x, gate[0], up[0]), kc.normal(jax.random.key(n), (m, n), dtype)
        fn = lambda a, b, c: situ_mlp_up(a, b, c, backend=backend, **SITU)  # noqa: E731
        d_x, d_gate, d_up = refs.np_grouped_situ_glu_grads(x, gate, up, np.array([m]), cot)
        want = (d_x, d_gate[0], d_up[0])
    else:
        x, ws, sizes, cot = refs._grouped_case((m, k, n, g, pattern, dtype, poison),
                                               1 if op == "matmul" else 2)
        args = (x, *ws)
        if op == "matmul":
            fn = lambda a, b: grouped_matmul(a, b, sizes, backend=backend)  # noqa: E731
            want = refs.np_grouped_matmul_grads(x, ws[0], sizes, cot)
        else:
            fn = lambda a, b, c: grouped_situ_glu(a, b, c, sizes, backend=backend, **SITU)  # noqa: E731
            want = refs.np_grouped_situ_glu_grads(x, *ws, sizes, cot)
    first = [np.asarray(a.astype(F32)) for a in refs._grads(fn, cot, *args)]
    second = [np.asarray(a.astype(F32)) for a in refs._grads(fn, cot, *args)]
    errors = [kc.rel_err(got, ref) for got, ref in zip(first, want)]
    tol = kc.kernel_tol(dtype)
    repeat = all(np.array_equal(a, b, equal_nan=True) for a, b in zip(first, second))
    return {"case": case_name(case), "rel_errors": errors, "tolerance": tol,
            "bitwise_repeatable": repeat, "ok": repeat and all(e <= tol for e in errors)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=["pallas", "interpret"], default="pallas")
    parser.add_argument("--quick", action="store_true", help="only the first, small case")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    if args.json and not os.path.isdir(os.path.dirname(os.path.abspath(args.json))):
        parser.error(f"--json {args.json}: the folder does not exist")
    results = []
    for case in QUICK if args.quick else CASES:
        start = time.perf_counter()
        try:
            result = run_case(case, args.backend)
        except Exception:  # noqa: BLE001 -- record it, run the other cases
            result = {"case": case_name(case), "ok": False, "error": traceback.format_exc()}
        result["seconds"] = round(time.perf_counter() - start, 2)
        results.append(result)
        print(("PASS " if result["ok"] else "FAIL ") + json.dumps(result), flush=True)
    if args.json:
        from k3jax.files import atomic_write
        report = {"device": jax.devices()[0].device_kind, "jax_version": jax.__version__,
                  "backend": args.backend, "cases": results}
        atomic_write(args.json, lambda f: json.dump(report, f, indent=1), mode="w")
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
