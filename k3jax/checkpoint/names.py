"""Checkpoint tensor names (docs/spec.md §3), in one table keyed by module parameter.

Every weight is stored ``[out, in]`` (torch Linear); k3jax parameters are
``[in, out]``, so most entries are transposed on load. Routed experts are one
tensor per expert, stacked on load along the leading E axis; their entries
come from the registered expert formats (WeightFormat.checkpoint_tensors,
k3jax.formats), which say what else happens to them (a packed format's raw
codes are held ``[out, in/2]`` as stored, their bits interleaved within each
4 bytes; its scales are transposed like the weights).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from k3jax.formats import StoredTensor, expert_tensors

LANGUAGE_MODEL_PREFIX = "language_model."


@dataclasses.dataclass(frozen=True)
class TensorRef:
    """Where a module parameter comes from.

    suffix: the name after the layer's prefix; ``{e}`` stands for the expert id.
    transpose: the stored tensor is the parameter's transpose ([out, in]).
    per_expert: one stored tensor per expert, stacked along the parameter's axis 0.
    raw, dtypes, interleave, check: a format's own tensor (StoredTensor):
    read as stored with a dtype in ``dtypes``, its codes interleaved after
    reading, each block passed to ``check`` (ValueError: rejected).
    """

    suffix: str
    transpose: bool
    per_expert: bool = False
    raw: bool = False
    dtypes: tuple[str, ...] = ()
    interleave: bool = False
    check: Callable[[np.ndarray], None] | None = None

    @classmethod
    def of_expert(cls, stored: StoredTensor) -> TensorRef:
        """The per-expert entry ``experts.{e}.<suffix>`` of a format's parameter."""
        return cls(f"experts.{{e}}.{stored.suffix}", stored.transpose, True, stored.raw,
                   stored.dtypes, stored.interleave, stored.check)

    def name(self, prefix: str, expert: int | None = None) -> str:
        return prefix + (self.suffix.format(e=expert) if self.per_expert else self.suffix)


def mlp_tensors(param_prefix: str = "", name_prefix: str = "") -> dict[str, TensorRef]:
    return {f"{param_prefix}gate_DF": TensorRef(f"{name_prefix}gate_proj.weight", True),
            f"{param_prefix}up_DF": TensorRef(f"{name_prefix}up_proj.weight", True),
            f"{param_prefix}down_FD": TensorRef(f"{name_prefix}down_proj.weight", True)}


DENSE_TENSORS: dict[str, TensorRef] = mlp_tensors()

MOE_TENSORS: dict[str, TensorRef] = {
    "router_DE": TensorRef("gate.weight", True),
    "router_bias_E": TensorRef("gate.e_score_correction_bias", False),
    "lat_down_DL": TensorRef("routed_expert_down_proj.weight", True),
    "lat_norm_L": TensorRef("routed_expert_norm.weight", False),
    "lat_up_LD": TensorRef("routed_expert_up_proj.weight", True),
    **mlp_tensors("shared.", "shared_experts."),
}
"""The MoE layer's tensors other than the routed experts'."""


def layer_prefix(layer: int, is_moe: bool) -> str:
    """The name prefix of layer ``layer`` (without the optional language_model.)."""
    return f"model.layers.{layer}." + ("block_sparse_moe." if is_moe else "mlp.")


def layer_tensors(is_moe: bool) -> dict[str, TensorRef]:
    """{module parameter: TensorRef} of a layer: for a MoE layer, its own
    tensors and the routed experts' of every registered format."""
    if not is_moe:
        return DENSE_TENSORS
    return {**MOE_TENSORS, **{param: TensorRef.of_expert(stored)
                              for param, stored in expert_tensors().items()}}
