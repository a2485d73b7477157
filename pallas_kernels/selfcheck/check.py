"""One check: run a kernel configuration once, eagerly, on fresh random
inputs of its shape, and compare it with the XLA path in float32.

Inputs (generated on the device): x [m, k] ~ N(0, 1) in x's dtype; weights
[g, k, n] ~ N(0, 1/k) in their dtype (MXFP4: random E2M1 codes, scales
2^-4..2^0); group sizes a random split of m - m // 8 rows over the
groups, one of them empty when there are 3 or more (so rows past sum(group
sizes), partial tiles at group boundaries and an empty group occur). The
kernel runs through its op's dispatch.py entry (launch.launcher); the
reference is the XLA entry of the same table with x and dense weights cast
to float32.

Verdicts: "ok" when max |y - ref| / max |ref| <= the tolerance (TOL_BF16 for
16-bit x and MXFP4 weights, whose kernels multiply in bf16; TOL_F32 for
float32 x) and y is finite; "mismatch" otherwise (NaN never passes);
"error" when the kernel raised; "timeout" when it ran past the limit (the
check then runs on in a daemon thread, its result discarded).

A launch whose weights are larger than CHECK_WEIGHT_BYTES each is checked
on fewer groups (check_groups) with the same M rows and the same tiling
(launch.fixed_tiling_launcher), which still covers every tile kind: full and
partial tiles, empty groups and the rows past the groups.

The check runs in a thread of its own: there no trace of the caller's is
active, so it executes eagerly even when called while the caller's jit or
shard_map is being traced.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.backend import XLA
from pallas_kernels.selfcheck.cache import CheckResult
from pallas_kernels.selfcheck.config import KernelConfig, mxfp4_dtypes
from pallas_kernels.selfcheck.launch import fixed_tiling_launcher, launcher

CHECK_WEIGHT_BYTES = 4 << 30   # per weight: larger launches are checked on fewer groups
TOL_BF16 = 1e-2
TOL_F32 = 5e-5
PERTURBATION = 0.5   # added to one output element, times max |ref|


def tolerance(config: KernelConfig) -> float:
    if config.w_dtype in mxfp4_dtypes() or jnp.dtype(config.x_dtype).itemsize < 4:
        return TOL_BF16
    return TOL_F32


def random_inputs(config: KernelConfig, rng: np.random.Generator) -> dict:
    """The launch's arguments: {"x", "weights": [1 or 2], "group_sizes"}
    (module docstring), generated on the default device (jax.random, seeded
    from ``rng``); weights are arrays or Mxfp4Weights."""
    from pallas_kernels.mxfp4 import Mxfp4Weights

    m, k, n, g = config.m, config.k, config.n, config.groups
    keys = iter(jax.random.split(jax.random.key(int(rng.integers(2**31))), 8))
    x = jax.random.normal(next(keys), (m, k), jnp.float32).astype(jnp.dtype(config.x_dtype))

    def weight():
        if config.w_dtype in mxfp4_dtypes():   # scale bytes in FAST_SCALES, O(1) values
            packed = jax.random.randint(next(keys), (g, n, k // 2), 0, 256, jnp.int32)
            scales = jax.random.randint(next(keys), (g, k // 32, n), 123, 128, jnp.int32)
            return Mxfp4Weights(packed.astype(jnp.uint8), scales.astype(jnp.uint8),
                                mxfp4_dtypes()[config.w_dtype], config.k_order_axis)
        w = jax.random.normal(next(keys), (g, k, n), jnp.float32) / np.sqrt(max(k, 1))
        return w.astype(jnp.dtype(config.w_dtype))

    rows = m - m // 8 if g > 1 else m
    filled = g - 1 if g >= 3 else g            # one empty group where there are 3 or more
    sizes = rng.multinomial(rows, rng.dirichlet(np.ones(filled))).astype(np.int32)
    if filled < g:
        sizes = np.insert(sizes, rng.integers(g), 0).astype(np.int32)
    return {"x": x, "weights": [weight() for _ in range(config.num_weights)],
            "group_sizes": jnp.asarray(sizes)}


def check_groups(config: KernelConfig) -> int:
    """The groups a check of ``config`` runs: all of them while one weight
    takes at most CHECK_WEIGHT_BYTES, else as many as fit (at least 1)."""
    per_group = config.k * config.n * (17 / 32 if config.w_dtype in mxfp4_dtypes()
                                       else jnp.dtype(config.w_dtype).itemsize)
    if config.groups * per_group <= CHECK_WEIGHT_BYTES:
        return config.groups
    return max(1, int(CHECK_WEIGHT_BYTES // per_group))


def _as_float32(w):
    from pallas_kernels.mxfp4 import Mxfp4Weights
    return w if isinstance(w, Mxfp4Weights) else w.astype(jnp.float32)


def compare(y: np.ndarray, ref: np.ndarray, tol: float) -> tuple[str, float, str | None]:
    """(verdict, max_rel_err, error) of a kernel output against its reference."""
    y = np.asarray(y, np.float64)
    ref = np.asarray(ref, np.float64)
    if y.shape != ref.shape:
        return "mismatch", float("inf"), f"output shape {list(y.shape)} != {list(ref.shape)}"
    scale = float(np.max(np.abs(ref))) if ref.size else 0.0
    if not np.all(np.isfinite(y)):
        bad = int(np.sum(~np.isfinite(y)))
        return "mismatch", float("nan"), f"{bad} non-finite output element(s)"
    err = float(np.max(np.abs(y - ref))) / (scale or 1.0) if y.size else 0.0
    if err <= tol:
        return "ok", err, None
    return "mismatch", err, f"max relative error {err:.3g} > tolerance {tol:g}"


def error_line(e: BaseException) -> str:
    """One line for a launch error: an interpret-mode kernel's own message
    (interpret_compat), else the exception's first line that is not a
    traceback header."""
    from pallas_kernels import interpret_compat

    noted = interpret_compat.take_error_line()
    if noted:
        return noted
    lines = [ln.strip() for ln in str(e).splitlines()
             if ln.strip() and not ln.startswith("Traceback")]
    return f"{type(e).__name__}: {lines[0] if lines else ''}".rstrip(": ")


def time_launch(fn: Callable, args: tuple, repeats: int) -> float:
    """Median wall time (microseconds) of ``repeats`` runs of a compiled ``fn``
    after one untimed run."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times)) * 1e6


