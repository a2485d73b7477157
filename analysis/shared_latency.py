"""A latency model of the shared expert (or dense MLP) under sequence
parallelism on one node: replicated, sharded (one all-gather + one
reduce-scatter, SharedOverlap.NONE) and sharded as overlapped rings
(SharedOverlap.RING). A model, not a measurement: multi-GPU timings are not
measured in this project.

Each matmul takes the longer of its FLOPs at the dense bf16 rate and its HBM
bytes (weights, input, output) at the copy rate (a roofline per kernel;
elementwise epilogues such as SiTU are folded into the matmul). A transfer
of b bytes to a neighbour takes ``latency + b / link``; a ring all-gather or
reduce-scatter over tp devices moves (tp - 1) / tp of its buffer. Per device,
with R = ceil(T / tp) rows, D hidden, F the MLP width (bf16 activations, the
float32 partial sums k3jax reduces):

    replicated   up(R, D -> 2F) + down(R, F -> D); no communication
    sharded      up(tp R, D -> 2F/tp) + down(tp R, F/tp -> D, float32 out)
                 + all-gather [tp R, D] bf16 + reduce-scatter [tp R, D] float32,
                 nothing overlapped (the compiled 8 x H200 schedule of the dense
                 layer runs both synchronously: tests/test_overlap.py)
    ring         the two rings interleaved, as in the compiled 8 x H200
                 schedule (XLA's combiner sends a row block and a running sum
                 in one collective-permute): up(R, D -> 2F/tp) of the own
                 block, then tp - 1 steps that each run one up and one
                 down(R, F/tp -> D, float32 out) under one transfer of an [R, D]
                 bf16 block + an [R, D] float32 sum, each step costing the
                 longer of the two, then the last down. Each block's matmul
                 reads the weight shard again (the model charges HBM for it;
                 L2, 50 MB on an H200, may hold a shard between steps).

``exposed_comm_s`` is the time not covered by matmuls: total minus compute.
"""

from __future__ import annotations

import dataclasses
import enum
import math

from k3jax.config import K3Config
from pallas_kernels.hardware import H200 as GPU


@dataclasses.dataclass(frozen=True)
class Hardware:
    """One GPU of a node and its link to the others (H200: the rates of
    pallas_kernels.hardware.H200)."""

    name: str
    matmul_flops_per_s: float       # dense bf16 matmul rate
    hbm_bytes_per_s: float          # HBM copy rate
    link_bytes_per_s: float         # to the other GPUs, one direction
    collective_latency_s: float     # fixed cost of one collective or one ring step
    sources: str

    def __post_init__(self) -> None:
        for field in ("matmul_flops_per_s", "hbm_bytes_per_s", "link_bytes_per_s"):
            if not getattr(self, field) > 0:
                raise ValueError(f"Hardware.{field} must be > 0, got {getattr(self, field)!r}")
        if not self.collective_latency_s >= 0:
            raise ValueError(f"Hardware.collective_latency_s must be >= 0, "
                             f"got {self.collective_latency_s!r}")


H200 = Hardware(
    name=f"{GPU.name}, 8 per NVLink node",
    matmul_flops_per_s=GPU.dense_bf16_flops_per_s,
    hbm_bytes_per_s=GPU.hbm_copy_bytes_per_s,
    link_bytes_per_s=GPU.nvlink_peak_bytes_per_s,
    collective_latency_s=GPU.collective_latency_s,
    sources="; ".join(f"{key}: {GPU.sources[key]}" for key in (
        "dense_bf16_flops_per_s", "hbm_copy_bytes_per_s", "nvlink_peak_bytes_per_s",
        "collective_latency_s")),
)


class SharedForm(enum.Enum):
    """The three placements the model compares."""

    REPLICATED = "replicated"
    SHARDED = "sharded"              # SharedOverlap.NONE
    RING = "sharded+ring"            # SharedOverlap.RING


@dataclasses.dataclass(frozen=True)
class Estimate:
    """One shared-expert forward (one layer) on one device, in seconds."""

    form: SharedForm
    tokens: int
    tp: int
    flops: float                # matmul FLOPs per device
    hbm_bytes: float            # bytes the matmuls read and write per device
    wire_bytes: float           # bytes this device sends
    compute_s: float            # the matmuls alone
    total_s: float

    @property
    def exposed_comm_s(self) -> float:
        return self.total_s - self.compute_s


def _matmul(m: int, k: int, n: int, out_bytes: int, hw: Hardware) -> tuple[float, float, float]:
    """(FLOPs, HBM bytes, seconds) of [m, k] bf16 @ [k, n] bf16 -> [m, n] (``out_bytes`` each)."""
    flops = 2.0 * m * k * n
    nbytes = 2.0 * (k * n + m * k) + float(out_bytes) * m * n
    return flops, nbytes, max(flops / hw.matmul_flops_per_s, nbytes / hw.hbm_bytes_per_s)


def estimate(cfg: K3Config, tokens: int, tp: int, form: SharedForm, hw: Hardware = H200, *,
             intermediate: int | None = None) -> Estimate:
    """The model's latency of the shared expert (width ``cfg.shared_intermediate_size``,
    or ``intermediate``: e.g. the dense layer 0's) for ``tokens`` global tokens
    under sequence parallelism over ``tp`` devices."""
    if tokens < 1 or tp < 1:
        raise ValueError(f"tokens and tp must be >= 1, got tokens={tokens}, tp={tp}")
    D = cfg.hidden_size
    F = intermediate or cfg.shared_intermediate_size
    if form is not SharedForm.REPLICATED and (F % tp or tp == 1):
        raise ValueError(f"a sharded MLP needs tp > 1 dividing its width {F}, got tp={tp}")
    R = math.ceil(tokens / tp)
    if form is SharedForm.REPLICATED:
        parts = [_matmul(R, D, 2 * F, 2, hw), _matmul(R, F, D, 2, hw)]
        compute = sum(p[2] for p in parts)
        return Estimate(form, tokens, tp, sum(p[0] for p in parts), sum(p[1] for p in parts), 0.0,
                        compute, compute)
    Fs = F // tp
    link, lat = hw.link_bytes_per_s, hw.collective_latency_s
    block_in, block_sum = R * D * 2, R * D * 4          # one ring block: bf16 rows, float32 sums
    wire = (tp - 1) * (block_in + block_sum)
    if form is SharedForm.SHARDED:
        parts = [_matmul(tp * R, D, 2 * Fs, 2, hw), _matmul(tp * R, Fs, D, 4, hw)]
        compute = sum(p[2] for p in parts)
        comm = 2 * lat + wire / link
        return Estimate(form, tokens, tp, sum(p[0] for p in parts), sum(p[1] for p in parts), wire,
                        compute, compute + comm)
    up, down = _matmul(R, D, 2 * Fs, 2, hw), _matmul(R, Fs, D, 4, hw)
    step = max(up[2] + down[2], lat + (block_in + block_sum) / link)
    return Estimate(form, tokens, tp, tp * (up[0] + down[0]), tp * (up[1] + down[1]), wire,
                    tp * (up[2] + down[2]), up[2] + (tp - 1) * step + down[2])


def sweep(cfg: K3Config, tokens: list[int], tp: int, hw: Hardware = H200,
          **kw) -> dict[SharedForm, list[Estimate]]:
    """``estimate`` for every form at every token count."""
    return {form: [estimate(cfg, t, tp, form, hw, **kw) for t in tokens] for form in SharedForm}


__all__ = ["H200", "Estimate", "Hardware", "SharedForm", "estimate", "sweep"]
