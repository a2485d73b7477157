"""Writers of the committed tables (not installed): ``python -m scripts.NAME``.

    write_tile_table       pallas_kernels' launch tiles, from the kernel cost model
    write_overlap_table    the auto shared-expert form, from the layer latency model
    write_dispatch_table   the auto EP dispatch form, from the dispatch latency model
"""
