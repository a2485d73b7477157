"""Every decision about one K3 layer, made once: the shared-expert gate, the
padding rule (docs/spec.md §4 and §5), the kernel backend, the routed experts' storage
and the dtype, in one ``Layout`` that the modules, the planner, ``compile``,
the loader and the gradients read. None of them re-derives any of it.

The mesh (axes ``DATA`` and ``TENSOR``, defined in k3jax.parallel_config and
re-exported here) and the ParallelConfig come first; ``make_layout`` turns
them, with the model config, into the Layout:

    backend   resolved once from the mesh's devices ("auto": pallas on a
              Hopper GPU, triton on other CUDA GPUs >= sm_80 with jax-triton,
              xla elsewhere; pallas_kernels.backend). A layout made without
              devices (no mesh, or an AbstractMesh: planning, abstract
              modules) resolves "auto" to "xla".
    experts   ExpertStorage: DENSE, MXFP4 (packed in device memory) or
              MXFP4_DEQUANT (MXFP4 in the checkpoint, dequantized at load).
              make_layout raises Mxfp4ShardError when packed MXFP4 cannot be
              split this way.
    dtype     the activations' and (non-MXFP4) weights' dtype.

Token rows are split over ``token_axes``: (DATA, TENSOR) under sequence
parallelism, else (DATA,). The three layouts of an MLP and of the routed experts:

    MlpMode.REPLICATED   full weights; each device runs its own rows; no collective
    MlpMode.SP_SHARDED   gate/up columns and down rows split over TENSOR;
                         all-gather rows -> float32 partial MLP ->
                         float32 reduce-scatter rows -> activation dtype
    MlpMode.TP           same split, rows replicated over TENSOR; all-reduce

An SP-sharded MLP issues its gather and scatter either as the two collectives
(``SharedOverlap.NONE``) or as two rings of tp - 1 collective-permutes each,
every block's matmul running while the next block travels
(``SharedOverlap.RING``, k3jax.collective_matmul), summing the partials in
``ParallelConfig.shared_scatter_dtype``; or it moves weights instead of rows
(``SharedOverlap.WEIGHTS``): one all-gather per weight over TENSOR, then the
replicated MLP on own rows. At rest its weights are split the same way in
all three forms.

    MoEMode.LOCAL        every expert whole on every device
    MoEMode.TP           each expert's intermediate split over TENSOR (padded);
                         the routed latent is summed before the RMSNorm
    MoEMode.EP           whole experts over (DATA, TENSOR); no padding. Under
                         sequence parallelism (or tp 1) rows are all-gathered
                         and the routed latent reduce-scattered over every
                         axis; over plain TP rows stay replicated over TENSOR
                         (all-gathered over DATA only) and the routed latent is
                         reduce-scattered over DATA, then all-reduced over
                         TENSOR together with the shared expert's TP partial
"""

from __future__ import annotations

import dataclasses
import enum

import jax.numpy as jnp
from jax.sharding import AbstractMesh, Mesh
from jax.sharding import PartitionSpec as P

from k3jax import shared_overlap_choice
from k3jax.config import K3Config
from k3jax.mlp_placement import LayoutError, MlpLayout, MlpMode, mlp_layout
from k3jax.parallel_config import (
    DATA,
    DEFAULT_SHARED_OVERLAP,
    MESH_AXES,
    SHARD_SHARED_EXPERT_ENV,
    TENSOR,
    ParallelConfig,
    SharedOverlap,
    abstract_mesh,
    check_mesh,
    make_mesh,
    padded_rows,
)
from pallas_kernels.backend import Backend, ResolvedBackend, resolve_backend
from pallas_kernels.mxfp4 import BLOCK_SIZE


class Mxfp4ShardError(LayoutError):
    """Packed MXFP4 experts cannot be split this way (a shard would cut a
    32-wide scale block); dense (dequantized) expert storage can."""


class ExpertStorage(enum.Enum):
    """How the routed experts' weights live in device memory.

    DENSE          w1_ELF, w3_ELF, w2_EFL in the Layout's dtype (random values,
                   or float experts read from a checkpoint)
    MXFP4          uint8 codes + UE8M0 scales, packed along each weight's input
                   axis (the codes [E, out, in/2] as the checkpoint stores them,
                   the scales [E, in/32, out]); the grouped matmuls dequantize
                   one active expert at a time
    MXFP4_DEQUANT  MXFP4 in the checkpoint, dequantized to the Layout's dtype
                   as it is loaded: in device memory exactly as DENSE
    """

    DENSE = "dense"
    MXFP4 = "mxfp4"
    MXFP4_DEQUANT = "mxfp4-dequant"

    @property
    def packed(self) -> bool:
        """Are the experts held as packed MXFP4 codes and scales?"""
        return self is ExpertStorage.MXFP4


