"""A latency model of one K3 MoE layer under expert parallelism over ep
H200s on N nodes (G = ep / N a node), for each way of moving the routed rows
to their experts and the routed latent back (EpDispatch: gather,
hierarchical, all-to-all; k3jax.parallel.ep_exchange). A model's prediction,
not a measurement: every figure it gives is labelled as such.

The layer (SP + EP: T global tokens, padded to a multiple of ep, R = T / ep
own rows a device; row bytes b = 2L (bf16 latent) + 4K (int32 ids) + 4K
(float32 weights); sums 4L) is k3jax.tools.layer_latency.routed_ops without
its collectives (router, latent down, the pairs' gather, the two grouped
GEMMs at kernel_cost's predicted times, the pairs' scatter, norm, latent up;
the same buffers (ep R rows) in every form), the replicated shared expert on
own rows (the compute the transfers may hide under), and the form's
transfers, per device (expected bytes this device sends):

    gather        an all-gather over all ep devices of rows, ids and weights
                  (three collectives), a float32 reduce-scatter back: each
                  moves (ep - 1) R x (bytes a row). A ring across nodes enters
                  and leaves each node once per channel, one channel a NIC,
                  so 1 / G of a device's sends go through its NIC (N > 1), the
                  rest over NVLink, both at once;
    hierarchical  all-gathers over NODE ((N - 1) R b, InfiniBand), then inside
                  the node ((G - 1) N R b, NVLink); the reduce-scatter inside
                  ((G - 1) N R 4L), then over NODE ((N - 1) R 4L);
    all-to-all    stage A (N > 1): an all-gather of the [N] send counts, then
                  rows, ids, weights (three ragged all-to-alls) to each remote
                  node holding one of a row's experts: R x remote_nodes x b
                  over InfiniBand; stage B: the counts, then R x stage_b_rows x
                  b over NVLink; back B: R x stage_b_rows x 4L; back A:
                  R x remote_nodes x 4L (k3jax.tools.ep_destinations). Its own
                  HBM work per stage of S = n x rows slots: packing and zeroing
                  (3 S b bytes); zeroing, masking and summing the returns
                  (16 S L bytes).

Assumptions, each stated once here:

  * one collective in flight at a time (XLA's GPU default), in program
    order; k3jax compiles with the all-gather combiner off (k3jax.xla_options),
    so rows, ids and weights move in three;
  * a collective's latency is NCCL's tuning model's, LL protocol
    (``latency_s``): a ring over n ranks on N nodes H200.ring_base_latency_s
    + (n - N) NVLink steps (at least H200.net_step_floor_s on a ring across
    nodes) + (N - 1) inter-node steps (H200.ib_lone_step_latency_s with one
    rank a node); a ragged all-to-all the base and one step. Then its bytes:
    max(NVLink bytes / NVLink rate, NIC bytes / NIC rate). The LL latency
    with the large-message bandwidth is optimistic between the two regimes;
  * a ragged all-to-all costs what XLA's implementation for its group costs
    (k3jax.tools.ragged_xla): inside a node the one-shot kernel, as above;
    stage A (peers on different nodes) the per-peer NCCL path: its host work
    first (the offsets' exchange, two host synchronisations, four
    device-to-host copies: ``Transfer.meta_s``, the host blocked, so nothing
    later in program order starts before it ends), then a per-peer cost;
  * the busiest device sets the layer's time (``Balance``, max / mean pairs
    a device and a node; BALANCED for the table): its grouped GEMMs hold
    balance.device x the mean pairs (``busiest_gemm_s``); an all-to-all's
    stage A carries balance.node x the mean rows, stage B balance.device x;
    the gathers move every row to every device whatever the balance;
  * otherwise expected bytes (the routing model's mean): at a few rows a
    device the all-to-all's figure is optimistic;
  * while a collective moves bytes, compute runs at 1 - s of its speed
    (k3jax.tools.layer_schedule's rule, with the collective's own HBM rate);
  * the layer is the better of two program orders (routed scope first, or
    the shared expert first), as in k3jax.tools.layer_latency.

Figures per form (``DispatchEstimate``): ``layer_s`` (what ``auto``
compares), ``dispatch_s`` (dispatch + combine alone, back to back, with the
form's own HBM work), ``exposed_s`` (what they add to the common compute) and
the bytes on each link. Rates: pallas_kernels.hardware.H200 and
k3jax.tools.ragged_xla (``hardware()`` lists them with their sources).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

from k3jax.config import K3Config
from k3jax.tools import kernel_cost
from k3jax.tools import layer_latency as ll
from k3jax.tools import ragged_xla as rx
from k3jax.tools.dispatch_transfers import (
    DIRECT,
    INFINIBAND,
    NICS_PER_GPU,
    RING,
    SCHEDULE_LINK,
    Transfer,
    latency_s,
)
from k3jax.tools.ep_destinations import (
    BALANCED,
    UNIFORM,
    Balance,
    Destinations,
    Routing,
    check_placement,
    expected,
)
from k3jax.tools.layer_schedule import (
    REDUCE_SCATTER_HBM,
    Op,
    Schedule,
    compute,
    simulate,
)
from pallas_kernels.hardware import H200 as GPU

FORMS = ("gather", "hierarchical", "all-to-all")
"""EpDispatch's values, in order of preference on a tie."""
TIE_REL = 0.01
"""A form later in FORMS is picked only where the model says it is more than
this much faster than every earlier one: the model is not finer than about a
percent."""

