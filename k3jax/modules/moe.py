"""KimiMoE: one Kimi K3 MoE layer on a mesh (docs/spec.md §2, §4, §5).

    x_TD -> route -> lat_TL = x @ lat_down -> routed experts (sum over top-k)
         -> RMSNorm -> @ lat_up  +  shared(x_TD)

Parameters (global shapes, F = the padded MoE intermediate):
    router_DE [D, E], router_bias_E [E] float32, lat_down_DL [D, L],
    lat_norm_L [L], lat_up_LD [L, D], the routed experts w1 / w3 [E, L, F] and
    w2 [E, F, L] in the Layout's format,
    shared.{gate_DF, up_DF, down_FD} (a KimiMLP of width I x num_shared_experts).

The routed experts' parameters are the ones ``layout.experts`` (a
WeightFormat, k3jax/formats/) declares: w1_ELF / w3_ELF / w2_EFL in the module
dtype for dense experts, or a packed format's own arrays (codes and scales),
which it hands the grouped matmuls as the weight objects they take
(``expert_weights``). A packed format's integer arrays are frozen
(PackedWeight, not nnx.Param; k3jax.variables): gradients flow through
their dequantized values to the input and the other weights, never to them.
The router bias is a RouterBias (selection only; update_router_bias). With redundant experts
(``Layout.expert_placement``) the experts' axis holds E + R slots, replicas
exact copies; the router's ids become slots right after routing
(k3jax.parallel.replicas.slot_ids) and everything after works on slots.

Two per-device bodies run inside ``jax.shard_map``, picked by ``Layout.dispatch``:
    moe_rows_local   Dispatch.OWN_ROWS: each device routes its own rows; rows
                     are all-gathered over ``Layout.dispatch_stages``, the
                     experts held here run, and the float32 latent is
                     reduce-scattered back before the RMSNorm (or, under
                     EpDispatch.ALL_TO_ALL, rows and latent move by ragged
                     all-to-all, k3jax.parallel.ep_exchange). Covers LOCAL (no axes),
                     TP under SP (TENSOR) and EP (all).
    moe_tp_local     Dispatch.ALL_REDUCE (tp > 1 without SP): rows replicated
                     over TENSOR; every expert's F split (TP) or whole experts
                     over (DATA, TENSOR) (EP over plain TP: rows all-gathered
                     and the latent reduce-scattered over DATA when dp > 1);
                     the routed latent and the shared expert's partial sum
                     are all-reduced over TENSOR in one psum.

With the router statistics on (``KimiMoE.router_stats``), ``with_router_stats``
wraps the body: the router keeps its sigmoid scores, and the call's
ExpertLoad (k3jax.modules.router_stats) is summed over the token axes from
each device's own valid rows and returned replicated beside y.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import AbstractMesh, Mesh

from k3jax.config import K3Config
from k3jax.layout import (
    TENSOR,
    Dispatch,
    EpDispatch,
    Layout,
    MlpMode,
    MoEMode,
    SharedOverlap,
    check_mesh,
)
from k3jax.modules.inputs import as_rows, from_rows
from k3jax.modules.mlp import (
    KimiMLP,
    gather_down,
    gather_gate_up,
    mlp_local,
    mlp_tp_partial,
)
from k3jax.modules.params import Init, ParamDecl, ParamSource, make_params, source_of
from k3jax.modules.router_stats import (
    STATS_NAME,
    RouterStats,
    RowRouting,
    expert_load_local,
    expert_load_specs,
)
from k3jax.ops import SiTU, rms_norm, route
from k3jax.ops.experts import (
    ExpertWeight,
    experts_down_combined,
    experts_up,
    routed_experts,
    sort_pairs,
)
from k3jax.ops.matmul import matmul
from k3jax.parallel.ep_exchange import all_to_all_routed, gather_staged, scatter_staged
from k3jax.parallel.replicas import slot_ids
from k3jax.parallel.sequence import on_layer_mesh, row_sharded_forward
from k3jax.variables import RouterBias
from pallas_kernels.situ_mlp.api import situ_mlp_up

SHARED_PREFIX = "shared."  # parameter-name prefix of the shared expert inside KimiMoE
# jax.named_scope of the two branches: compiled ops' op_name metadata carries
# them, so a schedule (k3jax.tools.hlo_schedule) can tell shared from routed work.
SHARED_SCOPE, ROUTED_SCOPE = "shared_expert", "routed_experts"


def moe_decls(layout: Layout) -> list[ParamDecl]:
    """The MoE's own parameters (the shared expert declares its own), in the
    Layout's dtype; the routed experts' are its format's
    (WeightFormat.param_decls), over the layout's E + R slots with redundant
    experts, each declaration then marking the logical expert of each slot
    (ParamDecl.slots: sources fill a slot from its expert)."""
    cfg, dtype = layout.cfg, layout.dtype
    D, L, E = cfg.hidden_size, cfg.routed_expert_hidden_size, cfg.num_experts
    specs = layout.moe_param_specs()
    decls = [ParamDecl("router_DE", (D, E), dtype, specs["router_DE"], Init.WEIGHT, D),
             ParamDecl("router_bias_E", (E,), jnp.dtype(jnp.float32), specs["router_bias_E"],
                       Init.BIAS, variable=RouterBias),
             ParamDecl("lat_down_DL", (D, L), dtype, specs["lat_down_DL"], Init.WEIGHT, D),
             ParamDecl("lat_up_LD", (L, D), dtype, specs["lat_up_LD"], Init.WEIGHT, L)]
    if cfg.latent_moe_use_norm:
        decls.append(ParamDecl("lat_norm_L", (L,), dtype, specs["lat_norm_L"], Init.NORM))
    experts = layout.experts.param_decls(layout.expert_layout)   # [E + R, ...] with redundant slots
    if (placement := layout.expert_placement) is not None:
        experts = [dataclasses.replace(d, slots=placement.slot_expert) for d in experts]
    return decls + experts


def expert_weights(p: dict, layout: Layout) -> tuple[ExpertWeight, ExpertWeight, ExpertWeight]:
    """(w1 [E, L, F], w3 [E, L, F], w2 [E, F, L]) from this device's expert
    shards ``p`` (E the local experts, F this shard's), as the grouped
    matmuls take them: whatever the layout's format hands them
    (WeightFormat.kernel_weights: the arrays as stored, or a packed format's
    weight objects, dequantized inside the matmuls to the activations' dtype)."""
    return layout.experts.kernel_weights(p, layout.dtype)


# -- per-device bodies (inside shard_map) --------------------------------------
# x_TD [T, D]: this device's rows (T = padded rows / Layout.row_shards);
# valid_T [T]: False on padding rows; p: this device's weight shards (router,
# latent projections and norm whole; experts [E/ep, L, F/s] etc. per
# Layout.moe_param_specs; p["shared"] the shared expert's, per its MlpLayout).
# Each returns y_TD [T, D] in x's dtype: this device's rows of the output.
# seen: None, or a list the router appends what it saw to (RowRouting of own
# rows, once per body) for the router statistics (``with_router_stats``).
def _latent_out(r_TL, p, cfg: K3Config, dtype):
    """Routed latent r_TL [T, L] (float32, fully reduced) -> RMSNorm ->
    up-projection -> [T, D] in ``dtype``."""
    if cfg.latent_moe_use_norm:
        r = rms_norm(r_TL, p["lat_norm_L"], cfg.rms_norm_eps, out_dtype=dtype)
    else:
        r = r_TL.astype(dtype)
    return matmul(r, p["lat_up_LD"])


def _route_own(x_TD, valid_T, p, layout: Layout, seen: list | None = None):
    """Route own rows x_TD [T, D] and project them to the latent: (lat_TL,
    ids_TK, w_TK) of these T rows, ids_TK the slots of the router's experts
    (k3jax.parallel.replicas.slot_ids: the expert ids themselves without
    redundant slots) (and, with ``seen``, append their
    RowRouting: the same routing, its scores kept)."""
    args = (x_TD, p["router_DE"], p["router_bias_E"], layout.cfg, valid_T)
    if seen is None:
        ids_TK, w_TK = route(*args)
    else:
        ids_TK, w_TK, scores_TE = route(*args, with_scores=True)
        seen.append(RowRouting(ids_TK, scores_TE, valid_T))
    return matmul(x_TD, p["lat_down_DL"]), slot_ids(ids_TK, layout), w_TK   # ids -> slots


def _dispatch(x_TD, valid_T, p, layout: Layout, seen: list | None = None):
    """``_route_own``, all-gathered over ``layout.dispatch_stages`` ([T * n, .],
    n the devices of ``dispatch_axes``) when there are any."""
    rows = _route_own(x_TD, valid_T, p, layout, seen)
    return tuple(gather_staged(a, layout.dispatch_stages) for a in rows)


def _first_expert(layout: Layout):
    """Global id of this device's first expert (EP), else 0."""
    if layout.moe_mode is MoEMode.EP:
        return jax.lax.axis_index(layout.expert_axes) * layout.local_experts
    return 0


def _routed_partial(x_TD, valid_T, p, *, layout: Layout, act: SiTU, seen: list | None = None):
    """Route own rows x_TD [T, D], then the routed experts held here -> float32
    latent [T * n, L], summed over the experts of this device (EP: global ids
    from ``first_expert``), unreduced over ``layout.dispatch_axes`` (n their
    size, 1 without): lat/ids/weights are all-gathered over them first."""
    lat_TL, ids_TK, w_TK = _dispatch(x_TD, valid_T, p, layout, seen)
    experts = expert_weights(p, layout)
    return routed_experts(lat_TL, ids_TK, w_TK, *experts, act,
                          first_expert=_first_expert(layout), backend=layout.backend)


def _own_rows_latent(x_TD, valid_T, p, *, layout: Layout, act: SiTU, seen: list | None = None):
    """The float32 routed latent [T, L] of own rows, summed over all their
    experts: staged gather -> experts -> staged reduce-scatter, or the
    dropless ragged all-to-all (EpDispatch.ALL_TO_ALL)."""
    if layout.ep_dispatch is not EpDispatch.ALL_TO_ALL:
        return _scatter_latent(_routed_partial(x_TD, valid_T, p, layout=layout, act=act,
                                               seen=seen), layout)
    between, inside = layout.exchange_axes
    par = layout.parallel
    lat_TL, ids_TK, w_TK = _route_own(x_TD, valid_T, p, layout, seen)
    experts = expert_weights(p, layout)
    return all_to_all_routed(lat_TL, ids_TK, w_TK, *experts, act,
                             between=between, inside=inside, nodes=par.nodes,
                             devices_per_node=par.ep // par.nodes,
                             num_experts=layout.num_slots,
                             first_expert=_first_expert(layout),
                             emulated=layout.ragged_emulated, backend=layout.backend)


def moe_rows_local(x_TD, valid_T, p, *, layout: Layout, act: SiTU, seen: list | None = None):
    """Dispatch.OWN_ROWS: route own rows; all-gather lat/ids/weights over
    ``layout.dispatch_stages`` ([T * n, .], n the size of ``dispatch_axes``);
    run the experts held here (global ids from ``first_expert`` under EP);
    reduce-scatter the float32 latent back to [T, L] (or move rows and latent
    by ragged all-to-all: ``_own_rows_latent``); add the shared expert of own rows (replicated or
    SP-sharded, which issues its own collectives over TENSOR; under
    SharedOverlap.WEIGHTS, shared_weights_local)."""
    shared = layout.shared_mlp
    if shared.mode is MlpMode.SP_SHARDED and shared.overlap is SharedOverlap.WEIGHTS:
        return shared_weights_local(x_TD, valid_T, p, layout=layout, act=act, seen=seen)
    with jax.named_scope(ROUTED_SCOPE):
        r_TL = _own_rows_latent(x_TD, valid_T, p, layout=layout, act=act, seen=seen)
        routed_TD = _latent_out(r_TL, p, layout.cfg, x_TD.dtype)
    with jax.named_scope(SHARED_SCOPE):
        shared_TD = mlp_local(shared)(x_TD, p["shared"], act, layout.backend)
    return routed_TD + shared_TD


def _scatter_latent(r_TL, layout: Layout):
    return scatter_staged(r_TL, layout.dispatch_stages)


def shared_weights_local(x_TD, valid_T, p, *, layout: Layout, act: SiTU,
                         seen: list | None = None):
    """moe_rows_local with the shared expert in SharedOverlap.WEIGHTS, its two
    weight all-gathers placed under the routed experts' two grouped matmuls.
    XLA keeps one all-gather in flight at a time, and the routed rows' own
    all-gathers must land before the first grouped matmul, so each weight
    gather takes one grouped matmul, pinned there by optimization barriers:

      1. all-gather gate/up stacked (gather_gate_up), issued before the router;
      2. route, project and gather the routed rows; sort the pairs; the first
         grouped matmul (gate/up + SiTU);
      3. barrier: its output, the pairs (top-k weights), x, the gathered
         gate/up and the down shard -- the gate/up gather and the routed
         gathers are done before the second grouped matmul, the down gather
         not begun, and the shared gate/up GEMM cannot be merged with the
         routed latent projection of the same x (which would pull the
         gate/up gather's done before the router);
      4. all-gather down (gather_down); the shared gate/up + SiTU on own rows
         (the full gate/up die here, before the second grouped matmul's
         buffers exist); the second grouped matmul with the top-k combine
         (experts_down_combined), its rows and the gathered down pinned in
         one barrier between the two -- the down gather is done right after
         the grouped matmul, so it travels under it;
      5. the combine into the routed partial latent; the shared down GEMM
         while the routed latent is reduce-scattered; the routed latent's
         RMSNorm and up-projection, then the sum.

    The same ops as the replicated shared expert (situ_mlp's up, then down)
    and as routed_experts: same bits out."""
    w = p["shared"]
    with jax.named_scope(SHARED_SCOPE):
        gate_DF, up_DF = gather_gate_up(w)
    with jax.named_scope(ROUTED_SCOPE):
        lat_TL, ids_TK, w_TK = _dispatch(x_TD, valid_T, p, layout, seen)
        w1, w3, w2 = expert_weights(p, layout)
        pairs = sort_pairs(ids_TK, w_TK, layout.local_experts, _first_expert(layout))
        h_PF = experts_up(lat_TL, pairs, w1, w3, act, layout.backend)
        h_PF, weights_P, x_shared_TD, gate_DF, up_DF, down_shard_FD = jax.lax.optimization_barrier(
            (h_PF, pairs.weights_P, x_TD, gate_DF, up_DF, w["down_FD"]))
        pairs = pairs._replace(weights_P=weights_P)
    with jax.named_scope(SHARED_SCOPE):
        down_FD = gather_down(down_shard_FD)
        h_shared_TF = situ_mlp_up(x_shared_TD, gate_DF, up_DF, beta=act.beta,
                                  linear_beta=act.linear_beta, backend=layout.backend)
    with jax.named_scope(ROUTED_SCOPE):
        r_TL, down_FD = experts_down_combined(h_PF, pairs, w2, lat_TL.shape[0],
                                              layout.backend, pinned=down_FD)
    with jax.named_scope(SHARED_SCOPE):
        shared_TD = matmul(h_shared_TF, down_FD, out_dtype=x_TD.dtype)
    with jax.named_scope(ROUTED_SCOPE):
        routed_TD = _latent_out(_scatter_latent(r_TL, layout), p, layout.cfg, x_TD.dtype)
    return routed_TD + shared_TD


def moe_tp_local(x_TD, valid_T, p, *, layout: Layout, act: SiTU, seen: list | None = None):
    """Dispatch.ALL_REDUCE (tp > 1 without SP): rows replicated over TENSOR.
    TP: every expert's F split. EP over plain TP: the experts held here are
    whole (global ids from ``first_expert``); with dp > 1 lat/ids/weights are
    first all-gathered over the data axes ([T * dp, .], ``layout.dispatch_axes``,
    in the stages of ``layout.dispatch_stages``: NODE first under
    EpDispatch.HIERARCHICAL) and the float32 routed latent reduce-scattered
    back to [T, L] over them.
    Then the float32 routed latent [T, L] (partial over F or over experts) and
    the shared expert's float32 partial [T, D] are summed over TENSOR in one
    all-reduce of [T, L + D]."""
    if layout.shared_mlp.mode is not MlpMode.TP:
        raise AssertionError(f"moe_tp_local needs a TP shared expert, got {layout.shared_mlp.mode}")
    with jax.named_scope(ROUTED_SCOPE):
        r_TL = _routed_partial(x_TD, valid_T, p, layout=layout, act=act, seen=seen)
        r_TL = _scatter_latent(r_TL, layout)
    with jax.named_scope(SHARED_SCOPE):
        shared_TD = mlp_tp_partial(x_TD, p["shared"], act, layout.backend)
    L = r_TL.shape[1]
    both = jax.lax.psum(jnp.concatenate([r_TL, shared_TD], axis=1), TENSOR)
    return _latent_out(both[:, :L], p, layout.cfg, x_TD.dtype) + both[:, L:].astype(x_TD.dtype)


MOE_LOCAL = {Dispatch.OWN_ROWS: moe_rows_local, Dispatch.ALL_REDUCE: moe_tp_local}


def with_router_stats(body):
    """A per-device body that also returns the call's ExpertLoad
    (k3jax.modules.router_stats), from the routing ``body`` runs: (y_TD, load)."""
    def stats_body(x_TD, valid_T, p, *, layout: Layout, act: SiTU):
        seen: list = []
        y_TD = body(x_TD, valid_T, p, layout=layout, act=act, seen=seen)
        if len(seen) != 1:
            raise AssertionError(f"the MoE body routed {len(seen)} times, expected once")
        return y_TD, expert_load_local(seen[0], layout)
    return stats_body


class KimiMoE(nnx.Module):
    """One K3 MoE layer. ``__call__``: x [..., D] (any leading shape, e.g.
    [T, D] or [B, S, D]) -> y of the same shape, in the Layout's dtype (a
    floating x is cast to it; any other dtype is a TypeError naming it,
    k3jax.modules.inputs). The rows (the leading dimensions flattened, T of
    them) are computed split over ``layout.token_axes``; the output is placed
    that way when T is a multiple of the row blocks, else XLA chooses.
    Dtype, backend and expert format are the Layout's (``self.dtype``,
    ``self.backend``, ``self.experts`` repeat them). ``mesh`` must be the
    (dp, tp) mesh of ``layout.parallel``.

    Weights come from ``rngs`` (an nnx.Rngs: random, each generated into its
    shards) or ``source`` (RandomSource, AbstractSource, a checkpoint's),
    exactly one. Variable types (k3jax.variables): the router bias is a
    RouterBias, a packed format's arrays PackedWeights, everything else
    nnx.Param (what trains).

    ``router_stats`` (also settable later as ``module.router_stats``): each
    call sows the call's ExpertLoad (tokens per expert, device and node,
    mean router score per expert, imbalance; k3jax.modules.router_stats)
    into the ``RouterStats`` collection, ``nnx.capture(module,
    RouterStats)(x)`` returning it. Off, the program holds nothing of it.
    ``self.mesh`` is the layer's mesh (k3jax.layout.check_mesh: the same
    devices as ``mesh``, k3jax's axis names, Auto axes)."""

    def __init__(self, layout: Layout, mesh: Mesh | AbstractMesh, *,
                 rngs: nnx.Rngs | None = None, source: ParamSource | None = None,
                 router_stats: bool = False):
        source = source_of("KimiMoE", rngs, source)
        mesh = check_mesh(mesh, layout.parallel, "KimiMoE")   # the layer's mesh (Auto, k3jax's names)
        self.layout = layout
        self.cfg = layout.cfg
        self.mesh = mesh
        self.router_stats = bool(router_stats)
        self.dtype = layout.dtype
        self.backend = layout.backend
        self.act = SiTU.from_config(self.cfg)
        self.experts = layout.experts
        self._decls = moe_decls(layout)
        make_params(self, self._decls, mesh, source)
        self.shared = KimiMLP(layout, layout.shared_mlp, mesh, source=source,
                              name_prefix=SHARED_PREFIX)

    def weights(self) -> dict:
        return {**{d.name: getattr(self, d.name)[...] for d in self._decls},
                "shared": self.shared.weights()}

    def __call__(self, x: jax.Array) -> jax.Array:
        # an x on the user's mesh runs on the layer's, its output placed back like it
        return on_layer_mesh(self._forward, self.mesh, self.layout.parallel)(x)

    def _forward(self, x: jax.Array) -> jax.Array:
        x_TD, lead = as_rows(x, self.cfg.hidden_size, "KimiMoE")
        y_TD = moe_forward(self.layout.for_tokens(x_TD.shape[0]), self.mesh,
                           stats=self.router_stats)(x_TD, self.weights())
        if self.router_stats:
            y_TD, load = y_TD
            self.sow(RouterStats, STATS_NAME, load)
        return from_rows(y_TD, lead)


@functools.lru_cache(maxsize=64)
def moe_forward(layout: Layout, mesh: Mesh, stats: bool = False):
    """The jitted global forward (x_TD, weights) -> y_TD of one MoE layout
    (``row_sharded_forward`` around the body ``layout.dispatch`` names;
    padding rows are routed to no expert); with ``stats``, (y_TD,
    ExpertLoad) (``with_router_stats``). Cached, so eager calls compile
    once per shape."""
    weight_specs = {**{d.name: d.spec for d in moe_decls(layout)},
                    "shared": layout.shared_mlp.param_specs}
    body = MOE_LOCAL[layout.dispatch]
    body = functools.partial(with_router_stats(body) if stats else body, layout=layout,
                             act=SiTU.from_config(layout.cfg))
    return row_sharded_forward(body, mesh, layout.parallel, layout.dtype, weight_specs,
                               aux_specs=expert_load_specs() if stats else None)
