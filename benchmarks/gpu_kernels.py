"""Benchmark the k3jax Pallas Mosaic GPU kernels against XLA and the device ceilings.

One run measures, on one GPU:
  * ceilings: a large bf16 matmul (TFLOP/s) and an elementwise device copy
    (TB/s, bytes read + bytes written);
  * grouped MoE matmuls at K3 shapes, for local-expert counts 896 / EP:
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
  * MXFP4 experts at the first EP (bench_mxfp4.py): packed weights (on
    "pallas": mosaic_sm90_mxfp4.py's in-kernel decode, with its cost-model
    prediction) vs bf16 weights vs "dequantize + ragged_dot", with packed
    bytes per parameter. No library peer takes MXFP4 on sm_90 (tokamax's
    quantized ragged_dot fails to compile E2M1 / E8M0 there).
  * with jax-triton installed (the ``triton`` extra): the Triton kernels
    (--backend triton, pallas_kernels/*/triton_sm80.py) as a peer on every
    grouped and MLP row of a Hopper run ("triton" column), and MXFP4 rows
    (op "*_mxfp4": the Triton kernels dequantizing packed E2M1 weights in
    registers vs XLA decode + ragged_dot). On a CUDA GPU that is not Hopper
    the Triton kernels are the kernel column (no Mosaic).
Every kernel output is checked against the XLA reference before it is timed.
Timing: jit, warm-up, block_until_ready, median of --iters samples (each
sample averages enough back-to-back calls to last about 1 ms, so Python
dispatch does not dominate tiny kernels). The JSON and markdown outputs are
rewritten after every row ("complete": false until the end), so a run cut
short by a time limit still leaves what it measured.

  python benchmarks/gpu_kernels.py --keep-going --json out.json --markdown out.md  # H200
  python benchmarks/gpu_kernels.py --lower-only   # CPU: lower every kernel config for sm_90
  python benchmarks/gpu_kernels.py --lower-triton # CPU: the same for the Triton rows
  python benchmarks/gpu_kernels.py --smoke --json /tmp/smoke.json                  # CPU, seconds
  python benchmarks/gpu_kernels.py --model-only --json model.json  # CPU: the static cost model

--model-only writes, for every row of the sweep, what pallas_kernels/cost_model.py
predicts from the kernel's own schedule on the sweep's routing (tiles, SM fill,
weight reads per active expert, x bytes over weight bytes, rows computed per
useful row, predicted time); a GPU run puts the same prediction ("model") in
each row beside the measured figures.

Exit status: 0 all rows measured and correct; 1 some row failed (with
--keep-going) or some config failed to lower (--lower-only, --lower-triton); 2 usage error;
3 a kernel was wrong or failed (without --keep-going: nothing after it runs).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import importlib.metadata
import importlib.util
import json
import os
import re
import sys
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_mxfp4 import run_mxfp4
from bench_report import Results, describe_tiles, format_grouped_row, format_mlp_row, write_atomically
from bench_timing import TIMERS, pick_timing, time_all

from pallas_kernels import (
    cost_model,
    grouped_matmul,
    grouped_situ_glu,
    resolve_backend,
    situ_glu,
    situ_mlp_up,
)
from pallas_kernels import peers as peers_lib
from pallas_kernels.grouped_matmul import mosaic_sm90_swap_ab, reference
from pallas_kernels.mxfp4 import Mxfp4Weights

BETA, LINEAR_BETA = 4.0, 25.0
SITU = {"beta": BETA, "linear_beta": LINEAR_BETA}
# Issue 12's decode range: x <= 10% of the weight bytes at 16 to 256 tokens.
X_TARGET_MAX_TOKENS = 256
CHECK_TOL = 1e-2  # bf16 in / bf16 out vs the XLA reference, max-abs relative (bf16 u = 3.9e-3)
DTYPE = jnp.bfloat16


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


@dataclasses.dataclass(frozen=True)
class GroupedCase:
    """One grouped MoE matmul: op at EP ``ep`` with tokens x top_k rows over
    the ``local_experts`` = num_experts / ep experts of one device.

    op "gate_up_situ": x [rows, latent] -> [rows, inter], two weights;
    op "down":         x [rows, inter] -> [rows, latent], one weight.
    mxfp4: the weights are MXFP4 (packed uint8 [G, K/2, N] + UE8M0 scales
    [G, K/32, N] each; label "<op>_mxfp4"): timed here by the Triton kernels
    (bench_mxfp4.py times the "pallas" MXFP4 kernel), modelled by --model-only.
    """

    op: str
    ep: int
    local_experts: int
    tokens: int
    rows: int
    k: int
    n: int
    num_weights: int
    mxfp4: bool = False

    @property
    def label(self) -> str:
        return self.op + "_mxfp4" * self.mxfp4

    @property
    def name(self) -> str:
        return f"{self.label} ep={self.ep} tokens={self.tokens}"

    def fields(self) -> dict:
        return {"op": self.label, "ep": self.ep, "local_experts": self.local_experts,
                "tokens": self.tokens, "rows": self.rows, "K": self.k, "N": self.n}

    def arg_specs(self) -> tuple[jax.ShapeDtypeStruct, ...]:
        """(x_MK, *w_GKN, group_sizes_G) shapes of the kernel's arguments."""
        S = jax.ShapeDtypeStruct
        if self.mxfp4:
            w = [S((self.local_experts, self.k // 2, self.n), jnp.uint8),
                 S((self.local_experts, self.k // 32, self.n), jnp.uint8)]
        else:
            w = [S((self.local_experts, self.k, self.n), DTYPE)]
        return (S((self.rows, self.k), DTYPE), *w * self.num_weights,
                S((self.local_experts,), jnp.int32))

    def fn(self, backend: str) -> Callable:
        """The op on ``backend`` as f(x, *weights, group_sizes); MXFP4 weights
        come as (packed, scale) pairs: "triton" dequantizes them in the kernel,
        "xla" decodes them in XLA (bf16) before the reference."""
        if self.mxfp4:
            return mxfp4_fn(self.op, backend)
        if self.op == "gate_up_situ":
            return lambda x, a, b, s: grouped_situ_glu(x, a, b, s, backend=backend, **SITU)
        return lambda x, w, s: grouped_matmul(x, w, s, backend=backend)

    def epilogue(self, *products_f32):
        """What the kernel applies to its f32 products (for the spot check)."""
        return situ_glu(*products_f32, **SITU) if self.op == "gate_up_situ" else products_f32[0]


def _decode_GKN(packed_GHN, scale_GSN):
    """MXFP4 [G, K/2, N] + [G, K/32, N] -> bf16 [G, K, N] (dequant along K)."""
    from pallas_kernels.mxfp4 import dequant
    return dequant(packed_GHN, scale_GSN, DTYPE, axis=1)


def mxfp4_fn(op: str, backend: str) -> Callable:
    """f(x, *(packed, scale) per weight, group_sizes) on "triton", "xla" (XLA
    decode + ragged_dot) or "pallas" / "interpret" (mosaic_sm90_mxfp4.py's
    in-kernel decode, through the grouped ops' MXFP4 dispatch)."""
    if backend in ("pallas", "interpret"):
        if op == "gate_up_situ":
            return lambda x, gp, gs, up, us, s: grouped_situ_glu(
                x, Mxfp4Weights(gp, gs), Mxfp4Weights(up, us), s, backend=backend, **SITU)
        return lambda x, p, sc, s: grouped_matmul(x, Mxfp4Weights(p, sc), s, backend=backend)
    if backend == "xla":
        if op == "gate_up_situ":
            return lambda x, gp, gs, up, us, s: reference.grouped_situ_glu(
                x, _decode_GKN(gp, gs), _decode_GKN(up, us), s, **SITU)
        return lambda x, p, sc, s: reference.grouped_matmul(x, _decode_GKN(p, sc), s)
    if backend != "triton":
        raise ValueError(f"MXFP4 rows run on the triton, xla, pallas or interpret backend, "
                         f"not {backend!r}")
    from pallas_kernels.grouped_matmul import triton_sm80
    if op == "gate_up_situ":
        return lambda x, gp, gs, up, us, s: triton_sm80.grouped_situ_glu_mxfp4(
            x, gp, gs, up, us, s, **SITU)
    return lambda x, p, sc, s: triton_sm80.grouped_matmul_mxfp4(x, p, sc, s)


def _dense_weights(case: GroupedCase, ws: tuple) -> tuple:
    """The weights as dense bf16 [G, K, N] (MXFP4 (packed, scale) pairs decoded)
    for the spot check; the arrays themselves for bf16 cases."""
    if not case.mxfp4:
        return ws
    return tuple(_decode_GKN(ws[i], ws[i + 1]) for i in range(0, len(ws), 2))


def triton_available() -> bool:
    """jax-triton (the ``triton`` extra) is installed."""
    return importlib.util.find_spec("jax_triton") is not None


@dataclasses.dataclass(frozen=True)
class MlpCase:
    """The fused MLP up-projection x [tokens, d] @ gate/up [d, f], f = F / tp."""

    tp: int
    tokens: int
    d: int
    f: int

    @property
    def name(self) -> str:
        return f"situ_mlp_up tp={self.tp} tokens={self.tokens}"

    def fields(self) -> dict:
        return {"op": "situ_mlp_up", "tp": self.tp, "tokens": self.tokens, "D": self.d,
                "F": self.f}

    def arg_specs(self) -> tuple[jax.ShapeDtypeStruct, ...]:
        S = jax.ShapeDtypeStruct
        return S((self.tokens, self.d), DTYPE), S((self.d, self.f), DTYPE), S((self.d, self.f), DTYPE)

    @staticmethod
    def fn(backend: str) -> Callable:
        return lambda x, gate, up: situ_mlp_up(x, gate, up, backend=backend, **SITU)


def grouped_cases(plan: Plan, mxfp4: bool = False) -> list[GroupedCase]:
    """Every grouped config of the plan, ordered by tokens, then EP, then op
    (then bf16 before MXFP4 weights when ``mxfp4``): a run cut short by
    --time-budget loses the largest token counts of every EP rather than a
    whole EP."""
    ops = (("gate_up_situ", plan.latent, plan.inter, 2), ("down", plan.inter, plan.latent, 1))
    return [GroupedCase(op, ep, plan.num_experts // ep, tokens, tokens * plan.top_k, k, n, num_w,
                        mx)
            for tokens in plan.tokens for ep in plan.eps for op, k, n, num_w in ops
            for mx in ((False, True) if mxfp4 else (False,))]


def mlp_cases(plan: Plan) -> list[MlpCase]:
    """Every MLP config of the plan, ordered by tp, then tokens."""
    return [MlpCase(tp, tokens, plan.mlp_hidden, plan.mlp_inter // tp)
            for tp in plan.tps for tokens in plan.mlp_tokens]


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


def _rates(flops: float, weight_bytes: float, seconds: float, ceilings: dict) -> dict:
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
        row[impl] = _rates(flops, weight_bytes, t, ceilings)
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

    kernel_backend: str  # "pallas" on the GPU, "interpret" for --smoke
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


def jax_mosaic_ragged_dot(case: GroupedCase) -> Callable:
    """Peer for "down": jax's own Mosaic GPU ragged_dot
    (jax.experimental.pallas.ops.gpu.ragged_dot_mgpu), one fixed tiling like
    ours (64-row tiles at decode, 128 at prefill); not autotuned."""
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

    block_m = 128 if case.rows >= 128 * case.local_experts else 64
    return lambda x, w, s: ragged_dot_mgpu.ragged_dot(
        x, w, group_sizes=s, block_m=block_m, block_n=128, block_k=64, max_concurrent_steps=4,
        grid_block_n=4 if case.n % 512 == 0 else 1)


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
    with_triton = sweep.kernel_backend in ("pallas", "triton") and triton_available()
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
        if sweep.kernel_backend == "pallas" and not case.mxfp4:
            # tokamax: the library a JAX user would pick
            peers["tokamax"] = (peers_lib.tokamax_ragged_dot if case.op == "down"
                                else peers_lib.tokamax_situ_glu(**SITU))
            if case.op == "down":
                peers["jax_mosaic"] = jax_mosaic_ragged_dot(case)
            if with_triton:
                peers["triton"] = case.fn("triton")
            if (lean := x_lean_config(case, model["x_bytes_over_weight_bytes"])) is not None:
                peers["x_lean"] = decode_fn(case, lean)
        # MXFP4 rows: the Triton kernel is the kernel; 0.53125 B per weight element
        kernel_fn = case.fn("triton" if case.mxfp4 else sweep.kernel_backend)
        row = sweep.measure(
            case.name, kernel_fn, case.fn("xla"), (x, *ws, sizes),
            flops=2.0 * case.rows * case.k * case.n * case.num_weights,
            weight_bytes=float(active * case.k * case.n * case.num_weights
                               * (17 / 32 if case.mxfp4 else 2)),
            valid_rows=case.rows, peers=peers, **sweep.precompiled_for(case.name),
            fallback_check=functools.partial(spot_check_grouped, case, x=x,
                                             ws=_dense_weights(case, ws), sizes=sizes))
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
    """Random MXFP4 weight: uniform codes, scale bytes 119..121 (~ N(0, 1/k)
    magnitudes for k = 3072..3584: E2M1 codes have RMS 2.9)."""
    kp, ks = jax.random.split(key)
    packed = jax.random.randint(kp, (g, k // 2, n), 0, 256, jnp.int32).astype(jnp.uint8)
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
        peers = ({"triton": case.fn("triton")}
                 if sweep.kernel_backend == "pallas" and triton_available() else {})
        row = sweep.measure(case.name, case.fn(sweep.kernel_backend), case.fn("xla"),
                            (x, gate, up), flops=2.0 * case.tokens * case.d * case.f * 2,
                            weight_bytes=2.0 * case.d * case.f * 2, valid_rows=case.tokens,
                            peers=peers, **sweep.precompiled_for(case.name))
        sweep.results.add("mlp", {**case.fields(), **row, "model": model_mlp(case)})
        print(format_mlp_row(sweep.results.data["mlp"][-1]))


def grouped_sizes(case: GroupedCase) -> np.ndarray:
    """The sweep's routing for ``case`` (the GPU run and the model use the same)."""
    return routed_group_sizes(case.rows, case.local_experts, seed=case.tokens + case.ep)


def x_lean_config(case: GroupedCase,
                  pick_x_over_w: float) -> mosaic_sm90_swap_ab.SwapABConfig | None:
    """The decode tiling timed beside the launcher's where, at up to
    X_TARGET_MAX_TOKENS tokens, the launcher's loads x over
    cost_model.DECODE_X_OVER_W of its weight bytes (pick_x_over_w: its
    model_grouped row's x_bytes_over_weight_bytes on this routing)
    (cost_model.x_lean_candidate; None if the launcher's meets it, or no
    tiling does, or the weights are MXFP4)."""
    if (case.mxfp4 or case.tokens > X_TARGET_MAX_TOKENS
            or pick_x_over_w <= cost_model.DECODE_X_OVER_W):
        return None
    lean = cost_model.x_lean_candidate(case.rows, case.k, case.n, case.local_experts,
                                       case.num_weights)
    return None if lean is None else lean.config


def decode_fn(case: GroupedCase, config: mosaic_sm90_swap_ab.SwapABConfig) -> Callable:
    """The decode kernel with a fixed tiling, as case.fn's signature."""
    if case.op == "gate_up_situ":
        return lambda x, w1, w3, s: mosaic_sm90_swap_ab.grouped_situ_glu(
            x, w1, w3, s, config=config, **SITU)
    return lambda x, w, s: mosaic_sm90_swap_ab.grouped_matmul(x, w, s, config=config)


def model_grouped(case: GroupedCase, sizes: np.ndarray) -> dict:
    """The cost model's prediction for one grouped row (the kernel and tiles
    the launcher picks, named in its config), with the targets' ratios; where
    x_lean_config gives a tiling, "x_lean" is its prediction on the same
    routing (config, predicted_us, x / w, weight reads, SM fill)."""
    cost = cost_model.launch_cost(sizes, case.rows, case.k, case.n, case.num_weights,
                                  mxfp4=case.mxfp4)
    lean = x_lean_config(case, cost.x_bytes_over_weight_bytes)
    if lean is not None:
        lean_cost = cost_model.decode_cost(sizes, case.rows, case.k, case.n, case.num_weights,
                                           config=lean)
        x_lean = {key: lean_cost.fields()[key] for key in (
            "config", "predicted_us", "x_bytes_over_weight_bytes",
            "weight_reads_per_active_expert", "sm_fill")}
    active = int(np.count_nonzero(sizes))
    useful_flops = 2.0 * case.rows * case.k * case.n * case.num_weights
    # MXFP4 rows: the packed bytes (0.53125 B per parameter) are the weight traffic
    weight_bytes = (17 / 32 if case.mxfp4 else 2.0) * active * case.k * case.n * case.num_weights
    xla_s = cost_model.xla_ragged_dot_dense_s(case.rows, case.k, case.n, case.local_experts,
                                              case.num_weights)
    seconds = cost.predicted_us * 1e-6
    return {**cost.fields(),
            "pct_dense": 100 * useful_flops / seconds / cost_model.DENSE_BF16_FLOPS,
            "pct_copy": 100 * weight_bytes / seconds / cost_model.COPY_BYTES_PER_S,
            "xla_ragged_dot_dense_us": xla_s * 1e6, "speedup_vs_xla_dense": xla_s / seconds,
            **({} if lean is None else {"x_lean": x_lean})}


def model_mlp(case: MlpCase) -> dict:
    """The cost model's prediction for one MLP row, beside XLA's roofline."""
    cost = cost_model.mlp_cost(case.tokens, case.d, case.f)
    xla_s = cost_model.xla_mlp_roofline_s(case.tokens, case.d, case.f)
    return {**cost.fields(), "xla_roofline_us": xla_s * 1e6,
            "speedup_vs_xla_roofline": xla_s / (cost.predicted_us * 1e-6)}


def model_all(plan: Plan) -> dict:
    """Every row of the sweep, as the static cost model predicts it (no GPU)."""
    # MXFP4 rows ("<op>_mxfp4", mosaic_sm90_mxfp4's kernel) beside the bf16 ones
    grouped = [{"op": c.label, "ep": c.ep, "tp": None, "tokens": c.tokens, "rows": c.rows,
                "local_experts": c.local_experts, "K": c.k, "N": c.n,
                "active_experts": int(np.count_nonzero(grouped_sizes(c))),
                **model_grouped(c, grouped_sizes(c))} for c in grouped_cases(plan, mxfp4=True)]
    mlp = [{"op": "situ_mlp_up", "ep": None, "tp": c.tp, "tokens": c.tokens, "D": c.d, "F": c.f,
            **model_mlp(c)} for c in mlp_cases(plan)]
    return {"meta": {"model": "pallas_kernels/cost_model.py", "num_sms": cost_model.H200_NUM_SMS,
                     "dense_bf16_flops": cost_model.DENSE_BF16_FLOPS,
                     "copy_bytes_per_s": cost_model.COPY_BYTES_PER_S,
                     "tile_overhead_s": cost_model.TILE_OVERHEAD_S, "top_k": plan.top_k,
                     "mxfp4_decode_ops_per_param": cost_model.MXFP4_DECODE_OPS_PER_PARAM,
                     "sm_lane_ops_per_s": cost_model.SM_LANE_OPS_PER_S,
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


def lower_all(plan: Plan) -> int:
    """Lower every kernel config of the plan for sm_90 on this host (no GPU
    needed: Pallas lowering, Mosaic GPU layout inference, the SMEM budget).
    Returns the number of configs that failed."""
    failures = 0
    cases = [(c.name, c.fn("pallas"), c.arg_specs()) for c in grouped_cases(plan)]
    cases += [(f"{c.name} (peer: jax Mosaic)", jax_mosaic_ragged_dot(c), c.arg_specs())
              for c in grouped_cases(plan) if c.op == "down"]
    cases += [(c.name, c.fn("pallas"), c.arg_specs()) for c in mlp_cases(plan)]
    for name, fn, specs in cases:
        t0 = time.perf_counter()
        try:
            text = jax.jit(fn).trace(*specs).lower(lowering_platforms=("cuda",)).as_text()
            if "mosaic_gpu" not in text:
                raise RuntimeError("no Mosaic GPU custom call in the lowered module")
            print(f"lowered  {name:<52} {time.perf_counter() - t0:5.2f} s")
        except Exception as e:  # noqa: BLE001 -- report every failing config, then exit 1
            failures += 1
            print(f"FAILED   {name:<52} {type(e).__name__}: {str(e)[:500]}")
    print(f"# {len(cases) - failures} of {len(cases)} configs lower for sm_90")
    return failures


def lower_all_triton(plan: Plan, capability: int = 90) -> int:
    """Lower every Triton config of the plan (bf16 and MXFP4 grouped, MLP) for
    sm_``capability`` through jax-triton (Triton compiles each kernel to PTX
    here). Returns the number of configs that failed."""
    from pallas_kernels.triton_target import triton_target

    failures = 0
    cases = [(c.name, c.fn("triton"), c.arg_specs()) for c in grouped_cases(plan, mxfp4=True)]
    cases += [(c.name, c.fn("triton"), c.arg_specs()) for c in mlp_cases(plan)]
    for name, fn, specs in cases:
        t0 = time.perf_counter()
        try:
            with triton_target(capability):
                text = jax.jit(fn).trace(*specs).lower(lowering_platforms=("cuda",)).as_text()
            if "triton_kernel_call" not in text:
                raise RuntimeError("no triton_kernel_call in the lowered module")
            print(f"lowered  triton {name:<45} {time.perf_counter() - t0:5.2f} s")
        except Exception as e:  # noqa: BLE001 -- report every failing config
            failures += 1
            print(f"FAILED   triton {name:<45} {type(e).__name__}: {str(e)[:500]}")
    print(f"# {len(cases) - failures} of {len(cases)} Triton configs lower for sm_{capability}")
    return failures


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive integer")
    return value


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--smoke", action="store_true",
                      help="tiny shapes, xla vs interpret backends: runs on the CPU in seconds")
    mode.add_argument("--lower-only", action="store_true",
                      help="lower every kernel config of the sweep for sm_90 and stop "
                           "(no GPU needed; a pre-flight check before a GPU run)")
    mode.add_argument("--lower-triton", action="store_true",
                      help="lower every Triton row of the sweep (bf16 and MXFP4 grouped, MLP) "
                           "for sm_90 through jax-triton and stop (no GPU needed)")
    mode.add_argument("--model-only", action="store_true",
                      help="print (and with --json write) the static cost model's prediction "
                           "for every row of the sweep and stop (no GPU needed)")
    p.add_argument("--json", metavar="PATH", help="write all results as JSON")
    p.add_argument("--markdown", metavar="PATH", help="write a BENCHMARKS.md snippet")
    p.add_argument("--iters", type=_positive_int, default=None,
                   help="timing samples per measurement (default 10, smoke 1)")
    p.add_argument("--ep", type=_positive_int, nargs="+",
                   help="EP sizes to sweep (default 8 16 32; must divide the expert count)")
    p.add_argument("--tokens", type=_positive_int, nargs="+", help="grouped token counts to sweep")
    p.add_argument("--tp", type=_positive_int, nargs="+",
                   help="MLP tp sizes (F = 6144 / tp; must divide it)")
    p.add_argument("--mlp-tokens", type=_positive_int, nargs="+", help="MLP token counts to sweep")
    p.add_argument("--keep-going", action="store_true",
                   help="record a failing/wrong kernel as an error row instead of aborting")
    p.add_argument("--time-budget", type=float, default=420.0,
                   help="seconds after which remaining configs are skipped (default 420)")
    args = p.parse_args(argv)
    plan = build_plan(args)
    for ep in plan.eps:
        if plan.num_experts % ep:
            p.error(f"--ep {ep} does not divide the {plan.num_experts} experts")
    for tp in plan.tps:
        if plan.mlp_inter % tp:
            p.error(f"--tp {tp} does not divide the MLP intermediate size {plan.mlp_inter}")
    for flag, path in (("--json", args.json), ("--markdown", args.markdown)):
        if path and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
            p.error(f"{flag} {path}: the folder does not exist")
    return args


def build_plan(args: argparse.Namespace) -> Plan:
    plan = SMOKE if args.smoke else FULL
    overrides = {"eps": args.ep, "tokens": args.tokens, "tps": args.tp,
                 "mlp_tokens": args.mlp_tokens}
    return dataclasses.replace(plan, **{k: tuple(v) for k, v in overrides.items() if v})


def _dump_json(path: str, data: dict) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=1)


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def main(argv=None) -> int:
    args = parse_args(argv)
    plan = build_plan(args)
    if args.lower_only:
        return 1 if lower_all(plan) else 0
    if args.lower_triton:
        return 1 if lower_all_triton(plan) else 0
    if args.model_only:
        model = model_all(plan)
        print_model(model)
        if args.json:
            write_atomically(args.json, lambda tmp: _dump_json(tmp, model))
        return 0
    iters = args.iters or (1 if args.smoke else 10)
    # a GPU run: Mosaic on Hopper, Triton on other CUDA GPUs (sm_80+)
    kernel_backend = "interpret" if args.smoke else resolve_backend("auto")
    if not args.smoke and kernel_backend == "xla":
        print("error: the full benchmark needs a GPU: Hopper, or CUDA sm_80+ with the triton "
              "extra (use --smoke or --lower-only on the CPU)", file=sys.stderr)
        return 2
    start = time.monotonic()
    deadline = start + args.time_budget
    device = jax.devices()[0]
    meta = {"date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "gpu": device.device_kind, "platform": device.platform,
            "jax_version": jax.__version__, "jaxlib_version": _version("jaxlib"),
            "flax_version": _version("flax"), "kernel_backend": kernel_backend,
            "command": " ".join(["python", "benchmarks/gpu_kernels.py",
                                 *(sys.argv[1:] if argv is None else argv)]),
            "smoke": args.smoke, "iters": iters, "check_tol": CHECK_TOL, "top_k": plan.top_k,
            "num_experts": plan.num_experts}
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
        run_mlp(plan, sweep)
        run_grouped(plan, sweep)
        run_mxfp4(sweep, [c for c in grouped_cases(plan) if c.ep == plan.eps[0]], situ=SITU,
                  check=check_against_reference, rates=_rates, time_all=time_all,
                  model=(lambda c: model_grouped(dataclasses.replace(c, mxfp4=True),
                                                 grouped_sizes(c)))
                  if kernel_backend == "pallas" else None)
    except KernelMismatch as e:
        print(f"ABORT: kernel output is wrong, not timing it: {e}", file=sys.stderr)
        return 3
    results.finish(time.monotonic() - start)
    print(f"# done in {results.data['meta']['elapsed_s']:.1f} s")
    return 1 if any("error" in r for r in results.rows) else 0


if __name__ == "__main__":
    sys.exit(main())
