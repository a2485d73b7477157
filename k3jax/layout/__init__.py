"""Every decision about a K3 layer, made once, read in this order:

    parallel               mesh axis roles (data, tensor, node), ParallelConfig,
                           SharedOverlap, EpDispatch, make_mesh
    placement              the shared-expert gate and the MLP placements
    expert_storage         the routed experts' storage and the padding rule
    layout                 Layout and make_layout: specs, padded sizes, dispatch,
                           overlap claim, backend, dtype; refuses what cannot run
    shared_overlap_choice  the per-token-count picks of ``auto``, read from the
    ep_dispatch_choice     committed tables in k3jax/data/

The modules, the loader, the gradients and the tools read the Layout; none
re-derives anything in it.
"""

from k3jax.layout.expert_storage import ExpertStorage, Mxfp4ShardError, padded_moe_intermediate
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
    check_mesh,
    make_mesh,
    padded_rows,
)
from k3jax.layout.placement import LayoutError, MlpLayout, MlpMode, mlp_layout

__all__ = ["NODE", "EpDispatch", "DATA", "TENSOR", "MESH_AXES", "SHARD_SHARED_EXPERT_ENV", "ParallelConfig",
           "SharedOverlap", "DEFAULT_SHARED_OVERLAP", "MlpMode", "MlpLayout", "MoEMode",
           "Layout", "make_layout", "mlp_layout", "padded_moe_intermediate", "make_mesh",
           "abstract_mesh", "padded_rows", "Dispatch", "check_mesh", "LayoutError",
           "Mxfp4ShardError", "EpDispatchError", "ExpertStorage"]