# --------------------------------------------------------------------------
# The padding rule (docs/spec.md §5; the MLP gate, §4, is k3jax.mlp_placement)
# --------------------------------------------------------------------------
def padded_moe_intermediate(intermediate: int, shards: int, min_per_partition: int) -> int:
    """docs/spec.md §5: the routed-expert intermediate after padding, for ``shards``
    devices splitting each expert's intermediate (1 under EP). Each shard takes
    ``intermediate // shards`` real columns, so ``shards`` must divide it."""
    if intermediate % shards:
        raise LayoutError(f"moe_intermediate_size {intermediate} is not divisible by the "
                         f"{shards} devices splitting each expert's intermediate")
    if shards > 1 and intermediate // shards < min_per_partition:
        return min_per_partition * shards
    return intermediate


# --------------------------------------------------------------------------
# The MoE layout
# --------------------------------------------------------------------------
class MoEMode(enum.Enum):
    LOCAL = "local"
    TP = "tensor-parallel"
    EP = "expert-parallel"


class Dispatch(enum.Enum):
    """How the routed experts meet the token rows.

    OWN_ROWS     each device routes its own rows; they are all-gathered over
                 ``Layout.dispatch_axes`` (none: LOCAL) and the float32 routed
                 latent reduce-scattered back (LOCAL, TP under SP, EP under SP
                 or with tp 1).
    ALL_REDUCE   tp > 1 without SP (TP, or EP over plain TP): rows replicated
                 over TENSOR; under EP with dp > 1 they are all-gathered over
                 DATA (``Layout.dispatch_axes``) and the float32 routed latent
                 reduce-scattered over DATA; then the routed latent and the
                 shared expert's partial sums are all-reduced over TENSOR together.
    """

    OWN_ROWS = "own-rows"
    ALL_REDUCE = "all-reduce"


