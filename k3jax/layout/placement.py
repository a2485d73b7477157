"""The layout of one SiTU-GLU MLP (the dense layer-0 MLP or the MoE layer's
shared expert): THE gate that decides its weights' mesh axes (docs/spec.md
§4), and the form an SP-sharded one moves its data in.

    MlpMode.REPLICATED   full weights; each device runs its own rows; no collective
    MlpMode.SP_SHARDED   gate/up columns and down rows split over TENSOR
    MlpMode.TP           same split, rows replicated over TENSOR; all-reduce

An SP-sharded MLP's SharedOverlap (NONE, RING, WEIGHTS; k3jax.layout.parallel)
says what moves. AUTO is resolved per static token count by
``MlpLayout.for_tokens``, from the committed table that the whole-layer
latency model writes (k3jax.layout.shared_overlap_choice); the modules, the planner
and ``compile`` resolve it before they use the form.
"""

from __future__ import annotations

import dataclasses
import enum

import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from k3jax.layout import shared_overlap_choice
from k3jax.layout.parallel import SCATTER_DTYPES, TENSOR, ParallelConfig, SharedOverlap

LAYER_KINDS = shared_overlap_choice.LAYERS
"""("moe", "dense"): the MoE layer's shared expert, the dense layer's MLP."""


class LayoutError(ValueError):
    """The model cannot be laid out over a (valid) ParallelConfig: one of its
    sizes does not split over the devices asked for. The caller's choice of
    layout, not a bug or a checkpoint problem (the CLIs name the flags)."""



class MlpMode(enum.Enum):
    REPLICATED = "replicated"
    SP_SHARDED = "sp-sharded"
    TP = "tensor-parallel"


@dataclasses.dataclass(frozen=True)
class MlpLayout:
    """Placement of one SiTU-GLU MLP (the dense layer-0 MLP or the shared expert).

    parallel: the mesh it runs on; token rows are split over
      ``parallel.token_axes`` (so an SP-sharded MLP always sees rows split
      over TENSOR, and a TP one rows replicated over TENSOR).
    weight_axes: the mesh axes that split the intermediate F ((): replicated).
    gate_DF / up_DF / down_FD: the weights' PartitionSpecs.
    reason: why this mode was chosen (printed by the CLI).
    overlap: how an SP_SHARDED MLP moves its rows (NONE in the other modes).
    """

    mode: MlpMode
    parallel: ParallelConfig
    hidden: int
    intermediate: int
    weight_axes: tuple[str, ...]
    reason: str
    overlap: SharedOverlap = SharedOverlap.NONE
    scatter: str = "float32"
    layer_kind: str = "moe"

    def __post_init__(self) -> None:
        if self.overlap is not SharedOverlap.NONE and self.mode is not MlpMode.SP_SHARDED:
            raise ValueError(f"MlpLayout: overlap {self.overlap.value} needs an SP-sharded MLP, "
                             f"got {self.mode.value}")
        if self.scatter not in SCATTER_DTYPES:
            raise ValueError(f"MlpLayout: scatter must be one of {SCATTER_DTYPES}, "
                             f"got {self.scatter!r}")
        if self.layer_kind not in LAYER_KINDS:
            raise ValueError(f"MlpLayout: layer_kind must be one of {LAYER_KINDS}, "
                             f"got {self.layer_kind!r}")

    def for_tokens(self, tokens: int, dtype) -> MlpLayout:
        """This layout with SharedOverlap.AUTO replaced by the form (and
        scatter dtype) the committed table picks for ``tokens`` global tokens
        on this (tp, dp) (k3jax.layout.shared_overlap_choice); itself when the form
        is already concrete. The table's bf16 scatter is taken only for
        bfloat16 activations (``dtype``; the table models bf16 layers, and a
        float32 layer keeps float32 sums); an explicit
        ``ParallelConfig.shared_scatter_dtype`` overrides both."""
        if self.overlap is not SharedOverlap.AUTO:
            return self
        form, scatter = shared_overlap_choice.pick(self.parallel.tp, self.parallel.dp, tokens,
                                                   layer=self.layer_kind)
        if jnp.dtype(dtype) != jnp.dtype(jnp.bfloat16):
            scatter = "float32"
        scatter = self.parallel.shared_scatter_dtype or scatter
        return dataclasses.replace(
            self, overlap=SharedOverlap(form), scatter=scatter,
            reason=f"{self.reason} -> {form}" + (f" ({scatter} scatter)" if form != "weights" else "")
            + f" at {tokens} tokens")

    @property
    def gate_DF(self) -> P:
        return P(None, self.weight_axes or None)

    @property
    def up_DF(self) -> P:
        return self.gate_DF

    @property
    def down_FD(self) -> P:
        return P(self.weight_axes or None, None)

    @property
    def param_specs(self) -> dict[str, P]:
        return {"gate_DF": self.gate_DF, "up_DF": self.up_DF, "down_FD": self.down_FD}

    @property
    def scatter_dtype(self) -> jnp.dtype:
        """The dtype an SP-sharded token-side form (NONE, RING) sends and sums
        its partials in over TENSOR (``scatter``)."""
        return jnp.dtype(self.scatter)

    @property
    def collectives(self) -> tuple[str, ...]:
        """Collectives one forward issues, over TENSOR (RING: 2 (tp - 1)
        collective-permutes, tp - 1 of the input rows, then tp - 1 of the
        partial sums; WEIGHTS: an all-gather of gate and up stacked, then one of down).
        AUTO has none until ``for_tokens`` picks the form: ValueError."""
        if self.overlap is SharedOverlap.AUTO:
            raise ValueError("MlpLayout.collectives: the auto form is picked per token count; "
                             "call for_tokens(T) first")
        if self.overlap is SharedOverlap.RING:
            return ("collective-permute",) * (2 * (self.parallel.tp - 1))
        if self.overlap is SharedOverlap.WEIGHTS:
            return ("all-gather",) * 2
        return {MlpMode.REPLICATED: (),
                MlpMode.SP_SHARDED: ("all-gather", "reduce-scatter"),
                MlpMode.TP: ("all-reduce",)}[self.mode]


