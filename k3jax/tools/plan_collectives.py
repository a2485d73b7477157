"""The collectives of one MoE-layer forward, as the planner lists them: each
one's kind, mesh axes, per-device shape and dtype (``Collective``), for the
routed experts' dispatch under every Layout (``moe_collectives``, with the
EP exchange's staged and ragged collectives, ``exchange_collectives``), the
dropless all-to-all's worst-case buffers (``dispatch_buffer_bytes``) and a
sequence-parallel sharded MLP (``sp_sharded_mlp_collectives``). k3jax.tools.plan
reads them into its Plan."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax.numpy as jnp
import numpy as np

from k3jax.layout import (
    NODE,
    TENSOR,
    Dispatch,
    EpDispatch,
    Layout,
    MlpLayout,
    MlpMode,
    SharedOverlap,
    padded_rows,
)
from k3jax.parallel.ep_exchange import exchange_buffer_rows


# --------------------------------------------------------------------------
# Collectives of one MoE-layer forward
# --------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective of a MoE forward. ``shape`` is the full per-device
    buffer (all-gather output, reduce-scatter input, all-reduce array) and
    ``bytes`` its size; ``group`` the number of devices taking part."""

    kind: str                   # "all-gather" | "reduce-scatter" | "all-reduce" |
                                # "collective-permute" | "ragged-all-to-all"
    axes: tuple[str, ...]
    group: int
    what: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def bytes(self) -> int:
        return math.prod(self.shape) * np.dtype(jnp.dtype(self.dtype)).itemsize

    @property
    def wire_bytes(self) -> int:
        """Bytes each device sends, as a ring algorithm moves them:
        (g - 1) / g of the buffer for an all-gather or reduce-scatter,
        2 (g - 1) / g for an all-reduce, the whole block for a
        collective-permute (one block to one neighbour); for a ragged
        all-to-all, whose buffer is sized for the worst case, (g - 1) / g of
        it: the most it can send (what it sends depends on the routing)."""
        g = self.group
        if self.kind == "collective-permute":
            return self.bytes
        factor = 2 if self.kind == "all-reduce" else 1
        return factor * (g - 1) * self.bytes // g

    @property
    def crosses_nodes(self) -> bool:
        """Does it run over the node axis, i.e. on the inter-node link?"""
        return NODE in self.axes

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "axis": "+".join(self.axes), "axes": list(self.axes),
                "crosses_nodes": self.crosses_nodes,
                "group": self.group, "what": self.what, "shape": list(self.shape),
                "dtype": self.dtype, "bytes": self.bytes, "wire_bytes": self.wire_bytes}


def moe_collectives(layout: Layout, tokens: int) -> list[Collective]:
    """The collectives one KimiMoE forward issues for ``tokens`` global tokens,
    in program order, as the bodies in k3jax.modules.moe / mlp issue them
    (activations in ``layout.dtype``):

    Dispatch.OWN_ROWS (moe_rows_local: LOCAL, TP under SP, EP): all-gather over
      ``dispatch_axes`` of the latent rows (activation dtype), the top-k ids
      (int32) and weights (float32); reduce-scatter of the float32 routed
      latent; an SP-sharded shared expert adds its own over TENSOR
      (``sp_sharded_mlp_collectives``: an all-gather and a reduce-scatter, or
      2 (tp - 1) collective-permutes under SharedOverlap.RING, the partial
      sums in ``shared_scatter_dtype``; under SharedOverlap.WEIGHTS the
      all-gather of gate/up comes first, before the routed path's, and that
      of down after them, as k3jax.modules.moe.shared_weights_local issues them).
    Dispatch.ALL_REDUCE (moe_tp_local, tp > 1 without SP): under EP with
      dp > 1 the same three all-gathers and one reduce-scatter over DATA
      (``dispatch_axes``); then one float32 all-reduce of [rows, L + D] over TENSOR.
    EP on one device has no ``dispatch_axes``, so it issues (and lists) none.
    Rows gathered by EpDispatch.HIERARCHICAL list each all-gather once per
    stage (NODE, then inside the node) and the reduce-scatter backwards;
    EpDispatch.ALL_TO_ALL lists ``exchange_collectives`` instead.
    """
    if tokens < 1:
        raise ValueError(f"tokens must be >= 1, got {tokens}")
    layout = layout.for_tokens(tokens)
    cfg, par = layout.cfg, layout.parallel
    D, L, K = cfg.hidden_size, cfg.routed_expert_hidden_size, cfg.num_experts_per_token
    sizes = par.axis_sizes
    local_rows = padded_rows(tokens, layout.row_shards) // layout.row_shards
    act = str(layout.dtype)
    out: list[Collective] = []
    shared = layout.shared_mlp
    weights_form = shared.mode is MlpMode.SP_SHARDED and shared.overlap is SharedOverlap.WEIGHTS
    if weights_form:
        out.append(sp_sharded_mlp_collectives(shared, local_rows, act, "shared-expert")[0])
    if layout.dispatch_axes and layout.ep_dispatch is EpDispatch.ALL_TO_ALL:
        out += exchange_collectives(layout, local_rows)
    rows, scatters = local_rows, []
    for axes in layout.dispatch_stages:
        group = math.prod(sizes[a] for a in axes)
        rows *= group
        out += [Collective("all-gather", axes, group, "latent rows", (rows, L), act),
                Collective("all-gather", axes, group, "top-k expert ids", (rows, K), "int32"),
                Collective("all-gather", axes, group, "top-k weights", (rows, K), "float32")]
        scatters.insert(0, Collective("reduce-scatter", axes, group,
                                      "routed latent (partial sums)", (rows, L), "float32"))
    out += scatters
    if layout.dispatch is Dispatch.ALL_REDUCE:
        out.append(Collective("all-reduce", (TENSOR,), par.tp,
                              "routed latent + shared-expert partial sums",
                              (local_rows, L + D), "float32"))
        return out
    if weights_form:
        out += sp_sharded_mlp_collectives(shared, local_rows, act, "shared-expert")[1:]
    elif layout.shared_mlp.mode is MlpMode.SP_SHARDED:
        out += sp_sharded_mlp_collectives(layout.shared_mlp, local_rows, act, "shared-expert")
    elif layout.shared_mlp.mode is not MlpMode.REPLICATED:
        raise AssertionError(f"shared expert mode {layout.shared_mlp.mode} under moe_rows_local")
    return out


