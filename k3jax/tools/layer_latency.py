"""A latency model of one K3 layer (the MoE layer, or the dense layer 0) on
the GPUs of one H200 node under sequence parallelism, for each form of its
shared expert (dense layer: its MLP). A model's prediction, not a
measurement: every figure it gives is labelled as such.

Layout modelled (k3jax.layout, modules.moe): SP + EP over n = dp x tp
devices, T global tokens padded to a multiple of n, R = T / n own rows a
device, D hidden, L latent, E experts, K top-k, I the expert width, F the
MLP width (shared: I x num_shared; dense: intermediate_size). Ops of the MoE
layer, in program order (the routed scope, then the shared one):

    router         [R, D] @ [D, E], float32 logits               roofline
    lat_down       [R, D] @ [D, L]                               roofline
    routed.ag      all-gather over n of lat [R, L] bf16 + ids, weights [R, K]
                   int32 / float32: (n - 1) R (2L + 8K) wire bytes
    routed.in      the gather of every pair's row: P = nRK rows of L, bf16
                   read + written (HBM only)
    routed.gate_up grouped SiTU-GLU, [P, L] -> [P, I] over E / n experts
    routed.down    grouped [P, I] -> [P, L]; both kernel_cost.launch_cost's
                   predicted times (the launcher's kernel and tiles) on the
                   balanced routing: the device's RK pairs spread evenly over
                   its experts
    routed.out     the pairs' bf16 rows read and scattered into float32 sums
                   (P L (2 + 4) HBM bytes)
    routed.rs      reduce-scatter over n of the float32 latent: (n - 1) R L 4
    lat_up         RMSNorm (R L (4 + 2) bytes) + [R, L] @ [L, D]  roofline

The shared expert (bf16 weights, s = scatter bytes: 4 float32, 2 bfloat16):

    replicated  up [R, D] -> [R, F] (gate and up, SiTU fused) and down
                [R, F] -> [R, D] with the full weights; no collective
    none        all-gather rows over tp ((tp - 1) R D 2 wire bytes), up and
                down on tp R rows with the F / tp shard (down writes s-byte
                partials), reduce-scatter ((tp - 1) R D s)
    ring        up of the own block, then tp - 1 steps, each one up and one
                down of an R-row block under one collective-permute of an
                [R, D] bf16 block + an [R, D] s-byte running sum (XLA's
                combiner sends both in one permute, as in the compiled
                8 x H200 schedule), each step starting when the previous
                step's compute and transfer are both done; then the last down
    weights     all-gather of the gate/up and of the down shards over tp
                ((tp - 1) / tp of 2 D F 2 and of F D 2 bytes, in the weight
                dtype), neither depending on x: both start at the layer's
                start; then the replicated MLP on own rows

A roofline matmul takes the longer of its FLOPs at the dense bf16 rate and
its HBM bytes at the copy rate (k3jax.tools.kernel_cost.roofline_s). The ops
run on the two-resource schedule of k3jax.tools.layer_schedule (compute one op
at a time, collectives async sharing the link, a collective in flight taking
SMs and HBM bandwidth from the compute under it); the MoE layer takes the
better of two program orders (routed scope first, or shared scope first).
Rates: pallas_kernels.hardware.H200 (``hardware()`` lists them with sources).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math

import numpy as np

from k3jax.config import K3Config
from k3jax.layout import ParallelConfig, SharedOverlap, make_layout
from k3jax.tools import kernel_cost
from k3jax.tools.layer_schedule import (
    NVLINK,
    PERMUTE_HBM,
    REDUCE_SCATTER_HBM,
    Link,
    Op,
    Schedule,
    collective,
    compute,
    simulate,
)
from pallas_kernels.hardware import H200 as GPU

BF16 = 2
SCATTER_BYTES = {"float32": 4, "bfloat16": 2}
TIE_REL = 0.01
"""A bf16 scatter is picked over the float32 one only when the model says it
is more than this much faster: the model is not finer than about a percent,
and the bf16 sum differs from the float32 one by about 1e-2."""


class Form(enum.Enum):
    """The shared expert's (dense MLP's) forms under sequence parallelism;
    the values are SharedOverlap's (replicated: the unsharded layout)."""

    REPLICATED = "replicated"
    NONE = "none"
    RING = "ring"
    WEIGHTS = "weights"

    @property
    def token_side(self) -> bool:
        """Does this form move token rows (and so have a scatter dtype)?"""
        return self in (Form.NONE, Form.RING)


