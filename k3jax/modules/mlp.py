"""KimiMLP: the SiTU-GLU MLP of the dense layer 0 and of the shared expert.

Parameters (global shapes; PartitionSpecs from the ``MlpLayout``):
    gate_DF, up_DF [D, F]   split over F (columns) when sharded
    down_FD        [F, D]   split over F (rows) when sharded

One ``*_local`` function per layout runs inside ``jax.shard_map``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import AbstractMesh, Mesh

from k3jax.layout import TENSOR, Layout, MlpLayout, MlpMode, SharedOverlap, check_mesh
from k3jax.modules.inputs import as_rows, from_rows
from k3jax.modules.params import Init, ParamDecl, ParamSource, make_params, source_of
from k3jax.ops import SiTU, situ_mlp
from k3jax.ops.matmul import matmul
from k3jax.parallel.ring import ring_sp_mlp
from k3jax.parallel.sequence import gather_rows, on_layer_mesh, row_sharded_forward, scatter_rows
from pallas_kernels.backend import KernelBackend
from pallas_kernels.situ_mlp.api import situ_mlp_up

MlpWeights = dict[str, jax.Array]   # {"gate_DF", "up_DF", "down_FD"}


def mlp_decls(layout: MlpLayout, dtype, prefix: str = "") -> list[ParamDecl]:
    D, F = layout.hidden, layout.intermediate
    specs = layout.param_specs
    return [ParamDecl(prefix + "gate_DF", (D, F), dtype, specs["gate_DF"], Init.WEIGHT, D),
            ParamDecl(prefix + "up_DF", (D, F), dtype, specs["up_DF"], Init.WEIGHT, D),
            ParamDecl(prefix + "down_FD", (F, D), dtype, specs["down_FD"], Init.WEIGHT, F)]


# -- per-device bodies (inside shard_map) ------------------------------------
# x_TD [T, D] is this device's rows (T = padded rows / Layout.row_shards);
# weights are this device's shards: gate_DF, up_DF [D, F/s], down_FD [F/s, D],
# s = 1 (REPLICATED) or tp (SP_SHARDED, TP). Each returns y_TD [T, D] in x's dtype
# (mlp_tp_partial: the unreduced float32 partial sum).
def mlp_replicated_local(x_TD, w: MlpWeights, act: SiTU, backend: KernelBackend):
    """Full weights, own rows, no collective."""
    return situ_mlp(x_TD, w["gate_DF"], w["up_DF"], w["down_FD"], act, backend=backend)


def mlp_tp_partial(x_TD, w: MlpWeights, act: SiTU, backend: KernelBackend):
    """This F shard's float32 partial sum [T, D] of the rows given (unreduced)."""
    return situ_mlp(x_TD, w["gate_DF"], w["up_DF"], w["down_FD"], act, backend=backend,
                    out_dtype=jnp.float32)


def mlp_sp_sharded_local(x_TD, w: MlpWeights, act: SiTU, backend: KernelBackend,
                         scatter_dtype=jnp.float32):
    """Rows split over TENSOR: all-gather them ([T * tp, D]) -> float32 partial
    MLP on this F shard -> reduce-scatter over TENSOR in ``scatter_dtype``
    (sums the partials, returns own rows) -> x's dtype. Summing in float32
    (the default) makes the result match the replicated layout's to float32
    rounding; bfloat16 halves the scatter's bytes and rounds each partial and
    the sum to bf16."""
    partial = mlp_tp_partial(gather_rows(x_TD, TENSOR), w, act, backend)
    return scatter_rows(partial.astype(scatter_dtype), TENSOR).astype(x_TD.dtype)