def _check_now(config: KernelConfig, perturb: bool, launch: Callable | None,
               repeats: int) -> CheckResult:
    t0 = time.perf_counter()
    groups = check_groups(config)
    shape = config if groups == config.groups else dataclasses.replace(config, groups=groups)
    inputs = random_inputs(shape, np.random.default_rng())
    x, ws, gs = inputs["x"], inputs["weights"], inputs["group_sizes"]
    ref = jax.jit(launcher(shape, XLA))(x.astype(jnp.float32), [_as_float32(w) for w in ws], gs)
    ref = np.asarray(jax.device_get(ref), np.float64)
    try:
        if launch is None:
            launch = (launcher(config, config.backend) if shape is config
                      else fixed_tiling_launcher(config))
        fn = jax.jit(launch)
        y = np.asarray(jax.device_get(fn(x, ws, gs)), np.float64)
    except Exception as e:   # a launch error of any kind is the verdict, not a crash
        return CheckResult("error", None, time.perf_counter() - t0, error_line(e))
    if perturb and y.size:
        y = y.copy()
        y.flat[0] += PERTURBATION * max(float(np.max(np.abs(ref))), 1.0)
    verdict, err, error = compare(y, ref, tolerance(config))
    timings = ({"median_us": time_launch(fn, (x, ws, gs), repeats)}
               if repeats and verdict == "ok" else None)
    return CheckResult(verdict, err, time.perf_counter() - t0, error, timings_us=timings,
                       checked_groups=None if shape is config else groups)


def run_check(config: KernelConfig, *, timeout_s: float, perturb: bool = False,
              launch: Callable | None = None, repeats: int = 0) -> CheckResult:
    """Check ``config`` (module docstring). ``perturb``: add PERTURBATION to
    the kernel's output before the comparison (the test hook). ``launch``:
    another launcher of the same signature (a tuning candidate's tiling).
    ``repeats`` > 0: a launch that passes is then timed (time_launch) on the
    same inputs, the median in ``timings_us["median_us"]``."""
    box: list[CheckResult] = []
    failure: list[BaseException] = []

    def work():
        try:
            box.append(_check_now(config, perturb, launch, repeats))
        except BaseException as e:   # reported in the caller's thread
            failure.append(e)

    t0 = time.perf_counter()
    thread = threading.Thread(target=work, name=f"k3jax-selfcheck {config.op}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        return CheckResult("timeout", None, time.perf_counter() - t0,
                           f"no result within {timeout_s:g} s")
    if failure:
        return CheckResult("error", None, time.perf_counter() - t0,
                           f"the check itself failed: {error_line(failure[0])}")
    return box[0]