LAYERS = ("moe", "dense")
CHOICES: tuple[tuple[Form, str | None], ...] = (
    (Form.NONE, "float32"), (Form.NONE, "bfloat16"), (Form.RING, "float32"),
    (Form.RING, "bfloat16"), (Form.WEIGHTS, None))
"""What ``auto`` chooses among: (form, scatter dtype; None for weights)."""


def check_layout(cfg: K3Config, tp: int, dp: int, tokens: int) -> None:
    """ValueError naming the culprit unless the model covers this layout:
    tokens >= 1, tp >= 2 dividing the hidden size and both MLP widths, dp x tp
    GPUs on one node, dividing the expert count (EP)."""
    if tokens < 1:
        raise ValueError(f"token count must be >= 1, got {tokens}")
    if tp < 2:
        raise ValueError(f"tp must be >= 2 (sequence parallelism splits rows over it), got {tp}")
    if dp < 1:
        raise ValueError(f"dp must be >= 1, got {dp}")
    for what, width in (("the shared expert's MLP width", cfg.shared_intermediate_size),
                        ("the dense MLP width", cfg.intermediate_size),
                        ("the hidden size", cfg.hidden_size)):
        if width % tp:
            raise ValueError(f"tp {tp} does not divide {what} {width}")
    if dp * tp > GPU.gpus_per_node:
        raise ValueError(f"dp x tp = {dp * tp} GPUs: the model covers one node of "
                         f"{GPU.gpus_per_node}")
    if cfg.num_experts % (dp * tp):
        raise ValueError(f"dp x tp = {dp * tp} does not divide the {cfg.num_experts} experts (EP)")


def _matmul_s(m: int, k: int, n: int, out_bytes: float = BF16) -> float:
    """Roofline of [m, k] bf16 @ [k, n] bf16 -> [m, n] of ``out_bytes`` each."""
    return kernel_cost.roofline_s(2.0 * m * k * n, BF16 * (m * k + k * n) + out_bytes * m * n)


def _mlp_up_s(rows: int, d: int, f: int) -> float:
    """Gate and up [rows, d] @ [d, f] each, SiTU fused: writes h [rows, f] bf16."""
    return kernel_cost.roofline_s(2.0 * rows * d * 2 * f, BF16 * (rows * d + 2 * d * f + rows * f))


def _bytes_s(nbytes: float) -> float:
    return nbytes / GPU.hbm_copy_bytes_per_s


def mlp_ops(form: Form, rows: int, tp: int, d: int, f: int, scatter: str | None,
            prefix: str) -> list[Op]:
    """The ops of one MLP (width f) in ``form`` for ``rows`` own rows a device
    (module docstring), names prefixed with ``prefix``."""
    if form.token_side and scatter not in SCATTER_BYTES:
        raise ValueError(f"form {form.value} needs a scatter dtype in {sorted(SCATTER_BYTES)}, "
                         f"got {scatter!r}")
    n = prefix
    if form is Form.REPLICATED:
        return [compute(n + "up", _mlp_up_s(rows, d, f)),
                compute(n + "down", _matmul_s(rows, f, d), n + "up")]
    if form is Form.WEIGHTS:
        frac = (tp - 1) / tp
        return [collective(n + "ag_gate_up", frac * 2 * d * f * BF16),
                collective(n + "ag_down", frac * f * d * BF16),
                compute(n + "up", _mlp_up_s(rows, d, f), n + "ag_gate_up"),
                compute(n + "down", _matmul_s(rows, f, d), n + "up", n + "ag_down")]
    s, fs = SCATTER_BYTES[scatter], f // tp
    if form is Form.NONE:
        return [collective(n + "ag", (tp - 1) * rows * d * BF16),
                compute(n + "up", _mlp_up_s(tp * rows, d, fs), n + "ag"),
                compute(n + "down", _matmul_s(tp * rows, fs, d, s), n + "up"),
                collective(n + "rs", (tp - 1) * rows * d * s, n + "down",
                           hbm_per_wire=REDUCE_SCATTER_HBM)]
    step_s = _mlp_up_s(rows, d, fs) + _matmul_s(rows, fs, d, s)
    ops = [compute(n + "up0", _mlp_up_s(rows, d, fs))]
    before = (n + "up0",)
    for step in range(1, tp):
        ops += [collective(f"{n}permute{step}", rows * d * (BF16 + s), *before,
                           hbm_per_wire=PERMUTE_HBM),
                compute(f"{n}step{step}", step_s, *before)]
        before = (f"{n}permute{step}", f"{n}step{step}")
    return ops + [compute(n + "down_last", _matmul_s(rows, fs, d, s), *before)]


