"""The module of layer N, dense MLP or MoE, on a mesh: its parameter
declarations (layer_decls, module_decls) and the module itself (build_layer)."""

from __future__ import annotations

from flax import nnx
from jax.sharding import AbstractMesh, Mesh

from k3jax.layout import Layout
from k3jax.modules.mlp import KimiMLP, mlp_decls
from k3jax.modules.moe import SHARED_PREFIX, KimiMoE, moe_decls
from k3jax.modules.params import ParamDecl, ParamSource, source_of


def layer_decls(layout: Layout, layer: int) -> list[ParamDecl]:
    """Every parameter declaration of the module build_layer makes for ``layer``
    (what a checkpoint must hold for it, before any module exists)."""
    if not layout.cfg.is_moe_layer(layer):
        return mlp_decls(layout.dense_mlp, layout.dtype)
    return moe_decls(layout) + mlp_decls(layout.shared_mlp, layout.dtype, SHARED_PREFIX)


def module_decls(module: KimiMLP | KimiMoE) -> dict[str, ParamDecl]:
    """{param path ("shared.gate_DF"): declaration} of every weight ``module``
    holds (nnx.Param, RouterBias and PackedWeight alike)."""
    if isinstance(module, KimiMoE):
        decls = moe_decls(module.layout) + mlp_decls(module.shared.layout, module.dtype,
                                                     SHARED_PREFIX)
    elif isinstance(module, KimiMLP):
        decls = mlp_decls(module.layout, module.dtype)
    else:
        raise TypeError(f"expected a KimiMLP or KimiMoE, got {type(module).__name__}")
    return {d.name: d for d in decls}


def build_layer(layout: Layout, layer: int, mesh: Mesh | AbstractMesh, *,
                rngs: nnx.Rngs | None = None, source: ParamSource | None = None
                ) -> KimiMLP | KimiMoE:
    """Layer ``layer``'s block: KimiMoE for MoE layers, else the dense KimiMLP.
    Dtype, backend and (MoE layers) expert format are the Layout's. Weights
    come from ``rngs`` (nnx.Rngs, as Flax modules take it; under
    ``nnx.eval_shape`` the layer is abstract) or ``source`` (RandomSource,
    AbstractSource, a checkpoint's), exactly one."""
    source = source_of("build_layer", rngs, source)
    if layout.cfg.is_moe_layer(layer):
        return KimiMoE(layout, mesh, source=source)
    return KimiMLP(layout, layout.dense_mlp, mesh, source=source)