def mlp_layout(parallel: ParallelConfig, hidden: int, intermediate: int, *,
               layer_kind: str = "moe") -> MlpLayout:
    """THE gate: the layout (and so the weights' mesh axes) of an MLP.

    Under sequence parallelism (docs/spec.md §4):
        shard = enabled and tp > 1 and intermediate % tp == 0 and hidden % tp == 0
    and the MLP stays replicated otherwise. Without SP and with tp > 1 the MLP is
    plain tensor-parallel (this needs intermediate % tp == 0). Serves the shared
    expert (``layer_kind`` "moe") and the dense layer-0 MLP ("dense") alike.
    """
    tp = parallel.tp
    if parallel.sequence_parallel:
        if not parallel.shard_shared_expert:
            return MlpLayout(MlpMode.REPLICATED, parallel, hidden, intermediate, (),
                             "sequence parallel, sharding not requested (opt-in)",
                             layer_kind=layer_kind)
        if intermediate % tp or hidden % tp:
            return MlpLayout(MlpMode.REPLICATED, parallel, hidden, intermediate, (),
                             f"sharding requested but hidden {hidden} / intermediate "
                             f"{intermediate} is not divisible by tp={tp}", layer_kind=layer_kind)
        return MlpLayout(MlpMode.SP_SHARDED, parallel, hidden, intermediate, (TENSOR,),
                         f"sequence parallel, sharded over tp={tp}, "
                         f"overlap {parallel.shared_overlap.value}",
                         parallel.shared_overlap, parallel.shared_scatter_dtype or "float32",
                         layer_kind)
    if tp == 1:
        return MlpLayout(MlpMode.REPLICATED, parallel, hidden, intermediate, (),
                         "no tensor parallelism" + (" (sharding needs sequence parallel)"
                                                    if parallel.shard_shared_expert else ""),
                         layer_kind=layer_kind)
    if intermediate % tp:
        raise LayoutError(f"tensor parallel MLP: intermediate size {intermediate} is not "
                         f"divisible by tp={tp}")
    return MlpLayout(MlpMode.TP, parallel, hidden, intermediate, (TENSOR,),
                     f"tensor parallel over tp={tp}", layer_kind=layer_kind)


__all__ = ["LAYER_KINDS", "LayoutError", "MlpLayout", "MlpMode", "mlp_layout"]
