"""MXFP4 rows of the GPU benchmark (benchmarks.kernel_sweep): the grouped
MoE matmuls with MXFP4 experts (Mxfp4Weights: codes packed along K + UE8M0
scales, 0.53125 B per parameter) at the first EP of the plan, every token
count (decode and prefill), three implementations on the same arguments:

  "mxfp4"        grouped_matmul / grouped_situ_glu on the packed weights (the
                 backend's MXFP4 path: on "pallas" the Mosaic kernels that
                 TMA-stream the packed codes and scales and decode them in
                 registers, mosaic_sm90_mxfp4_swap_ab.py or, where its tiles
                 read the weights fewer times, mosaic_sm90_mxfp4.py; on "xla" the blocked loop
                 that dequantizes one active expert at a time);
  "bf16"         the kernel backend on bf16 weights (the same values
                 dequantized once, outside the timing): what MXFP4 should match;
  "dequant_ragged_dot"  dequantize every local expert, then jax.lax.ragged_dot
                 (XLA). Skipped, and the row says so,
                 when its compiled temporaries exceed the GPU's memory.

Weight traffic is counted in packed bytes for "mxfp4" (0.53125 B per active
parameter) and bf16 bytes otherwise; "pct_copy" is against the copy ceiling.
Each row also carries the cost model's prediction for the MXFP4 kernel the
dispatch takes ("model": k3jax.tools.kernel_cost.launch_cost(..., mxfp4=True)).
No library peer: tokamax 0.0.17's quantized ragged_dot does not compile MXFP4
(E2M1, 32-wide E8M0 scales) for sm_90a (docs/kernels.md, BENCHMARKS.md).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import grouped_matmul, grouped_situ_glu
from pallas_kernels.grouped_matmul import reference
from pallas_kernels.mxfp4 import Mxfp4Dequant, Mxfp4Weights

MXFP4_BYTES_PER_PARAM = 0.5 + 1 / 32
DTYPE = jnp.bfloat16


def random_mxfp4(key, g: int, k: int, n: int) -> Mxfp4Weights:
    """Random codes [g, n, k/2] and scale bytes 119..122 [g, k/32, n] (weights
    of magnitude <= 6 * 2**-5; the bytes are in FAST_SCALES: dequant FAST)."""
    kp, ks = jax.random.split(key)
    packed = jax.random.randint(kp, (g, n, k // 2), 0, 256, jnp.int32).astype(jnp.uint8)
    scale = jax.random.randint(ks, (g, k // 32, n), 119, 123, jnp.int32).astype(jnp.uint8)
    return Mxfp4Weights(packed, scale, Mxfp4Dequant.FAST)


def implementations(op: str, kernel_backend: str, situ: dict) -> dict[str, Callable]:
    """name -> f(x, packed weights tuple, bf16 weights tuple, sizes)."""
    if op == "gate_up_situ":
        def run(backend, ws, x, s):
            return grouped_situ_glu(x, *ws, s, backend=backend, **situ)

        def dequant(x, packed, s):
            return reference.grouped_situ_glu(x, *[w.dequantize(DTYPE) for w in packed], s, **situ)
    else:
        def run(backend, ws, x, s):
            return grouped_matmul(x, *ws, s, backend=backend)

        def dequant(x, packed, s):
            return reference.grouped_matmul(x, packed[0].dequantize(DTYPE), s)
    return {"mxfp4": lambda x, packed, dense, s: run(kernel_backend, packed, x, s),
            "bf16": lambda x, packed, dense, s: run(kernel_backend, dense, x, s),
            "dequant_ragged_dot": lambda x, packed, dense, s: dequant(x, packed, s)}


def device_memory_bytes(device) -> int | None:
    """The device's memory limit, when it reports one."""
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    return int(stats["bytes_limit"]) if stats and "bytes_limit" in stats else None


