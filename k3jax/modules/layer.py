"""build_layer: the module of layer N, dense MLP or MoE, on a mesh."""

from __future__ import annotations

import jax.numpy as jnp
from jax.sharding import AbstractMesh, Mesh

from k3jax.layout import Layout
from k3jax.modules.mlp import KimiMLP
from k3jax.modules.moe import ExpertStorage, KimiMoE
from k3jax.modules.params import ParamSource
from k3jax.ops import SiTU
from pallas_kernels.backend import Backend


def build_layer(layout: Layout, layer: int, mesh: Mesh | AbstractMesh, *, source: ParamSource,
                dtype=jnp.float32, backend: Backend = "auto",
                experts: ExpertStorage = ExpertStorage.DENSE) -> KimiMLP | KimiMoE:
    """Layer ``layer``'s block: KimiMoE for MoE layers, else the dense KimiMLP.
    ``experts`` chooses the routed experts' storage (MoE layers only)."""
    cfg = layout.cfg
    if cfg.is_moe_layer(layer):
        return KimiMoE(layout, mesh, dtype=dtype, source=source, backend=backend, experts=experts)
    return KimiMLP(layout.dense_mlp, SiTU.from_config(cfg), mesh, layout.token_axes,
                   dtype=dtype, source=source, backend=backend)
