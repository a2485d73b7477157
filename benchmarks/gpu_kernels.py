"""Benchmark the k3jax Pallas Mosaic GPU kernels against XLA and the device ceilings.

One run measures, on one GPU:
  * ceilings: a large bf16 matmul (TFLOP/s) and an elementwise device copy
    (TB/s, bytes read + bytes written);
  * grouped MoE matmuls at K3 shapes, for local-expert counts 896 / EP:
      - "gate_up_situ": fused x @ [w1 | w3] + SiTU-GLU, 3584 -> 2 x 3072
        (kernel: grouped_situ_glu; baseline: two jax.lax.ragged_dot + situ_glu)
      - "down": 3072 -> 3584 (kernel: grouped_matmul; baseline: ragged_dot)
    with M = tokens x top_k rows spread over the local experts (random
    balanced routing), reporting % of the dense matmul rate and, for the
    small token counts where the kernels stream weights, the achieved
    weight-read bandwidth vs the copy ceiling;
  * the fused dense/shared MLP up-projection situ_mlp_up (D = 7168,
    F = 6144 / tp) vs the unfused XLA reference.
Every kernel output is checked against the XLA reference before it is timed;
a mismatch aborts the run. Timing: jit, warm-up, block_until_ready, median of
--iters samples (each sample averages enough back-to-back calls to last
about 1 ms, so Python dispatch does not dominate tiny kernels).

  python benchmarks/gpu_kernels.py --json out.json --markdown out.md   # on an H200
  python benchmarks/gpu_kernels.py --smoke --json /tmp/smoke.json      # CPU, seconds
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pallas_kernels import grouped_matmul, grouped_situ_glu, situ_glu, situ_mlp_up

BETA, LINEAR_BETA = 4.0, 25.0
CHECK_TOL = 2e-2  # bf16 in / bf16 out vs the XLA reference, max-abs relative


@dataclasses.dataclass(frozen=True)
class Plan:
    """Shapes swept by one run."""

    latent: int  # routed expert hidden (K of gate/up, N of down)
    inter: int  # expert intermediate (N of gate/up, K of down)
    num_experts: int
    top_k: int
    eps: tuple[int, ...]
    tokens: tuple[int, ...]
    mlp_hidden: int
    mlp_inter: int
    tps: tuple[int, ...]
    mlp_tokens: tuple[int, ...]
    small_tokens: int  # token counts <= this report weight-read bandwidth
    matmul_dim: int  # ceiling matmul is matmul_dim^3
    copy_elems: int  # ceiling copy size (bf16 elements)


FULL = Plan(latent=3584, inter=3072, num_experts=896, top_k=16, eps=(8, 16, 32),
            tokens=(16, 64, 256, 1024, 4096, 16384), mlp_hidden=7168, mlp_inter=6144,
            tps=(1, 4, 8), mlp_tokens=(8, 32, 128, 512, 2048), small_tokens=256,
            matmul_dim=8192, copy_elems=1 << 30)
SMOKE = Plan(latent=64, inter=32, num_experts=16, top_k=2, eps=(4,), tokens=(24,),
             mlp_hidden=64, mlp_inter=64, tps=(2,), mlp_tokens=(8,), small_tokens=8,
             matmul_dim=128, copy_elems=1 << 16)


class KernelMismatch(RuntimeError):
    """The kernel failed or its output disagrees with the XLA reference."""


def time_fn(fn: Callable, args: tuple, *, iters: int, target_s: float = 1e-3) -> float:
    """Median seconds per call of a jitted fn (block_until_ready after each sample).

    The caller has already compiled and run fn once; one more call warms up
    and sizes the number of back-to-back calls per sample.
    """
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    single = max(time.perf_counter() - t0, 1e-7)
    reps = int(min(max(math.ceil(target_s / single), 1), 100))
    if single > 0.25:  # a very slow baseline (e.g. dense ragged_dot): fewer samples
        iters = min(iters, 3)
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        out = None
        for _ in range(reps):
            out = fn(*args)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - t0) / reps)
    return statistics.median(samples)


def measure_ceilings(plan: Plan, iters: int) -> dict:
    """Dense bf16 matmul TFLOP/s and elementwise copy TB/s (read + write)."""
    n = plan.matmul_dim
    ka, kb = jax.random.split(jax.random.key(0))
    a = jax.random.normal(ka, (n, n), jnp.bfloat16)
    b = jax.random.normal(kb, (n, n), jnp.bfloat16)
    dot = jax.jit(jnp.dot)
    jax.block_until_ready(dot(a, b))
    t_dot = time_fn(dot, (a, b), iters=iters)
    src = jnp.ones((plan.copy_elems,), jnp.bfloat16)
    copy = jax.jit(lambda v: -v)  # cannot be elided; reads and writes every byte once
    jax.block_until_ready(copy(src))
    t_copy = time_fn(copy, (src,), iters=iters)
    copy_bytes = 2 * src.size * src.dtype.itemsize
    return {"matmul_shape": [n, n, n], "matmul_tflops": 2 * n ** 3 / t_dot / 1e12,
            "matmul_us": t_dot * 1e6, "copy_bytes_moved": copy_bytes,
            "copy_tbps": copy_bytes / t_copy / 1e12, "copy_us": t_copy * 1e6}


def routed_group_sizes(rows: int, groups: int, seed: int) -> np.ndarray:
    """int32 [groups]: rows assigned to experts uniformly at random (sum = rows)."""
    rng = np.random.default_rng(seed)
    return rng.multinomial(rows, np.full(groups, 1.0 / groups)).astype(np.int32)


@jax.jit
def _error_stats(out, ref, valid_rows):
    """(all finite, tail rows all zero, max |out - ref| / max |ref|) on the device."""
    out32, ref32 = out.astype(jnp.float32), ref.astype(jnp.float32)
    valid = (jnp.arange(out.shape[0]) < valid_rows)[:, None]
    finite = jnp.all(jnp.isfinite(out32))
    tail_zero = jnp.all(jnp.where(valid, 0.0, out32) == 0.0)
    scale = jnp.maximum(jnp.max(jnp.where(valid, jnp.abs(ref32), 0.0)), 1e-30)
    return finite, tail_zero, jnp.max(jnp.abs(out32 - ref32)) / scale


def check_against_reference(name: str, out, ref, valid_rows: int) -> float:
    """Max-abs relative error of the valid rows; raise KernelMismatch when wrong."""
    finite, tail_zero, err = (np.asarray(v) for v in _error_stats(out, ref, valid_rows))
    if not finite:
        raise KernelMismatch(f"{name}: kernel output has NaN/inf")
    if not tail_zero:
        raise KernelMismatch(f"{name}: rows >= {valid_rows} are not zero")
    if not float(err) <= CHECK_TOL:
        raise KernelMismatch(f"{name}: relative error {float(err):.3g} > {CHECK_TOL} vs XLA reference")
    return float(err)


def spot_check_grouped(name: str, out, x, ws, sizes, epilogue) -> float:
    """Check a few groups' rows with plain dense matmuls (no ragged_dot).

    Used when the XLA ragged_dot baseline cannot run (e.g. out of memory when
    XLA expands it densely): first, middle and last non-empty group, up to 256
    rows each; also all-finite output.
    """
    sizes = np.asarray(sizes)
    starts = np.concatenate([[0], np.cumsum(sizes)])
    nonempty = np.nonzero(sizes)[0]
    if not bool(jnp.all(jnp.isfinite(out.astype(jnp.float32)))):
        raise KernelMismatch(f"{name}: kernel output has NaN/inf")
    worst = 0.0
    for g in sorted({int(nonempty[0]), int(nonempty[len(nonempty) // 2]), int(nonempty[-1])}):
        rows = slice(int(starts[g]), int(starts[g] + min(sizes[g], 256)))
        prods = [jnp.dot(x[rows], w[g], preferred_element_type=jnp.float32) for w in ws]
        ref = epilogue(*prods)
        worst = max(worst, check_against_reference(f"{name} group {g}", out[rows], ref,
                                                   rows.stop - rows.start))
    return worst


def _rates(flops: float, weight_bytes: float, seconds: float, ceilings: dict) -> dict:
    tflops = flops / seconds / 1e12
    weight_tbps = weight_bytes / seconds / 1e12
    return {"us": seconds * 1e6, "tflops": tflops,
            "pct_dense": 100 * tflops / ceilings["matmul_tflops"],
            "weight_tbps": weight_tbps, "pct_copy": 100 * weight_tbps / ceilings["copy_tbps"]}


def bench_pair(name: str, kernel_fn, xla_fn, args: tuple, *, flops: float, weight_bytes: float,
               valid_rows: int, ceilings: dict, iters: int, fallback_check=None) -> dict:
    """Check the kernel against XLA, then time both; one result row.

    fallback_check(out) -> rel err verifies the kernel when the XLA baseline
    itself fails (its error is recorded in the row as "xla_error").
    """
    kernel_jit, xla_jit = jax.jit(kernel_fn), jax.jit(xla_fn)
    row: dict = {"flops": flops, "weight_bytes": weight_bytes}
    try:
        ref = jax.block_until_ready(xla_jit(*args))
        row["xla"] = _rates(flops, weight_bytes, time_fn(xla_jit, args, iters=iters), ceilings)
    except Exception as e:  # noqa: BLE001 -- e.g. XLA expands ragged_dot densely: OOM
        ref, row["xla_error"] = None, f"{type(e).__name__}: {str(e)[:300]}"
    try:
        out = jax.block_until_ready(kernel_jit(*args))
    except Exception as e:
        raise KernelMismatch(f"{name}: kernel raised {type(e).__name__}: {str(e)[:2000]}") from e
    if ref is not None:
        row["max_rel_err"] = check_against_reference(name, out, ref, valid_rows)
    elif fallback_check is not None:
        row["max_rel_err"] = fallback_check(out)
        row["checked"] = "spot check (XLA baseline failed)"
    else:
        raise KernelMismatch(f"{name}: no XLA reference to verify against ({row['xla_error']})")
    del ref
    row["kernel"] = _rates(flops, weight_bytes, time_fn(kernel_jit, args, iters=iters), ceilings)
    if "xla" in row:
        row["speedup"] = row["xla"]["us"] / row["kernel"]["us"]
    return row


def guarded(keep_going: bool, fn: Callable[..., dict], *args, **kwargs) -> dict:
    """fn(*args, **kwargs); with keep_going a KernelMismatch becomes an "error" row."""
    try:
        return fn(*args, **kwargs)
    except KernelMismatch as e:
        if not keep_going:
            raise
        print(f"ERROR (kept going): {e}", file=sys.stderr)
        return {"error": str(e)}


def grouped_rows(plan: Plan, kernel_backend: str, ceilings: dict, iters: int, deadline: float,
                 log: Callable[[str], None], keep_going: bool = False) -> list[dict]:
    """The grouped MoE sweep: ops x EP x token counts."""
    rows = []
    dtype = jnp.bfloat16
    situ = {"beta": BETA, "linear_beta": LINEAR_BETA}
    for ep in plan.eps:
        groups = plan.num_experts // ep
        keys = jax.random.split(jax.random.key(ep), 4)
        w_gate = jax.random.normal(keys[0], (groups, plan.latent, plan.inter), dtype) * plan.latent ** -0.5
        w_up = jax.random.normal(keys[1], (groups, plan.latent, plan.inter), dtype) * plan.latent ** -0.5
        w_down = jax.random.normal(keys[2], (groups, plan.inter, plan.latent), dtype) * plan.inter ** -0.5
        for tokens in plan.tokens:
            m = tokens * plan.top_k
            sizes = jnp.asarray(routed_group_sizes(m, groups, seed=tokens + ep))
            active = int(jnp.sum(sizes > 0))
            x_up = jax.random.normal(keys[3], (m, plan.latent), dtype)
            x_down = jax.random.normal(keys[3], (m, plan.inter), dtype)
            def situ_epilogue(g, u):
                return situ_glu(g, u, **situ)
            ops = [
                ("gate_up_situ", plan.latent, plan.inter, 2, (x_up, w_gate, w_up, sizes),
                 lambda x, a, b, s: grouped_situ_glu(x, a, b, s, backend=kernel_backend, **situ),
                 lambda x, a, b, s: grouped_situ_glu(x, a, b, s, backend="xla", **situ),
                 situ_epilogue),
                ("down", plan.inter, plan.latent, 1, (x_down, w_down, sizes),
                 lambda x, w, s: grouped_matmul(x, w, s, backend=kernel_backend),
                 lambda x, w, s: grouped_matmul(x, w, s, backend="xla"),
                 lambda y: y),
            ]
            for op, k, n, num_w, args, kernel_fn, xla_fn, epilogue in ops:
                base = {"op": op, "ep": ep, "local_experts": groups, "active_experts": active,
                        "tokens": tokens, "rows": m, "K": k, "N": n}
                if time.monotonic() > deadline:
                    rows.append({**base, "skipped": "time budget"})
                    continue
                name = f"{op} ep={ep} tokens={tokens}"
                fallback = functools.partial(spot_check_grouped, name, x=args[0],
                                             ws=args[1:-1], sizes=args[-1], epilogue=epilogue)
                row = guarded(keep_going, bench_pair, name, kernel_fn, xla_fn, args,
                              flops=2.0 * m * k * n * num_w,
                              weight_bytes=float(active * k * n * num_w * 2), valid_rows=m,
                              ceilings=ceilings, iters=iters, fallback_check=fallback)
                row["small"] = tokens <= plan.small_tokens
                rows.append({**base, **row})
                log(format_grouped_row(rows[-1]))
    return rows


def mlp_rows(plan: Plan, kernel_backend: str, ceilings: dict, iters: int, deadline: float,
             log: Callable[[str], None], keep_going: bool = False) -> list[dict]:
    """The fused dense MLP up-projection sweep: tp x token counts."""
    rows = []
    dtype = jnp.bfloat16
    situ = {"beta": BETA, "linear_beta": LINEAR_BETA}
    d = plan.mlp_hidden
    for tp in plan.tps:
        f = plan.mlp_inter // tp
        keys = jax.random.split(jax.random.key(100 + tp), 3)
        gate = jax.random.normal(keys[0], (d, f), dtype) * d ** -0.5
        up = jax.random.normal(keys[1], (d, f), dtype) * d ** -0.5
        for tokens in plan.mlp_tokens:
            base = {"op": "situ_mlp_up", "tp": tp, "tokens": tokens, "D": d, "F": f}
            if time.monotonic() > deadline:
                rows.append({**base, "skipped": "time budget"})
                continue
            x = jax.random.normal(keys[2], (tokens, d), dtype)
            row = guarded(
                keep_going, bench_pair, f"situ_mlp_up tp={tp} tokens={tokens}",
                lambda a, b, c: situ_mlp_up(a, b, c, backend=kernel_backend, **situ),
                lambda a, b, c: situ_mlp_up(a, b, c, backend="xla", **situ),
                (x, gate, up), flops=2.0 * tokens * d * f * 2, weight_bytes=2.0 * d * f * 2,
                valid_rows=tokens, ceilings=ceilings, iters=iters)
            rows.append({**base, **row})
            log(format_mlp_row(rows[-1]))
    return rows


def _fmt(row: dict, impl: str, key: str, spec: str) -> str:
    return format(row[impl][key], spec) if impl in row else "-"


def format_grouped_row(r: dict) -> str:
    if "error" in r:
        return f"{r['op']:<13} ep={r['ep']:<3} tokens={r['tokens']:<6} ERROR {r['error'][:200]}"
    if "skipped" in r:
        return f"{r['op']:<13} ep={r['ep']:<3} tokens={r['tokens']:<6} skipped ({r['skipped']})"
    bw = f"{_fmt(r, 'kernel', 'weight_tbps', '.2f')} TB/s ({_fmt(r, 'kernel', 'pct_copy', '.0f')}% copy)"
    return (f"{r['op']:<13} ep={r['ep']:<3} E={r['local_experts']:<4} tokens={r['tokens']:<6} "
            f"rows={r['rows']:<7} kernel {_fmt(r, 'kernel', 'us', '10.1f')} us "
            f"{_fmt(r, 'kernel', 'tflops', '6.1f')} TF/s ({_fmt(r, 'kernel', 'pct_dense', '4.1f')}% dense)"
            f" | xla {_fmt(r, 'xla', 'us', '10.1f')} us ({_fmt(r, 'xla', 'pct_dense', '4.1f')}%)"
            f" | x{r.get('speedup', float('nan')):.2f}" + (f" | weights {bw}" if r["small"] else ""))


def format_mlp_row(r: dict) -> str:
    if "error" in r:
        return f"situ_mlp_up tp={r['tp']} tokens={r['tokens']} ERROR {r['error'][:200]}"
    if "skipped" in r:
        return f"situ_mlp_up tp={r['tp']} tokens={r['tokens']} skipped ({r['skipped']})"
    return (f"situ_mlp_up   tp={r['tp']:<2} F={r['F']:<5} tokens={r['tokens']:<5} kernel "
            f"{_fmt(r, 'kernel', 'us', '9.1f')} us ({_fmt(r, 'kernel', 'pct_dense', '4.1f')}% dense, "
            f"weights {_fmt(r, 'kernel', 'pct_copy', '.0f')}% copy) | xla "
            f"{_fmt(r, 'xla', 'us', '9.1f')} us | x{r.get('speedup', float('nan')):.2f}")


def to_markdown(result: dict) -> str:
    """A snippet for BENCHMARKS.md: provenance, ceilings, one table per sweep."""
    meta, ceil = result["meta"], result["ceilings"]
    lines = [
        f"### Pallas Mosaic GPU kernels: {meta['date']}",
        "",
        (f"- GPU: {meta['gpu']} ({meta['platform']}), jax {meta['jax_version']}, "
         f"kernel backend `{meta['kernel_backend']}`"),
        f"- Command: `{meta['command']}`",
        (f"- Ceilings: bf16 matmul {ceil['matmul_shape'][0]}^3 = {ceil['matmul_tflops']:.1f} TFLOP/s; "
         f"elementwise copy = {ceil['copy_tbps']:.2f} TB/s (read + write)"),
        (f"- Timing: median of {meta['iters']} samples after warm-up; kernel outputs checked "
         f"against XLA (max rel err <= {CHECK_TOL})."),
        "",
        ("| op | EP | local experts | tokens | rows | kernel us | XLA us | speedup | "
         "kernel % dense | XLA % dense | kernel weight TB/s (% copy) |"),
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["grouped"]:
        if "skipped" in r or "error" in r:
            status = "skipped" if "skipped" in r else "ERROR"
            lines.append(f"| {r['op']} | {r['ep']} | {r['local_experts']} | {r['tokens']} | "
                         f"{r['rows']} | {status} | | | | | |")
            continue
        bw = (f"{r['kernel']['weight_tbps']:.2f} ({r['kernel']['pct_copy']:.0f}%)"
              if r["small"] else "")
        lines.append(
            f"| {r['op']} | {r['ep']} | {r['local_experts']} | {r['tokens']} | {r['rows']} | "
            f"{_fmt(r, 'kernel', 'us', '.1f')} | {_fmt(r, 'xla', 'us', '.1f')} | "
            f"{r.get('speedup', float('nan')):.2f} | {_fmt(r, 'kernel', 'pct_dense', '.1f')} | "
            f"{_fmt(r, 'xla', 'pct_dense', '.1f')} | {bw} |")
    lines += ["", "| op | tp | D | F | tokens | kernel us | XLA us | speedup | kernel % dense |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in result["mlp"]:
        if "skipped" in r or "error" in r:
            status = "skipped" if "skipped" in r else "ERROR"
            lines.append(f"| situ_mlp_up | {r['tp']} | {r['D']} | {r['F']} | {r['tokens']} | "
                         f"{status} | | | |")
            continue
        lines.append(
            f"| situ_mlp_up | {r['tp']} | {r['D']} | {r['F']} | {r['tokens']} | "
            f"{_fmt(r, 'kernel', 'us', '.1f')} | {_fmt(r, 'xla', 'us', '.1f')} | "
            f"{r.get('speedup', float('nan')):.2f} | {_fmt(r, 'kernel', 'pct_dense', '.1f')} |")
    return "\n".join(lines) + "\n"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true",
                   help="tiny shapes, xla vs interpret backends: runs on the CPU in seconds")
    p.add_argument("--json", metavar="PATH", help="write all results as JSON")
    p.add_argument("--markdown", metavar="PATH", help="write a BENCHMARKS.md snippet")
    p.add_argument("--iters", type=int, default=None,
                   help="timing samples per measurement (default 10, smoke 1)")
    p.add_argument("--ep", type=int, nargs="+", help="EP sizes to sweep (default 8 16 32)")
    p.add_argument("--tokens", type=int, nargs="+", help="grouped token counts to sweep")
    p.add_argument("--tp", type=int, nargs="+", help="MLP tp sizes (F = 6144 / tp)")
    p.add_argument("--mlp-tokens", type=int, nargs="+", help="MLP token counts to sweep")
    p.add_argument("--keep-going", action="store_true",
                   help="record a failing/wrong kernel as an error row instead of aborting")
    p.add_argument("--time-budget", type=float, default=420.0,
                   help="seconds after which remaining configs are skipped (default 420)")
    return p.parse_args(argv)


def build_plan(args: argparse.Namespace) -> Plan:
    plan = SMOKE if args.smoke else FULL
    overrides = {"eps": args.ep, "tokens": args.tokens, "tps": args.tp,
                 "mlp_tokens": args.mlp_tokens}
    return dataclasses.replace(plan, **{k: tuple(v) for k, v in overrides.items() if v})


def main(argv=None) -> int:
    args = parse_args(argv)
    plan = build_plan(args)
    iters = args.iters or (1 if args.smoke else 10)
    kernel_backend = "interpret" if args.smoke else "pallas"
    if not args.smoke and jax.default_backend() != "gpu":
        print("error: the full benchmark needs a GPU (use --smoke on the CPU)", file=sys.stderr)
        return 2
    start = time.monotonic()
    deadline = start + args.time_budget
    device = jax.devices()[0]
    meta = {"date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "gpu": getattr(device, "device_kind", str(device)), "platform": device.platform,
            "jax_version": jax.__version__, "kernel_backend": kernel_backend,
            "command": " ".join(["python", "benchmarks/gpu_kernels.py", *(argv or sys.argv[1:])]),
            "smoke": args.smoke, "iters": iters, "top_k": plan.top_k,
            "num_experts": plan.num_experts}
    print(f"# {meta['gpu']} jax {meta['jax_version']} kernel backend {kernel_backend}")
    ceilings = measure_ceilings(plan, iters)
    print(f"# ceilings: matmul {ceilings['matmul_tflops']:.1f} TFLOP/s, "
          f"copy {ceilings['copy_tbps']:.3f} TB/s")
    try:
        grouped = grouped_rows(plan, kernel_backend, ceilings, iters, deadline, print,
                               args.keep_going)
        mlp = mlp_rows(plan, kernel_backend, ceilings, iters, deadline, print, args.keep_going)
    except KernelMismatch as e:
        print(f"ABORT: kernel output is wrong, not timing it: {e}", file=sys.stderr)
        return 3
    meta["elapsed_s"] = time.monotonic() - start
    result = {"meta": meta, "ceilings": ceilings, "grouped": grouped, "mlp": mlp}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(to_markdown(result))
    print(f"# done in {meta['elapsed_s']:.1f} s")
    return 1 if any("error" in r for r in grouped + mlp) else 0


if __name__ == "__main__":
    sys.exit(main())
