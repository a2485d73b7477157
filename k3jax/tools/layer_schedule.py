"""A two-resource schedule of one layer on one device: the SMs (compute ops,
one at a time) and the NVLink port (collectives, any number at once). It
turns a list of ops with dependencies into a predicted end time. A model's
prediction, not a measurement.

Rules, each an assumption stated here once:

  * compute: one op at a time, never preempted; when the SMs are free they
    take the first op, in ``order``, whose dependencies are done;
  * a collective starts as soon as its dependencies are done (XLA's async
    start), waits ``Link.latency_s``, then moves its wire bytes; collectives
    moving bytes at the same time share the link's bandwidth equally
    (processor sharing);
  * while any collective moves bytes, a compute op runs at ``1 - s`` of its
    speed, s = max(collective SMs / SMs, HBM bytes/s the collectives move /
    HBM copy rate): the collective's kernels take SMs from the GEMMs and its
    reads and writes take HBM bandwidth. A collective reads what it sends and
    writes what it receives (2 HBM bytes per wire byte; a reduce-scatter also
    reads the partial it adds to: 3). The larger figure among the collectives
    in flight applies (with processor sharing the link's total rate is the
    same however many there are).

An op is a compute op (``seconds``: its time alone on the GPU) or a collective
(``wire_bytes``: what this device sends; ``hbm_per_wire``). The layer ends
when every op is done.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from pallas_kernels.hardware import H200 as GPU

EPS_S = 1e-15


@dataclasses.dataclass(frozen=True)
class Link:
    """The device's link and what a collective in flight takes from compute."""

    bytes_per_s: float          # bus bandwidth of an all-gather / reduce-scatter
    latency_s: float            # fixed cost of one collective (or ring step)
    sm_share: float             # fraction of the SMs a collective occupies
    hbm_bytes_per_s: float      # HBM copy rate the collectives' reads / writes compete for

    def __post_init__(self) -> None:
        if not (self.bytes_per_s > 0 and self.hbm_bytes_per_s > 0 and self.latency_s >= 0
                and 0 <= self.sm_share < 1):
            raise ValueError(f"Link: rates must be > 0, latency >= 0, 0 <= sm_share < 1: {self}")

    def slowdown(self, hbm_per_wire: float) -> float:
        """s: the fraction of compute speed lost while collectives of this
        HBM-per-wire-byte figure move bytes."""
        return min(max(self.sm_share, hbm_per_wire * self.bytes_per_s / self.hbm_bytes_per_s), 0.99)


NVLINK = Link(bytes_per_s=GPU.nvlink_bus_bytes_per_s, latency_s=GPU.collective_latency_s,
              sm_share=GPU.collective_sms / GPU.num_sms, hbm_bytes_per_s=GPU.hbm_copy_bytes_per_s)
"""The H200's NVLink 4 as pallas_kernels.hardware.H200 describes it (NCCL's
measured bus bandwidth, not the data sheet's 450 GB/s)."""

ALL_GATHER_HBM, REDUCE_SCATTER_HBM, PERMUTE_HBM = 2.0, 3.0, 2.0


@dataclasses.dataclass(frozen=True)
class Op:
    """One op of the layer. Exactly one of ``seconds`` (compute) and
    ``wire_bytes`` (collective) is set; ``deps`` names ops that must finish first."""

    name: str
    deps: tuple[str, ...] = ()
    seconds: float | None = None
    wire_bytes: float | None = None
    hbm_per_wire: float = ALL_GATHER_HBM

    def __post_init__(self) -> None:
        if (self.seconds is None) == (self.wire_bytes is None):
            raise ValueError(f"Op {self.name!r}: set exactly one of seconds and wire_bytes")
        value = self.seconds if self.seconds is not None else self.wire_bytes
        if not value >= 0:
            raise ValueError(f"Op {self.name!r}: its cost must be >= 0, got {value!r}")

    @property
    def is_collective(self) -> bool:
        return self.wire_bytes is not None


