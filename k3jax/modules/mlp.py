"""KimiMLP: the SiTU-GLU MLP of the dense layer 0 and of the shared expert.

Parameters (global shapes; PartitionSpecs from the ``MlpLayout``):
    gate_DF, up_DF [D, F]   split over F (columns) when sharded
    down_FD        [F, D]   split over F (rows) when sharded

One ``*_local`` function per layout runs inside ``jax.shard_map``.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import AbstractMesh, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from k3jax.layout import TENSOR, MlpLayout, MlpMode
from k3jax.modules.params import Init, ParamDecl, ParamSource, make_params
from k3jax.ops import SiTU, situ_mlp
from k3jax.sequence_parallel import gather_rows, pad_rows, scatter_rows
from pallas_kernels.backend import Backend

MlpWeights = dict[str, jax.Array]   # {"gate_DF", "up_DF", "down_FD"}


def mlp_decls(layout: MlpLayout, dtype, prefix: str = "") -> list[ParamDecl]:
    D, F = layout.hidden, layout.intermediate
    specs = layout.param_specs
    return [ParamDecl(prefix + "gate_DF", (D, F), dtype, specs["gate_DF"], Init.WEIGHT, D),
            ParamDecl(prefix + "up_DF", (D, F), dtype, specs["up_DF"], Init.WEIGHT, D),
            ParamDecl(prefix + "down_FD", (F, D), dtype, specs["down_FD"], Init.WEIGHT, F)]


# -- per-device bodies (inside shard_map); x_TD is this device's rows ----------
def mlp_replicated_local(x_TD, w: MlpWeights, act: SiTU, backend: Backend):
    """Full weights, own rows, no collective."""
    return situ_mlp(x_TD, w["gate_DF"], w["up_DF"], w["down_FD"], act, backend=backend)


def mlp_sp_sharded_local(x_TD, w: MlpWeights, act: SiTU, backend: Backend):
    """All-gather rows over TENSOR -> partial MLP on this F shard ->
    reduce-scatter over TENSOR (sums the partials, returns own rows).
    The partials travel in the activation dtype, as vLLM's do."""
    x_all = gather_rows(x_TD, TENSOR)
    partial = situ_mlp(x_all, w["gate_DF"], w["up_DF"], w["down_FD"], act, backend=backend)
    return scatter_rows(partial, TENSOR)


def mlp_tp_partial(x_TD, w: MlpWeights, act: SiTU, backend: Backend):
    """Rows replicated over TENSOR; this F shard's float32 partial sum (unreduced)."""
    return situ_mlp(x_TD, w["gate_DF"], w["up_DF"], w["down_FD"], act, backend=backend,
                    out_dtype=jnp.float32)


def mlp_tp_local(x_TD, w: MlpWeights, act: SiTU, backend: Backend):
    """Column-parallel gate/up, row-parallel down, all-reduce over TENSOR."""
    return jax.lax.psum(mlp_tp_partial(x_TD, w, act, backend), TENSOR).astype(x_TD.dtype)


MLP_LOCAL = {MlpMode.REPLICATED: mlp_replicated_local,
             MlpMode.SP_SHARDED: mlp_sp_sharded_local,
             MlpMode.TP: mlp_tp_local}


class KimiMLP(nnx.Module):
    """SiTU-GLU MLP on a mesh. ``__call__``: x_TD [T, D] (all rows) -> [T, D].

    Rows are split over ``token_axes`` (the Layout's: (data, tensor) under
    sequence parallelism, else (data,)); T need not divide evenly.
    """

    def __init__(self, layout: MlpLayout, act: SiTU, mesh: Mesh | AbstractMesh,
                 token_axes: tuple[str, ...], *, dtype=jnp.float32, source: ParamSource,
                 backend: Backend = "auto", name_prefix: str = ""):
        if layout.mode is MlpMode.SP_SHARDED and TENSOR not in token_axes:
            raise ValueError("an SP-sharded MLP needs token rows split over the tensor axis")
        self.layout = layout
        self.act = act
        self.mesh = mesh
        self.token_axes = tuple(token_axes)
        self.dtype = jnp.dtype(dtype)
        self.backend = backend
        make_params(self, mlp_decls(layout, self.dtype, name_prefix), mesh, source)

    def weights(self) -> MlpWeights:
        return {"gate_DF": self.gate_DF[...], "up_DF": self.up_DF[...],
                "down_FD": self.down_FD[...]}

    def __call__(self, x_TD: jax.Array) -> jax.Array:
        if x_TD.ndim != 2 or x_TD.shape[1] != self.layout.hidden:
            raise ValueError(f"KimiMLP: x must be [T, {self.layout.hidden}], got {list(x_TD.shape)}")
        forward = mlp_forward(self.layout, self.act, self.mesh, self.token_axes, self.dtype,
                              self.backend)
        return forward(x_TD, self.weights())


@functools.lru_cache(maxsize=64)
def mlp_forward(layout: MlpLayout, act: SiTU, mesh: Mesh, token_axes: tuple[str, ...], dtype,
                backend: Backend):
    """The jitted global forward (x_TD, weights) -> y_TD of one MLP layout:
    pad rows, place them over ``token_axes``, run the layout's body in
    shard_map, drop the padding. Cached, so eager calls compile once."""
    row_shards = math.prod(mesh.shape[axis] for axis in token_axes)
    x_spec = P(token_axes, None)
    body = MLP_LOCAL[layout.mode]
    sharded = jax.shard_map(lambda x, w: body(x, w, act, backend), mesh=mesh,
                            in_specs=(x_spec, layout.param_specs), out_specs=x_spec)

    @jax.jit
    def forward(x_TD, weights):
        x_pad, _ = pad_rows(x_TD.astype(dtype), row_shards)
        x_pad = jax.lax.with_sharding_constraint(x_pad, NamedSharding(mesh, x_spec))
        return sharded(x_pad, weights)[:x_TD.shape[0]]

    return forward


__all__ = ["KimiMLP", "mlp_decls", "MLP_LOCAL", "mlp_tp_partial", "MlpWeights"]