def forms_for(nodes: int) -> tuple[str, ...]:
    """The forms a layout over ``nodes`` nodes can run (hierarchical needs > 1)."""
    return FORMS if nodes > 1 else ("gather", "all-to-all")


def check_layout(cfg: K3Config, ep: int, nodes: int, tokens: int) -> None:
    """ValueError naming the culprit unless the model covers this layout:
    tokens >= 1, ep dividing the experts, nodes dividing ep, at most
    H200.gpus_per_node devices a node."""
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 1:
        raise ValueError(f"token count must be an integer >= 1, got {tokens!r}")
    check_placement(cfg.num_experts, cfg.num_experts_per_token, ep, nodes)
    if ep // nodes > GPU.gpus_per_node:
        raise ValueError(f"ep {ep} over {nodes} node(s) puts {ep // nodes} devices on a node; "
                         f"a node has {GPU.gpus_per_node}")


def _pieces(cfg: K3Config) -> tuple[tuple[str, int], ...]:
    """(what, bytes a row) of the three row collectives: bf16 latent, int32
    ids, float32 weights."""
    K = cfg.num_experts_per_token
    return (("rows", 2 * cfg.routed_expert_hidden_size), ("ids", 4 * K), ("weights", 4 * K))


def transfers(cfg: K3Config, form: str, ep: int, nodes: int, rows: int, dest: Destinations,
              balance: Balance = BALANCED) -> tuple[list[Transfer], list[Transfer]]:
    """(dispatch, combine) transfers of ``form`` for ``rows`` own rows a
    device, in program order (module docstring); ``dest`` the routing's
    expected destinations and ``balance`` its skew (used by all-to-all only:
    the busiest node receives ``balance.node`` x stage A's mean rows, the
    busiest device ``balance.device`` x stage B's)."""
    if form not in forms_for(nodes):
        raise ValueError(f"form must be one of {forms_for(nodes)} at {nodes} node(s), got {form!r}")
    N, G, R, sums = nodes, ep // nodes, rows, 4 * cfg.routed_expert_hidden_size
    a_rows, b_rows = R * dest.remote_nodes * balance.node, R * dest.stage_b_rows * balance.device
    out, back = [], []
    if form == "gather":
        nic = 1 / (G * NICS_PER_GPU) if N > 1 else 0.0
        for what, b in _pieces(cfg):
            sent = (ep - 1) * R * b
            out.append(Transfer(f"ag.{what}", "all-gather", sent * (1 - nic), sent * nic, ep, N))
        sent = (ep - 1) * R * sums
        back.append(Transfer("rs", "reduce-scatter", sent * (1 - nic), sent * nic, ep, N,
                             REDUCE_SCATTER_HBM))
    elif form == "hierarchical":
        out += [Transfer(f"ag.node.{what}", "all-gather", 0.0, (N - 1) * R * b, N, N)
                for what, b in _pieces(cfg)]
        out += [Transfer(f"ag.inside.{what}", "all-gather", (G - 1) * N * R * b, 0.0, G, 1)
                for what, b in _pieces(cfg)]
        back += [Transfer("rs.inside", "reduce-scatter", (G - 1) * N * R * sums, 0.0, G, 1,
                          REDUCE_SCATTER_HBM),
                 Transfer("rs.node", "reduce-scatter", 0.0, (N - 1) * R * sums, N, N,
                          REDUCE_SCATTER_HBM)]
    else:
        if N > 1:
            out.append(Transfer("a.counts", "all-gather", 0.0, (N - 1) * N * 4, N, N))
            out += [Transfer(f"a.{what}", "ragged-all-to-all", 0.0, a_rows * b, N, N)
                    for what, b in _pieces(cfg)]
            back.append(Transfer("a.back", "ragged-all-to-all", 0.0, a_rows * sums, N, N))
        if G > 1:
            out.append(Transfer("b.counts", "all-gather", (G - 1) * G * 4, 0.0, G, 1))
            out += [Transfer(f"b.{what}", "ragged-all-to-all", b_rows * b, 0.0, G, 1)
                    for what, b in _pieces(cfg)]
            back.insert(0, Transfer("b.back", "ragged-all-to-all", b_rows * sums, 0.0, G, 1))
    return out, back


