"""Routed-expert weight formats, one file each (docs/extending.md):

    base       WeightFormat (what a format owns), ExpertLayout, StoredTensor
    decl       ParamDecl, Padding, Init: how any parameter is declared
    dense      DenseFormat: float experts ("dense"; "mxfp4-dequant")
    mxfp4      Mxfp4Format: packed E2M1 codes + UE8M0 scales ("mxfp4")
    registry   names -> formats, ExpertStorage (the built-in choices)

make_layout resolves the user's choice here and the Layout holds the bound
format; the modules, the loader and the tools call its methods and name no
format themselves.
"""

from k3jax.formats.base import ExpertLayout, ExpertWeights, StoredTensor, WeightFormat
from k3jax.formats.decl import Init, Padding, ParamDecl
from k3jax.formats.dense import DenseFormat
from k3jax.formats.mxfp4 import Mxfp4Format
from k3jax.formats.registry import (
    ExpertStorage,
    codecs,
    dequantized_form,
    expert_tensors,
    get_format,
    register_format,
    registered_formats,
    unregister_format,
)

LAYOUT_ALIASES = {"Mxfp4ShardError": "ExpertShardError"}
"""Earlier names of k3jax.layout.ExpertShardError, which k3jax.layout still
resolves for callers written before the formats had their own package."""

__all__ = ["DenseFormat", "ExpertLayout", "ExpertStorage", "ExpertWeights", "Init",
           "LAYOUT_ALIASES", "Mxfp4Format", "Padding", "ParamDecl", "StoredTensor",
           "WeightFormat", "codecs", "dequantized_form", "expert_tensors", "get_format",
           "register_format", "registered_formats", "unregister_format"]
