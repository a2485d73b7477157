"""Models of the kernels and the layers on an H200, run offline (no GPU, never
at trace time): the kernel cost model (kernel_cost), the tile search over it
(tile_search) and the writer of the launchers' committed tile table
(write_tile_table), and the shared expert's latency model under sequence
parallelism (shared_latency). All read pallas_kernels.hardware.H200. The
runtime packages (k3jax, pallas_kernels) never import this one.
"""
