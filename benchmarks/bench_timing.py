"""How the GPU benchmark times a call: CUPTI kernel time (as jax's own Mosaic
GPU benchmarks do) where it works, else wall clock over back-to-back calls.
Every function takes a compiled/jitted fn that has already run once."""

from __future__ import annotations

import math
import statistics
import sys
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp


def time_wallclock(fn: Callable, args: tuple, *, iters: int, target_s: float = 1e-3) -> float:
    """Median seconds per call over ``iters`` samples; a sample is enough
    back-to-back calls to last ~``target_s`` (so Python dispatch overlaps the
    device work), ended by block_until_ready. fn has been compiled and run."""
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


def time_cupti(fn: Callable, args: tuple, *, iters: int) -> float:
    """Median over ``iters`` calls of the summed GPU kernel time of one call
    (CUPTI, as jax's own Mosaic GPU benchmarks time: no dispatch, no gaps)."""
    from jax.experimental.mosaic.gpu import profiler

    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    if time.perf_counter() - t0 > 0.25:
        iters = min(iters, 3)
    _, per_call_ms = profiler.measure(fn, iterations=iters)(*args)
    if per_call_ms is None:
        raise RuntimeError("CUPTI saw no kernel launch")
    per_call_ms = per_call_ms if isinstance(per_call_ms, list) else [per_call_ms]
    return statistics.median(per_call_ms) / 1e3


TIMERS = {"cupti": time_cupti, "wallclock": time_wallclock}


def pick_timing(platform: str) -> str:
    """"cupti" on a GPU where CUPTI works (tried on a small matmul), else "wallclock"."""
    if platform != "gpu":
        return "wallclock"
    a = jnp.ones((256, 256), jnp.bfloat16)
    try:
        time_cupti(jax.jit(jnp.dot), (a, a), iters=2)
        return "cupti"
    except Exception as e:  # noqa: BLE001 -- e.g. CUPTI unavailable in this container
        print(f"# CUPTI timing unavailable ({type(e).__name__}: {str(e)[:200]}); "
              "timing wall-clock", file=sys.stderr)
        return "wallclock"


def time_all(fns: dict[str, Callable], args: tuple, *, iters: int, timing: str
             ) -> tuple[dict[str, float], str]:
    """Seconds per call of every fn, all with one method: ``timing``, or
    wall-clock for all of them when CUPTI fails on one. Returns (times, method)."""
    if timing == "cupti":
        try:
            return {name: time_cupti(fn, args, iters=iters) for name, fn in fns.items()}, "cupti"
        except Exception as e:  # noqa: BLE001 -- fall back for this row only, and say so
            print(f"# CUPTI failed ({type(e).__name__}: {str(e)[:200]}): wall-clock for this row",
                  file=sys.stderr)
    return {name: time_wallclock(fn, args, iters=iters) for name, fn in fns.items()}, "wallclock"