def compute(name: str, seconds: float, *deps: str) -> Op:
    return Op(name, tuple(deps), seconds=seconds)


def collective(name: str, wire_bytes: float, *deps: str, hbm_per_wire: float = ALL_GATHER_HBM) -> Op:
    return Op(name, tuple(deps), wire_bytes=wire_bytes, hbm_per_wire=hbm_per_wire)


@dataclasses.dataclass(frozen=True)
class Schedule:
    """The schedule's outcome: each op's (start, end) in seconds from the layer's start."""

    end_s: float
    spans: dict[str, tuple[float, float]]
    compute_s: float            # the compute ops' times alone (no slowdown)
    wire_bytes: float

    @property
    def exposed_s(self) -> float:
        """What the collectives and their slowdown add to the compute alone."""
        return self.end_s - self.compute_s


def simulate(ops: Sequence[Op], link: Link = NVLINK) -> Schedule:
    """Run ``ops`` (in program order: the compute priority) by the module
    docstring's rules."""
    by_name = {op.name: op for op in ops}
    if len(by_name) != len(ops):
        raise ValueError("simulate: op names must be unique")
    for op in ops:
        missing = [d for d in op.deps if d not in by_name]
        if missing:
            raise ValueError(f"simulate: op {op.name!r} depends on unknown {missing}")
    done: dict[str, float] = {}
    start: dict[str, float] = {}
    waiting = list(ops)
    running_compute: list = []            # [op, remaining full-speed seconds]
    latency_left: dict[str, float] = {}   # collectives in their latency phase
    bytes_left: dict[str, float] = {}     # collectives moving bytes
    t = 0.0
    while waiting or running_compute or latency_left or bytes_left:
        ready = [op for op in waiting if all(d in done for d in op.deps)]
        for op in ready:
            if op.is_collective:
                waiting.remove(op)
                start[op.name] = t
                latency_left[op.name] = link.latency_s
        if not running_compute:
            first = next((op for op in ready if not op.is_collective), None)
            if first is not None:
                waiting.remove(first)
                start[first.name] = t
                running_compute = [first, first.seconds]
        if not (running_compute or latency_left or bytes_left):
            raise ValueError(f"simulate: ops {[op.name for op in waiting]} can never start "
                             "(a dependency cycle)")
        share = link.bytes_per_s / len(bytes_left) if bytes_left else 0.0
        rate = 1.0 - (link.slowdown(max(by_name[n].hbm_per_wire for n in bytes_left))
                      if bytes_left else 0.0)
        steps = [left for left in latency_left.values()]
        steps += [left / share for left in bytes_left.values()]
        if running_compute:
            steps.append(running_compute[1] / rate)
        dt = max(min(steps), 0.0)
        t += dt
        for name in list(bytes_left):
            bytes_left[name] -= dt * share
            if bytes_left[name] <= EPS_S * link.bytes_per_s:
                del bytes_left[name]
                done[name] = t
        for name in list(latency_left):
            latency_left[name] -= dt
            if latency_left[name] <= EPS_S:
                del latency_left[name]
                if by_name[name].wire_bytes > 0:
                    bytes_left[name] = by_name[name].wire_bytes
                else:
                    done[name] = t
        if running_compute:
            running_compute[1] -= dt * rate
            if running_compute[1] <= EPS_S:
                done[running_compute[0].name] = t
                running_compute = []
    return Schedule(end_s=t, spans={n: (start[n], done[n]) for n in by_name},
                    compute_s=sum(op.seconds for op in ops if not op.is_collective),
                    wire_bytes=sum(op.wire_bytes for op in ops if op.is_collective))


__all__ = ["ALL_GATHER_HBM", "NVLINK", "PERMUTE_HBM", "REDUCE_SCATTER_HBM", "Link", "Op",
           "Schedule", "collective", "compute", "simulate"]
