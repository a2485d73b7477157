"""How routed token rows meet the experts under expert parallelism, inside
``jax.shard_map`` (the forms of ``EpDispatch``; ``Layout`` picks one).

Staged gather (EpDispatch.GATHER, HIERARCHICAL): ``gather_staged`` all-gathers
rows over each stage of ``Layout.dispatch_stages`` in turn and
``scatter_staged`` reduce-scatters the float32 latent over them in reverse.
GATHER is one stage over every EP axis; HIERARCHICAL is NODE first (each GPU
with its counterparts on the other nodes: the only stage on the inter-node
link, so each row crosses it once per node), then the axes inside the node.

Dropless all-to-all (EpDispatch.ALL_TO_ALL): ``all_to_all_routed``. With N
nodes of G devices (``Layout.exchange_axes``: the axes between and inside
nodes), E_l experts a device, device d = n G + g holding experts
[d E_l, (d + 1) E_l), and T own rows:

    stage A (between nodes, N > 1): each own row goes once to each node
        holding one of its K experts, to the counterpart device there
        (lat row in the activation dtype + its K ids and weights);
    stage B (inside the node, G > 1): each row this device received (or
        owns, N = 1) goes once to each device of this node holding one of
        its experts;
    the experts held here run on the pairs of the received rows;
    back B: one float32 [L] row per (row, device) to the stage-B sender,
        which sums a row's returns: one row per (token, node);
    back A: that row to the token's owner, which sums its nodes' rows.

Buffers are sized for the worst case, so no row is ever dropped and there
is no capacity factor: a stage over n devices sends from n x rows slots (a
row goes at most once to each destination) and receives into n x rows
(each sender sends a row at most once): stage A [N T] rows, stage B [G N T]
= [ep T], as many rows as the gather holds (``exchange_buffer_rows``).
Each ragged stage first all-gathers the [n] send counts (the sender must
know where its slice lands in each receiver's buffer).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from k3jax.ops.activation import SiTU
from k3jax.ops.experts import ExpertWeight, routed_experts
from k3jax.parallel.ragged_a2a import ragged_all_to_all
from k3jax.parallel.sequence import gather_rows, scatter_rows
from pallas_kernels.backend import Backend

Stages = tuple[tuple[str, ...], ...]


def gather_staged(x_TX: jax.Array, stages: Stages) -> jax.Array:
    """x_TX [T, X] -> [T * n, X] (n the product of the stages' sizes):
    all-gathered over each stage in order."""
    for axes in stages:
        x_TX = gather_rows(x_TX, axes)
    return x_TX


def scatter_staged(x_TX: jax.Array, stages: Stages) -> jax.Array:
    """The inverse placement of ``gather_staged``: [T * n, X] partial sums
    -> [T, X] this device's rows, reduce-scattered over the stages in
    reverse order (summed in x's dtype)."""
    for axes in reversed(stages):
        x_TX = scatter_rows(x_TX, axes)
    return x_TX


class RaggedRoute(NamedTuple):
    """One ragged stage over n devices for T rows: where each row goes and
    how to bring the results back.

    slot_row_S [n T]      the row each send slot carries (slots grouped by
                          destination, rows ascending; slots past ``sent`` unused)
    sent []               slots in use: sum(send_sizes_n)
    send_sizes_n, input_offsets_n   my slices, per destination, in the send slots
    output_offsets_n      where my slice lands in each destination's buffer
    recv_sizes_n, recv_offsets_n    what each sender puts in my receive buffer
                          (contiguous, in sender order)
    back_offsets_n        where my returned slice lands in each sender's slots
    """

    slot_row_S: jax.Array
    sent: jax.Array
    send_sizes_n: jax.Array
    input_offsets_n: jax.Array
    output_offsets_n: jax.Array
    recv_sizes_n: jax.Array
    recv_offsets_n: jax.Array
    back_offsets_n: jax.Array


def _exclusive_cumsum(x, axis=0):
    return jnp.cumsum(x, axis=axis) - x


def plan_route(dest_Tn: jax.Array, axes: tuple[str, ...]) -> RaggedRoute:
    """The route of rows to destinations ``dest_Tn`` [T, n] bool (row t goes
    to device j of ``axes`` when dest_Tn[t, j]); all-gathers the send
    counts over ``axes``."""
    T, n = dest_Tn.shape
    flat_S = dest_Tn.T.reshape(n * T)                               # slot j * T + t
    key_S = jnp.where(flat_S, jnp.arange(n * T, dtype=jnp.int32), n * T)
    slot_row_S = (jnp.argsort(key_S, stable=True) % T).astype(jnp.int32)
    send_n = dest_Tn.sum(axis=0, dtype=jnp.int32)
    sizes_nn = jax.lax.all_gather(send_n, axes, axis=0)             # [sender, receiver]
    me = jax.lax.axis_index(axes)
    recv_n = sizes_nn[:, me]
    return RaggedRoute(slot_row_S=slot_row_S, sent=send_n.sum(), send_sizes_n=send_n,
                       input_offsets_n=_exclusive_cumsum(send_n),
                       output_offsets_n=_exclusive_cumsum(sizes_nn, axis=0)[me],
                       recv_sizes_n=recv_n, recv_offsets_n=_exclusive_cumsum(recv_n),
                       back_offsets_n=_exclusive_cumsum(sizes_nn, axis=1)[:, me])


def send_rows(x_TX: jax.Array, route: RaggedRoute, axes: tuple[str, ...], *,
              emulated: bool) -> jax.Array:
    """x_TX [T, X] -> [n T, X]: the rows sent to me, contiguous in sender
    order (rows past sum(recv_sizes_n) are zeros)."""
    n = route.send_sizes_n.shape[0]
    out = jnp.zeros((n * x_TX.shape[0], *x_TX.shape[1:]), x_TX.dtype)
    return ragged_all_to_all(x_TX[route.slot_row_S], out, route.input_offsets_n,
                             route.send_sizes_n, route.output_offsets_n, route.recv_sizes_n,
                             axes, emulated=emulated)


def return_rows(y_RX: jax.Array, route: RaggedRoute, rows: int, axes: tuple[str, ...], *,
                emulated: bool) -> jax.Array:
    """The way back of ``send_rows``: y_RX [n rows, X] (one result per
    received row) -> [rows, X] float32, each of my rows the sum of the
    results its destinations returned."""
    n = route.send_sizes_n.shape[0]
    back_SX = ragged_all_to_all(y_RX, jnp.zeros_like(y_RX), route.recv_offsets_n,
                                route.recv_sizes_n, route.back_offsets_n, route.send_sizes_n,
                                axes, emulated=emulated)
    used_S = jnp.arange(n * rows) < route.sent
    back_SX = jnp.where(used_S.reshape(-1, *(1,) * (y_RX.ndim - 1)), back_SX, 0)
    return jnp.zeros((rows, *y_RX.shape[1:]), jnp.float32).at[route.slot_row_S].add(
        back_SX.astype(jnp.float32))


def _send_pairs(lat_TL, ids_TK, w_TK, route: RaggedRoute, axes, num_experts, emulated):
    """Rows with their top-k ids and weights through one ragged stage; the
    receive buffer's unused rows get out-of-range ids (no expert). The
    weights travel as floats, so gradients reach the router through them."""
    lat, ids, w = (send_rows(a, route, axes, emulated=emulated) for a in (lat_TL, ids_TK, w_TK))
    used_R = jnp.arange(ids.shape[0]) < route.recv_sizes_n.sum()
    return lat, jnp.where(used_R[:, None], ids, num_experts), w


def _has_destination(dest_TK: jax.Array, n: int) -> jax.Array:
    """dest_TK [T, K] destination index per pair (out of [0, n): none) ->
    [T, n] bool: does row t go to destination j."""
    return (dest_TK[:, :, None] == jnp.arange(n, dtype=dest_TK.dtype)).any(axis=1)


def exchange_buffer_rows(rows: int, nodes: int, devices_per_node: int) -> dict[str, int]:
    """Worst-case rows of every all-to-all buffer for ``rows`` own rows
    (stage A over ``nodes``, stage B over ``devices_per_node``): what the
    planner prices. A stage of one device is skipped (0 rows)."""
    a = rows * nodes if nodes > 1 else 0
    into_b = a or rows
    b = into_b * devices_per_node if devices_per_node > 1 else 0
    return {"stage_a_send": a, "stage_a_recv": a, "stage_b_send": b, "stage_b_recv": b}


def all_to_all_routed(lat_TL: jax.Array, ids_TK: jax.Array, w_TK: jax.Array,
                      w1_ELF: ExpertWeight, w3_ELF: ExpertWeight, w2_EFL: ExpertWeight,
                      act: SiTU, *, between: tuple[str, ...], inside: tuple[str, ...],
                      nodes: int, devices_per_node: int, num_experts: int,
                      first_expert: jax.Array, emulated: bool,
                      backend: Backend = "auto") -> jax.Array:
    """The routed latent of this device's own rows by dropless ragged
    all-to-all (module docstring): lat_TL [T, L], ids_TK / w_TK [T, K]
    (ids of padding rows out of range) -> float32 [T, L], the sum over all
    K experts of every own row (no reduce-scatter left to do).

    ``between`` / ``inside``: the mesh axes of stage A / B (() to skip);
    experts are numbered node-major over them, E_l = w1_ELF.shape[0] a device."""
    E_l = w1_ELF.shape[0]
    T = lat_TL.shape[0]
    rows, lat, ids, w = T, lat_TL, ids_TK, w_TK
    route_a = route_b = None
    if between:
        route_a = plan_route(_has_destination(ids // (E_l * devices_per_node), nodes), between)
        lat, ids, w = _send_pairs(lat, ids, w, route_a, between, num_experts, emulated)
        rows = nodes * T
    rows_a = rows
    if inside:
        node = jax.lax.axis_index(between) if between else 0
        device = ids // E_l
        here = jnp.where(device // devices_per_node == node, device % devices_per_node, -1)
        route_b = plan_route(_has_destination(here, devices_per_node), inside)
        lat, ids, w = _send_pairs(lat, ids, w, route_b, inside, num_experts, emulated)
        rows = devices_per_node * rows_a
    r_RL = routed_experts(lat, ids, w, w1_ELF, w3_ELF, w2_EFL, act, first_expert=first_expert,
                          backend=backend)
    if inside:
        r_RL = return_rows(r_RL, route_b, rows_a, inside, emulated=emulated)
    if between:
        r_RL = return_rows(r_RL, route_a, T, between, emulated=emulated)
    return r_RL


__all__ = ["gather_staged", "scatter_staged", "RaggedRoute", "plan_route", "send_rows",
           "return_rows", "all_to_all_routed", "exchange_buffer_rows"]
