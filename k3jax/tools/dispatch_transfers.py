"""The collectives of the dispatch latency model (k3jax.tools.dispatch_latency):
the links, NCCL's latency rule, and ``Transfer``, one collective with the
bytes it moves and what XLA's implementation for its group costs
(k3jax.tools.ragged_xla). A model, not a measurement."""

from __future__ import annotations

import dataclasses

from k3jax.tools import ragged_xla as rx
from k3jax.tools.layer_schedule import ALL_GATHER_HBM, NVLINK, Link, Op, collective
from pallas_kernels.hardware import H200 as GPU

INFINIBAND = Link(bytes_per_s=GPU.ib_bus_bytes_per_s, latency_s=GPU.ib_step_latency_s,
                  sm_share=GPU.collective_sms / GPU.num_sms, hbm_bytes_per_s=GPU.hbm_copy_bytes_per_s)
"""One GPU's InfiniBand NIC (ConnectX-7, NDR 400 Gb/s) as NCCL drives it;
``latency_s``: one inter-node step of a ring."""
NICS_PER_GPU = GPU.nics_per_node // GPU.gpus_per_node
SCHEDULE_LINK = dataclasses.replace(NVLINK, latency_s=0.0)
"""The link k3jax.tools.layer_schedule runs the transfers on: each Transfer's
own latency is part of its time (``Transfer.op``)."""
RING, DIRECT = "ring", "direct"


def latency_s(pattern: str, ranks: int, nodes: int) -> float:
    """NCCL's LL-protocol latency of one collective over ``ranks`` devices on
    ``nodes`` nodes (module docstring): a ring of ranks - 1 steps, nodes - 1
    of them between nodes; a direct exchange (all-to-all) one step."""
    if nodes < 1 or ranks < nodes or ranks % nodes:
        raise ValueError(f"latency_s: {ranks} ranks cannot spread evenly over {nodes} nodes")
    inter_step = GPU.ib_lone_step_latency_s if ranks == nodes else INFINIBAND.latency_s
    if pattern == DIRECT:
        return GPU.ring_base_latency_s + (inter_step if nodes > 1 else GPU.nvlink_step_latency_s)
    if pattern != RING:
        raise ValueError(f"latency_s: pattern must be {RING!r} or {DIRECT!r}, got {pattern!r}")
    inter = nodes - 1
    step = GPU.nvlink_step_latency_s if nodes == 1 else max(GPU.nvlink_step_latency_s,
                                                            GPU.net_step_floor_s)
    return GPU.ring_base_latency_s + (ranks - 1 - inter) * step + inter * inter_step


@dataclasses.dataclass(frozen=True)
class Transfer:
    """One collective of a form: the expected bytes this device sends on
    each link, the devices and nodes it spans, its HBM bytes per wire byte."""

    name: str
    kind: str                   # "all-gather" | "reduce-scatter" | "ragged-all-to-all"
    nvlink_bytes: float
    ib_bytes: float
    ranks: int
    nodes: int
    hbm_per_wire: float = ALL_GATHER_HBM

    @property
    def path(self) -> str | None:
        """A ragged all-to-all's XLA implementation (k3jax.tools.ragged_xla)."""
        return rx.ragged_path(self.ranks, self.nodes) if self.kind == "ragged-all-to-all" else None

    @property
    def meta_s(self) -> float:
        """The NCCL path's host work before any row moves (rx.nccl_host_s)."""
        if self.path != rx.NCCL_FALLBACK:
            return 0.0
        return rx.nccl_host_s(latency_s(DIRECT, self.ranks, self.nodes))

    @property
    def latency_s(self) -> float:
        """NCCL's latency (module docstring), plus the NCCL path's per-peer cost."""
        own = latency_s(DIRECT if self.kind == "ragged-all-to-all" else RING, self.ranks,
                        self.nodes)
        return own + (rx.nccl_peer_s(self.ranks) if self.path == rx.NCCL_FALLBACK else 0.0)

    @property
    def wire_s(self) -> float:
        """Moving the bytes alone: both links at once, the slower one decides."""
        return max(self.nvlink_bytes / NVLINK.bytes_per_s, self.ib_bytes / INFINIBAND.bytes_per_s)

    @property
    def seconds(self) -> float:
        """Alone on an idle GPU: the NCCL path's host work, latency, then the bytes."""
        return self.meta_s + self.latency_s + self.wire_s

    def op(self, *deps: str) -> Op:
        """This transfer's rows on SCHEDULE_LINK: latency + bytes as
        NVLink-rate bytes, with the HBM bytes per second it really moves (so
        the slowdown rule sees the right rate; compute under its latency runs
        slowed too, a small pessimism)."""
        wire = (self.latency_s + self.wire_s) * SCHEDULE_LINK.bytes_per_s
        moved = self.nvlink_bytes + self.ib_bytes
        return collective(self.name, wire, *deps, hbm_per_wire=self.hbm_per_wire * moved / wire)

    def ops(self, *deps: str) -> list[Op]:
        """``op`` after, on the NCCL path, its host work (``{name}.meta``, a
        link op that moves nothing: compute under it slows by the collective's
        SM share only); the host is blocked until it ends."""
        if not self.meta_s:
            return [self.op(*deps)]
        meta = collective(f"{self.name}{rx.META}", self.meta_s * SCHEDULE_LINK.bytes_per_s, *deps,
                          hbm_per_wire=0.0)
        return [meta, self.op(meta.name)]


__all__ = ["DIRECT", "INFINIBAND", "NICS_PER_GPU", "RING", "SCHEDULE_LINK", "Transfer", "latency_s"]
