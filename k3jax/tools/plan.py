"""The planner: per-device weight bytes and the collectives of one MoE-layer
forward, for any (config, ParallelConfig), without allocating anything.

The bytes are not a second model of the layout: every layer is built with the
real modules (``build_layer``) on an ``AbstractMesh`` with ``AbstractSource``
(ShapeDtypeStructs carrying NamedShardings), and each parameter's per-device
shard shape is read back (``k3jax.tools.memory.param_shard_bytes``). The full-size
K3 at tp 32 therefore plans on a laptop. Per-layer bytes are multiplied by
``cfg.num_dense_layers`` / ``cfg.num_moe_layers``.

Dtypes default to the published checkpoint: routed experts MXFP4
(0.53125 B per parameter: 4-bit codes + one UE8M0 byte per 32 inputs),
everything else BF16, the router bias float32 (as the modules store it).

The collectives are read off the same ``Layout`` the modules dispatch on
(``dispatch``, ``dispatch_axes``, ``shared_mlp.mode``), with the dtypes the
bodies in ``k3jax.modules.moe`` / ``mlp`` exchange. ``bytes`` of a collective
is the full buffer each device holds (all-gather: its output, reduce-scatter:
its input, all-reduce: the reduced array), the NCCL "size" convention.
These are the collectives inside the block, for a caller that holds the rows
in the layout's ``x_TD`` sharding; a caller that passes replicated rows whose
count the row blocks do not divide also gets XLA's all-gather of the output
rows at the block's boundary (tests/test_plan.py checks the plan against the
compiled HLO).
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

import jax.numpy as jnp
import numpy as np

from k3jax.config import K3Config
from k3jax.formats import DenseFormat, ExpertStorage, expert_tensors
from k3jax.layout import (
    Layout,
    LayoutError,
    MlpMode,
    ParallelConfig,
    abstract_mesh,
    make_layout,
)
from k3jax.layout.expert_placement import ExpertPlacement
from k3jax.modules import AbstractSource, build_layer
from k3jax.tools.memory import param_shard_bytes, param_shard_shapes
from k3jax.tools.plan_collectives import (
    Collective,
    dispatch_buffer_bytes,
    exchange_collectives,
    moe_collectives,
    sp_sharded_mlp_collectives,
)

WEIGHT_DTYPES = ("bfloat16", "float32")
EXPERT_DTYPES = ("mxfp4", "bfloat16", "float32")
COMPONENTS = ("dense_mlp", "shared_experts", "router", "latent_projections", "routed_experts",
              "redundant_experts")
"""redundant_experts: the bytes the R redundant slots add to a device
(``ParallelConfig.redundant_experts``): R / (E + R) of its slots, the
routed experts' share without them under routed_experts."""
_MOE_COMPONENT = {"router_DE": "router", "router_bias_E": "router",
                  "lat_down_DL": "latent_projections", "lat_up_LD": "latent_projections",
                  "lat_norm_L": "latent_projections"}


def _moe_component(path: str) -> str:
    """The component of a MoE parameter; the routed experts' are every
    registered format's (k3jax.formats.expert_tensors)."""
    if path.startswith("shared."):
        return "shared_experts"
    if path in expert_tensors():
        return "routed_experts"
    try:
        return _MOE_COMPONENT[path]
    except KeyError:
        raise ValueError(f"planner: MoE parameter {path!r} belongs to no known component; "
                         f"k3jax/tools/plan.py needs updating") from None


# --------------------------------------------------------------------------
# Modules, built abstractly
# --------------------------------------------------------------------------
def planning_layout(cfg: K3Config, parallel: ParallelConfig, *, dtype: str = "bfloat16",
                    expert_dtype: str = "mxfp4",
                    expert_placement: ExpertPlacement | None = None) -> Layout:
    """The Layout the planner reads: weights in ``dtype``, routed experts
    packed MXFP4 when ``expert_dtype`` is "mxfp4" (else dense), backend xla
    (its modules are abstract: nothing runs), redundant slots placed by
    ``expert_placement`` (bytes do not depend on the placement, only on R).
    Raises ExpertShardError when packed experts cannot be split over
    ``parallel``."""
    _check_dtypes(dtype, expert_dtype)
    experts = ExpertStorage.MXFP4 if expert_dtype == "mxfp4" else ExpertStorage.DENSE
    return make_layout(cfg, parallel, abstract_mesh(parallel), backend="xla", experts=experts,
                       dtype=jnp.dtype(dtype), expert_placement=expert_placement)


def abstract_layer(layout: Layout, layer: int):
    """Layer ``layer``'s module (KimiMLP or KimiMoE) on an AbstractMesh: shapes,
    dtypes and shardings only, nothing allocated."""
    return build_layer(layout, layer, abstract_mesh(layout.parallel), source=AbstractSource())


