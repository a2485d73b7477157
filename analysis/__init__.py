"""Models of the kernels and the layers on an H200, run offline (no GPU, never
at trace time): the kernel cost model (kernel_cost), the tile search over it
(tile_search) and the writer of the launchers' committed tile table
(write_tile_table), and the whole-layer latency model of a MoE or dense layer
under sequence parallelism (layer_latency, on the schedule of layer_schedule)
with the writer of the committed auto shared-expert table
(write_overlap_table), and the latency model of moving routed rows under
expert parallelism across nodes (dispatch_latency, with where a token's
experts live: ep_destinations) with the writer of the committed auto EP
dispatch table (write_dispatch_table). All read pallas_kernels.hardware.H200.
The runtime packages (k3jax, pallas_kernels) never import this one; ``k3jax
latency`` loads it when run.
"""
