"""Pre-flight on the CPU: every kernel configuration of the sweep lowers for sm_90.

:func:`lowering_configs` is the list of Mosaic GPU configurations the timed
sweep (benchmarks.kernel_sweep) runs, in its order: every grouped case on
"pallas", jax's Mosaic ragged_dot peer of every "down" case, then every MLP
case. :func:`triton_configs` is the same for the Triton rows (bf16 and MXFP4
grouped, MLP). Lowering needs no GPU: it runs Pallas lowering, Mosaic GPU
layout inference and the SMEM budget (or Triton's compile to PTX).

  python -m benchmarks.lower_check                       # Mosaic GPU, sm_90
  python -m benchmarks.lower_check --triton              # Triton, through jax-triton
  python -m benchmarks.lower_check --ep 16 --tokens 16   # a slice of the sweep

Exit status: 0 every configuration lowers; 1 some failed; 2 usage error.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Callable

import jax

from benchmarks.cases import (
    FULL,
    Plan,
    add_plan_flags,
    grouped_cases,
    jax_mosaic_ragged_dot,
    mlp_cases,
    plan_from_args,
)


@dataclasses.dataclass(frozen=True)
class LoweringConfig:
    """One kernel configuration: its row name, the call, its argument shapes."""

    name: str
    fn: Callable
    arg_specs: tuple[jax.ShapeDtypeStruct, ...]


def lowering_configs(plan: Plan = FULL) -> list[LoweringConfig]:
    """The sweep's Mosaic GPU configurations: grouped cases, jax Mosaic peers
    ("<name> (peer: jax Mosaic)", "down" only), MLP cases."""
    out = [LoweringConfig(c.name, c.fn("pallas"), c.arg_specs()) for c in grouped_cases(plan)]
    out += [LoweringConfig(f"{c.name} (peer: jax Mosaic)", jax_mosaic_ragged_dot(c), c.arg_specs())
            for c in grouped_cases(plan) if c.op == "down"]
    out += [LoweringConfig(c.name, c.fn("pallas"), c.arg_specs()) for c in mlp_cases(plan)]
    return out


def triton_configs(plan: Plan = FULL) -> list[LoweringConfig]:
    """The sweep's Triton configurations: bf16 and MXFP4 grouped cases, MLP cases."""
    out = [LoweringConfig(c.name, c.fn("triton"), c.arg_specs())
           for c in grouped_cases(plan, mxfp4=True)]
    out += [LoweringConfig(c.name, c.fn("triton"), c.arg_specs()) for c in mlp_cases(plan)]
    return out


def lower_all(plan: Plan) -> int:
    """Lower every Mosaic GPU configuration of the plan for sm_90 on this host.
    Returns the number of configurations that failed."""
    failures = 0
    cases = lowering_configs(plan)
    for c in cases:
        t0 = time.perf_counter()
        try:
            text = jax.jit(c.fn).trace(*c.arg_specs).lower(lowering_platforms=("cuda",)).as_text()
            if "mosaic_gpu" not in text:
                raise RuntimeError("no Mosaic GPU custom call in the lowered module")
            print(f"lowered  {c.name:<52} {time.perf_counter() - t0:5.2f} s")
        except Exception as e:  # noqa: BLE001 -- report every failing config, then exit 1
            failures += 1
            print(f"FAILED   {c.name:<52} {type(e).__name__}: {str(e)[:500]}")
    print(f"# {len(cases) - failures} of {len(cases)} configs lower for sm_90")
    return failures


def lower_all_triton(plan: Plan, capability: int = 90) -> int:
    """Lower every Triton configuration of the plan for sm_``capability``
    through jax-triton (Triton compiles each kernel to PTX here). Returns the
    number of configurations that failed."""
    from pallas_kernels.triton_target import triton_target

    failures = 0
    cases = triton_configs(plan)
    for c in cases:
        t0 = time.perf_counter()
        try:
            with triton_target(capability):
                text = jax.jit(c.fn).trace(*c.arg_specs).lower(
                    lowering_platforms=("cuda",)).as_text()
            if "triton_kernel_call" not in text:
                raise RuntimeError("no triton_kernel_call in the lowered module")
            print(f"lowered  triton {c.name:<45} {time.perf_counter() - t0:5.2f} s")
        except Exception as e:  # noqa: BLE001 -- report every failing config
            failures += 1
            print(f"FAILED   triton {c.name:<45} {type(e).__name__}: {str(e)[:500]}")
    print(f"# {len(cases) - failures} of {len(cases)} Triton configs lower for sm_{capability}")
    return failures


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--triton", action="store_true",
                   help="lower the Triton rows (bf16 and MXFP4 grouped, MLP) through jax-triton")
    add_plan_flags(p)
    args = p.parse_args(argv)
    args.plan = plan_from_args(p, args, FULL)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    failures = lower_all_triton(args.plan) if args.triton else lower_all(args.plan)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
