"""The token sweep: the shared expert under sequence parallelism, replicated
vs sharded, and the whole MoE layer (SP + EP) with either shared-expert
layout, over global token counts (docs/spec.md §6: 8 ... 2048).

Method: each (benchmark, layout, T) is one jitted forward of the real module
on a (1, N) mesh. After ``warmup`` calls (the first compiles), ``repeats``
samples are taken; a sample is ``inner`` back-to-back calls ended by
``block_until_ready`` on the output, divided by ``inner`` (``inner`` is chosen
so a sample lasts at least ``min_sample_ms``: this keeps Python dispatch out
of microsecond-scale GPU calls; it is 1 whenever one call already lasts
min_sample_ms). The reported latency is the median sample.

Slowest device: vLLM's benchmark takes the max over ranks of each rank's
time. Here one process drives every device through one SPMD program, and
``block_until_ready`` returns only when every device's shard of the output is
ready, so each sample already is the slowest device's time.

Every layout pair is also checked for agreement (the same seed gives the
same logical weights in every layout), so a broken layout cannot post a time.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from k3jax.config import K3Config
from k3jax.files import atomic_write
from k3jax.layout import (
    DEFAULT_SHARED_OVERLAP,
    MlpMode,
    MoEMode,
    ParallelConfig,
    SharedOverlap,
    make_layout,
    make_mesh,
)
from k3jax.modules import KimiMLP, RandomSource, build_layer

DEFAULT_TOKENS = (8, 32, 128, 256, 512, 1024, 2048)
LAYOUTS = ("replicated", "sharded")
BENCHMARKS = ("shared_expert", "moe_layer")
CPU_MAX_EXPERTS = 32
CPU_MAX_TOP_K = 2
TOLERANCE = {"float32": 1e-4, "bfloat16": 3e-2}


# --------------------------------------------------------------------------
# Dimensions
# --------------------------------------------------------------------------
def scale_config(cfg: K3Config, scale: int, multiple: int, *, num_experts: int | None = None,
                 top_k: int | None = None) -> K3Config:
    """``cfg`` with hidden, intermediate and latent widths divided by ``scale``
    (each rounded to a multiple of ``multiple``, at least ``multiple``, so tp
    still divides them), and optionally another expert count / top-k. A
    changed expert count drops expert grouping (groups no longer fit)."""
    if scale < 1:
        raise ValueError(f"scale must be >= 1, got {scale}")

    def s(width: int) -> int:
        return max(multiple, round(width / scale / multiple) * multiple)

    changes: dict[str, Any] = {
        "hidden_size": s(cfg.hidden_size), "intermediate_size": s(cfg.intermediate_size),
        "moe_intermediate_size": s(cfg.moe_intermediate_size),
        "routed_expert_hidden_size": s(cfg.routed_expert_hidden_size),
        "min_moe_intermediate_per_partition": max(1, cfg.min_moe_intermediate_per_partition // scale)}
    if num_experts is not None and num_experts != cfg.num_experts:
        changes.update(num_experts=num_experts, num_expert_group=1, topk_group=1)
    if top_k is not None:
        changes["num_experts_per_token"] = top_k
    return cfg.replace(**changes)


def default_experts(cfg: K3Config, devices: int, platform: str) -> tuple[int, int]:
    """(experts, top-k) for the sweep: the config's on an accelerator; on the
    CPU at most 32 experts (a multiple of the device count) and top-2, since
    XLA:CPU runs the grouped matmul as a dense masked product whose cost grows
    with local experts x T x top-k."""
    if platform != "cpu":
        return cfg.num_experts, cfg.num_experts_per_token
    experts = cfg.num_experts
    if experts > CPU_MAX_EXPERTS:
        experts = max(devices, CPU_MAX_EXPERTS // devices * devices)
    return experts, min(cfg.num_experts_per_token, CPU_MAX_TOP_K, experts)


# --------------------------------------------------------------------------
# Results
# --------------------------------------------------------------------------
@dataclasses.dataclass
class Series:
    """One layout's latencies over the token sweep (milliseconds)."""

    layout: str
    description: str
    median_ms: list[float] = dataclasses.field(default_factory=list)
    min_ms: list[float] = dataclasses.field(default_factory=list)
    samples_ms: list[list[float]] = dataclasses.field(default_factory=list)
    inner: list[int] = dataclasses.field(default_factory=list)
    forms: list[str] = dataclasses.field(default_factory=list)
    """The shared MLP's SharedOverlap in force at each token count (the
    ``auto`` pick resolved; "none" where the MLP is not SP-sharded)."""


@dataclasses.dataclass
class Comparison:
    """Replicated vs sharded shared expert in one benchmark."""

    name: str
    what: str
    replicated: Series
    sharded: Series
    max_rel_diff: list[float] = dataclasses.field(default_factory=list)

    @property
    def ratio(self) -> list[float]:
        """sharded / replicated median latency per token count (> 1: sharded slower)."""
        return [s / r for s, r in zip(self.sharded.median_ms, self.replicated.median_ms,
                                          strict=True)]

    def crossover(self, tokens: Sequence[int]) -> int | None:
        return crossover_tokens(tokens, self.ratio)

    def to_dict(self, tokens: Sequence[int]) -> dict[str, Any]:
        return {"what": self.what,
                "replicated": dataclasses.asdict(self.replicated),
                "sharded": dataclasses.asdict(self.sharded),
                "ratio": self.ratio, "crossover_tokens": self.crossover(tokens),
                "max_rel_diff": self.max_rel_diff}