@dataclasses.dataclass(frozen=True)
class Layout:
    """Everything decided for one K3 layer: placement, backend, expert
    storage, dtype (module docstring). Made by ``make_layout`` only.

    Modules, the planner, compile, the loader and the gradients read it; none
    re-derives anything in it. Hashable: jitted forwards are cached by it.
    """

    cfg: K3Config
    parallel: ParallelConfig
    dense_mlp: MlpLayout
    shared_mlp: MlpLayout
    moe_mode: MoEMode
    expert_shards: int          # devices splitting one expert's intermediate
    padded_moe_intermediate: int
    backend: ResolvedBackend    # the kernels' backend, resolved from the mesh's devices
    experts: ExpertStorage      # how the routed experts live in device memory
    dtype: jnp.dtype            # activations and non-MXFP4 weights

    # -- token rows --------------------------------------------------------
    @property
    def token_axes(self) -> tuple[str, ...]:
        return self.parallel.token_axes

    @property
    def row_shards(self) -> int:
        return self.parallel.row_shards

    @property
    def x_TD(self) -> P:
        return P(self.token_axes, None)

    # -- routed experts --------------------------------------------------------
    @property
    def expert_axes(self) -> tuple[str, ...]:
        """Axes that hold different experts: under EP every axis of size > 1
        ((DATA, TENSOR) when tp > 1, with or without sequence parallelism;
        (DATA,) when tp is 1)."""
        if self.moe_mode is not MoEMode.EP:
            return ()
        return MESH_AXES if self.parallel.tp > 1 else (DATA,)

    @property
    def local_experts(self) -> int:
        return self.cfg.num_experts // (self.parallel.ep)

    @property
    def w13_ELF(self) -> P:
        if self.moe_mode is MoEMode.EP:
            return P(self.expert_axes, None, None)
        if self.moe_mode is MoEMode.TP:
            return P(None, None, TENSOR)
        return P()

    @property
    def w2_EFL(self) -> P:
        if self.moe_mode is MoEMode.EP:
            return P(self.expert_axes, None, None)
        if self.moe_mode is MoEMode.TP:
            return P(None, TENSOR, None)
        return P()

    def moe_param_specs(self) -> dict[str, P]:
        """PartitionSpec of every MoE parameter (shared expert under ``shared.``).
        Router, latent projections and norm are replicated."""
        specs = {"router_DE": P(), "router_bias_E": P(), "lat_down_DL": P(),
                 "lat_norm_L": P(), "lat_up_LD": P(),
                 "w1_ELF": self.w13_ELF, "w3_ELF": self.w13_ELF, "w2_EFL": self.w2_EFL}
        specs.update({f"shared.{k}": v for k, v in self.shared_mlp.param_specs.items()})
        return specs

    @property
    def dispatch(self) -> Dispatch:
        """Which per-device MoE body runs (modules.moe and the planner read this)."""
        if self.parallel.tp > 1 and not self.parallel.sequence_parallel:
            return Dispatch.ALL_REDUCE
        return Dispatch.OWN_ROWS

    @property
    def dispatch_axes(self) -> tuple[str, ...]:
        """Axes over which token rows are all-gathered before the routed experts
        and their latent reduce-scattered after: every axis under EP (DATA
        only for EP over plain TP, whose rows are already whole on TENSOR),
        TENSOR for a tensor-parallel MoE under SP, none otherwise (plain TP
        holds all rows already and all-reduces instead; EP on one device, or
        EP over plain TP with dp 1, has nobody to exchange rows with, and XLA
        would keep the no-op collectives)."""
        if self.moe_mode is MoEMode.EP:
            if self.dispatch is Dispatch.ALL_REDUCE:
                return (DATA,) if self.parallel.dp > 1 else ()
            return self.expert_axes if self.parallel.ep > 1 else ()
        if self.moe_mode is MoEMode.TP and self.parallel.sequence_parallel:
            return (TENSOR,)
        return ()

    # -- overlap contract -------------------------------------------------------
    @property
    def shared_overlaps_routed(self) -> bool:
        """Does the compiled program run the shared expert's work under the
        routed experts'? A claim checked against the H200 schedule
        (tests/test_aot_layouts.py at 256 and 8192 tokens;
        tests/test_shared_weights_schedule.py for WEIGHTS at 2048 and 8192;
        compiled with k3jax.xla_options.OVERLAP_COMPILER_OPTIONS).

        vLLM switches its shared/routed stream overlap off for a sharded shared
        expert because the expert issues collectives of its own, and two streams
        issuing collectives can deadlock. In one SPMD XLA program every device
        issues collectives in the same compiled order, so that hazard does not
        exist, and XLA's latency-hiding scheduler decides what overlaps:
        - replicated shared expert: no collective of its own; True;
        - SP-sharded with SharedOverlap.RING: its collective-permutes stay
          asynchronous with a matmul under each; True;
        - SP-sharded with SharedOverlap.WEIGHTS (any dp): its two weight
          all-gathers stay asynchronous, gate/up with the first routed
          grouped matmul under it, down with the second (its start follows
          the first grouped matmul: XLA keeps one all-gather in flight, and
          the routed rows' gathers come between); True;
        - SP-sharded with SharedOverlap.NONE, tensor axis spanning the mesh
          (dp 1): its all-gather and reduce-scatter stay asynchronous with
          routed GEMMs between start and done; True;
        - SP-sharded with SharedOverlap.NONE and dp > 1: XLA schedules its
          all-gather with no routed GEMM under it (dp 2 x tp 4 at 256 tokens,
          and with EP at 8192 too); False: not kept, so not claimed;
        - plain TP (and EP over plain TP): its partial sum rides in the routed
          path's all-reduce (one all-reduce for both), fused rather than
          overlapped; False.
        - SharedOverlap.AUTO: True when every form the table picks for this
          (tp, dp) is (the table's generator admits only those).
        """
        mode = self.shared_mlp.mode
        if mode is MlpMode.SP_SHARDED:
            if self.shared_mlp.overlap is SharedOverlap.AUTO:   # every form it can pick
                return all(self.for_tokens(t).shared_overlaps_routed
                           for t in shared_overlap_choice.first_tokens(
                               self.parallel.tp, self.parallel.dp))
            return self.shared_mlp.overlap is not SharedOverlap.NONE or self.parallel.dp == 1
        return mode is not MlpMode.TP

    def for_tokens(self, tokens: int) -> Layout:
        """This layout for ``tokens`` global tokens: SharedOverlap.AUTO in the
        shared expert and the dense MLP replaced by the forms the committed
        table picks (MlpLayout.for_tokens, with this layout's dtype); itself
        when both are concrete.
        The modules, the planner and ``compile`` call it with their static T."""
        shared = self.shared_mlp.for_tokens(tokens, self.dtype)
        dense = self.dense_mlp.for_tokens(tokens, self.dtype)
        if shared is self.shared_mlp and dense is self.dense_mlp:
            return self
        return dataclasses.replace(self, shared_mlp=shared, dense_mlp=dense)

    def overlap_forms(self) -> dict[str, str]:
        """The forms in force (JSON of run / plan / compile / bench): the shared
        expert's and the dense MLP's SharedOverlap value ("auto" until
        ``for_tokens`` resolves it) and their scatter dtypes."""
        return {"shared_expert": self.shared_mlp.overlap.value,
                "shared_expert_scatter_dtype": self.shared_mlp.scatter,
                "dense_mlp": self.dense_mlp.overlap.value,
                "dense_mlp_scatter_dtype": self.dense_mlp.scatter}

    def describe(self) -> str:
        lines = [f"parallel: {self.parallel.describe()}",
                 f"token rows split over {self.token_axes} into {self.row_shards} blocks",
                 f"dense MLP: {self.dense_mlp.mode.value} ({self.dense_mlp.reason})",
                 f"shared expert: {self.shared_mlp.mode.value} ({self.shared_mlp.reason})",
                 f"routed experts: {self.moe_mode.value}, {self.local_experts} per device, "
                 f"intermediate {self.cfg.moe_intermediate_size} -> padded "
                 f"{self.padded_moe_intermediate} over {self.expert_shards} shard(s)",
                 f"routed dispatch: {self.dispatch.value}",
                 f"shared expert may overlap routed work: {self.shared_overlaps_routed}"]
        return "\n".join(lines)