def _hbm_s(nbytes: float) -> float:
    return nbytes / GPU.hbm_copy_bytes_per_s


def _stage_slots(ep: int, nodes: int, rows: int) -> dict[str, int]:
    """Send slots of each ragged stage (k3jax.parallel.ep_exchange.exchange_buffer_rows):
    A over N nodes [N R], B over G devices [G x (rows into B)]."""
    G = ep // nodes
    a = nodes * rows if nodes > 1 else 0
    return {"a": a, "b": G * (a or rows) if G > 1 else 0}


def busiest_gemm_s(cfg: K3Config, rows: int, ep: int, balance: Balance) -> tuple[float, float]:
    """(gate/up, down) seconds of the busiest device's grouped launches:
    ``balance.device`` x the mean R K pairs a device, spread evenly over its
    slots (k3jax.tools.kernel_cost's predicted times, as
    layer_latency.routed_gemm_s, which this equals when balanced)."""
    if balance.device == 1.0 and balance.slots_per_device is None:
        return ll.routed_gemm_s(cfg, rows, ep)
    L, I, K = cfg.routed_expert_hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_token
    local = balance.slots_per_device or cfg.num_experts // ep
    held = min(round(balance.device * rows * K), ep * rows * K)
    sizes = np.full(local, held // local, np.int32)
    sizes[:held % local] += 1
    gate_up = kernel_cost.launch_cost(sizes, ep * rows * K, L, I, 2)
    down = kernel_cost.launch_cost(sizes, ep * rows * K, I, L, 1)
    return gate_up.predicted_us * 1e-6, down.predicted_us * 1e-6


def layer_ops(cfg: K3Config, form: str, ep: int, nodes: int, rows: int, dest: Destinations,
              balance: Balance = BALANCED) -> tuple[list[Op], list[Op], list[Transfer]]:
    """(routed ops, shared-expert ops, the form's transfers) of the layer;
    the routed GEMMs are the busiest device's (``busiest_gemm_s``)."""
    dispatch, combine = transfers(cfg, form, ep, nodes, rows, dest, balance)
    common = {op.name: op for op in ll.routed_ops(cfg, rows, ep) if not op.is_collective}
    gate_up_s, down_s = busiest_gemm_s(cfg, rows, ep, balance)
    common["routed.gate_up"] = dataclasses.replace(common["routed.gate_up"], seconds=gate_up_s)
    common["routed.down"] = dataclasses.replace(common["routed.down"], seconds=down_s)
    row_b = sum(b for _, b in _pieces(cfg))
    slots = _stage_slots(ep, nodes, rows) if form == "all-to-all" else {}
    L = cfg.routed_expert_hidden_size
    ops, last = [common["router"], common["lat_down"]], ("router", "lat_down")
    for t in dispatch:
        stage = t.name.split(".")[0]
        if t.name.endswith(".counts"):      # the stage packs its rows while the counts travel
            ops.append(compute(f"{stage}.pack", _hbm_s(3 * slots[stage] * row_b), *last))
            ops.append(t.op(*last))
            last = (f"{stage}.pack", t.name)
            continue
        ops += t.ops(*last)
        last = (t.name,)
    ops.append(dataclasses.replace(common["routed.in"], deps=last))
    ops += [common["routed.gate_up"], common["routed.down"], common["routed.out"]]
    last = ("routed.out",)
    for t in combine:
        ops += t.ops(*last)
        last = (t.name,)
        if t.kind == "ragged-all-to-all":
            stage = t.name.split(".")[0]
            ops.append(compute(f"{stage}.sum", _hbm_s(16 * slots[stage] * L), t.name))
            last = (f"{stage}.sum",)
    ops.append(dataclasses.replace(common["lat_up"], deps=last))
    shared = ll.mlp_ops(ll.Form.REPLICATED, rows, 1, cfg.hidden_size, cfg.shared_intermediate_size,
                        None, "shared.")
    return ops, shared, dispatch + combine


COMMON_OPS = ("router", "lat_down", "routed.in", "routed.gate_up", "routed.down", "routed.out",
              "lat_up", "shared.up", "shared.down")
"""The compute every form runs (``exposed_s`` is the layer less these)."""


@dataclasses.dataclass(frozen=True)
class DispatchEstimate:
    """The model's prediction for one form of one layout at one token count
    (seconds; bytes a device sends per layer, expected)."""

    form: str
    ep: int
    nodes: int
    tokens: int
    rows: int
    routing: Routing
    balance: Balance
    schedule: Schedule
    transfers: tuple[Transfer, ...]
    common_s: float             # the compute every form runs (COMMON_OPS), alone
    own_s: float                # the form's own HBM work (all-to-all's packing and sums), alone

    @property
    def layer_s(self) -> float:
        """The layer's predicted time: what ``auto`` compares."""
        return self.schedule.end_s

    @property
    def dispatch_s(self) -> float:
        """Dispatch + combine alone: the transfers one after another and the
        form's own HBM work, nothing overlapped."""
        return sum(t.seconds for t in self.transfers) + self.own_s

    @property
    def exposed_s(self) -> float:
        """What the dispatch + combine add to the layer's common compute (the
        rest hides under the shared expert)."""
        return self.layer_s - self.common_s

    @property
    def ib_bytes(self) -> float:
        return sum(t.ib_bytes for t in self.transfers)

    @property
    def nvlink_bytes(self) -> float:
        return sum(t.nvlink_bytes for t in self.transfers)

    def as_dict(self) -> dict:
        return {"form": self.form, "ep": self.ep, "nodes": self.nodes, "tokens": self.tokens,
                "rows": self.rows, "routing": self.routing.name, "balance": self.balance.name,
                "layer_s": self.layer_s, "dispatch_s": self.dispatch_s,
                "exposed_s": self.exposed_s, "ib_bytes": self.ib_bytes,
                "nvlink_bytes": self.nvlink_bytes,
                "transfers": [{"name": t.name, "kind": t.kind, "nvlink_bytes": t.nvlink_bytes,
                               "ib_bytes": t.ib_bytes, "ranks": t.ranks, "nodes": t.nodes,
                               "path": t.path, "host_s": t.meta_s, "seconds": t.seconds}
                              for t in self.transfers]}


@functools.lru_cache(maxsize=4096)
def estimate(cfg: K3Config, tokens: int, ep: int, nodes: int, form: str,
             routing: Routing = UNIFORM, balance: Balance = BALANCED) -> DispatchEstimate:
    """The model's layer with ``form`` for ``tokens`` global tokens, SP + EP
    over ep devices on ``nodes`` nodes (module docstring); ``balance``: the
    pairs' skew over the devices (the busiest device sets the time)."""
    check_layout(cfg, ep, nodes, tokens)
    if balance.device > ep or balance.node > nodes:
        raise ValueError(f"balance: max / mean cannot exceed the {ep} devices / {nodes} nodes, "
                         f"got {balance.device} / {balance.node}")
    rows = math.ceil(tokens / ep)
    dest = expected(cfg.num_experts, cfg.num_experts_per_token, ep, nodes, routing)
    routed, shared, moved = layer_ops(cfg, form, ep, nodes, rows, dest, balance)
    best = min((simulate(rx.host_ordered(ops), SCHEDULE_LINK)
                for ops in (routed + shared, shared + routed)), key=lambda s: s.end_s)
    work = [op for op in routed + shared if not op.is_collective]
    common = sum(op.seconds for op in work if op.name in COMMON_OPS)
    own = sum(op.seconds for op in work if op.name not in COMMON_OPS)
    return DispatchEstimate(form, ep, nodes, tokens, rows, routing, balance, best, tuple(moved),
                            common, own)


def auto_form(estimates: dict[str, float]) -> str:
    """The fastest form by layer seconds; a form later in FORMS must beat
    every earlier one by more than TIE_REL."""
    best = None
    for form in (f for f in FORMS if f in estimates):
        if best is None or estimates[form] * (1 + TIE_REL) < estimates[best]:
            best = form
    return best


def sweep(cfg: K3Config, ep: int, nodes: int, tokens: int, routing: Routing = UNIFORM,
          balance: Balance = BALANCED) -> tuple[dict[str, DispatchEstimate], str]:
    """Every form the layout can run, and the auto pick among them."""
    ests = {form: estimate(cfg, tokens, ep, nodes, form, routing, balance)
            for form in forms_for(nodes)}
    return ests, auto_form({form: e.layer_s for form, e in ests.items()})


def curves(cfg: K3Config, layouts, tokens, routing: Routing = UNIFORM,
           balance: Balance = BALANCED) -> dict:
    """For a figure: {(ep, nodes): {"tokens": [...], "pick": [...], form:
    {"dispatch_s": [...], "exposed_s": [...], "layer_s": [...], "ib_bytes":
    [...], "nvlink_bytes": [...]}}} (model predictions)."""
    out = {}
    for ep, nodes in layouts:
        entry = {"tokens": list(tokens), "pick": []}
        for t in tokens:
            ests, pick = sweep(cfg, ep, nodes, t, routing, balance)
            entry["pick"].append(pick)
            for form, e in ests.items():
                series = entry.setdefault(form, {"dispatch_s": [], "exposed_s": [], "layer_s": [],
                                                 "ib_bytes": [], "nvlink_bytes": []})
                for key in series:
                    series[key].append(getattr(e, key))
        out[(ep, nodes)] = entry
    return out


def hardware() -> dict:
    """The model's link figures with their sources (the --json "hardware" object)."""
    figures = {"nvlink_bus_bytes_per_s": GPU.nvlink_bus_bytes_per_s,
               "ib_bus_bytes_per_s": GPU.ib_bus_bytes_per_s,
               "ib_peak_bytes_per_s": GPU.ib_peak_bytes_per_s,
               "nics_per_node": GPU.nics_per_node, "gpus_per_node": GPU.gpus_per_node,
               "ring_base_latency_s": GPU.ring_base_latency_s,
               "nvlink_step_latency_s": GPU.nvlink_step_latency_s,
               "ib_step_latency_s": GPU.ib_step_latency_s,
               "ib_lone_step_latency_s": GPU.ib_lone_step_latency_s,
               "net_step_floor_s": GPU.net_step_floor_s,
               "collective_sms": GPU.collective_sms, "num_sms": GPU.num_sms,
               "hbm_copy_bytes_per_s": GPU.hbm_copy_bytes_per_s}
    return {"name": GPU.name, **figures, **rx.figures(),
            "sources": {**{k: GPU.sources.get(k, GPU.sources["chip"]) for k in figures},
                        **rx.SOURCES},
            "expert_gemms": "k3jax.tools.kernel_cost.launch_cost predicted times, balanced routing "
                            "(k3jax.tools.layer_latency.routed_gemm_s; a model)",
            "tie_rel": TIE_REL}


__all__ = ["COMMON_OPS", "DIRECT", "FORMS", "INFINIBAND", "RING", "SCHEDULE_LINK", "TIE_REL",
           "DispatchEstimate", "Transfer", "auto_form", "busiest_gemm_s", "check_layout", "curves",
           "estimate", "forms_for", "hardware", "latency_s", "layer_ops", "sweep", "transfers"]