def mlp_sp_ring_local(x_TD, w: MlpWeights, act: SiTU, backend: KernelBackend,
                      scatter_dtype=jnp.float32):
    """As mlp_sp_sharded_local, overlapped (SharedOverlap.RING): the input
    rows travel the tensor-axis ring block by block (tp - 1 ppermutes of
    [T, D]), each block's gate/up + SiTU ([T, F/tp]) running while the next
    travels; then each block's float32 down partial [T, D] is added to the
    running sum passed around the ring (tp - 1 ppermutes of [T, D] in
    ``scatter_dtype``; each add in float32), each device ending with the sum
    of its own rows -> x's dtype."""
    def up(block_TD):
        return situ_mlp_up(block_TD, w["gate_DF"], w["up_DF"], beta=act.beta,
                           linear_beta=act.linear_beta, backend=backend)

    def down(h_TF):
        return matmul(h_TF, w["down_FD"], out_dtype=jnp.float32)

    return ring_sp_mlp(x_TD, up, down, TENSOR, scatter_dtype).astype(x_TD.dtype)


def gather_gate_up(w: MlpWeights) -> tuple[jax.Array, jax.Array]:
    """Inside shard_map: this device's gate_DF, up_DF [D, F/tp] -> the full
    (gate_DF, up_DF) [D, F], F in device order, in ONE all-gather over TENSOR
    of the two stacked ([2, D, F/tp] -> [2, D, F]), in their dtype."""
    gate_up_2DF = jax.lax.all_gather(jnp.stack([w["gate_DF"], w["up_DF"]]), TENSOR, axis=2,
                                     tiled=True)
    return gate_up_2DF[0], gate_up_2DF[1]


def gather_down(down_FD: jax.Array) -> jax.Array:
    """Inside shard_map: this device's down_FD [F/tp, D] -> the full [F, D],
    one all-gather over TENSOR in its dtype."""
    return jax.lax.all_gather(down_FD, TENSOR, axis=0, tiled=True)


def gather_mlp_weights(w: MlpWeights) -> MlpWeights:
    """Inside shard_map: this device's F shards -> the full weights (the
    replicated layout's), in two all-gathers over TENSOR (gather_gate_up,
    gather_down). Under autodiff each transposes to a reduce-scatter of the
    gradient over TENSOR."""
    gate_DF, up_DF = gather_gate_up(w)
    return {"gate_DF": gate_DF, "up_DF": up_DF, "down_FD": gather_down(w["down_FD"])}


def mlp_sp_weights_local(x_TD, w: MlpWeights, act: SiTU, backend: KernelBackend):
    """Rows split over TENSOR, weights moved instead (SharedOverlap.WEIGHTS):
    gather_mlp_weights, then mlp_replicated_local on own rows; the gathered
    copy is a temporary of this call. Same arithmetic as the replicated
    layout (same bits out)."""
    return mlp_replicated_local(x_TD, gather_mlp_weights(w), act, backend)


def mlp_tp_local(x_TD, w: MlpWeights, act: SiTU, backend: KernelBackend):
    """Rows replicated over TENSOR: column-parallel gate/up, row-parallel down,
    float32 all-reduce over TENSOR, cast to x's dtype."""
    return jax.lax.psum(mlp_tp_partial(x_TD, w, act, backend), TENSOR).astype(x_TD.dtype)


MLP_LOCAL = {MlpMode.REPLICATED: mlp_replicated_local,
             MlpMode.SP_SHARDED: mlp_sp_sharded_local,
             MlpMode.TP: mlp_tp_local}


SP_LOCAL = {SharedOverlap.NONE: mlp_sp_sharded_local, SharedOverlap.RING: mlp_sp_ring_local,
            SharedOverlap.WEIGHTS: mlp_sp_weights_local}


def mlp_local(layout: MlpLayout):
    """The per-device body (x_TD, w, act, backend) -> y_TD of ``layout``:
    MLP_LOCAL[mode], or for an SP-sharded MLP the form its overlap names
    (SP_LOCAL), the token-side ones summing in ``layout.scatter_dtype``."""
    if layout.mode is not MlpMode.SP_SHARDED:
        return MLP_LOCAL[layout.mode]
    body = SP_LOCAL[layout.overlap]
    if layout.overlap.moves_rows:
        return functools.partial(body, scatter_dtype=layout.scatter_dtype)
    return body


