"""Flax NNX modules. They own parameters and pick a ``*_local`` body by layout.

Their weights' nnx.Variable types (k3jax.variables): nnx.Param (trains),
RouterBias (the router's selection bias), PackedWeight (a packed expert
format's integer arrays); ``WEIGHTS`` filters all three. The MoE layer's
router statistics (``router_stats=True``) go to the ``RouterStats``
collection, one ``ExpertLoad`` a call (k3jax.modules.router_stats)."""

from k3jax.modules.layer import build_layer, layer_decls, module_decls
from k3jax.modules.mlp import KimiMLP
from k3jax.modules.moe import KimiMoE
from k3jax.modules.params import AbstractSource, ParamSource, RandomSource, RngsSource
from k3jax.modules.router_stats import ExpertLoad, RouterStats, expert_loads
from k3jax.variables import WEIGHTS, PackedWeight, RouterBias, update_router_bias

__all__ = ["build_layer", "layer_decls", "module_decls", "KimiMLP", "KimiMoE", "AbstractSource",
           "ParamSource", "RandomSource", "RngsSource", "WEIGHTS", "PackedWeight", "RouterBias",
           "update_router_bias", "ExpertLoad", "RouterStats", "expert_loads"]
