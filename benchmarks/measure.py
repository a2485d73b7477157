"""Checking and timing one benchmark row: kernel vs the XLA reference and peers.

A row is measured only after the kernel's output matches the XLA reference
(max |out - ref| / max |ref| over the valid rows <= CHECK_TOL, every value
finite, rows past the valid ones exactly zero); a wrong kernel raises
KernelMismatch and is never timed. Rates are against the run's measured
ceilings: a large bf16 matmul (TFLOP/s) and an elementwise device copy (TB/s,
bytes read + bytes written).
"""

from __future__ import annotations

import dataclasses
import re
import sys
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.bench_report import Results
from benchmarks.bench_timing import TIMERS, time_all
from benchmarks.cases import DTYPE, GroupedCase, Plan
from pallas_kernels.backend import KernelBackend

CHECK_TOL = 1e-2  # bf16 in / bf16 out vs the XLA reference, max-abs relative (bf16 u = 3.9e-3)


class KernelMismatch(RuntimeError):
    """The kernel failed or its output disagrees with the XLA reference."""


def measure_ceilings(plan: Plan, iters: int, timing: str) -> dict:
    """Dense bf16 matmul TFLOP/s and elementwise copy TB/s (read + write)."""
    n = plan.matmul_dim
    ka, kb = jax.random.split(jax.random.key(0))
    a = jax.random.normal(ka, (n, n), DTYPE)
    b = jax.random.normal(kb, (n, n), DTYPE)
    dot = jax.jit(jnp.dot)
    jax.block_until_ready(dot(a, b))
    t_dot = TIMERS[timing](dot, (a, b), iters=iters)
    src = jax.random.normal(ka, (plan.copy_elems,), DTYPE)
    copy = jax.jit(lambda v: -v)  # cannot be elided; reads and writes every byte once
    jax.block_until_ready(copy(src))
    t_copy = TIMERS[timing](copy, (src,), iters=iters)
    copy_bytes = 2 * src.size * src.dtype.itemsize
    return {"matmul_shape": [n, n, n], "matmul_tflops": 2 * n ** 3 / t_dot / 1e12,
            "matmul_us": t_dot * 1e6, "copy_bytes_moved": copy_bytes,
            "copy_tbps": copy_bytes / t_copy / 1e12, "copy_us": t_copy * 1e6}


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


