"""XLA options k3jax compiles its GPU programs with. No jax import: the CLI
reads them before jax starts.

Overlap: XLA's collective combiners merge the shared expert's all-gather /
reduce-scatter into the routed path's: one collective that carries both and
so overlaps neither branch (at 256 tokens on 8 H200s the merged
reduce-scatter ran synchronously). A combine threshold of 0 bytes keeps every
collective separate, and the latency-hiding scheduler then overlaps each with
the other branch's GEMMs (tests/test_aot_layouts.py checks this against the
compiled schedule).

Ragged all-to-all across nodes: XLA runs a ragged all-to-all whose peers
are not all on one host (the cross-node stage of ``EpDispatch.ALL_TO_ALL``)
by per-peer NCCL send / recv, and jaxlib 0.11.2's XLA refuses that path at
run time unless ``xla_gpu_allow_ragged_all_to_all_nccl_send_recv_fallback``
is on (its default is off; k3jax.tools.ragged_xla has the sources).

XLA:CPU ignores these options. Set them on the TOP-LEVEL jit
(``jax.jit(f, compiler_options=...)`` or ``lowered.compile(compiler_options)``;
jax rejects them on a nested jit, and k3jax's module forwards are nested in
their callers' jits), or for a whole process as XLA_FLAGS (the ``k3jax`` CLI
adds GPU_XLA_FLAGS to XLA_FLAGS).
"""

from __future__ import annotations

GPU_COMPILER_OPTIONS: dict[str, int | bool] = {
    "xla_gpu_all_gather_combine_threshold_bytes": 0,
    "xla_gpu_reduce_scatter_combine_threshold_bytes": 0,
    "xla_gpu_allow_ragged_all_to_all_nccl_send_recv_fallback": True,
}
GPU_XLA_FLAGS = " ".join(f"--{k}={str(v).lower()}" for k, v in GPU_COMPILER_OPTIONS.items())


def with_gpu_flags(xla_flags: str) -> str:
    """``xla_flags`` (an XLA_FLAGS value) plus each GPU_XLA_FLAGS flag it
    does not set already (a user's own setting of one of them stands)."""
    flags = xla_flags.split()
    for name, value in GPU_COMPILER_OPTIONS.items():
        if not any(f.split("=")[0] == f"--{name}" for f in flags):
            flags.append(f"--{name}={str(value).lower()}")
    return " ".join(flags)


__all__ = ["GPU_COMPILER_OPTIONS", "GPU_XLA_FLAGS", "with_gpu_flags"]
