"""Time the k3jax Pallas GPU kernels against XLA, library peers and the device ceilings.

One run measures, on one GPU:
  * ceilings: a large bf16 matmul (TFLOP/s) and an elementwise device copy
    (TB/s, bytes read + bytes written);
  * grouped MoE matmuls at K3 shapes (benchmarks.cases), for local-expert
    counts 896 / EP:
      - "gate_up_situ": fused x @ [w1 | w3] + SiTU-GLU, 3584 -> 2 x 3072
        (kernel: grouped_situ_glu; baseline: two jax.lax.ragged_dot + situ_glu;
        peer: two tokamax.ragged_dot (Mosaic GPU) + situ_glu)
      - "down": 3072 -> 3584 (kernel: grouped_matmul; baseline: ragged_dot;
        peers: tokamax.ragged_dot, jax's ragged_dot_mgpu)
    with M = tokens x top_k rows spread over the local experts (random
    balanced routing), reporting % of the dense matmul rate and, for the
    small token counts where the kernels stream weights, the achieved
    weight-read bandwidth vs the copy ceiling;
  * the fused dense/shared MLP up-projection situ_mlp_up (D = 7168,
    F = 6144 / tp) vs the unfused XLA reference;
  * MXFP4 experts at the first EP (benchmarks.bench_mxfp4): packed weights
    (on "pallas": the Mosaic MXFP4 kernels' in-kernel dequant, swap-AB or
    row-major as the dispatch takes them, with the cost-model prediction) vs
    bf16 weights vs "dequantize + ragged_dot", with packed bytes per
    parameter. No library peer takes MXFP4 on sm_90 (tokamax's quantized
    ragged_dot fails to compile E2M1 / E8M0 there).
  * with jax-triton installed (the ``triton`` extra): the Triton kernels
    (--backend triton, pallas_kernels/*/triton_sm80.py) as a peer on every
    grouped and MLP row of a Hopper run ("triton" column), and MXFP4 rows
    (op "*_mxfp4": the Triton kernels dequantizing packed E2M1 weights in
    registers vs XLA dequant + ragged_dot). On a CUDA GPU that is not Hopper
    the Triton kernels are the kernel column (no Mosaic).
Every kernel output is checked against the XLA reference before it is timed
(benchmarks.measure). Timing: jit, warm-up, block_until_ready, median of
--iters samples (each sample averages enough back-to-back calls to last about
1 ms, so Python dispatch does not dominate tiny kernels). The JSON and
markdown outputs are rewritten after every row ("complete": false until the
end), so a run cut short by a time limit still leaves what it measured.

  python -m benchmarks.kernel_sweep --keep-going --json out.json --markdown out.md  # H200
  python -m benchmarks.kernel_sweep --smoke --json /tmp/smoke.json                  # CPU
  python -m benchmarks.lower_check     # CPU pre-flight: every config lowers for sm_90
  python -m benchmarks.model_rows      # CPU: the static cost model's rows

Exit status: 0 all rows measured and correct; 1 some row failed (with
--keep-going); 2 usage error or no GPU; 3 a kernel was wrong or failed
(without --keep-going: nothing after it runs).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import importlib.metadata
import os
import sys
import time

import jax
import jax.numpy as jnp

from benchmarks import measure
from benchmarks.bench_mxfp4 import run_mxfp4
from benchmarks.bench_report import Results, format_grouped_row, format_mlp_row
from benchmarks.bench_timing import pick_timing, time_all
from benchmarks.cases import (
    DTYPE,
    FULL,
    SITU,
    SMOKE,
    GroupedCase,
    Plan,
    add_plan_flags,
    decode_fn,
    dense_weights,
    grouped_cases,
    grouped_sizes,
    jax_mosaic_ragged_dot,
    mlp_cases,
    plan_from_args,
    positive_int,
    triton_available,
)
from benchmarks.measure import KernelMismatch, Sweep, measure_ceilings, spot_check_grouped
from benchmarks.model_rows import model_grouped, model_mlp, x_lean_config
from k3jax.tools import peers as peers_lib
from pallas_kernels.backend import INTERPRET, PALLAS, TRITON, XLA, resolve


def precompile_all(plan: Plan, backend: str) -> dict[str, tuple]:
    """Compile every kernel config of the plan before timing any: name ->
    (compiled, compile seconds); a config that fails to compile is left out
    (its row compiles again and records the error)."""
    compiled: dict[str, tuple] = {}
    for case in [*mlp_cases(plan), *grouped_cases(plan)]:
        t0 = time.perf_counter()
        try:
            compiled[case.name] = (jax.jit(case.fn(backend)).lower(*case.arg_specs()).compile(),
                                   time.perf_counter() - t0)
            print(f"compiled {case.name:<44} {compiled[case.name][1]:6.2f} s")
        except Exception as e:  # noqa: BLE001 -- reported again by its row
            print(f"FAILED   {case.name:<44} {type(e).__name__}: {str(e)[:300]}")
    return compiled


def run_grouped(plan: Plan, sweep: Sweep) -> None:
    """The grouped MoE sweep: token counts x EP x ops, one row each."""
    weights_by_ep: dict[int, dict[str, jax.Array]] = {}  # all EPs: 13 GB at K3 shapes (+ 3.5 MXFP4)
    with_triton = sweep.kernel_backend in (PALLAS, TRITON) and triton_available()
    for case in grouped_cases(plan, mxfp4=with_triton):
        if sweep.out_of_time():
            sweep.results.add("grouped", {**case.fields(), "skipped": "time budget"})
            print(format_grouped_row(sweep.results.data["grouped"][-1]))
            continue
        if case.ep not in weights_by_ep:
            weights_by_ep[case.ep] = _expert_weights(plan, case, mxfp4=with_triton)
        w = weights_by_ep[case.ep]
        ws = (w["gate"], w["up"]) if case.op == "gate_up_situ" else (w["down"],)
        if case.mxfp4:
            names = ("gate", "up") if case.op == "gate_up_situ" else ("down",)
            ws = tuple(a for name in names for a in w[name + "_mxfp4"])
        sizes_np = grouped_sizes(case)
        sizes = jnp.asarray(sizes_np)
        x = jax.random.normal(jax.random.key(case.tokens), (case.rows, case.k), DTYPE)
        active = int(jnp.sum(sizes > 0))
        # the model prices bf16 weights: none for MXFP4 rows
        model = None if case.mxfp4 else model_grouped(case, sizes_np)
        peers = {}
        if sweep.kernel_backend == PALLAS and not case.mxfp4:
            # tokamax: the library a JAX user would pick
            peers["tokamax"] = (peers_lib.tokamax_ragged_dot if case.op == "down"
                                else peers_lib.tokamax_situ_glu(**SITU))
            if case.op == "down":
                peers["jax_mosaic"] = jax_mosaic_ragged_dot(case)
            if with_triton:
                peers["triton"] = case.fn(TRITON)
            if (lean := x_lean_config(case, model["x_bytes_over_weight_bytes"])) is not None:
                peers["x_lean"] = decode_fn(case, lean)
        # MXFP4 rows: the Triton kernel is the kernel; 0.53125 B per weight element
        kernel_fn = case.fn(TRITON if case.mxfp4 else sweep.kernel_backend)
        row = sweep.measure(
            case.name, kernel_fn, case.fn(XLA), (x, *ws, sizes),
            flops=2.0 * case.rows * case.k * case.n * case.num_weights,
            weight_bytes=float(active * case.k * case.n * case.num_weights
                               * (17 / 32 if case.mxfp4 else 2)),
            valid_rows=case.rows, peers=peers, **sweep.precompiled_for(case.name),
            fallback_check=functools.partial(spot_check_grouped, case, x=x,
                                             ws=dense_weights(case, ws), sizes=sizes))
        sweep.results.add("grouped", {**case.fields(), "active_experts": active,
                                      "small": case.tokens <= plan.small_tokens, **row,
                                      **({} if model is None else {"model": model})})
        print(format_grouped_row(sweep.results.data["grouped"][-1]))


def _expert_weights(plan: Plan, case: GroupedCase, mxfp4: bool) -> dict:
    """Random gate/up [G, latent, inter] and down [G, inter, latent] for one EP
    (and, with ``mxfp4``, random MXFP4 ones: "<name>_mxfp4" = (packed, scale))."""
    keys = jax.random.split(jax.random.key(case.ep), 3)
    shape_up = (case.local_experts, plan.latent, plan.inter)
    shape_down = (case.local_experts, plan.inter, plan.latent)
    weights = {"gate": jax.random.normal(keys[0], shape_up, DTYPE) * plan.latent ** -0.5,
               "up": jax.random.normal(keys[1], shape_up, DTYPE) * plan.latent ** -0.5,
               "down": jax.random.normal(keys[2], shape_down, DTYPE) * plan.inter ** -0.5}
    if mxfp4:
        for i, (name, (g, k, n)) in enumerate((("gate", shape_up), ("up", shape_up),
                                               ("down", shape_down))):
            weights[name + "_mxfp4"] = _random_mxfp4(jax.random.fold_in(keys[i], 1), g, k, n)
    return weights


def _random_mxfp4(key, g: int, k: int, n: int) -> tuple[jax.Array, jax.Array]:
    """Random MXFP4 weight [g, k, n]: uniform codes [g, n, k/2] (Mxfp4Weights'
    packed_GNK), scale bytes 119..121 [g, k/32, n] (~ N(0, 1/k) magnitudes
    for k = 3072..3584: E2M1 codes have RMS 2.9)."""
    kp, ks = jax.random.split(key)
    packed = jax.random.randint(kp, (g, n, k // 2), 0, 256, jnp.int32).astype(jnp.uint8)
    scale = jax.random.randint(ks, (g, k // 32, n), 119, 122, jnp.int32).astype(jnp.uint8)
    return packed, scale


def run_mlp(plan: Plan, sweep: Sweep) -> None:
    """The fused dense MLP up-projection sweep: tp x token counts."""
    for case in mlp_cases(plan):
        if sweep.out_of_time():
            sweep.results.add("mlp", {**case.fields(), "skipped": "time budget"})
            print(format_mlp_row(sweep.results.data["mlp"][-1]))
            continue
        keys = jax.random.split(jax.random.key(100 + case.tp), 3)
        gate = jax.random.normal(keys[0], (case.d, case.f), DTYPE) * case.d ** -0.5
        up = jax.random.normal(keys[1], (case.d, case.f), DTYPE) * case.d ** -0.5
        x = jax.random.normal(keys[2], (case.tokens, case.d), DTYPE)
        peers = ({"triton": case.fn(TRITON)}
                 if sweep.kernel_backend == PALLAS and triton_available() else {})
        row = sweep.measure(case.name, case.fn(sweep.kernel_backend), case.fn(XLA),
                            (x, gate, up), flops=2.0 * case.tokens * case.d * case.f * 2,
                            weight_bytes=2.0 * case.d * case.f * 2, valid_rows=case.tokens,
                            peers=peers, **sweep.precompiled_for(case.name))
        sweep.results.add("mlp", {**case.fields(), **row, "model": model_mlp(case)})
        print(format_mlp_row(sweep.results.data["mlp"][-1]))



MXFP4_DECODE_MAX_TOKENS = 256   # --mxfp4-decode-first: the decode rows


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="On the CPU: --smoke; python -m benchmarks.lower_check "
                                       "(pre-flight); python -m benchmarks.model_rows (the model)",
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true",
                   help="tiny shapes, xla vs interpret backends: runs on the CPU in seconds")
    p.add_argument("--json", metavar="PATH", help="write all results as JSON")
    p.add_argument("--markdown", metavar="PATH", help="write a BENCHMARKS.md snippet")
    p.add_argument("--iters", type=positive_int, default=None,
                   help="timing samples per measurement (default 10, smoke 1)")
    add_plan_flags(p)
    p.add_argument("--keep-going", action="store_true",
                   help="record a failing/wrong kernel as an error row instead of aborting")
    p.add_argument("--time-budget", type=float, default=420.0,
                   help="seconds after which remaining configs are skipped (default 420)")
    p.add_argument("--mxfp4-decode-first", action="store_true",
                   help=f"time the MXFP4 rows of at most {MXFP4_DECODE_MAX_TOKENS} tokens right "
                        "after the MLP sweep, before the bf16 grouped sweep (the time budget "
                        "cannot skip them); the other MXFP4 rows run last as usual")
    args = p.parse_args(argv)
    args.plan = plan_from_args(p, args, SMOKE if args.smoke else FULL)
    for flag, path in (("--json", args.json), ("--markdown", args.markdown)):
        if path and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
            p.error(f"{flag} {path}: the folder does not exist")
    return args


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def main(argv=None) -> int:
    args = parse_args(argv)
    plan = args.plan
    iters = args.iters or (1 if args.smoke else 10)
    # a GPU run: Mosaic on Hopper, Triton on other CUDA GPUs (sm_80+)
    kernel_backend = INTERPRET if args.smoke else resolve("auto")
    if not args.smoke and kernel_backend == XLA:
        print("error: the full benchmark needs a GPU: Hopper, or CUDA sm_80+ with the triton "
              "extra (on the CPU use --smoke, or python -m benchmarks.lower_check)", file=sys.stderr)
        return 2
    start = time.monotonic()
    deadline = start + args.time_budget
    device = jax.devices()[0]
    meta = {"date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "gpu": device.device_kind, "platform": device.platform,
            "jax_version": jax.__version__, "jaxlib_version": _version("jaxlib"),
            "flax_version": _version("flax"), "kernel_backend": kernel_backend.name,
            "command": " ".join(["python", "-m", "benchmarks.kernel_sweep",
                                 *(sys.argv[1:] if argv is None else argv)]),
            "smoke": args.smoke, "iters": iters, "check_tol": measure.CHECK_TOL,
            "top_k": plan.top_k, "num_experts": plan.num_experts}
    meta["timing"] = pick_timing(device.platform)
    results = Results(meta, args.json, args.markdown)
    print(f"# {meta['gpu']} jax {meta['jax_version']} jaxlib {meta['jaxlib_version']} "
          f"flax {meta['flax_version']} kernel backend {kernel_backend} timing {meta['timing']}")
    ceilings = measure_ceilings(plan, iters, meta["timing"])
    results.set_ceilings(ceilings)
    print(f"# ceilings: matmul {ceilings['matmul_tflops']:.1f} TFLOP/s, "
          f"copy {ceilings['copy_tbps']:.3f} TB/s")
    sweep = Sweep(kernel_backend, ceilings, iters, meta["timing"], deadline, args.keep_going,
                  results)
    if not args.smoke:  # every kernel config compiles before any is timed
        t0 = time.monotonic()
        sweep.precompiled = precompile_all(plan, kernel_backend)
        results.data["meta"]["precompile_s"] = time.monotonic() - t0
    try:
        # The MLP sweep is short: it runs first, so the time budget cannot skip it.
        mx_cases = [c for c in grouped_cases(plan) if c.ep == plan.eps[0]]
        first = ([c for c in mx_cases if c.tokens <= MXFP4_DECODE_MAX_TOKENS]
                 if args.mxfp4_decode_first else [])

        def mxfp4_rows(cases):
            run_mxfp4(sweep, cases, situ=SITU, check=measure.check_against_reference,
                      rates=measure.rates, time_all=time_all,
                      model=(lambda c: model_grouped(dataclasses.replace(c, mxfp4=True),
                                                     grouped_sizes(c)))
                      if kernel_backend == PALLAS else None)

        run_mlp(plan, sweep)
        if first:
            mxfp4_rows(first)
        run_grouped(plan, sweep)
        mxfp4_rows([c for c in mx_cases if c not in first])
    except KernelMismatch as e:
        print(f"ABORT: kernel output is wrong, not timing it: {e}", file=sys.stderr)
        return 3
    results.finish(time.monotonic() - start)
    print(f"# done in {results.data['meta']['elapsed_s']:.1f} s")
    return 1 if any("error" in r for r in results.rows) else 0


if __name__ == "__main__":
    sys.exit(main())
