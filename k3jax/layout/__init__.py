"""Every decision about a K3 layer, made once, read in this order:

    parallel               mesh axis roles (data, tensor, node), ParallelConfig,
                           SharedOverlap, EpDispatch, make_mesh
    user_mesh              check_mesh: a mesh built any way (Explicit axes, the
                           user's axis names) -> the layer's mesh, or a refusal
    placement              the shared-expert gate and the MLP placements
    expert_storage         the padding rule; the refusal of a format's split
    layout                 Layout and make_layout: specs, padded sizes, dispatch,
                           overlap claim, backend, expert format (resolved from
                           k3jax.formats), dtype; refuses what cannot run
    shared_overlap_choice  the per-token-count picks of ``auto``, read from the
    ep_dispatch_choice     committed tables in k3jax/data/

The modules, the loader, the gradients and the tools read the Layout; none
re-derives anything in it.
"""

from k3jax.layout.expert_storage import ExpertShardError, padded_moe_intermediate
from k3jax.layout.layout import Dispatch, EpDispatchError, Layout, MoEMode, make_layout
from k3jax.layout.parallel import (
    DATA,
    DEFAULT_SHARED_OVERLAP,
    MESH_AXES,
    NODE,
    SHARD_SHARED_EXPERT_ENV,
    TENSOR,
    EpDispatch,
    ParallelConfig,
    SharedOverlap,
    abstract_mesh,
    make_mesh,
    padded_rows,
)
from k3jax.layout.placement import LayoutError, MlpLayout, MlpMode, mlp_layout
from k3jax.layout.user_mesh import check_mesh

__all__ = ["NODE", "EpDispatch", "DATA", "TENSOR", "MESH_AXES", "SHARD_SHARED_EXPERT_ENV", "ParallelConfig",
           "SharedOverlap", "DEFAULT_SHARED_OVERLAP", "MlpMode", "MlpLayout", "MoEMode",
           "Layout", "make_layout", "mlp_layout", "padded_moe_intermediate", "make_mesh",
           "abstract_mesh", "padded_rows", "Dispatch", "check_mesh", "LayoutError",
           "ExpertShardError", "EpDispatchError"]


def __getattr__(name: str):
    """Names that moved with the formats, still importable from here:
    ExpertStorage (k3jax.formats) and the earlier names of ExpertShardError
    (k3jax.formats.LAYOUT_ALIASES)."""
    from k3jax import formats
    if name == "ExpertStorage":
        return formats.ExpertStorage
    if formats.LAYOUT_ALIASES.get(name) == "ExpertShardError":
        return ExpertShardError
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
