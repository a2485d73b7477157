"""The shard_map building blocks, used inside the modules' ``jax.shard_map``:

    sequence     sequence-parallel rows: pad, gather, scatter
    ring         the ring all-gather / reduce-scatter matmuls
    ep_exchange  routed rows under EP: staged gather / scatter, the dropless
                 ragged all-to-all
    ragged_a2a   ragged all-to-all, native or its CPU emulation

Each is a pure function of local arrays and mesh axis names; none reads a
Layout.
"""
