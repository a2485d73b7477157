"""KimiMoE: one Kimi K3 MoE layer on a mesh (SPEC 2, 4, 5).

    x_TD -> route -> lat_TL = x @ lat_down -> routed experts (sum over top-k)
         -> RMSNorm -> @ lat_up  +  shared(x_TD)

Parameters (global shapes, F = the padded MoE intermediate):
    router_DE [D, E], router_bias_E [E] float32, lat_down_DL [D, L],
    lat_norm_L [L], lat_up_LD [L, D], w1_ELF / w3_ELF [E, L, F], w2_EFL [E, F, L],
    shared.{gate_DF, up_DF, down_FD} (a KimiMLP of width I x num_shared_experts).

Two per-device bodies run inside ``jax.shard_map``:
    moe_rows_local   each device routes its own rows; rows are all-gathered over
                     ``Layout.dispatch_axes``, the experts held here run, and the
                     float32 latent is reduce-scattered back before the RMSNorm.
                     Covers LOCAL (no axes), TP under SP (TENSOR) and EP (all).
    moe_tp_local     plain TP: rows replicated over TENSOR, every expert's F
                     split; the routed latent and the shared expert's partial
                     sum are all-reduced together in one psum.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import AbstractMesh, Mesh, NamedSharding

from pallas_kernels.backend import Backend

from k3jax.config import K3Config
from k3jax.layout import MESH_AXES, TENSOR, Layout, MoEMode
from k3jax.modules.mlp import MLP_LOCAL, KimiMLP, mlp_tp_partial
from k3jax.modules.params import Init, Padding, ParamDecl, ParamSource, make_params
from k3jax.ops import SiTU, rms_norm, route, routed_experts
from k3jax.ops.matmul import matmul
from k3jax.sequence_parallel import gather_rows, pad_rows, scatter_rows


def moe_decls(layout: Layout, dtype) -> list[ParamDecl]:
    """The MoE's own parameters (the shared expert declares its own)."""
    cfg = layout.cfg
    D, L, E, I = (cfg.hidden_size, cfg.routed_expert_hidden_size, cfg.num_experts,
                  cfg.moe_intermediate_size)
    F = layout.padded_moe_intermediate
    specs = layout.moe_param_specs()
    pad = (lambda axis: Padding(axis, layout.expert_shards, I)) if F != I else (lambda axis: None)
    decls = [ParamDecl("router_DE", (D, E), dtype, specs["router_DE"], Init.WEIGHT, D),
             ParamDecl("router_bias_E", (E,), jnp.dtype(jnp.float32), specs["router_bias_E"], Init.BIAS),
             ParamDecl("lat_down_DL", (D, L), dtype, specs["lat_down_DL"], Init.WEIGHT, D),
             ParamDecl("lat_up_LD", (L, D), dtype, specs["lat_up_LD"], Init.WEIGHT, L),
             ParamDecl("w1_ELF", (E, L, F), dtype, specs["w1_ELF"], Init.WEIGHT, L, pad(2)),
             ParamDecl("w3_ELF", (E, L, F), dtype, specs["w3_ELF"], Init.WEIGHT, L, pad(2)),
             ParamDecl("w2_EFL", (E, F, L), dtype, specs["w2_EFL"], Init.WEIGHT, I, pad(1))]
    if cfg.latent_moe_use_norm:
        decls.append(ParamDecl("lat_norm_L", (L,), dtype, specs["lat_norm_L"], Init.NORM))
    return decls


# -- per-device bodies ------------------------------------------------------
def _latent_out(r_TL, p, cfg: K3Config, dtype):
    """Routed latent (float32, fully reduced) -> RMSNorm -> up-projection."""
    if cfg.latent_moe_use_norm:
        r = rms_norm(r_TL, p["lat_norm_L"], cfg.rms_norm_eps, out_dtype=dtype)
    else:
        r = r_TL.astype(dtype)
    return matmul(r, p["lat_up_LD"])