class KimiMLP(nnx.Module):
    """SiTU-GLU MLP on a mesh. ``__call__``: x [..., D] (any leading shape)
    -> y of the same shape, in the Layout's dtype (a floating x is cast to
    it; any other dtype is a TypeError naming it, k3jax.modules.inputs). The
    rows (the leading dimensions flattened) are computed split over
    ``layout.parallel.token_axes`` ((data, tensor) under sequence
    parallelism, else (data,)); the output is placed that way when their
    number is a multiple of the row blocks, else XLA chooses.

    ``layer`` is the layer's Layout and ``mlp`` one of its MLPs
    (``layer.dense_mlp`` or ``layer.shared_mlp``); the activation, dtype and
    backend are the Layout's. ``self.layout`` is ``mlp``, ``self.cfg`` the
    model config. ``mesh`` must be the (dp, tp) mesh of ``layer.parallel``.
    Weights (nnx.Param) come from ``rngs`` (an nnx.Rngs) or ``source``
    (RandomSource, AbstractSource, a checkpoint's), exactly one.
    """

    def __init__(self, layer: Layout, mlp: MlpLayout, mesh: Mesh | AbstractMesh, *,
                 rngs: nnx.Rngs | None = None, source: ParamSource | None = None,
                 name_prefix: str = ""):
        source = source_of("KimiMLP", rngs, source)
        if mlp not in (layer.dense_mlp, layer.shared_mlp):
            raise ValueError(f"KimiMLP: mlp must be the Layout's dense_mlp or shared_mlp, "
                             f"got {mlp.mode.value} {mlp.hidden} x {mlp.intermediate}")
        mesh = check_mesh(mesh, mlp.parallel, "KimiMLP")   # the layer's mesh (Auto, k3jax's names)
        self.layout = mlp
        self.cfg = layer.cfg
        self.act = SiTU.from_config(layer.cfg)
        self.mesh = mesh
        self.dtype = layer.dtype
        self.backend = layer.backend
        make_params(self, mlp_decls(mlp, self.dtype, name_prefix), mesh, source)

    def weights(self) -> MlpWeights:
        return {"gate_DF": self.gate_DF[...], "up_DF": self.up_DF[...],
                "down_FD": self.down_FD[...]}

    def __call__(self, x: jax.Array) -> jax.Array:
        # an x on the user's mesh runs on the layer's, its output placed back like it
        return on_layer_mesh(self._forward, self.mesh, self.layout.parallel)(x)

    def _forward(self, x: jax.Array) -> jax.Array:
        x_TD, lead = as_rows(x, self.layout.hidden, "KimiMLP")
        forward = mlp_forward(self.layout.for_tokens(x_TD.shape[0], self.dtype), self.act,
                              self.mesh, self.dtype, self.backend)
        return from_rows(forward(x_TD, self.weights()), lead)


@functools.lru_cache(maxsize=64)
def mlp_forward(layout: MlpLayout, act: SiTU, mesh: Mesh, dtype, backend: KernelBackend):
    """The jitted global forward (x_TD, weights) -> y_TD of one MLP layout
    (``row_sharded_forward`` around the layout's body). Cached, so eager
    calls compile once per shape."""
    body = mlp_local(layout)
    return row_sharded_forward(lambda x_TD, valid_T, w: body(x_TD, w, act, backend), mesh,
                               layout.parallel, dtype, layout.param_specs)


__all__ = ["KimiMLP", "mlp_decls", "MLP_LOCAL", "SP_LOCAL", "mlp_local", "mlp_tp_partial",
           "gather_gate_up", "gather_down", "gather_mlp_weights", "mlp_sp_weights_local",
           "MlpWeights"]
