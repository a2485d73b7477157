"""Benchmarks and on-device checks of k3jax, one job a module.

- cases: the kernel sweep's shapes, cases and routing (what every job below
  enumerates).
- kernel_sweep: the timed sweep on a GPU (``python -m benchmarks.kernel_sweep``;
  ``--smoke`` on the CPU), measure (check a row against XLA, then time it),
  bench_mxfp4 (its MXFP4 rows), bench_timing (CUPTI / wall-clock timers) and
  bench_report (JSON, console and markdown outputs).
- model_rows: the static cost model's prediction for every row
  (``python -m benchmarks.model_rows``).
- lower_check: every configuration of the sweep lowers for sm_90 on the CPU
  (``python -m benchmarks.lower_check [--triton]``); ``lowering_configs`` is
  the configuration list.
- plot_gpu_kernels: plot a kernel_sweep result.
- gpu_kernel_checks, gpu_grad_checks: forward and backward correctness of the
  kernels on the device.
- compile_table: registers, spills and SMEM of every configuration, compiled
  for the H200 without a GPU.
- token_sweep: the token sweep behind ``k3jax bench`` (shared expert
  replicated vs sharded, and the whole MoE layer).
- h200_device_run.sh: the one command for a lent H200.
"""