def moe_rows_local(x_TD, valid_T, p, *, layout: Layout, act: SiTU, backend: Backend):
    """Own rows in, own rows out; see the module docstring."""
    cfg = layout.cfg
    ids_TK, w_TK = route(x_TD, p["router_DE"], p["router_bias_E"], cfg, valid_T)
    lat_TL = matmul(x_TD, p["lat_down_DL"])
    axes = layout.dispatch_axes
    first_expert = 0
    if axes:
        lat_TL, ids_TK, w_TK = (gather_rows(a, axes) for a in (lat_TL, ids_TK, w_TK))
    if layout.moe_mode is MoEMode.EP:
        first_expert = jax.lax.axis_index(layout.expert_axes) * layout.local_experts
    r_TL = routed_experts(lat_TL, ids_TK, w_TK, p["w1_ELF"], p["w3_ELF"], p["w2_EFL"], act,
                          first_expert=first_expert, backend=backend)
    if axes:
        r_TL = scatter_rows(r_TL, axes)
    shared_TD = MLP_LOCAL[layout.shared_mlp.mode](x_TD, p["shared"], act, backend)
    return _latent_out(r_TL, p, cfg, x_TD.dtype) + shared_TD


def moe_tp_local(x_TD, valid_T, p, *, layout: Layout, act: SiTU, backend: Backend):
    """Plain TP: one all-reduce over TENSOR for [routed latent | shared partial]."""
    cfg = layout.cfg
    ids_TK, w_TK = route(x_TD, p["router_DE"], p["router_bias_E"], cfg, valid_T)
    lat_TL = matmul(x_TD, p["lat_down_DL"])
    r_TL = routed_experts(lat_TL, ids_TK, w_TK, p["w1_ELF"], p["w3_ELF"], p["w2_EFL"], act,
                          backend=backend)
    shared_TD = mlp_tp_partial(x_TD, p["shared"], act, backend)
    L = r_TL.shape[1]
    both = jax.lax.psum(jnp.concatenate([r_TL, shared_TD], axis=1), TENSOR)
    return _latent_out(both[:, :L], p, cfg, x_TD.dtype) + both[:, L:].astype(x_TD.dtype)


class KimiMoE(nnx.Module):
    """One K3 MoE layer. ``__call__``: x_TD [T, D] (all rows, any T) -> [T, D]."""

    def __init__(self, layout: Layout, mesh: Mesh | AbstractMesh, *, dtype=jnp.float32,
                 source: ParamSource, backend: Backend = "auto"):
        if tuple(mesh.axis_names) != MESH_AXES or tuple(mesh.axis_sizes) != (
                layout.parallel.dp, layout.parallel.tp):
            raise ValueError(f"KimiMoE: mesh {dict(mesh.shape)} does not match the layout "
                             f"({layout.parallel.describe()})")
        self.layout = layout
        self.cfg = layout.cfg
        self.mesh = mesh
        self.dtype = jnp.dtype(dtype)
        self.backend = backend
        self.act = SiTU.from_config(self.cfg)
        make_params(self, moe_decls(layout, self.dtype), mesh, source)
        self.shared = KimiMLP(layout.shared_mlp, self.act, mesh, layout.token_axes,
                              dtype=dtype, source=source, backend=backend, name_prefix="shared.")

    def weights(self) -> dict:
        names = [d.name for d in moe_decls(self.layout, self.dtype)]
        return {**{n: getattr(self, n)[...] for n in names}, "shared": self.shared.weights()}

    def weight_specs(self) -> dict:
        specs = self.layout.moe_param_specs()
        own = {d.name: specs[d.name] for d in moe_decls(self.layout, self.dtype)}
        return {**own, "shared": self.layout.shared_mlp.param_specs}

    def __call__(self, x_TD: jax.Array) -> jax.Array:
        D = self.cfg.hidden_size
        if x_TD.ndim != 2 or x_TD.shape[1] != D:
            raise ValueError(f"KimiMoE: x must be [T, {D}], got {list(x_TD.shape)}")
        T = x_TD.shape[0]
        x_pad, valid = pad_rows(x_TD.astype(self.dtype), self.layout.row_shards)
        x_spec = self.layout.x_TD
        row_spec = jax.sharding.PartitionSpec(self.layout.token_axes)
        x_pad = jax.lax.with_sharding_constraint(x_pad, NamedSharding(self.mesh, x_spec))
        body = moe_tp_local if (self.layout.moe_mode is MoEMode.TP
                                and not self.layout.dispatch_axes) else moe_rows_local
        fn = functools.partial(body, layout=self.layout, act=self.act, backend=self.backend)
        y = jax.shard_map(fn, mesh=self.mesh, in_specs=(x_spec, row_spec, self.weight_specs()),
                          out_specs=x_spec)(x_pad, valid, self.weights())
        return y[:T]