def layer_param_bytes(cfg: K3Config, parallel: ParallelConfig, layer: int, *,
                      dtype: str = "bfloat16", expert_dtype: str = "mxfp4") -> dict[str, int]:
    """{param path: per-device bytes} of layer ``layer``: routed experts in
    ``expert_dtype`` (MXFP4: the module's packed uint8 codes and scales), the
    router bias float32, everything else ``dtype``.

    The module holds one float dtype, so float experts of another dtype than
    ``dtype`` are priced from their shard shapes at ``expert_dtype``'s size."""
    layout = planning_layout(cfg, parallel, dtype=dtype, expert_dtype=expert_dtype)
    module = abstract_layer(layout, layer)
    out = param_shard_bytes(module)
    if cfg.is_moe_layer(layer) and isinstance(layout.experts, DenseFormat):
        itemsize = np.dtype(jnp.dtype(expert_dtype)).itemsize
        shapes = param_shard_shapes(module)
        out.update({name: math.prod(shapes[name][0]) * itemsize
                    for name in layout.experts.param_names()})
    return out


def plan_layer_bytes(cfg: K3Config, parallel: ParallelConfig, layer: int, *,
                     dtype: str = "bfloat16", expert_dtype: str = "mxfp4") -> dict[str, int]:
    """{component: per-device bytes} of ONE layer (components: COMPONENTS;
    a dense layer fills only ``dense_mlp``)."""
    out = dict.fromkeys(COMPONENTS, 0)
    for path, nbytes in layer_param_bytes(cfg, parallel, layer, dtype=dtype,
                                          expert_dtype=expert_dtype).items():
        out[_moe_component(path) if cfg.is_moe_layer(layer) else "dense_mlp"] += nbytes
    R = parallel.redundant_experts   # every device holds (E + R) / ep slots of equal bytes
    out["redundant_experts"] = out["routed_experts"] * R // (cfg.num_experts + R)
    out["routed_experts"] -= out["redundant_experts"]
    return out


def _check_dtypes(dtype: str, expert_dtype: str) -> None:
    if dtype not in WEIGHT_DTYPES:
        raise ValueError(f"weight dtype must be one of {WEIGHT_DTYPES}, got {dtype!r}")
    if expert_dtype not in EXPERT_DTYPES:
        raise ValueError(f"expert dtype must be one of {EXPERT_DTYPES}, got {expert_dtype!r}")


def _first_layer(cfg: K3Config, moe: bool) -> int | None:
    return next((i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i) == moe), None)


def model_bytes(cfg: K3Config, parallel: ParallelConfig, *, dtype: str = "bfloat16",
                expert_dtype: str = "mxfp4") -> tuple[dict[str, int], dict[str, dict[str, int]]]:
    """(per-device bytes summed over all layers {component..., total},
    per-layer bytes {"dense": {...}, "moe": {...}})."""
    per_layer = {}
    totals = dict.fromkeys(COMPONENTS, 0)
    for kind, moe, count in (("dense", False, cfg.num_dense_layers), ("moe", True, cfg.num_moe_layers)):
        layer = _first_layer(cfg, moe)
        if layer is None:
            continue
        per_layer[kind] = plan_layer_bytes(cfg, parallel, layer, dtype=dtype, expert_dtype=expert_dtype)
        for component, nbytes in per_layer[kind].items():
            totals[component] += nbytes * count
    totals["total"] = sum(totals[c] for c in COMPONENTS)
    return totals, per_layer


# --------------------------------------------------------------------------
# The plan
# --------------------------------------------------------------------------
def format_gb(nbytes: int) -> str:
    """Decimal gigabytes, 2 decimals (docs/spec.md §6's "180.81 GB")."""
    return f"{nbytes / 1e9:.2f}"


def format_gib(nbytes: int) -> str:
    """Binary gibibytes with up to 8 decimals, trailing zeros dropped
    (docs/spec.md §6's "22.640625 GiB")."""
    return f"{nbytes / 2**30:.8f}".rstrip("0").removesuffix(".")


