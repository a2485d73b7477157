"""The names benchmarks/compile_table.py reads from the kernel sweep as ``gpu_kernels``.

The sweep is split by job: the cases in benchmarks.cases, the timed run in
benchmarks.kernel_sweep, the cost model's rows in benchmarks.model_rows and
the configuration list in benchmarks.lower_check (``lowering_configs``, the
list compile_table.kernel_configs builds). This module only re-exports what
compile_table imports from here.
"""

from benchmarks.cases import FULL, SITU, grouped_cases, jax_mosaic_ragged_dot, mlp_cases

__all__ = ["FULL", "SITU", "grouped_cases", "jax_mosaic_ragged_dot", "mlp_cases"]
