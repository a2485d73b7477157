"""Which implementation XLA's GPU ragged-all-to-all runs for a group, and what
the dispatch latency model (k3jax.tools.dispatch_latency) charges for it.

Read in XLA's xla/backends/gpu/runtime/ragged_all_to_all_thunk.cc
(RunCollective) and checked against the binary jaxlib 0.11.2 ships
(jax-cuda13-plugin 0.11.2, xla_cuda_plugin.so); docs/latency.md gives the
revisions and what could not be confirmed. In order, a group gets:

  1. the device-initiated NCCL kernel (LSA inside an NVLink domain, GIN
     across it), only with xla_gpu_experimental_ragged_all_to_all_use_device_kernel
     (default false) and symmetric buffers;
  2. the one-shot kernel: every peer on this host (``is_local``), peer
     access, at most ONE_SHOT_MAX_PEERS outputs; the multi-GPU barrier
     variant with NCCL (default on) also where the NVLink (LSA) domain spans
     the whole group;
  3. otherwise the per-peer NCCL path: an all-to-all of the output offsets
     (per-peer send / recv), the host blocked until it ends, a device-to-host
     copy of the four offset / size arrays, the host blocked again, then one
     grouped send / recv for every (update, peer) slot. In the jaxlib 0.11.2
     build this path runs only with
     xla_gpu_allow_ragged_all_to_all_nccl_send_recv_fallback=true (default
     false: "RaggedAllToAll fallback to NCCL is not allowed").

So inside one 8-GPU node k3jax's stage B gets the one-shot kernel, and its
stage A (one device a node, peers on different nodes over InfiniBand) gets
the NCCL path. The model charges that path (``ragged_path``,
``nccl_host_s``, ``nccl_peer_s``) and makes the host block visible to the
schedule (``host_ordered``).
"""

from __future__ import annotations

import dataclasses

from k3jax.tools.layer_schedule import Op

ONE_SHOT, NCCL_FALLBACK = "one-shot", "nccl-fallback"
ONE_SHOT_MAX_PEERS = 8
"""The one-shot kernel holds at most 8 output pointers (the binary's
RaggedAllToAllKernelImpl takes a std::array<void*, 8>)."""
HOST_ROUND_TRIP_S = 6e-6
"""One small device-to-host copy, or one host synchronisation, seen from the
host: 5-7 us a cudaMemcpyAsync call (DualPath, arXiv 2602.21548, section
5.2); a stream synchronisation taken as the same (an assumption)."""
METADATA_COPIES, HOST_SYNCS = 4, 2
"""The NCCL path copies the four offset / size arrays to the host and blocks
the host twice (LoadRaggedTensorMetadata, RunAllToAllOnIndexBuffer)."""
FALLBACK_PER_PEER_S = 12e-6
"""The NCCL path's cost per (update, peer) slot, even an empty one: about
12 us (openxla/xla#46982, A100, jax 0.10.0). k3jax's stages send one update
a peer."""
META = ".meta"
"""The suffix of the schedule op that stands for the NCCL path's host work."""

SOURCES = {
    "one_shot_max_peers": "XLA GPU RaggedAllToAllKernelImpl (std::array<void*, 8> of outputs) in "
                          "jax-cuda13-plugin 0.11.2's xla_cuda_plugin.so; ragged_all_to_all_thunk.cc "
                          "IsOneShotKernelSupported / is_local (docs/latency.md)",
    "host_round_trip_s": "5-7 us per cudaMemcpyAsync call (DualPath, arXiv 2602.21548, section 5.2); "
                         "a stream synchronisation assumed the same",
    "metadata_copies": "ragged_all_to_all_thunk.cc LoadRaggedTensorMetadata (4 arrays copied, then "
                       "BlockHostUntilDone)",
    "host_syncs": "ragged_all_to_all_thunk.cc RunAllToAllOnIndexBuffer and "
                  "LoadRaggedTensorMetadata (BlockHostUntilDone each)",
    "fallback_per_peer_s": "about 12 us per (update, peer) slot of the NCCL path, empty or not "
                           "(openxla/xla#46982, A100, jax 0.10.0)",
}


def ragged_path(ranks: int, nodes: int) -> str:
    """The implementation a group of ``ranks`` devices on ``nodes`` nodes
    (H200 nodes: one NVLink domain each) runs with XLA's defaults: the
    one-shot kernel inside one node for up to ONE_SHOT_MAX_PEERS peers, else
    the NCCL path."""
    return ONE_SHOT if nodes == 1 and ranks <= ONE_SHOT_MAX_PEERS else NCCL_FALLBACK


def nccl_host_s(offsets_exchange_s: float) -> float:
    """The NCCL path's work before any row moves, the host blocked: the
    offsets' all-to-all (``offsets_exchange_s``, its NCCL latency), HOST_SYNCS
    synchronisations and METADATA_COPIES copies."""
    return offsets_exchange_s + (HOST_SYNCS + METADATA_COPIES) * HOST_ROUND_TRIP_S


def nccl_peer_s(ranks: int, updates_per_peer: int = 1) -> float:
    """The NCCL path's per-slot cost over ``ranks`` peers (self included)."""
    return ranks * updates_per_peer * FALLBACK_PER_PEER_S


def host_ordered(ops: list[Op]) -> list[Op]:
    """``ops`` in program order, each op after a host-blocking one (a name
    ending in META) made to wait for it: the host issues nothing further
    until it returns (work issued before runs on)."""
    out, blocker = [], None
    for op in ops:
        if blocker is not None and blocker not in op.deps:
            op = dataclasses.replace(op, deps=op.deps + (blocker,))
        out.append(op)
        if op.name.endswith(META):
            blocker = op.name
    return out


def figures() -> dict:
    """The charged figures (the --json "hardware" object adds them)."""
    return {"one_shot_max_peers": ONE_SHOT_MAX_PEERS, "host_round_trip_s": HOST_ROUND_TRIP_S,
            "metadata_copies": METADATA_COPIES, "host_syncs": HOST_SYNCS,
            "fallback_per_peer_s": FALLBACK_PER_PEER_S}


__all__ = ["FALLBACK_PER_PEER_S", "HOST_ROUND_TRIP_S", "HOST_SYNCS", "META", "METADATA_COPIES",
           "NCCL_FALLBACK", "ONE_SHOT", "ONE_SHOT_MAX_PEERS", "SOURCES", "figures",
           "host_ordered", "nccl_host_s", "nccl_peer_s", "ragged_path"]