def spot_check_grouped(case: GroupedCase, out, x, ws, sizes) -> float:
    """Check a few groups' rows with plain dense matmuls (no ragged_dot).

    Used when the XLA ragged_dot baseline cannot run (XLA:GPU may expand it
    densely, G times the work and memory, and run out of memory): first,
    middle and last non-empty group, up to 256 rows each; also all-finite output.
    """
    sizes = np.asarray(sizes)
    starts = np.concatenate([[0], np.cumsum(sizes)])
    nonempty = np.nonzero(sizes)[0]
    if not bool(jnp.all(jnp.isfinite(out.astype(jnp.float32)))):
        raise KernelMismatch(f"{case.name}: kernel output has NaN/inf")
    worst = 0.0
    for g in sorted({int(nonempty[0]), int(nonempty[len(nonempty) // 2]), int(nonempty[-1])}):
        rows = slice(int(starts[g]), int(starts[g] + min(sizes[g], 256)))
        products = [jnp.dot(x[rows], w[g], preferred_element_type=jnp.float32) for w in ws]
        worst = max(worst, check_against_reference(f"{case.name} group {g}", out[rows],
                                                   case.epilogue(*products),
                                                   rows.stop - rows.start))
    return worst


def rates(flops: float, weight_bytes: float, seconds: float, ceilings: dict) -> dict:
    tflops = flops / seconds / 1e12
    weight_tbps = weight_bytes / seconds / 1e12
    return {"us": seconds * 1e6, "tflops": tflops,
            "pct_dense": 100 * tflops / ceilings["matmul_tflops"],
            "weight_tbps": weight_tbps, "pct_copy": 100 * weight_tbps / ceilings["copy_tbps"]}



CUSTOM_CALL = re.compile(r'custom_call_target="([^"]+)"')


def bench_pair(name: str, kernel_fn, xla_fn, args: tuple, *, flops: float, weight_bytes: float,
               valid_rows: int, ceilings: dict, iters: int, timing: str,
               fallback_check=None, peers: dict[str, Callable] | None = None,
               precompiled=None, compile_s: float | None = None) -> dict:
    """Check the kernel against XLA, then time kernel, XLA and peers; one row.

    fallback_check(out) -> rel err verifies the kernel when the XLA baseline
    itself fails (its error is recorded in the row as "xla_error") or would
    not fit the device ("xla_skipped": arguments + temporaries > its memory).
    ``precompiled`` is the kernel compiled before any timing (precompile_all),
    with its compile time ``compile_s``; the row records compile and run times. ``peers``
    (name -> fn, e.g. jax's own Mosaic ragged_dot) are checked the same way
    and timed beside; a failing peer is recorded as "<name>_error". The row
    names the custom calls in XLA's compiled program ("xla_custom_calls"), so
    it shows which ragged_dot lowering the baseline got (e.g. cuDNN or none).
    """
    row: dict = {"flops": flops, "weight_bytes": weight_bytes}
    timed: dict[str, Callable] = {}
    t_row = time.perf_counter()
    ref = None
    try:
        t0 = time.perf_counter()
        xla = jax.jit(xla_fn).lower(*args).compile()
        row["xla_compile_s"] = time.perf_counter() - t0
        row["xla_custom_calls"] = sorted(set(CUSTOM_CALL.findall(xla.as_text())))
        too_big = exceeds_device_memory(xla)
        if too_big:  # e.g. XLA's dense ragged_dot: 202 GiB at 16384 tokens, EP 8
            row["xla_skipped"] = too_big
            print(f"# {name}: XLA baseline skipped: {too_big}")
        else:
            ref = jax.block_until_ready(xla(*args))
            timed["xla"] = xla
    except Exception as e:  # noqa: BLE001 -- e.g. XLA expands ragged_dot densely: OOM
        ref, row["xla_error"] = None, f"{type(e).__name__}: {str(e)[:300]}"
    try:
        t0 = time.perf_counter()
        kernel = precompiled if precompiled is not None else jax.jit(kernel_fn).lower(*args).compile()
        row["kernel_compile_s"] = (compile_s if precompiled is not None
                                   else time.perf_counter() - t0)
        out = jax.block_until_ready(kernel(*args))
    except Exception as e:
        raise KernelMismatch(f"{name}: kernel raised {type(e).__name__}: {str(e)[:2000]}") from e
    if ref is not None:
        row["max_rel_err"] = check_against_reference(name, out, ref, valid_rows)
    elif fallback_check is not None:
        row["max_rel_err"] = fallback_check(out)
        row["checked"] = "spot check (XLA baseline failed or skipped)"
    else:
        why = row.get("xla_error") or row.get("xla_skipped")
        raise KernelMismatch(f"{name}: no XLA reference to verify against ({why})")
    timed["kernel"] = kernel
    for peer, peer_fn in (peers or {}).items():
        try:
            compiled = jax.jit(peer_fn).lower(*args).compile()
            peer_out = jax.block_until_ready(compiled(*args))
            check_against_reference(f"{name} {peer}", peer_out, out, valid_rows)  # vs checked kernel
            timed[peer] = compiled
        except Exception as e:  # noqa: BLE001 -- a peer's failure is recorded, not fatal
            row[f"{peer}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    del ref, out
    seconds, row["timing"] = time_all(timed, args, iters=iters, timing=timing)
    for impl, t in seconds.items():
        row[impl] = rates(flops, weight_bytes, t, ceilings)
    if "xla" in row:
        row["speedup"] = row["xla"]["us"] / row["kernel"]["us"]
    row["row_s"] = time.perf_counter() - t_row
    return row


def exceeds_device_memory(compiled) -> str | None:
    """Why a compiled program cannot run on this device (its arguments, outputs
    and temporaries exceed the device's memory), or None."""
    stats = jax.devices()[0].memory_stats() or {}
    limit = stats.get("bytes_limit")
    mem = compiled.memory_analysis()
    if not limit or mem is None:
        return None
    need = (mem.temp_size_in_bytes + mem.argument_size_in_bytes + mem.output_size_in_bytes)
    if need <= limit:
        return None
    return (f"needs {need / 2**30:.1f} GiB (temporaries {mem.temp_size_in_bytes / 2**30:.1f} GiB) "
            f"> {limit / 2**30:.1f} GiB on the device")


def guarded(keep_going: bool, fn: Callable[..., dict], *args, **kwargs) -> dict:
    """fn(*args, **kwargs); with keep_going a KernelMismatch becomes an "error" row."""
    try:
        return fn(*args, **kwargs)
    except KernelMismatch as e:
        if not keep_going:
            raise
        print(f"ERROR (kept going): {e}", file=sys.stderr)
        return {"error": str(e)}


@dataclasses.dataclass
class Sweep:
    """What every measurement of one run shares."""

    kernel_backend: KernelBackend  # PALLAS on the GPU, INTERPRET for --smoke
    ceilings: dict
    iters: int
    timing: str  # "cupti" | "wallclock"
    deadline: float  # time.monotonic() after which configs are skipped
    keep_going: bool
    results: Results
    precompiled: dict[str, tuple] = dataclasses.field(default_factory=dict)

    def precompiled_for(self, name: str) -> dict:
        """bench_pair's precompiled / compile_s for the config ``name`` (or none)."""
        if name not in self.precompiled:
            return {}
        compiled, seconds = self.precompiled[name]
        return {"precompiled": compiled, "compile_s": seconds}

    def out_of_time(self) -> bool:
        return time.monotonic() > self.deadline

    def measure(self, name: str, kernel_fn, xla_fn, args: tuple, **kwargs) -> dict:
        """bench_pair with this run's settings (an "error" row with keep_going)."""
        return guarded(self.keep_going, bench_pair, name, kernel_fn, xla_fn, args,
                       ceilings=self.ceilings, iters=self.iters, timing=self.timing, **kwargs)
