"""Check on first use: every kernel configuration a layer launches on a GPU
(or, on a CPU, in interpret mode) is run once against the XLA path before it
is trusted; the result is cached per machine (docs/selfcheck.md).

config.py  KernelConfig (op, shapes, dtypes, tiles, backend) and the
           environment half of a cache key
launch.py  the launchers a check runs: the op's dispatch.py entry, or a
           fixed tiling of its kernels
check.py   one check: random inputs, kernel vs XLA in float32, a timeout
tune.py    on request: time a few candidate tilings, keep the fastest
cache.py   one atomically written JSON file per key
gate.py    trusted_backend: what the public ops ask at trace time
"""