def exchange_collectives(layout: Layout, local_rows: int) -> list[Collective]:
    """The collectives of EpDispatch.ALL_TO_ALL (k3jax.parallel.ep_exchange) for
    ``local_rows`` own rows, in program order, each ragged buffer at its
    worst-case rows (``exchange_buffer_rows``): per stage (A between nodes,
    B inside a node; a stage of one device is skipped) an all-gather of the
    [n] send counts, then the rows (activation dtype), their top-k ids and
    weights; after the experts, the float32 latent back through B, then A."""
    cfg, par = layout.cfg, layout.parallel
    L, K = cfg.routed_expert_hidden_size, cfg.num_experts_per_token
    between, inside = layout.exchange_axes
    G = par.ep // par.nodes
    buffers = exchange_buffer_rows(local_rows, par.nodes, G)
    act = str(layout.dtype)
    out, back = [], []
    for stage, axes, n, rows in (("A", between, par.nodes, buffers["stage_a_recv"]),
                                 ("B", inside, G, buffers["stage_b_recv"])):
        if not axes:
            continue
        out += [Collective("all-gather", axes, n, f"stage {stage} send counts", (n, n), "int32"),
                Collective("ragged-all-to-all", axes, n, f"stage {stage} latent rows", (rows, L), act),
                Collective("ragged-all-to-all", axes, n, f"stage {stage} top-k expert ids",
                           (rows, K), "int32"),
                Collective("ragged-all-to-all", axes, n, f"stage {stage} top-k weights",
                           (rows, K), "float32")]
        back.insert(0, Collective("ragged-all-to-all", axes, n,
                                  f"stage {stage} routed latent back (float32 sums)",
                                  (rows, L), "float32"))
    return out + back


def dispatch_buffer_bytes(layout: Layout, tokens: int) -> dict[str, int]:
    """Per-device bytes of the routed rows' exchange buffers for ``tokens``
    global tokens: the gathered rows (latent, ids, weights) and the float32
    latent of the gather forms, or the ragged all-to-all's send and receive
    buffers sized for the worst case (dropless: no row can overflow them).
    {} when rows are not exchanged."""
    layout = layout.for_tokens(tokens)
    cfg, par = layout.cfg, layout.parallel
    L, K = cfg.routed_expert_hidden_size, cfg.num_experts_per_token
    act = np.dtype(layout.dtype).itemsize
    local_rows = padded_rows(tokens, layout.row_shards) // layout.row_shards
    row_bytes = L * act + K * 4 * 2          # latent row + int32 ids + float32 weights
    if not layout.dispatch_axes:
        return {}
    if layout.ep_dispatch is not EpDispatch.ALL_TO_ALL:
        rows = local_rows * math.prod(par.axis_sizes[a] for a in layout.dispatch_axes)
        return {"gathered_rows": rows * row_bytes, "routed_latent_float32": rows * L * 4}
    out = {}
    for name, rows in exchange_buffer_rows(local_rows, par.nodes, par.ep // par.nodes).items():
        if rows:
            out[f"{name}_rows"] = rows * row_bytes
            out[f"{name}_latent_float32"] = rows * L * 4
    return out


def sp_sharded_mlp_collectives(mlp: MlpLayout, local_rows: int, act_dtype: str,
                               who: str) -> list[Collective]:
    """The collectives of one SP-sharded MLP forward over ``local_rows`` rows
    per device (k3jax.modules.mlp): SharedOverlap.NONE, an all-gather of the
    D-wide input rows (activation dtype) and a float32 reduce-scatter of the
    partial sums; RING, the same bytes as tp - 1 collective-permutes of one
    [local_rows, D] block each way (input rows, then running sums); the
    partial sums in ``mlp.scatter_dtype``. WEIGHTS: an all-gather of gate and
    up stacked ([2, D, F]) and one of down ([F, D]), in the weights' dtype
    (``act_dtype``: the Layout's dtype is the weights' too), whatever the rows."""
    tp, D, F = mlp.parallel.tp, mlp.hidden, mlp.intermediate
    scatter = str(mlp.scatter_dtype)
    if mlp.overlap is SharedOverlap.WEIGHTS:
        return [Collective("all-gather", (TENSOR,), tp, f"{who} gate/up weights", (2, D, F),
                           act_dtype),
                Collective("all-gather", (TENSOR,), tp, f"{who} down weights", (F, D), act_dtype)]
    if mlp.overlap is SharedOverlap.RING:
        return ([Collective("collective-permute", (TENSOR,), tp,
                            f"{who} input rows, ring step {s + 1}/{tp - 1}",
                            (local_rows, D), act_dtype) for s in range(tp - 1)]
                + [Collective("collective-permute", (TENSOR,), tp,
                              f"{who} partial sums, ring step {s + 1}/{tp - 1}",
                              (local_rows, D), scatter) for s in range(tp - 1)])
    rows = local_rows * tp
    return [Collective("all-gather", (TENSOR,), tp, f"{who} input rows", (rows, D), act_dtype),
            Collective("reduce-scatter", (TENSOR,), tp, f"{who} partial sums", (rows, D),
                       scatter)]