def crossover_tokens(tokens: Sequence[int], ratio: Sequence[float]) -> int | None:
    """The first token count from which the sharded layout is slower
    (ratio > 1) at it and at every larger count of the sweep; None when it is
    not slower at the largest. Requiring "and stays slower" keeps one noisy
    point from posing as the crossover."""
    crossover = None
    for t, r in zip(tokens, ratio, strict=True):
        if r > 1.0:
            crossover = t if crossover is None else crossover
        else:
            crossover = None
    return crossover


@dataclasses.dataclass
class BenchResult:
    cfg: K3Config
    source: str
    scale: int
    platform: str
    device_kind: str
    devices: int
    simulated: bool
    dtype: str
    backend: str
    tokens: list[int]
    repeats: int
    warmup: int
    min_sample_ms: float
    comparisons: dict[str, Comparison]

    def to_dict(self) -> dict[str, Any]:
        c = self.cfg
        return {
            "source": self.source, "scale": self.scale,
            "config": {"hidden_size": c.hidden_size, "moe_intermediate_size": c.moe_intermediate_size,
                       "shared_intermediate_size": c.shared_intermediate_size,
                       "routed_expert_hidden_size": c.routed_expert_hidden_size,
                       "num_experts": c.num_experts, "num_experts_per_token": c.num_experts_per_token,
                       "num_shared_experts": c.num_shared_experts},
            "platform": self.platform, "device_kind": self.device_kind, "devices": self.devices,
            "simulated_devices": self.simulated, "dtype": self.dtype, "backend": self.backend,
            "tokens": list(self.tokens), "repeats": self.repeats, "warmup": self.warmup,
            "min_sample_ms": self.min_sample_ms,
            "method": ("jit; warm-up calls, then the median of `repeats` samples; a sample is "
                       "`inner` back-to-back calls ended by block_until_ready over every device's "
                       "output shard, divided by `inner`; one SPMD program, so each sample is the "
                       "slowest device's time (vLLM: max over ranks)"),
            "benchmarks": {name: comp.to_dict(self.tokens) for name, comp in self.comparisons.items()},
        }


# --------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------
def time_call(fn: Callable[[], Any], *, warmup: int, repeats: int,
              min_sample_ms: float = 1.0) -> tuple[list[float], int, Any]:
    """(samples in ms, inner calls per sample, last output) of ``fn()``."""
    out = None
    for _ in range(max(warmup, 1)):              # at least one: compile outside the samples
        out = jax.block_until_ready(fn())
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn())
    single = time.perf_counter() - t0
    inner = max(1, math.ceil(min_sample_ms / 1e3 / max(single, 1e-9)))
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            out = fn()
        out = jax.block_until_ready(out)
        samples.append((time.perf_counter() - t0) / inner * 1e3)
    return samples, inner, out


def _jitted(module: nnx.Module):
    graphdef, state = nnx.split(module)
    forward = jax.jit(lambda state, x: nnx.merge(graphdef, state)(x))
    return lambda x: forward(state, x)


def _bench_parallel(devices: int, layout: str, moe: bool,
                    overlap: SharedOverlap = DEFAULT_SHARED_OVERLAP) -> ParallelConfig:
    return ParallelConfig(tp=devices, sequence_parallel=True, expert_parallel=moe,
                          shard_shared_expert=(layout == "sharded"), shared_overlap=overlap)


def _build(kind: str, cfg: K3Config, parallel: ParallelConfig, mesh, dtype, backend, seed: int):
    layout = make_layout(cfg, parallel, mesh, backend=backend, dtype=dtype)
    want = MlpMode.SP_SHARDED if parallel.shard_shared_expert else MlpMode.REPLICATED
    if layout.shared_mlp.mode is not want:
        raise ValueError(f"the shared expert cannot be {want.value} here: {layout.shared_mlp.reason}")
    if kind == "shared_expert":
        module = KimiMLP(layout, layout.shared_mlp, mesh, source=RandomSource(seed))
    else:
        assert layout.moe_mode is MoEMode.EP
        first_moe = next(i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i))
        module = build_layer(layout, first_moe, mesh, source=RandomSource(seed))
    return module, layout