def run_mxfp4(sweep, cases, *, situ: dict, check: Callable, rates: Callable,
              time_all: Callable, model: Callable | None = None) -> None:
    """One "mxfp4" row per case (benchmarks.cases.GroupedCase); check(name, out,
    ref, valid_rows) -> rel err, rates(flops, bytes, seconds, ceilings) -> dict,
    model(case) -> the cost model's fields for the MXFP4 kernel (or None)."""
    memory = device_memory_bytes(jax.devices()[0])
    for case in cases:
        fields = {**case.fields(), "bytes_per_param_mxfp4": MXFP4_BYTES_PER_PARAM}
        if model is not None:   # the MXFP4 kernel's predicted time (the sweep's routing for the case)
            fields["model"] = model(case)
        if sweep.out_of_time():
            sweep.results.add("mxfp4", {**fields, "skipped": "time budget"})
            continue
        keys = jax.random.split(jax.random.key(1000 + case.tokens), 1 + case.num_weights)
        packed = tuple(random_mxfp4(kk, case.local_experts, case.k, case.n) for kk in keys[1:])
        dense = tuple(jax.jit(lambda w: w.dequantize(DTYPE))(w) for w in packed)
        sizes = jnp.asarray(np.random.default_rng(case.tokens).multinomial(
            case.rows, np.full(case.local_experts, 1.0 / case.local_experts)).astype(np.int32))
        x = jax.random.normal(keys[0], (case.rows, case.k), DTYPE)
        args = (x, packed, dense, sizes)
        active = int(jnp.sum(sizes > 0))
        params = float(active * case.k * case.n * case.num_weights)
        row: dict = {**fields, "active_experts": active}
        timed, outs = {}, {}
        for name, fn in implementations(case.op, sweep.kernel_backend, situ).items():
            try:
                compiled = jax.jit(fn).lower(*args).compile()
                temp = compiled.memory_analysis().temp_size_in_bytes
                row[f"{name}_temp_bytes"] = temp
                if memory is not None and temp > memory:
                    row[f"{name}_error"] = (f"skipped: compiled temporaries {temp / 2**30:.1f} GiB "
                                            f"exceed the GPU's {memory / 2**30:.1f} GiB")
                    continue
                outs[name] = jax.block_until_ready(compiled(*args))
                timed[name] = compiled
            except Exception as e:  # noqa: BLE001 -- recorded in the row
                row[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        if "mxfp4" not in outs or "bf16" not in outs:
            sweep.results.add("mxfp4", {**row, "error": "mxfp4 or bf16 implementation failed"})
            continue
        try:   # same weights: MXFP4 on packed codes == the bf16 path on their decode
            row["max_rel_err"] = check(f"mxfp4 {case.name}", outs["mxfp4"], outs["bf16"],
                                       case.rows)
        except Exception as e:  # noqa: BLE001
            sweep.results.add("mxfp4", {**row, "error": str(e)[:300]})
            continue
        del outs
        seconds, row["timing"] = time_all(timed, args, iters=sweep.iters, timing=sweep.timing)
        flops = 2.0 * case.rows * case.k * case.n * case.num_weights
        for name, t in seconds.items():
            per_param = MXFP4_BYTES_PER_PARAM if name == "mxfp4" else 2.0
            row[name] = rates(flops, params * per_param, t, sweep.ceilings)
        sweep.results.add("mxfp4", row)
        print(format_mxfp4_row(row))


def format_mxfp4_row(r: dict) -> str:
    head = f"mxfp4 {r['op']:<13} ep={r['ep']:<3} tokens={r['tokens']:<6}"
    if "skipped" in r or "error" in r:
        return f"{head} {r.get('skipped') or r.get('error')}"
    parts = []
    for name in ("mxfp4", "bf16", "dequant_ragged_dot"):
        if name in r:
            parts.append(f"{name} {r[name]['us']:.1f} us ({r[name]['weight_tbps']:.2f} TB/s, "
                         f"{r[name]['pct_copy']:.0f}% copy)")
        else:
            parts.append(f"{name} {r.get(name + '_error', '-')[:80]}")
    return f"{head} " + " | ".join(parts)
