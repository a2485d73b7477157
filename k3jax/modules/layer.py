"""The module of layer N, dense MLP or MoE, on a mesh: its parameter
declarations (layer_decls) and the module itself (build_layer)."""

from __future__ import annotations

import jax.numpy as jnp
from jax.sharding import AbstractMesh, Mesh

from k3jax.layout import Layout
from k3jax.modules.mlp import KimiMLP, mlp_decls
from k3jax.modules.moe import SHARED_PREFIX, ExpertStorage, KimiMoE, moe_decls
from k3jax.modules.params import ParamDecl, ParamSource
from k3jax.ops import SiTU
from pallas_kernels.backend import Backend


def layer_decls(layout: Layout, layer: int, dtype,
                experts: ExpertStorage = ExpertStorage.DENSE) -> list[ParamDecl]:
    """Every parameter declaration of the module build_layer makes for ``layer``
    (what a checkpoint must hold for it, before any module exists)."""
    dtype = jnp.dtype(dtype)
    if not layout.cfg.is_moe_layer(layer):
        return mlp_decls(layout.dense_mlp, dtype)
    return moe_decls(layout, dtype, experts) + mlp_decls(layout.shared_mlp, dtype, SHARED_PREFIX)


def build_layer(layout: Layout, layer: int, mesh: Mesh | AbstractMesh, *, source: ParamSource,
                dtype=jnp.float32, backend: Backend = "auto",
                experts: ExpertStorage = ExpertStorage.DENSE) -> KimiMLP | KimiMoE:
    """Layer ``layer``'s block: KimiMoE for MoE layers, else the dense KimiMLP.
    ``experts`` chooses the routed experts' storage (MoE layers only)."""
    cfg = layout.cfg
    if cfg.is_moe_layer(layer):
        return KimiMoE(layout, mesh, dtype=dtype, source=source, backend=backend, experts=experts)
    return KimiMLP(layout.dense_mlp, SiTU.from_config(cfg), mesh, dtype=dtype, source=source,
                   backend=backend)