@dataclasses.dataclass(frozen=True)
class Plan:
    """Per-device weight bytes (summed over layers) and one MoE forward's collectives."""

    cfg: K3Config
    parallel: ParallelConfig
    layout: Layout
    source: str
    tokens: int
    dtype: str
    expert_dtype: str
    per_device_bytes: dict[str, int]
    per_layer_bytes: dict[str, dict[str, int]]
    collectives: tuple[Collective, ...]
    comparisons: dict[str, int]
    dispatch_buffers: dict[str, int]

    @property
    def padded_moe_intermediate_size(self) -> int:
        return self.layout.padded_moe_intermediate

    def to_dict(self) -> dict[str, Any]:
        par, lay = self.parallel, self.layout
        return {
            "source": self.source,
            "parallel": {"dp": par.dp, "tp": par.tp, "nodes": par.nodes,
                         "ep_dispatch": par.ep_dispatch.value,
                         "sequence_parallel": par.sequence_parallel,
                         "expert_parallel": par.expert_parallel, "ep": par.ep,
                         "shard_shared_expert": par.shard_shared_expert,
                         "pad_under_ep": par.pad_under_ep,
                         "redundant_experts": par.redundant_experts,
                         "shared_overlap": par.shared_overlap.value,
                         "shared_scatter_dtype": par.shared_scatter_dtype},
            "layout": {"dense_mlp": lay.dense_mlp.mode.value, "shared_expert": lay.shared_mlp.mode.value,
                       "shared_expert_overlap": lay.shared_mlp.overlap.value,
                       "overlap_forms": lay.overlap_forms(),
                       "routed_experts": lay.moe_mode.value, "local_experts": lay.local_experts,
                       "expert_shards": lay.expert_shards,
                       "token_axes": list(lay.token_axes),
                       "mesh": dict(par.axis_sizes),
                       "ep_dispatch": lay.ep_dispatch.value,
                       "shared_overlaps_routed": lay.shared_overlaps_routed},
            "dtypes": {"weights": self.dtype, "routed_experts": self.expert_dtype,
                       "router_bias": "float32", "activations": self.dtype},
            "layers": {"dense": self.cfg.num_dense_layers, "moe": self.cfg.num_moe_layers},
            "per_device_bytes": dict(self.per_device_bytes),
            "per_device_gb": {k: format_gb(v) for k, v in self.per_device_bytes.items()},
            "per_device_gib": {k: format_gib(v) for k, v in self.per_device_bytes.items()},
            "per_layer_bytes": {k: dict(v) for k, v in self.per_layer_bytes.items()},
            "moe_intermediate_size": self.cfg.moe_intermediate_size,
            "padded_moe_intermediate_size": self.padded_moe_intermediate_size,
            "tokens": self.tokens,
            "collectives": [c.to_dict() for c in self.collectives],
            "dispatch_buffer_bytes": dict(self.dispatch_buffers),
            "collective_bytes_per_device": sum(c.bytes for c in self.collectives),
            "collective_wire_bytes_per_device": sum(c.wire_bytes for c in self.collectives),
            "comparisons": dict(self.comparisons),
        }

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)


def make_plan(cfg: K3Config, parallel: ParallelConfig, *, tokens: int = 256,
              dtype: str = "bfloat16", expert_dtype: str = "mxfp4", source: str = "",
              expert_placement: ExpertPlacement | None = None) -> Plan:
    """Plan ``cfg`` on ``parallel`` (``expert_placement``: the redundant
    slots' placement the layout shows). Raises ValueError for a layout the
    mesh cannot hold (e.g. an EP size that does not divide the experts)."""
    layout = planning_layout(cfg, parallel, dtype=dtype, expert_dtype=expert_dtype,
                             expert_placement=expert_placement).for_tokens(tokens)
    totals, per_layer = model_bytes(cfg, parallel, dtype=dtype, expert_dtype=expert_dtype)
    comparisons = _comparisons(cfg, parallel, layout, totals, dtype, expert_dtype)
    return Plan(cfg=cfg, parallel=parallel, layout=layout, source=source, tokens=tokens,
                dtype=dtype, expert_dtype=expert_dtype, per_device_bytes=totals,
                per_layer_bytes=per_layer,
                collectives=tuple(moe_collectives(layout, tokens)) if cfg.num_moe_layers else (),
                comparisons=comparisons,
                dispatch_buffers=dispatch_buffer_bytes(layout, tokens) if cfg.num_moe_layers else {})


def _comparisons(cfg, parallel, layout, totals, dtype, expert_dtype) -> dict[str, int]:
    """Side-by-side figures: the shared expert replicated when it is sharded
    under SP, and the routed experts with / without vLLM's pre-fix padding
    under EP. Each comes from planning the alternative layout."""
    out = {}
    if layout.shared_mlp.mode is MlpMode.SP_SHARDED:
        alt, _ = model_bytes(cfg, dataclasses.replace(parallel, shard_shared_expert=False),
                             dtype=dtype, expert_dtype=expert_dtype)
        out["shared_experts_if_replicated"] = alt["shared_experts"]
        out["shared_experts_saved"] = alt["shared_experts"] - totals["shared_experts"]
    if parallel.expert_parallel:
        other = not parallel.pad_under_ep
        try:
            alt, _ = model_bytes(cfg, dataclasses.replace(parallel, pad_under_ep=other),
                                 dtype=dtype, expert_dtype=expert_dtype)
        except LayoutError:   # the pre-fix padding cannot split this intermediate: no figure
            return out
        key = "routed_experts_if_padded_under_ep" if other else "routed_experts_with_fix"
        out[key] = alt["routed_experts"]
    return out


__all__ = ["Plan", "Collective", "make_plan", "plan_layer_bytes", "layer_param_bytes", "model_bytes",
           "moe_collectives", "exchange_collectives", "dispatch_buffer_bytes",
           "sp_sharded_mlp_collectives", "abstract_layer", "planning_layout",
           "format_gb", "format_gib", "COMPONENTS", "WEIGHT_DTYPES",
           "EXPERT_DTYPES"]