def make_layout(cfg: K3Config, parallel: ParallelConfig,
                mesh: Mesh | AbstractMesh | None = None, *, backend: Backend = "auto",
                experts: ExpertStorage = ExpertStorage.DENSE, dtype=jnp.float32) -> Layout:
    """Decide every placement and build choice of one K3 layer on a (dp, tp)
    mesh, with clear errors for what the mesh cannot hold.

    ``mesh`` (the one the modules will run on) must be the mesh ``parallel``
    describes; its devices resolve ``backend`` once (without devices, "auto"
    is "xla"). Raises LayoutError when a size does not split over the mesh,
    and Mxfp4ShardError when packed MXFP4 experts (``experts`` MXFP4, a model
    with MoE layers) would cut a 32-wide scale block."""
    if not isinstance(experts, ExpertStorage):
        raise ValueError(f"make_layout: experts must be an ExpertStorage, got {experts!r}")
    if mesh is not None:
        check_mesh(mesh, parallel, "make_layout")
    devices = list(mesh.devices.flat) if isinstance(mesh, Mesh) else None
    resolved = resolve_backend(backend, devices) if devices or backend != "auto" else "xla"
    if parallel.expert_parallel:
        moe_mode = MoEMode.EP
        if cfg.num_experts % parallel.ep:
            raise LayoutError(f"expert parallel: num_experts {cfg.num_experts} is not divisible "
                             f"by the EP size dp*tp = {parallel.ep}")
        shards = 1
        padding_shards = parallel.ep if parallel.pad_under_ep else 1
    elif parallel.tp > 1:
        moe_mode = MoEMode.TP
        shards = padding_shards = parallel.tp
    else:
        moe_mode = MoEMode.LOCAL
        shards = padding_shards = 1
    padded = padded_moe_intermediate(cfg.moe_intermediate_size, padding_shards,
                                     cfg.min_moe_intermediate_per_partition)
    if experts.packed and cfg.num_moe_layers:
        _check_mxfp4_shards(cfg, shards, padded)
    return Layout(cfg=cfg, parallel=parallel,
                  dense_mlp=mlp_layout(parallel, cfg.hidden_size, cfg.intermediate_size,
                                       layer_kind="dense"),
                  shared_mlp=mlp_layout(parallel, cfg.hidden_size, cfg.shared_intermediate_size,
                                        layer_kind="moe"),
                  moe_mode=moe_mode, expert_shards=shards, padded_moe_intermediate=padded,
                  backend=resolved, experts=experts, dtype=jnp.dtype(dtype))


def _check_mxfp4_shards(cfg: K3Config, shards: int, padded: int) -> None:
    """Packed codes and scales run along each weight's input axis (L for w1/w3,
    F for w2), so the latent width and each shard's intermediate, real and
    padded, must be whole 32-wide scale blocks."""
    L, I = cfg.routed_expert_hidden_size, cfg.moe_intermediate_size
    for what, width in (("latent width", L), ("per-shard intermediate", I // shards),
                        ("padded per-shard intermediate", padded // shards)):
        if width % BLOCK_SIZE:
            raise Mxfp4ShardError(f"MXFP4 packed experts need the {what} ({width}) to be a "
                                  f"multiple of {BLOCK_SIZE}; store the experts dequantized instead")


__all__ = ["DATA", "TENSOR", "MESH_AXES", "SHARD_SHARED_EXPERT_ENV", "ParallelConfig",
           "SharedOverlap", "DEFAULT_SHARED_OVERLAP", "MlpMode", "MlpLayout", "MoEMode",
           "Layout", "make_layout", "mlp_layout", "padded_moe_intermediate", "make_mesh",
           "abstract_mesh", "padded_rows", "Dispatch", "check_mesh", "LayoutError",
           "Mxfp4ShardError", "ExpertStorage"]