@functools.lru_cache(maxsize=512)
def routed_gemm_s(cfg: K3Config, rows: int, n: int) -> tuple[float, float]:
    """(gate/up, down) seconds: k3jax.tools.kernel_cost's predicted times of the
    two grouped launches on one device for ``rows`` own rows a device, n EP
    devices, the balanced routing (module docstring)."""
    L, I, K = cfg.routed_expert_hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_token
    local = cfg.num_experts // n
    pairs = n * rows * K
    held = rows * K
    sizes = np.full(local, held // local, np.int32)
    sizes[:held % local] += 1
    gate_up = kernel_cost.launch_cost(sizes, pairs, L, I, 2)
    down = kernel_cost.launch_cost(sizes, pairs, I, L, 1)
    return gate_up.predicted_us * 1e-6, down.predicted_us * 1e-6


def routed_ops(cfg: K3Config, rows: int, n: int) -> list[Op]:
    """The MoE layer's own ops (module docstring), EP over n devices."""
    D, L, E, K = (cfg.hidden_size, cfg.routed_expert_hidden_size, cfg.num_experts,
                  cfg.num_experts_per_token)
    pairs = n * rows * K
    gate_up_s, down_s = routed_gemm_s(cfg, rows, n)
    return [compute("router", _matmul_s(rows, D, E, 4)),
            compute("lat_down", _matmul_s(rows, D, L)),
            collective("routed.ag", (n - 1) * rows * (L * BF16 + 8 * K), "router", "lat_down"),
            compute("routed.in", _bytes_s(pairs * L * BF16 * 2), "routed.ag"),
            compute("routed.gate_up", gate_up_s, "routed.in"),
            compute("routed.down", down_s, "routed.gate_up"),
            compute("routed.out", _bytes_s(pairs * L * (BF16 + 4)), "routed.down"),
            collective("routed.rs", (n - 1) * rows * L * 4, "routed.out",
                       hbm_per_wire=REDUCE_SCATTER_HBM),
            compute("lat_up", _bytes_s(rows * L * 6) + _matmul_s(rows, L, D), "routed.rs")]


@dataclasses.dataclass(frozen=True)
class LayerEstimate:
    """The model's prediction for one layer on one device (seconds)."""

    layer: str
    tp: int
    dp: int
    tokens: int
    form: Form
    scatter_dtype: str | None
    schedule: Schedule

    @property
    def layer_s(self) -> float:
        return self.schedule.end_s


def layer_latency(cfg: K3Config, tokens: int, tp: int, dp: int, form: Form,
                  scatter_dtype: str | None = None, *, layer: str = "moe",
                  link: Link = NVLINK) -> LayerEstimate:
    """The model's latency of one layer (``layer`` "moe" or "dense") for
    ``tokens`` global tokens, SP + EP over dp x tp GPUs of one node, the
    shared expert (dense: the MLP) in ``form`` with ``scatter_dtype``
    (token-side forms only)."""
    check_layout(cfg, tp, dp, tokens)
    if layer not in LAYERS:
        raise ValueError(f"layer must be one of {LAYERS}, got {layer!r}")
    if not form.token_side:
        scatter_dtype = None
    n = dp * tp
    rows = math.ceil(tokens / n)
    if layer == "dense":
        ops = mlp_ops(form, rows, tp, cfg.hidden_size, cfg.intermediate_size, scatter_dtype, "")
        return LayerEstimate(layer, tp, dp, tokens, form, scatter_dtype, simulate(ops, link))
    routed = routed_ops(cfg, rows, n)
    shared = mlp_ops(form, rows, tp, cfg.hidden_size, cfg.shared_intermediate_size,
                     scatter_dtype, "shared.")
    # The shared expert's first ops issued at the layer's start, or after the
    # routed dispatch (its collectives then do not share the link with it).
    later = [dataclasses.replace(op, deps=op.deps or ("routed.ag",)) for op in shared]
    programs = (routed + shared, shared + routed, routed + later, later + routed)
    best = min((simulate(ops, link) for ops in programs), key=lambda s: s.end_s)
    return LayerEstimate(layer, tp, dp, tokens, form, scatter_dtype, best)


def module_schedule(cfg: K3Config, tokens: int, tp: int, form: Form,
                    scatter_dtype: str | None = "float32", *, link: Link = NVLINK,
                    intermediate: int | None = None) -> Schedule:
    """The model's schedule of the shared expert alone (width
    ``cfg.shared_intermediate_size``, or ``intermediate``), SP over tp
    devices, with no routed work to overlap: ``none`` runs gather, matmuls
    and scatter one after another. What vLLM measured (VLLM_POINTS)."""
    check_layout(cfg, tp, 1, tokens)
    rows = math.ceil(tokens / tp)
    ops = mlp_ops(form, rows, tp, cfg.hidden_size, intermediate or cfg.shared_intermediate_size,
                  scatter_dtype if form.token_side else None, "")
    return simulate(ops, link)


def module_latency(cfg: K3Config, tokens: int, tp: int, form: Form,
                   scatter_dtype: str | None = "float32", *, link: Link = NVLINK) -> float:
    """module_schedule's end: seconds for one shared-expert forward (a model's prediction)."""
    return module_schedule(cfg, tokens, tp, form, scatter_dtype, link=link).end_s


def mlp_flops(rows: int, d: int, f: int) -> float:
    """Matmul FLOPs a device does for ``rows`` own rows through an MLP of width
    f, in every form (replicated: rows x the whole MLP; sharded: tp x rows x
    1/tp of it)."""
    return 6.0 * rows * d * f


def eligible_choices(cfg: K3Config, tp: int, dp: int, layer: str = "moe"
                     ) -> tuple[tuple[Form, str | None], ...]:
    """The CHOICES ``auto`` may pick for (tp, dp): in the MoE layer only the
    forms whose compiled H200 schedule keeps the shared expert's collectives
    under routed work (``Layout.shared_overlaps_routed`` of the SP + EP
    layout with that form; SharedOverlap.NONE at dp > 1 is not). The dense
    layer has no routed work to hide under: every choice."""
    if layer == "dense":
        return CHOICES
    keep = []
    for form, scatter in CHOICES:
        parallel = ParallelConfig(dp=dp, tp=tp, sequence_parallel=True, expert_parallel=True,
                                  shard_shared_expert=True, shared_overlap=SharedOverlap(form.value))
        if make_layout(cfg, parallel).shared_overlaps_routed:
            keep.append((form, scatter))
    return tuple(keep)


def auto_choice(estimates: dict[tuple[Form, str | None], float],
                choices: tuple[tuple[Form, str | None], ...] = CHOICES) -> tuple[Form, str | None]:
    """The fastest of ``choices`` by their layer seconds; a bf16 scatter must
    beat the others by more than TIE_REL (ties go to the float32 scatter)."""
    def key(choice):
        form, scatter = choice
        return estimates[choice] * (1 + TIE_REL if scatter == "bfloat16" else 1.0)
    return min(choices, key=key)


@dataclasses.dataclass(frozen=True)
class AutoRow:
    layer: str
    tp: int
    dp: int
    tokens: int
    form: Form
    scatter_dtype: str | None
    layer_s: float
    replicated_s: float

    @property
    def ratio(self) -> float:
        return self.layer_s / self.replicated_s


def sweep(cfg: K3Config, tp: int, dp: int, tokens: int, *, layer: str = "moe",
          link: Link = NVLINK) -> tuple[list[LayerEstimate], AutoRow]:
    """Every form (each token-side one with both scatter dtypes) and the auto
    pick among the eligible ones (``eligible_choices``)."""
    ests = [layer_latency(cfg, tokens, tp, dp, Form.REPLICATED, layer=layer, link=link)]
    ests += [layer_latency(cfg, tokens, tp, dp, f, s, layer=layer, link=link) for f, s in CHOICES]
    by_choice = {(e.form, e.scatter_dtype): e.layer_s for e in ests[1:]}
    form, scatter = auto_choice(by_choice, eligible_choices(cfg, tp, dp, layer))
    return ests, AutoRow(layer, tp, dp, tokens, form, scatter, by_choice[(form, scatter)],
                         ests[0].layer_s)


# vLLM's measurement of its TP-sharded shared expert against the replicated
# one at tp 4 (docs/spec.md section 6, vLLM PR 50912): (global tokens, lowest
# and highest change in percent). The small-token figure is a range over the
# small counts.
VLLM_POINTS = ((8, -39.0, -14.0), (32, -39.0, -14.0), (128, -39.0, -14.0), (256, 10.0, 10.0),
               (512, 30.0, 30.0), (1024, 75.0, 75.0), (2048, 135.0, 135.0))
VLLM_TP = 4
MODULE_ERROR_PP = 55.0
"""The largest distance, in percentage points, between the module model's
change (none, float32 scatter, nothing overlapped, against replicated) and
vLLM's published range at any of VLLM_POINTS (vllm_validation)."""


def vllm_validation(cfg: K3Config, link: Link = NVLINK) -> list[dict]:
    """Per VLLM_POINTS row: the module model's change in percent (a model's
    prediction), vLLM's published range and the error in percentage points
    (0 inside the range)."""
    out = []
    for tokens, lo, hi in VLLM_POINTS:
        rep = module_latency(cfg, tokens, VLLM_TP, Form.REPLICATED, link=link)
        none = module_latency(cfg, tokens, VLLM_TP, Form.NONE, "float32", link=link)
        pct = 100.0 * (none / rep - 1.0)
        err = max(lo - pct, pct - hi, 0.0)
        out.append({"tokens": tokens, "predicted_pct": pct, "vllm_low_pct": lo,
                    "vllm_high_pct": hi, "error_pp": err})
    return out


def hardware(link: Link = NVLINK) -> dict:
    """The model's constants with their sources (the --json "hardware" object)."""
    figures = {"dense_bf16_flops_per_s": GPU.dense_bf16_flops_per_s,
               "hbm_copy_bytes_per_s": GPU.hbm_copy_bytes_per_s,
               "nvlink_bus_bytes_per_s": GPU.nvlink_bus_bytes_per_s,
               "collective_latency_s": GPU.collective_latency_s,
               "collective_sms": GPU.collective_sms, "num_sms": GPU.num_sms,
               "gpus_per_node": GPU.gpus_per_node}
    sources = {k: GPU.sources.get(k, GPU.sources["chip"]) for k in figures}
    return {"name": GPU.name, **figures, "sources": sources,
            "collective_slowdown": {
                "all_gather": link.slowdown(2.0), "reduce_scatter": link.slowdown(3.0),
                "rule": "an op under a collective runs at 1 - s of its speed, s = max(collective "
                        "SMs / SMs, HBM bytes per wire byte x link rate / HBM copy rate); 2 HBM "
                        "bytes per wire byte (all-gather, permute), 3 (reduce-scatter)"},
            "routed_gemms": "k3jax.tools.kernel_cost.launch_cost predicted times (a model)",
            "tie_rel": TIE_REL}


__all__ = ["CHOICES", "LAYERS", "MODULE_ERROR_PP", "SCATTER_BYTES", "TIE_REL", "VLLM_POINTS",
           "VLLM_TP", "AutoRow", "Form", "LayerEstimate", "auto_choice", "check_layout",
           "eligible_choices",
           "hardware", "layer_latency", "mlp_flops", "mlp_ops", "module_latency",
           "module_schedule", "routed_gemm_s", "routed_ops", "sweep", "vllm_validation"]
