"""The module of layer N, dense MLP or MoE, on a mesh: its parameter
declarations (layer_decls) and the module itself (build_layer)."""

from __future__ import annotations

from jax.sharding import AbstractMesh, Mesh

from k3jax.layout import Layout
from k3jax.modules.mlp import KimiMLP, mlp_decls
from k3jax.modules.moe import SHARED_PREFIX, KimiMoE, moe_decls
from k3jax.modules.params import ParamDecl, ParamSource


def layer_decls(layout: Layout, layer: int) -> list[ParamDecl]:
    """Every parameter declaration of the module build_layer makes for ``layer``
    (what a checkpoint must hold for it, before any module exists)."""
    if not layout.cfg.is_moe_layer(layer):
        return mlp_decls(layout.dense_mlp, layout.dtype)
    return moe_decls(layout) + mlp_decls(layout.shared_mlp, layout.dtype, SHARED_PREFIX)


def build_layer(layout: Layout, layer: int, mesh: Mesh | AbstractMesh, *,
                source: ParamSource) -> KimiMLP | KimiMoE:
    """Layer ``layer``'s block: KimiMoE for MoE layers, else the dense KimiMLP.
    Dtype, backend and (MoE layers) expert format are the Layout's."""
    if layout.cfg.is_moe_layer(layer):
        return KimiMoE(layout, mesh, source=source)
    return KimiMLP(layout, layout.dense_mlp, mesh, source=source)