def run_bench(cfg: K3Config, devices: Sequence[jax.Device], *, tokens: Sequence[int] = DEFAULT_TOKENS,
              repeats: int = 10, warmup: int = 2, dtype: str = "float32", backend: str = "auto",
              benchmarks: Sequence[str] = BENCHMARKS, min_sample_ms: float = 1.0, seed: int = 0,
              source: str = "", scale: int = 1, simulated: bool = False,
              shared_overlap: SharedOverlap = DEFAULT_SHARED_OVERLAP,
              progress: Callable[[str], None] | None = None) -> BenchResult:
    """Sweep ``tokens`` for each benchmark and both shared-expert layouts on a
    (1, len(devices)) mesh; ``cfg`` is used as given (scale it first). The
    sharded layout moves its rows as ``shared_overlap`` says.
    ``progress(label)`` is called after each measured point."""
    n = len(devices)
    jdtype = jnp.dtype(dtype)
    comparisons: dict[str, Comparison] = {}
    for kind in benchmarks:
        if kind not in BENCHMARKS:
            raise ValueError(f"unknown benchmark {kind!r}; choose from {BENCHMARKS}")
        series, outputs = {}, {}
        for name in LAYOUTS:
            parallel = _bench_parallel(n, name, kind == "moe_layer", shared_overlap)
            mesh = make_mesh(parallel, devices)
            module, layout = _build(kind, cfg, parallel, mesh, jdtype, backend, seed)
            forward = _jitted(module)
            what = (f"shared expert, KimiMLP {cfg.hidden_size} x {cfg.shared_intermediate_size}"
                    if kind == "shared_expert" else
                    f"MoE layer, {cfg.num_experts} experts top-{cfg.num_experts_per_token}, EP over {n}")
            series[name] = Series(name, f"{layout.shared_mlp.mode.value}: {layout.shared_mlp.reason}; "
                                        f"{parallel.describe()}")
            outputs[name] = []
            sharding = NamedSharding(mesh, layout.x_TD)
            for t in tokens:
                x_host = np.random.default_rng([seed, t]).standard_normal((t, cfg.hidden_size))
                x = jax.device_put(x_host.astype(np.float32).astype(jdtype), sharding)
                samples, inner, y = time_call(functools.partial(forward, x), warmup=warmup, repeats=repeats,
                                              min_sample_ms=min_sample_ms)
                s = series[name]
                s.median_ms.append(statistics.median(samples))
                s.min_ms.append(min(samples))
                s.samples_ms.append(samples)
                s.inner.append(inner)
                s.forms.append(layout.for_tokens(t).shared_mlp.overlap.value)
                outputs[name].append(np.asarray(jax.device_get(y), np.float32))
                if progress:
                    progress(f"{kind} {name} T={t}")
            del module, forward
        comparisons[kind] = Comparison(kind, what, series["replicated"], series["sharded"],
                                       _check_agreement(kind, tokens, outputs, dtype))
    first = devices[0]
    return BenchResult(cfg=cfg, source=source, scale=scale, platform=first.platform,
                       device_kind=first.device_kind, devices=n, simulated=simulated, dtype=dtype,
                       backend=backend, tokens=list(tokens), repeats=repeats, warmup=warmup,
                       min_sample_ms=min_sample_ms, comparisons=comparisons)


def _check_agreement(kind, tokens, outputs, dtype) -> list[float]:
    """max |sharded - replicated| / max |replicated| per token count; raises
    when the layouts disagree (or produce NaN / inf)."""
    diffs = []
    for t, a, b in zip(tokens, outputs["replicated"], outputs["sharded"], strict=True):
        if not (np.all(np.isfinite(a)) and np.all(np.isfinite(b))):
            raise RuntimeError(f"{kind}: non-finite output at T={t}")
        diff = float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(a))), 1e-30))
        if diff > TOLERANCE.get(dtype, 3e-2):
            raise RuntimeError(f"{kind}: sharded and replicated layouts disagree at T={t} "
                               f"(relative difference {diff:.3g})")
        diffs.append(diff)
    return diffs


__all__ = ["run_bench", "scale_config", "default_experts", "crossover_tokens", "time_call",
           "BenchResult", "Comparison", "Series", "DEFAULT_TOKENS", "BENCHMARKS", "LAYOUTS"]


# --------------------------------------------------------------------------
# Output files (written atomically: a failure leaves no half-written file)
# --------------------------------------------------------------------------
def plot_result(result: BenchResult, path: str) -> None:
    """PNG: latency vs global tokens (log x), replicated and sharded shared
    expert per benchmark panel, the crossover marked."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    comps = list(result.comparisons.values())
    fig, axes = plt.subplots(1, len(comps), figsize=(6.4 * len(comps), 4.8), squeeze=False)
    for ax, comp in zip(axes[0], comps, strict=True):
        for series, style in ((comp.replicated, "o-"), (comp.sharded, "s--")):
            ax.plot(result.tokens, series.median_ms, style, label=f"shared expert {series.layout}")
        cross = comp.crossover(result.tokens)
        if cross is not None:
            ax.axvline(cross, color="grey", linestyle=":", label=f"crossover T={cross}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(result.tokens, [str(t) for t in result.tokens])
        ax.set_xlabel("global tokens")
        ax.set_ylabel("median latency (ms)")
        ax.set_title(comp.what, fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"k3jax bench: {result.devices} {result.platform} device(s)"
                 f"{' (simulated)' if result.simulated else ''}, {result.dtype}, "
                 f"{result.source}, scale 1/{result.scale}", fontsize=10)
    fig.tight_layout()
    try:
        atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=110))
    finally:
        plt.close(fig)


__all__ += ["plot_result"]
