"""XLA options k3jax compiles its GPU programs with. No jax import: the CLI
reads them before jax starts.

XLA's collective combiners merge the shared expert's all-gather /
reduce-scatter into the routed path's: one collective that carries both and
so overlaps neither branch (at 256 tokens on 8 H200s the merged
reduce-scatter ran synchronously). A combine threshold of 0 bytes keeps every
collective separate, and the latency-hiding scheduler then overlaps each with
the other branch's GEMMs (tests/test_aot_layouts.py checks this against the
compiled schedule). XLA:CPU ignores these options.

Set them on the TOP-LEVEL jit (``jax.jit(f, compiler_options=...)`` or
``lowered.compile(compiler_options)``; jax rejects them on a nested jit, and
k3jax's module forwards are nested in their callers' jits), or for a whole
process as XLA_FLAGS (the ``k3jax`` CLI adds OVERLAP_XLA_FLAGS to XLA_FLAGS).
"""

from __future__ import annotations

OVERLAP_COMPILER_OPTIONS: dict[str, int] = {
    "xla_gpu_all_gather_combine_threshold_bytes": 0,
    "xla_gpu_reduce_scatter_combine_threshold_bytes": 0,
}
OVERLAP_XLA_FLAGS = " ".join(f"--{k}={v}" for k, v in OVERLAP_COMPILER_OPTIONS.items())


def with_overlap_flags(xla_flags: str) -> str:
    """``xla_flags`` (an XLA_FLAGS value) plus each OVERLAP_XLA_FLAGS flag it
    does not set already (a user's own setting of one of them stands)."""
    flags = xla_flags.split()
    for name, value in OVERLAP_COMPILER_OPTIONS.items():
        if not any(f.split("=")[0] == f"--{name}" for f in flags):
            flags.append(f"--{name}={value}")
    return " ".join(flags)


__all__ = ["OVERLAP_COMPILER_OPTIONS", "OVERLAP_XLA_FLAGS", "with_overlap_flags"]
