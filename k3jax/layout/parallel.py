"""The mesh and how the block is spread over it: the mesh axis names (the only
place they are defined), ``ParallelConfig``, ``SharedOverlap``, ``EpDispatch``
and the meshes (``make_mesh`` over devices, ``abstract_mesh`` for planning).

On one node the mesh is (DATA, TENSOR) = (dp, tp). Over ``nodes`` > 1 nodes
it is (NODE, DATA, TENSOR) = (nodes, dp / nodes, tp): NODE is the outermost
axis, so a collective over NODE alone joins each GPU with its counterparts
(the same (data, tensor) position) on the other nodes and is the only kind
that crosses the inter-node link, while one over (DATA, TENSOR) stays inside
a node. ``dp`` is always the global data-parallel size, and ``data_axes``
the axes it spans ((NODE, DATA), or (DATA,) on one node); the tensor axis
never spans nodes.

Token rows are split over ``ParallelConfig.token_axes``: data_axes + (TENSOR,)
under sequence parallelism, else data_axes (the tensor axis then holds every
row of its data group), into ``row_shards`` blocks; T is padded to a multiple
of them (``padded_rows``). What each MLP and the routed experts do on that
mesh is k3jax.layout's.

A mesh need not come from ``make_mesh``: ``ParallelConfig.axis_names`` maps
the roles to the user's axis names, and k3jax.layout.user_mesh turns any
mesh of those axes (Explicit axis types included) into the layer's mesh.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import os
from typing import Mapping, Sequence

import jax
import numpy as np
from jax.sharding import AbstractMesh, AxisType, Mesh

from k3jax.choices import as_choice

NODE = "node"
DATA = "data"
TENSOR = "tensor"
MESH_AXES = (DATA, TENSOR)
"""The axes of a one-node mesh; over several nodes NODE comes first
(``ParallelConfig.mesh_axes``)."""
ROLES = (NODE, DATA, TENSOR)
"""The roles of the mesh axes, outermost first (ParallelConfig.axis_names
maps them to a user's axis names)."""
SHARD_SHARED_EXPERT_ENV = "K3JAX_SHARD_SP_SHARED_EXPERT"


class SharedOverlap(enum.Enum):
    """How an SP-sharded MLP (shared expert, dense layer 0) moves its rows.

    NONE   one all-gather of the input rows and one float32 reduce-scatter of
           the partial sums; XLA decides what overlaps them.
    RING   the same bytes as tp - 1 collective-permutes each way around the
           tensor-axis ring, each block's gate/up (or down) matmul running
           while the next block is in flight (k3jax.parallel.ring).
    WEIGHTS the rows stay put; the weights move instead: all-gather the
           gate/up and down shards over TENSOR (in the weights' dtype,
           (tp - 1) / tp of the full weights per device, whatever T), run the
           replicated MLP on the device's own rows, drop the gathered copy.
           Same arithmetic as the replicated layout, so the same output bits;
           the backward reduce-scatters the weight gradients over TENSOR.

    AUTO    one of the three per static token count: the whole-layer latency
           model's fastest for this (tp, dp), among the forms whose compiled
           schedule keeps the shared expert's collectives under routed work
           (a committed table, k3jax.layout.shared_overlap_choice; resolved by
           ``MlpLayout.for_tokens`` before any form is used).

    NONE and RING's reduce-scatter sums in ``ParallelConfig.shared_scatter_dtype``
    when it is set, else in the table's pick (AUTO) or float32.
    """

    NONE = "none"
    RING = "ring"
    WEIGHTS = "weights"
    AUTO = "auto"

    @property
    def moves_rows(self) -> bool:
        """Does this form move token rows (NONE, RING), rather than weights?
        (AUTO: not known until it is resolved; ValueError.)"""
        if self is SharedOverlap.AUTO:
            raise ValueError("SharedOverlap.AUTO moves rows or weights depending on the token "
                             "count; resolve it with MlpLayout.for_tokens first")
        return self is not SharedOverlap.WEIGHTS


class EpDispatch(enum.Enum):
    """How token rows reach the devices holding their experts under expert
    parallelism, and how the routed latent comes back (k3jax.parallel.ep_exchange).

    GATHER        every row all-gathered over every EP axis in one collective,
                  the float32 latent reduce-scattered back in one.
    HIERARCHICAL  the same gather in two stages: over NODE first (each GPU
                  with its counterparts, the only stage on the inter-node
                  link: each row crosses it once per node), then inside the
                  node; the reduce-scatter inside the node first, then over NODE.
                  Needs nodes > 1.
    ALL_TO_ALL    dropless ragged all-to-all: each row goes only to the nodes,
                  then the devices, that hold one of its experts; each device
                  returns one float32 row per (token, device), summed per
                  (token, node) before it crosses nodes back. Needs a body
                  that owns its rows (sequence parallelism, or tp 1).
    AUTO          one of them per static token count: the committed table of
                  the dispatch latency model (k3jax.layout.ep_dispatch_choice),
                  resolved by ``Layout.for_tokens``.
    """

    GATHER = "gather"
    HIERARCHICAL = "hierarchical"
    ALL_TO_ALL = "all-to-all"
    AUTO = "auto"


SCATTER_DTYPES = ("float32", "bfloat16")
"""The dtypes a token-side form (NONE, RING) may sum its partials in over the wire."""


DEFAULT_SHARED_OVERLAP = SharedOverlap.AUTO
"""The default: per token count, the whole-layer model's fastest form among
those whose compiled 8 x H200 schedule keeps the overlap (docs/latency.md)."""


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """How the block is spread over a (dp, tp) mesh.

    Every choice takes its enum member or the member's value, the string the
    CLI's flag takes (``ep_dispatch="all-to-all"``, ``shared_overlap="ring"``);
    the field holds the member. Anything else is a ValueError listing the
    choices.

    shard_shared_expert: opt-in TP sharding of the shared expert and dense MLP
      under sequence parallelism. Resolved once, at construction, to a bool:
      None reads ``K3JAX_SHARD_SP_SHARED_EXPERT`` (``1`` on; ``0``, empty or
      unset off) under sequence parallelism, the only place the gate consults
      it; a malformed value raises there. Without sequence parallelism None
      resolves to False without reading the variable (it cannot matter).
    pad_under_ep: reproduce vLLM's pre-fix behaviour (padding applied under EP).
      For side-by-side comparisons only; the padding is zeros, so outputs agree.
    shared_overlap: how an SP-sharded shared expert / dense MLP moves its
      rows (SharedOverlap); read only where an MLP is SP-sharded.
    nodes: how many nodes the dp x tp devices span (NODE axis); must divide
      dp, so that the tensor axis stays inside a node.
    ep_dispatch: how routed rows move under expert parallelism (EpDispatch);
      read only under EP.
    shared_scatter_dtype: the dtype (one of SCATTER_DTYPES) in which the
      token-side forms (NONE, RING) send and sum their partial sums over
      TENSOR: "float32" or "bfloat16", or that dtype (held as its name) (half the bytes of the largest
      transfer; bf16 rounding of each partial and of each running sum).
      None (default): float32 for NONE and RING, the table's pick under
      AUTO. WEIGHTS has no partial sums; it ignores the field.
    axis_names: the user's mesh axis name of each role, for a mesh whose
      names are not k3jax's: {"data": "batch", "tensor": "model"} (a role
      left out keeps its own name: data, tensor, node). Held as a tuple of
      (role, name) pairs in ROLES order (hashable); ``axis_name(role)``
      reads it. The mesh the user passes (make_layout, the modules) must
      use these names; k3jax.layout.user_mesh maps it onto k3jax's.
    redundant_experts: R >= 0 redundant expert slots under expert
      parallelism (``--redundant-experts``): the layer holds E + R slots,
      (E + R) / ep a device, placed by make_layout's ``expert_placement`` or,
      without one, for uniform load (k3jax.layout.expert_placement). 0
      (default): one slot per expert, the layout without redundancy.
    """

    dp: int = 1
    tp: int = 1
    sequence_parallel: bool = False
    expert_parallel: bool = False
    shard_shared_expert: bool | None = None
    pad_under_ep: bool = False
    shared_overlap: SharedOverlap | str = DEFAULT_SHARED_OVERLAP
    shared_scatter_dtype: str | None = None
    nodes: int = 1
    ep_dispatch: EpDispatch | str = EpDispatch.AUTO
    axis_names: Mapping[str, str] | tuple[tuple[str, str], ...] | None = None
    redundant_experts: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "axis_names", _role_names(self.axis_names))
        # a choice is an enum member or its value (the CLI's flag): "all-to-all", "ring"
        object.__setattr__(self, "ep_dispatch", as_choice(EpDispatch, self.ep_dispatch,
                                                          "ParallelConfig.ep_dispatch"))
        object.__setattr__(self, "shared_overlap", as_choice(SharedOverlap, self.shared_overlap,
                                                             "ParallelConfig.shared_overlap"))
        if self.shared_scatter_dtype is not None and not isinstance(self.shared_scatter_dtype, str):
            try:   # a dtype (jnp.bfloat16, np.dtype("float32")) -> its name
                object.__setattr__(self, "shared_scatter_dtype",
                                   np.dtype(self.shared_scatter_dtype).name)
            except TypeError:
                pass
        if self.shared_scatter_dtype not in (None, *SCATTER_DTYPES):
            raise ValueError(f"ParallelConfig.shared_scatter_dtype must be None or one of "
                             f"{SCATTER_DTYPES}, "
                             f"got {self.shared_scatter_dtype!r}")
        for name, value in (("dp", self.dp), ("tp", self.tp), ("nodes", self.nodes)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ParallelConfig.{name} must be a positive integer, got {value!r}")
        if self.dp % self.nodes:
            raise ValueError(f"ParallelConfig: nodes {self.nodes} must divide dp {self.dp} "
                             f"(dp x tp = {self.num_devices} devices; the tensor axis stays "
                             f"inside a node, so each node holds dp / nodes whole tensor groups)")
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("ParallelConfig: sequence_parallel needs tp > 1 "
                             "(it splits tokens over the tensor axis)")
        if self.pad_under_ep and not self.expert_parallel:
            raise ValueError("ParallelConfig: pad_under_ep only means something with expert_parallel")
        R = self.redundant_experts
        if not isinstance(R, int) or isinstance(R, bool) or R < 0:
            raise ValueError(f"--redundant-experts must be an integer >= 0, got {R!r}")
        if R and not self.expert_parallel:
            raise ValueError(f"--redundant-experts {R} needs --expert-parallel (redundant slots "
                             f"hold whole experts over the EP devices)")
        if self.shard_shared_expert is None:
            object.__setattr__(self, "shard_shared_expert",
                               self.sequence_parallel and _shard_shared_expert_from_env())
        elif not isinstance(self.shard_shared_expert, bool):
            raise ValueError("ParallelConfig.shard_shared_expert must be a bool or None, "
                             f"got {self.shard_shared_expert!r}")

    @property
    def num_devices(self) -> int:
        return self.dp * self.tp

    @property
    def ep(self) -> int:
        """Expert-parallel size: dp x tp under EP, else 1."""
        return self.num_devices if self.expert_parallel else 1

    @property
    def devices_per_node(self) -> int:
        return self.num_devices // self.nodes

    @property
    def mesh_axes(self) -> tuple[str, ...]:
        """(DATA, TENSOR) on one node, (NODE, DATA, TENSOR) over several."""
        return (NODE, *MESH_AXES) if self.nodes > 1 else MESH_AXES

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        """Sizes of ``mesh_axes``: (dp, tp), or (nodes, dp / nodes, tp)."""
        if self.nodes > 1:
            return (self.nodes, self.dp // self.nodes, self.tp)
        return (self.dp, self.tp)

    @property
    def axis_sizes(self) -> dict[str, int]:
        return dict(zip(self.mesh_axes, self.mesh_shape))

    def axis_name(self, role: str) -> str:
        """The user's mesh axis name of ``role`` (NODE, DATA or TENSOR):
        ``axis_names``' entry, else the role's own name."""
        return dict(self.axis_names).get(role, role)

    @property
    def named_mesh_axes(self) -> tuple[str, ...]:
        """``mesh_axes`` under the user's names (``axis_name``): the axes of
        the mesh ``make_mesh`` builds."""
        return tuple(self.axis_name(role) for role in self.mesh_axes)

    @property
    def data_axes(self) -> tuple[str, ...]:
        """The axes dp spans: (NODE, DATA) over several nodes, else (DATA,)."""
        return (NODE, DATA) if self.nodes > 1 else (DATA,)

    @property
    def token_axes(self) -> tuple[str, ...]:
        """Mesh axes the token rows are split over: data_axes + (TENSOR,)
        under sequence parallelism, else data_axes."""
        return (*self.data_axes, TENSOR) if self.sequence_parallel else self.data_axes

    @property
    def row_shards(self) -> int:
        """How many blocks the token rows are cut into (T is padded to a multiple)."""
        return self.num_devices if self.sequence_parallel else self.dp

    def describe(self) -> str:
        parts = [f"dp={self.dp}", f"tp={self.tp}"]
        if self.nodes > 1:
            parts.append(f"nodes={self.nodes} ({self.devices_per_node} devices each)")
        if self.sequence_parallel:
            parts.append("sequence-parallel")
        if self.expert_parallel:
            parts.append(f"expert-parallel (ep={self.ep})")
            if self.ep_dispatch is not EpDispatch.AUTO:
                parts.append(f"ep-dispatch {self.ep_dispatch.value}")
            if self.redundant_experts:
                parts.append(f"{self.redundant_experts} redundant experts")
        if self.shard_shared_expert:
            parts.append("shard-shared-expert requested")
        if self.pad_under_ep:
            parts.append("pad-under-ep (pre-fix behaviour)")
        if self.axis_names:
            parts.append("mesh axes " + ", ".join(f"{r}={n}" for r, n in self.axis_names))
        return ", ".join(parts)


def _role_names(value) -> tuple[tuple[str, str], ...]:
    """ParallelConfig.axis_names as (role, name) pairs in ROLES order;
    ValueError naming the entry unless each key is a role, each name a
    non-empty string, and the three roles' names (given or their own) differ."""
    if value is None:
        return ()
    pairs = tuple(value.items()) if isinstance(value, Mapping) else tuple(value)
    given: dict[str, str] = {}
    for pair in pairs:
        role, name = pair if isinstance(pair, tuple) and len(pair) == 2 else (pair, None)
        if role not in ROLES:
            raise ValueError(f"ParallelConfig.axis_names: {role!r} is not a role; the roles are "
                             f"{', '.join(ROLES)} (role -> your mesh's axis name)")
        if not isinstance(name, str) or not name:
            raise ValueError(f"ParallelConfig.axis_names[{role!r}] must be a mesh axis name "
                             f"(a non-empty string), got {name!r}")
        if name in ROLES and name != role:
            raise ValueError(f"ParallelConfig.axis_names[{role!r}] = {name!r}: that is k3jax's "
                             f"name of role {name}; name your axes otherwise")
        given[role] = name
    names = {role: given.get(role, role) for role in ROLES}
    for role in ROLES:
        others = [r for r in ROLES if r != role and names[r] == names[role]]
        if others:
            raise ValueError(f"ParallelConfig.axis_names: roles {role} and {others[0]} both name "
                             f"mesh axis {names[role]!r}; each role needs its own axis")
    return tuple((role, given[role]) for role in ROLES if role in given)


def _shard_shared_expert_from_env() -> bool:
    raw = os.environ.get(SHARD_SHARED_EXPERT_ENV, "0").strip()
    if raw not in ("", "0", "1"):
        raise ValueError(f"{SHARD_SHARED_EXPERT_ENV} must be 0 or 1, got {raw!r}")
    return raw == "1"


def node_of_devices(devices: Sequence[jax.Device], nodes: int) -> list[int]:
    """The node of each of ``devices`` (in that order) when they span ``nodes``
    nodes: with one process per host (``process_index``), processes are
    dealt to nodes in blocks of process_count / nodes; in a single process
    (simulated devices, one host) the devices in blocks of len / nodes.
    ValueError when the processes cannot be dealt evenly."""
    processes = sorted({d.process_index for d in devices})
    if len(processes) == 1:
        per_node = len(devices) // nodes
        return [i // per_node for i in range(len(devices))]
    if len(processes) % nodes:
        raise ValueError(f"{len(processes)} processes cannot be split evenly over {nodes} nodes "
                         f"(--nodes must divide the number of processes)")
    per_node = len(processes) // nodes
    return [processes.index(d.process_index) // per_node for d in devices]


def make_mesh(parallel: ParallelConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """The mesh of ``parallel`` over ``devices``: (dp, tp), or (nodes, dp /
    nodes, tp) over several nodes.

    By default it uses every device of every process; a single process with
    more devices than dp * tp takes the first dp * tp (handy on a CPU with 8
    simulated devices). Axis types are Auto: the modules place weights and
    tokens with explicit NamedShardings and shard_map in_specs themselves.
    The axes carry ``parallel.named_mesh_axes`` (k3jax's names unless
    ``parallel.axis_names`` says otherwise). Over several nodes, NODE index n
    holds exactly the devices of node n (``node_of_devices``: a process's
    devices never straddle two nodes), in (process, id) order inside each node.
    """
    if devices is None:
        devices = jax.devices()
        if jax.process_count() == 1 and len(devices) > parallel.num_devices:
            devices = devices[:parallel.num_devices]
    devices = list(devices)
    if len(devices) != parallel.num_devices:
        raise ValueError(f"dp * tp = {parallel.dp} * {parallel.tp} = {parallel.num_devices} "
                         f"but {len(devices)} devices are available ({jax.default_backend()}); "
                         f"on the CPU simulate more with --devices / jax_num_cpu_devices")
    if parallel.nodes == 1:
        return jax.make_mesh((parallel.dp, parallel.tp), parallel.named_mesh_axes,
                             axis_types=(AxisType.Auto,) * 2, devices=devices)
    devices = sorted(devices, key=lambda d: (d.process_index, d.id))
    node = node_of_devices(devices, parallel.nodes)
    by_node = [[d for d, n in zip(devices, node) if n == i] for i in range(parallel.nodes)]
    if any(len(group) != parallel.devices_per_node for group in by_node):
        raise ValueError(f"--nodes {parallel.nodes}: the nodes hold "
                         f"{[len(g) for g in by_node]} devices, not {parallel.devices_per_node} "
                         f"each")
    grid = np.array([d for group in by_node for d in group], dtype=object)
    return Mesh(grid.reshape(parallel.mesh_shape), parallel.named_mesh_axes,
                axis_types=(AxisType.Auto,) * 3)


def abstract_mesh(parallel: ParallelConfig) -> AbstractMesh:
    """The mesh's shape without devices, under ``parallel.named_mesh_axes``:
    for planning full-size layouts."""
    return AbstractMesh(parallel.mesh_shape, parallel.named_mesh_axes,
                        axis_types=(AxisType.Auto,) * len(parallel.mesh_axes))


def padded_rows(num_tokens: int, row_shards: int) -> int:
    """T rounded up to a multiple of the row blocks (docs/spec.md §4: L = ceil(T / shards))."""
    return math.ceil(num_tokens / row_shards) * row_shards


__all__ = ["NODE", "DATA", "TENSOR", "MESH_AXES", "SHARD_SHARED_EXPERT_ENV", "ParallelConfig",
           "SharedOverlap", "EpDispatch", "DEFAULT_SHARED_OVERLAP", "SCATTER_DTYPES", "ROLES",
           "make_mesh", "node_of_devices", "abstract_mesh", "padded_rows"]
