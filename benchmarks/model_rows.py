"""The static cost model's prediction for every row of the kernel sweep (no GPU).

For each row of benchmarks.cases' sweep, what k3jax/tools/kernel_cost.py
predicts from the kernel's own schedule on the sweep's routing: tiles, SM
fill, weight reads per active expert, x bytes over weight bytes, rows
computed per useful row, predicted time, beside XLA's dense ragged_dot and
roofline. A GPU run (benchmarks.kernel_sweep) puts the same prediction
("model") in each row beside the measured figures.

  python -m benchmarks.model_rows --json model.json      # CPU
  python -m benchmarks.model_rows --ep 8 --tokens 16 256

Exit status: 0 written; 2 usage error.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

from benchmarks.bench_report import describe_tiles, write_atomically
from benchmarks.cases import (
    FULL,
    GroupedCase,
    MlpCase,
    Plan,
    add_plan_flags,
    grouped_cases,
    grouped_sizes,
    mlp_cases,
    plan_from_args,
)
from k3jax.tools import kernel_cost, tile_search
from pallas_kernels.grouped_matmul import mosaic_sm90_swap_ab

# The x-lean range: x at most tile_search.TARGETS.x_over_w of the weight bytes up to this many tokens.
X_TARGET_MAX_TOKENS = 256


def x_lean_config(case: GroupedCase,
                  pick_x_over_w: float) -> mosaic_sm90_swap_ab.SwapABConfig | None:
    """The decode tiling timed beside the launcher's where, at up to
    X_TARGET_MAX_TOKENS tokens, the launcher's loads x over
    tile_search.TARGETS.x_over_w of its weight bytes (pick_x_over_w: its
    model_grouped row's x_bytes_over_weight_bytes on this routing)
    (tile_search.x_lean_candidate; None if the launcher's meets it, or no
    tiling does, or the weights are MXFP4)."""
    if (case.mxfp4 or case.tokens > X_TARGET_MAX_TOKENS
            or pick_x_over_w <= tile_search.TARGETS.x_over_w):
        return None
    lean = tile_search.x_lean_candidate(case.rows, case.k, case.n, case.local_experts,
                                       case.num_weights)
    return None if lean is None else lean.config


def model_grouped(case: GroupedCase, sizes: np.ndarray) -> dict:
    """The cost model's prediction for one grouped row (the kernel and tiles
    the launcher picks, named in its config), with the targets' ratios; where
    x_lean_config gives a tiling, "x_lean" is its prediction on the same
    routing (config, predicted_us, x / w, weight reads, SM fill)."""
    cost = kernel_cost.launch_cost(sizes, case.rows, case.k, case.n, case.num_weights,
                                  mxfp4=case.mxfp4)
    lean = x_lean_config(case, cost.x_bytes_over_weight_bytes)
    if lean is not None:
        lean_cost = kernel_cost.swap_ab_cost(sizes, case.rows, case.k, case.n, case.num_weights,
                                           config=lean)
        x_lean = {key: lean_cost.fields()[key] for key in (
            "config", "predicted_us", "x_bytes_over_weight_bytes",
            "weight_reads_per_active_expert", "sm_fill")}
    active = int(np.count_nonzero(sizes))
    useful_flops = 2.0 * case.rows * case.k * case.n * case.num_weights
    # MXFP4 rows: the packed bytes (0.53125 B per parameter) are the weight traffic
    weight_bytes = (17 / 32 if case.mxfp4 else 2.0) * active * case.k * case.n * case.num_weights
    xla_s = kernel_cost.xla_ragged_dot_dense_s(case.rows, case.k, case.n, case.local_experts,
                                              case.num_weights)
    seconds = cost.predicted_us * 1e-6
    return {**cost.fields(),
            "pct_dense": 100 * useful_flops / seconds / kernel_cost.DENSE_BF16_FLOPS,
            "pct_copy": 100 * weight_bytes / seconds / kernel_cost.COPY_BYTES_PER_S,
            "xla_ragged_dot_dense_us": xla_s * 1e6, "speedup_vs_xla_dense": xla_s / seconds,
            **({} if lean is None else {"x_lean": x_lean})}


def model_mlp(case: MlpCase) -> dict:
    """The cost model's prediction for one MLP row, beside XLA's roofline."""
    cost = kernel_cost.launch_mlp_cost(case.tokens, case.d, case.f)
    xla_s = kernel_cost.xla_mlp_roofline_s(case.tokens, case.d, case.f)
    return {**cost.fields(), "xla_roofline_us": xla_s * 1e6,
            "speedup_vs_xla_roofline": xla_s / (cost.predicted_us * 1e-6)}


def model_all(plan: Plan) -> dict:
    """Every row of the sweep, as the static cost model predicts it (no GPU)."""
    # MXFP4 rows ("<op>_mxfp4": mosaic_sm90_mxfp4_swap_ab's kernel at decode,
    # mosaic_sm90_mxfp4's past it) beside the bf16 ones
    grouped = [{"op": c.label, "ep": c.ep, "tp": None, "tokens": c.tokens, "rows": c.rows,
                "local_experts": c.local_experts, "K": c.k, "N": c.n,
                "active_experts": int(np.count_nonzero(grouped_sizes(c))),
                **model_grouped(c, grouped_sizes(c))} for c in grouped_cases(plan, mxfp4=True)]
    mlp = [{"op": "situ_mlp_up", "ep": None, "tp": c.tp, "tokens": c.tokens, "D": c.d, "F": c.f,
            **model_mlp(c)} for c in mlp_cases(plan)]
    return {"meta": {"model": "k3jax/tools/kernel_cost.py", "num_sms": kernel_cost.H200_NUM_SMS,
                     "dense_bf16_flops": kernel_cost.DENSE_BF16_FLOPS,
                     "copy_bytes_per_s": kernel_cost.COPY_BYTES_PER_S,
                     "tile_overhead_s": kernel_cost.TILE_OVERHEAD_S, "top_k": plan.top_k,
                     "mxfp4_dequant_sass_per_weight": kernel_cost.MXFP4_DEQUANT_SASS_PER_WEIGHT,
                     "mxfp4_swap_ab_dequant_sass_per_weight":
                         kernel_cost.MXFP4_SWAP_AB_DEQUANT_SASS_PER_WEIGHT,
                     "sm_lane_ops_per_s": kernel_cost.SM_LANE_OPS_PER_S,
                     "num_experts": plan.num_experts},
            "grouped": grouped, "mlp": mlp}


def print_model(model: dict) -> None:
    print(f"{'op':<19}{'ep':>4}{'tp':>4}{'tokens':>7}{'tiles':>7}{'fill':>6}{'reads':>7}"
          f"{'x/w':>7}{'rows':>6}{'pred us':>9}  vs XLA")
    for r in model["grouped"] + model["mlp"]:
        vs = r.get("speedup_vs_xla_dense", r.get("speedup_vs_xla_roofline"))
        print(f"{r['op']:<19}{r['ep'] or '':>4}{r['tp'] or '':>4}{r['tokens']:>7}{r['tiles']:>7}"
              f"{r['sm_fill']:>6.2f}{r['weight_reads_per_active_expert']:>7.3f}"
              f"{r['x_bytes_over_weight_bytes']:>7.3f}{r['rows_computed_per_useful_row']:>6.2f}"
              f"{r['predicted_us']:>9.1f}  {vs:.2f}x")
        if "x_lean" in r:
            lean = r["x_lean"]
            print(f"{'  x-lean tiling':<41}{lean['sm_fill']:>6.2f}"
                  f"{lean['weight_reads_per_active_expert']:>7.3f}"
                  f"{lean['x_bytes_over_weight_bytes']:>7.3f}{'':>6}{lean['predicted_us']:>9.1f}"
                  f"  {describe_tiles(lean['config'])}")



def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_plan_flags(p)
    p.add_argument("--json", metavar="PATH", help="write the rows as JSON")
    args = p.parse_args(argv)
    args.plan = plan_from_args(p, args, FULL)
    if args.json and not os.path.isdir(os.path.dirname(os.path.abspath(args.json))):
        p.error(f"--json {args.json}: the folder does not exist")
    return args


def _dump_json(path: str, data: dict) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=1)


def main(argv=None) -> int:
    args = parse_args(argv)
    model = model_all(args.plan)
    print_model(model)
    if args.json:
        write_atomically(args.json, lambda tmp: _dump_json(tmp, model))
    return 0


if __name__ == "__main__":
    sys.exit(main())
