"""Check on first use: every kernel configuration a layer launches on a GPU
(or, on a CPU, in interpret mode) is run once against the XLA path before it
is trusted; the result is cached per machine (docs/selfcheck.md).

config.py  KernelConfig (op, shapes, dtypes, tiles, backend) and the
           environment half of a cache key
check.py   one check: random inputs, kernel vs XLA in float32, a timeout
cache.py   one atomically written JSON file per key
gate.py    trusted_backend: what the dispatch asks at trace time
"""
