"""Checkpoint tensor names (docs/spec.md §3), in one table keyed by module parameter.

Every weight is stored ``[out, in]`` (torch Linear); k3jax parameters are
``[in, out]``, so most entries are transposed on load. The exception is the
packed MXFP4 routed-expert codes, which k3jax holds ``[out, in/2]`` as stored,
their bits interleaved within each 4 bytes (pallas_kernels.mxfp4_words; their
scales are transposed like the weights). Routed experts are one
tensor per expert, stacked on load along the leading E axis.
"""

from __future__ import annotations

import dataclasses

LANGUAGE_MODEL_PREFIX = "language_model."


@dataclasses.dataclass(frozen=True)
class TensorRef:
    """Where a module parameter comes from.

    suffix: the name after the layer's prefix; ``{e}`` stands for the expert id.
    transpose: the stored tensor is the parameter's transpose ([out, in]).
    per_expert: one stored tensor per expert, stacked along the parameter's axis 0.
    """

    suffix: str
    transpose: bool
    per_expert: bool = False
    packed: bool = False      # raw MXFP4 bytes (weight_packed / weight_scale), read as uint8

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
    "w1_ELF": TensorRef("experts.{e}.w1.weight", True, per_expert=True),
    "w3_ELF": TensorRef("experts.{e}.w3.weight", True, per_expert=True),
    "w2_EFL": TensorRef("experts.{e}.w2.weight", True, per_expert=True),
    **mlp_tensors("shared.", "shared_experts."),
    # MXFP4 experts: the codes [E, out, in/2] are held in the stored orientation
    # (each expert's tensor is its slice as it lies), each 4 bytes' bits
    # interleaved on the device (mxfp4_words); the scales [E, in/32, out] transposed.
    **{f"{w}_{part}_{axes}": TensorRef(f"experts.{{e}}.{w}.weight_{part}", part == "scale", True,
                                        packed=True)
       for w, part, axes in (("w1", "packed", "EFL"), ("w1", "scale", "ELF"),
                             ("w3", "packed", "EFL"), ("w3", "scale", "ELF"),
                             ("w2", "packed", "ELF"), ("w2", "scale", "EFL"))},
}


def layer_prefix(layer: int, is_moe: bool) -> str:
    """The name prefix of layer ``layer`` (without the optional language_model.)."""
    return f"model.layers.{layer}." + ("block_sparse_moe." if is_moe else "mlp.")


def layer_tensors(is_moe: bool) -> dict[str, TensorRef]:
    return MOE_TENSORS if is_moe else DENSE_TENSORS


def mxfp4_names(weight_name: str) -> tuple[str, str]:
    """``...w1.weight`` -> (``...w1.weight_packed``, ``...w1.weight_scale``)."""
    if not weight_name.endswith(".weight"):
        raise ValueError(f"not a weight name: {weight_name}")
    return weight_name + "_packed", weight_name + "_scale"
