"""Router statistics of one MoE layer, from the routing the layer runs
anyway: no second router matmul, no second top-k.

Turned on per module (``KimiMoE(..., router_stats=True)``, or
``module.router_stats = True``): each call then sows an ``ExpertLoad`` into
the ``RouterStats`` collection (an ``nnx.Intermediate``) under the name
``expert_load``, a tuple with one entry per call (Flax's ``sow``):

    y, stats = nnx.capture(moe, RouterStats)(x)     # stats: an nnx.State
    load = expert_loads(stats)[()]                  # {module path: ExpertLoad}

Outside ``nnx.capture`` the module keeps it as ``moe.expert_load``
(Flax warns that this form is deprecated); take it with
``nnx.pop(moe, RouterStats)`` after each call, or the tuple grows (and an
``nnx.jit`` step retraces). The functional form,
``moe_forward(layout, mesh, stats=True)(x, weights)``, returns (y, ExpertLoad).
Off (the default), the program holds nothing of it: no extra op, no
collective.

What each field counts (every (token, expert) pair of a valid row counts
once; padding rows count nowhere), summed over the mesh, the same on every
device:

    tokens_per_expert      int32 [E]: pairs routed to expert e
    tokens_per_device      int32 [devices]: pairs whose expert work runs on
                           the device, in role order ((node,) data, tensor
                           row-major: ``make_mesh``'s device order,
                           k3jax.layout.user_mesh.role_devices(module.mesh)).
                           Under EP, the pairs of the experts it holds (what
                           the dispatch delivers to it, whatever the form;
                           with redundant slots, the pairs its slots got).
                           Without EP every device runs every expert (whole,
                           or its 1/tp shard of the intermediate under TP) on
                           all rows of its data group, so it counts all their
                           pairs: each pair counts on the tp devices of its group.
    tokens_per_node        int32 [nodes]: the sum over each node's devices
    mean_score_per_expert  float32 [E]: the mean over valid rows of expert
                           e's sigmoid score (before the selection bias)
    imbalance_device       float32 []: max / mean of tokens_per_device
    imbalance_node         float32 []: max / mean of tokens_per_node
                           (1 when there is no token at all)

Cost when on: one int32 all-reduce of [E] (+ [dp] without EP) and one
float32 all-reduce of [E] over the token axes, after the routing (and one
int32 all-reduce of [E + R] with redundant slots).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from k3jax.layout import Layout, MoEMode
from k3jax.parallel.replicas import slot_ids

STATS_NAME = "expert_load"   # the name the module sows under


class RouterStats(nnx.Intermediate):
    """The collection the MoE layer sows its ExpertLoad into
    (``nnx.capture(module, RouterStats)``, ``nnx.pop(module, RouterStats)``)."""


class ExpertLoad(NamedTuple):
    """One layer call's router statistics (module docstring); a pytree of
    arrays, the same on every device."""

    tokens_per_expert: jax.Array
    tokens_per_device: jax.Array
    tokens_per_node: jax.Array
    mean_score_per_expert: jax.Array
    imbalance_device: jax.Array
    imbalance_node: jax.Array


class RowRouting(NamedTuple):
    """What a per-device body's router saw, for the statistics: ids_TK
    [T, K] (``num_experts`` on padding rows), scores_TE [T, E], valid_T [T]."""

    ids_TK: jax.Array
    scores_TE: jax.Array
    valid_T: jax.Array


def expert_load_local(seen: RowRouting, layout: Layout) -> ExpertLoad:
    """Inside ``jax.shard_map``: the ExpertLoad of the whole call from this
    device's own rows (``seen``), summed over ``layout.token_axes`` (two
    all-reduces), the same on every device."""
    par, E = layout.parallel, layout.cfg.num_experts
    ids = jnp.where(seen.valid_T[:, None], seen.ids_TK, E).reshape(-1)
    counts = jnp.bincount(ids, length=E + 1)[:E].astype(jnp.int32)
    if layout.moe_mode is not MoEMode.EP:   # pairs of own rows, at this device's data group
        group = jax.lax.axis_index(par.data_axes)
        own = jnp.sum(counts, dtype=jnp.int32)
        counts = jnp.concatenate([counts, jnp.where(jnp.arange(par.dp) == group, own, 0)])
    score_E = jnp.sum(jnp.where(seen.valid_T[:, None], seen.scores_TE, 0.0), axis=0)
    counts = jax.lax.psum(counts.astype(jnp.int32), par.token_axes)
    score_E = jax.lax.psum(score_E.astype(jnp.float32), par.token_axes)
    tokens_E = counts[:E]
    if layout.expert_placement is not None:   # redundant slots: count the pairs' slots
        slots = slot_ids(jnp.where(seen.valid_T[:, None], seen.ids_TK, E), layout).reshape(-1)
        per_slot = jnp.bincount(slots, length=layout.num_slots + 1)[:-1].astype(jnp.int32)
        per_device = jax.lax.psum(per_slot, par.token_axes).reshape(par.ep, -1).sum(
            axis=1, dtype=jnp.int32)
    elif layout.moe_mode is MoEMode.EP:     # device i holds experts [i E_l, (i + 1) E_l)
        per_device = tokens_E.reshape(par.ep, layout.local_experts).sum(axis=1, dtype=jnp.int32)
    else:                                   # every device of data group g runs its pairs
        per_device = jnp.repeat(counts[E:], par.tp)
    per_node = per_device.reshape(par.nodes, -1).sum(axis=1, dtype=jnp.int32)
    rows = jnp.sum(tokens_E) // layout.cfg.num_experts_per_token
    mean_score = score_E / jnp.maximum(rows, 1).astype(jnp.float32)
    return ExpertLoad(tokens_E, per_device, per_node, mean_score,
                      imbalance(per_device), imbalance(per_node))


def imbalance(tokens: jax.Array) -> jax.Array:
    """max / mean of ``tokens`` [n] as float32 []; 1 when all are 0."""
    t = tokens.astype(jnp.float32)
    mean = jnp.mean(t)
    return jnp.where(mean > 0, jnp.max(t) / jnp.where(mean > 0, mean, 1.0), 1.0)


def expert_load_specs() -> ExpertLoad:
    """The shard_map out_specs of an ExpertLoad: every field replicated."""
    return ExpertLoad(*(P(),) * len(ExpertLoad._fields))


def expert_loads(stats: Any) -> dict[tuple, ExpertLoad]:
    """{module path: the latest ExpertLoad sown there} of ``stats``: what
    ``nnx.capture(..., RouterStats)`` returns, ``nnx.state(module,
    RouterStats)`` or ``nnx.pop(module, RouterStats)`` (an nnx.State). The
    path of a module called directly is ()."""
    out = {}
    for path, var in nnx.to_flat_state(stats):
        if path and path[-1] == STATS_NAME:
            value = var.get_value() if isinstance(var, nnx.Variable) else var
            out[tuple(path[:-1])] = value[-1] if isinstance(value, tuple) else value
    return out


def expert_load_json(load: ExpertLoad) -> dict:
    """One layer's statistics as plain JSON values: tokens_per_expert,
    tokens_per_device, tokens_per_node (lists of int), mean_score_per_expert
    (list of float) and imbalance {"device": float, "node": float}. Every
    field is the same on every device, so in a multi-process run each
    process reads its own copy (no collective)."""
    host = ExpertLoad(*(np.asarray(_local_copy(a)) for a in load))
    return {"tokens_per_expert": [int(v) for v in host.tokens_per_expert],
            "tokens_per_device": [int(v) for v in host.tokens_per_device],
            "tokens_per_node": [int(v) for v in host.tokens_per_node],
            "mean_score_per_expert": [float(v) for v in host.mean_score_per_expert],
            "imbalance": {"device": float(host.imbalance_device),
                          "node": float(host.imbalance_node)}}


def _local_copy(a):
    """A replicated array's copy on this process's first device (the whole
    array when it is not a jax.Array, or is fully addressable)."""
    if isinstance(a, jax.Array) and not a.is_fully_addressable:
        return a.addressable_data(0)
    return a


__all__ = ["ExpertLoad", "RouterStats", "RowRouting", "STATS_NAME", "expert_load_json",
           "expert_load_local", "expert_loads", "expert_load_specs", "imbalance"]
