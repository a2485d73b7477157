"""Redundant expert slots at run time (k3jax.layout.redundant decides them,
k3jax.layout.expert_placement holds the placement): which slot a routed
pair goes to, and moving the slots' weights between devices for a new
placement.

``slot_ids`` (inside ``jax.shard_map``, in every MoE body right after the
router): the router's logical ids [T, K] -> physical slot ids [T, K]. Pair
(row, e) goes to replica ``row mod count(e)`` of expert e
(expert_placement.replica_choice), ``row`` the pair's row index in the
PADDED global rows: device i of ``Layout.token_axes`` owns rows [i T, (i +
1) T). Padding rows come last, so a real row's index is its index in the
caller's x whatever the layout, and every device (and every layout of the
same placement) picks the same replica for it. Everything downstream (group
sizes, the exchange's destination device slot // S, the local index) then
works on slots as it did on experts; the combine sums over k as before, so
the output is the layout's without redundancy up to float summation order.

``move_slots`` (a jitted program over the whole mesh): every slot of a new
placement takes the weights of an old slot holding the same logical expert
(``slot_sources``: on its own device when one is there, else on its node,
else anywhere), moved by collective permutes over ``Layout.expert_axes``:
for each device offset k in 1..ep - 1 one ``ppermute`` from device d to d +
k mod ep carrying the slots that pair needs (none when it needs none), the
moves within a device a local gather. The inputs are donated: the arrays
are replaced in place.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from k3jax.layout import Layout
from k3jax.layout.expert_placement import ExpertPlacement, PlacementError, replica_choice


def slot_ids(ids_TK: jax.Array, layout: Layout) -> jax.Array:
    """Inside shard_map: logical ids_TK [T, K] of this device's own T rows ->
    int32 slot ids [T, K] (module docstring); out-of-range ids (padding
    rows' E) -> E + R, a slot no device holds. The ids themselves without
    a placement (no op added)."""
    placement = layout.expert_placement
    if placement is None:
        return ids_TK
    T = ids_TK.shape[0]
    row_T = jax.lax.axis_index(layout.token_axes) * T + jnp.arange(T, dtype=jnp.int32)
    replicas_EM, count_E = placement.replica_arrays()
    return replica_choice(ids_TK, row_T, jnp.asarray(replicas_EM), jnp.asarray(count_E))


def identity_placement(layout: Layout) -> ExpertPlacement:
    """The layout's placement, the identity (slot e holds expert e) when it has none."""
    if layout.expert_placement is not None:
        return layout.expert_placement
    par = layout.parallel
    return ExpertPlacement(layout.cfg.num_experts, par.ep, par.nodes,
                           tuple(range(layout.cfg.num_experts)))


def slot_sources(old: ExpertPlacement, new: ExpertPlacement) -> np.ndarray:
    """int64 [E + R]: for each slot of ``new``, the slot of ``old`` holding
    the same logical expert that it copies: one on its own device when
    there is one, else on its node, else the lowest; several candidates
    are used in turn. PlacementError unless both have the same E, slots,
    ep and nodes."""
    for what in ("num_logical", "num_slots", "ep", "nodes"):
        if getattr(old, what) != getattr(new, what):
            raise PlacementError(f"the new placement has {what} {getattr(new, what)}, the "
                                 f"layer's {getattr(old, what)}: slots move only between "
                                 f"placements of one shape")
    S, G = old.slots_per_device, old.devices_per_node
    used = np.zeros(old.num_slots, np.int64)
    out = np.empty(new.num_slots, np.int64)
    for s, e in enumerate(new.slot_expert):
        have = np.asarray(old.replicas_of(e))
        device = have // S
        for candidates in (have[device == s // S], have[device // G == s // S // G], have):
            if candidates.size:
                pick = candidates[np.argmin(used[candidates])]
                break
        used[pick] += 1
        out[s] = pick
    return out


def _tables(sources: np.ndarray, ep: int, S: int):
    """(local_DS [ep, S]: the local source of each slot, itself when it
    comes from another device; {k: (send_Dn, recv_Dn)}): for offset k,
    sender d sends its slots send_Dn[d] to device d + k, which writes them
    to its slots recv_Dn[d + k] (S: padding, dropped)."""
    local = np.tile(np.arange(S), (ep, 1))
    pairs: dict[int, list[list[tuple[int, int]]]] = {}
    for dst, src in enumerate(sources):
        d, i, sd, si = dst // S, dst % S, int(src) // S, int(src) % S
        if sd == d:
            local[d, i] = si
        else:
            pairs.setdefault((d - sd) % ep, [[] for _ in range(ep)])[sd].append((si, i))
    shifts = {}
    for k, by_sender in sorted(pairs.items()):
        n = max(len(p) for p in by_sender)
        send = np.zeros((ep, n), np.int32)
        recv = np.full((ep, n), S, np.int32)
        for sd, moves in enumerate(by_sender):
            for j, (si, i) in enumerate(moves):
                send[sd, j] = si
                recv[(sd + k) % ep, j] = i
        shifts[k] = (send, recv)
    return local.astype(np.int32), shifts


@functools.lru_cache(maxsize=16)
def _program(mesh: Mesh, axes: tuple[str, ...], sources: tuple[int, ...], S: int, names: tuple):
    ep = len(sources) // S
    local, shifts = _tables(np.asarray(sources), ep, S)

    def body(arrays):
        me = jax.lax.axis_index(axes)
        out = {n: x[jnp.asarray(local)[me]] for n, x in arrays.items()}
        for k, (send, recv) in shifts.items():
            sent = {n: x[jnp.asarray(send)[me]] for n, x in arrays.items()}
            got = jax.lax.ppermute(sent, axes, perm=[(d, (d + k) % ep) for d in range(ep)])
            rows = jnp.asarray(recv)[me]
            out = {n: out[n].at[rows].set(got[n], mode="drop") for n in names}
        return out

    spec = {n: P(axes) for n in names}
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,), out_specs=spec),
                   donate_argnums=0)


def move_slots(arrays: dict[str, jax.Array], layout: Layout, new: ExpertPlacement,
               mesh: Mesh) -> dict[str, jax.Array]:
    """{name: [E + R, ...] slot array of ``layout``'s experts, sharded over
    ``layout.expert_axes`` along axis 0} -> the same arrays for placement
    ``new``: slot s holds ``new.slot_expert[s]``'s weights, moved by one
    jitted program of collective permutes (module docstring). The inputs
    are donated (invalid afterwards)."""
    return move_program(layout, new, mesh, tuple(arrays))(dict(arrays))


def move_program(layout: Layout, new: ExpertPlacement, mesh: Mesh, names: tuple[str, ...]):
    """The jitted {name: slot array} -> {name: slot array} that ``move_slots``
    runs for arrays named ``names`` (cached; lower it to read its collectives)."""
    sources = slot_sources(identity_placement(layout), new)
    return _program(mesh, layout.expert_axes, tuple(int(s) for s in sources),
                    layout.local_experts, tuple(sorted(names)))


__all__ = ["identity_placement", "move_program", "move_slots", "slot_ids", "slot_sources"]
