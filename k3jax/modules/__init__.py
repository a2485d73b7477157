"""Flax NNX modules. They own parameters and pick a ``*_local`` body by layout."""

from k3jax.modules.layer import build_layer, layer_decls
from k3jax.modules.mlp import KimiMLP
from k3jax.modules.moe import KimiMoE
from k3jax.modules.params import AbstractSource, ParamSource, RandomSource

__all__ = ["build_layer", "layer_decls", "KimiMLP", "KimiMoE", "AbstractSource", "ParamSource",
           "RandomSource"]
