"""Tools that inspect or model the k3jax library; the library never imports them.

    aot, compile, compile_grads, compile_triton   one layer compiled for H200s on
                                   compile-only devices (the deviceless compile) and
                                   its reports
    hlo_schedule                   the collectives of a compiled program, in order
    kernel_ptxas, kernel_sass      registers / spills and SASS counts of the kernels
    triton_compile, peers          Triton cubins on the CPU; the kernels' peers
    plan, plan_collectives, memory the planner: per-device bytes and collectives
    kernel_cost, tile_search       the kernel cost model (a model's prediction)
    layer_schedule, layer_latency  the whole-layer latency model (a prediction)
    ep_destinations, dispatch_latency  the EP dispatch latency model (a prediction)
    token_sweep                    ``k3jax bench``'s sweep

``k3jax.cli`` runs them; ``scripts/`` writes the committed tables they feed.
"""
