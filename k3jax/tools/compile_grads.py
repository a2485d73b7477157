"""One layer's training step compiled for H200 GPUs without a GPU
(``k3jax compile --grads``).

The program is the one ``k3jax.grads.layer_grads`` runs: ``grad_program``'s
jitted forward of the layer on x_TD [T, D] and its VJP for a cotangent dy_TD
[T, D] (x's sharding), returning (y_TD, dx_TD, the gradient of every trainable
weight, each sharded like its weight). It is lowered with abstract weights on
compile-only H200 devices and compiled with ``k3jax.tools.aot.GPU_COMPILER_OPTIONS``,
as ``k3jax.tools.compile.compile_layer`` compiles the forward. The report has the
forward's sections; the per-device bytes read:

    weights      argument bytes of the parameters (trainable and frozen);
    activations  argument bytes of x_TD's and dy_TD's shards;
    outputs      y_TD's and dx_TD's shards and every weight gradient
                 (``gradient_bytes`` of them are the weight gradients);
    temporaries  XLA's temp buffers (peak of the schedule: the forward's
                 residuals live here until the backward consumes them).

``fits_h200`` is one layer's training step on one device: this layer's
weights + activations + outputs (gradients included) + temporaries <= the
target's device memory. Packed MXFP4 experts are frozen (``frozen`` lists
their codes and scales and the selection-only router bias); ``x_gradient``
then names the path their input's gradient takes.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
from flax import nnx

from k3jax.config import K3Config
from k3jax.formats import ExpertStorage
from k3jax.grads import grad_program, param_path, split_trainable
from k3jax.layout import ParallelConfig
from k3jax.layout.expert_placement import ExpertPlacement
from k3jax.tools.aot import GPU_COMPILER_OPTIONS, ptxas_dump
from k3jax.tools.compile import (
    CompileReport,
    _cost,
    abstract_layer,
    compiled_bytes,
    planner_bytes,
    shard_bytes,
    target_summary,
)
from k3jax.tools.hlo_schedule import collective_schedule
from pallas_kernels.mxfp4 import Mxfp4Dequant
from pallas_kernels.selfcheck import gate

MXFP4_X_GRADIENT = {
    "xla": "blocked scan of dy @ W[g]^T, one active expert dequantized at a time "
           "(pallas_kernels.grouped_matmul.mxfp4_vjp)",
    "pallas": "Mosaic MXFP4 kernel forward; dx by the blocked scan of dy @ W[g]^T, one "
              "active expert dequantized at a time (pallas_kernels.grouped_matmul.mxfp4_vjp)",
}


@dataclasses.dataclass(frozen=True)
class GradsCompileReport(CompileReport):
    """What the GPU compiler made of one layer's forward and VJP (module docstring)."""

    gradient_bytes: int = 0                 # the weight gradients' shards, per device
    frozen: tuple[str, ...] = ()            # parameters without a gradient
    x_gradient: str | None = None           # the frozen MXFP4 experts' dx path

    @property
    def needed_bytes(self) -> int:
        """This layer's weights, activations, outputs (gradients) and temporaries."""
        return sum(self.per_device_bytes.values())

    def to_dict(self) -> dict[str, Any]:
        d = super().to_dict()
        d["fit"] = {"model_weight_bytes": self.model_weight_bytes,
                    "layer_weight_bytes": self.per_device_bytes["weights"],
                    "needed_bytes": self.needed_bytes,
                    "device_memory_bytes": self.device_memory_bytes}
        d["grads"] = {"gradient_bytes": self.gradient_bytes, "frozen": list(self.frozen),
                      "x_gradient": self.x_gradient}
        return d


def compile_layer_grads(cfg: K3Config, parallel: ParallelConfig, layer: int, *, tokens: int,
                        backend: str = "xla", dtype: str = "bfloat16",
                        expert_dtype: str = "mxfp4",
                        mxfp4_dequant: Mxfp4Dequant = Mxfp4Dequant.FAST,
                        compiler_options: dict | None = None,
                        expert_placement: ExpertPlacement | None = None) -> GradsCompileReport:
    """Compile layer ``layer``'s forward and VJP on ``tokens`` global rows for
    ``parallel.num_devices`` H200s (module docstring); packed MXFP4 experts'
    scale bytes are taken to allow ``mxfp4_dequant`` (as in
    ``k3jax.tools.compile.compile_layer``). Errors as ``compile_layer``."""
    built = abstract_layer(cfg, parallel, layer, tokens=tokens, backend=backend, dtype=dtype,
                           expert_dtype=expert_dtype, mxfp4_dequant=mxfp4_dequant,
                           expert_placement=expert_placement)
    options = GPU_COMPILER_OPTIONS if compiler_options is None else compiler_options
    mesh, layout, module, x_TD = built.mesh, built.layout, built.module, built.x_TD
    _, params, frozen = split_trainable(module)

    t0 = time.perf_counter()
    with (ptxas_dump() as reports, gate.collecting(),   # no check on first use: as compile_layer
          jax.sharding.use_abstract_mesh(mesh.abstract_mesh)):
        traced = grad_program(module).trace(params, frozen, x_TD, x_TD)
        compiled = traced.lower().compile(compiler_options=options)
        kernels = tuple(reports())
    seconds = time.perf_counter() - t0

    per_device = compiled_bytes(compiled, 2 * shard_bytes(x_TD))  # x and the cotangent
    planner, model = planner_bytes(cfg, parallel, layer, dtype=dtype, expert_dtype=expert_dtype)
    frozen_names = tuple(param_path(p) for p, _ in nnx.to_flat_state(frozen))
    packed = cfg.is_moe_layer(layer) and built.experts is ExpertStorage.MXFP4
    text = compiled.as_text()
    flops, bytes_accessed = _cost(compiled)
    return GradsCompileReport(
        cfg=cfg, parallel=parallel, layout=layout, layer=layer, tokens=tokens, backend=backend, dtype=dtype,
        expert_dtype=expert_dtype, per_device_bytes=per_device, planner_weight_bytes=planner,
        model_weight_bytes=model, device_memory_bytes=target_summary()["device_memory_bytes"],
        collectives=tuple(collective_schedule(text)), kernels=kernels, peer_kernels=(),
        flops=flops, bytes_accessed=bytes_accessed, compile_seconds=seconds, hlo_text=text,
        gradient_bytes=shard_bytes(params), frozen=frozen_names,
        x_gradient=MXFP4_X_GRADIENT[backend] if packed else None)


__all__ = ["GradsCompileReport", "MXFP4_X_GRADIENT", "compile_layer_grads"]
