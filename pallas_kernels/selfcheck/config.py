"""What identifies one kernel launch for the check on first use.

``KernelConfig`` is (op, shapes, dtypes, tile config, backend): the launch's
M x K x N over G groups, x's and the weights' dtype ("mxfp4" for packed
MXFP4 weights whose dequant is FAST, "mxfp4-exact" for EXACT ones: the
Mosaic backends run different kernels for them), packed weights' K order
(Mxfp4Weights.k_order_axis: the Mosaic kernels take x, or give y, in
another order for it), the tiling the backend's dispatch picks for that
shape, the resolved backend (a KernelBackend of a kernel family: Mosaic,
compiled or interpreted, or Triton), and the SiTU betas of the fused ops.
``name`` is its printable form (the selfcheck table, the warning lines and
K3JAX_SELFCHECK_PERTURB use it); ``to_json`` the cache key's half, the
backend by its name. ``table_key`` is the launch's key in the committed
tile table.

``environment()`` is the rest of a cache key: device kind, the runtime's
platform version (the CUDA version on a GPU), the NVIDIA driver's version
line where the system has one, jax and jaxlib versions and a hash of the
kernel sources.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import pathlib

import jax
import jax.numpy as jnp

from pallas_kernels.backend import (
    INTERPRET,
    PALLAS,
    TRITON,
    Backend,
    BackendName,
    Family,
    KernelBackend,
    describe_devices,
    parse_backend,
    resolve,
)

OPS = ("grouped_matmul", "grouped_situ_glu", "situ_mlp_up")
CHECKED_FAMILIES = (Family.MOSAIC, Family.TRITON)   # XLA launches are never checked
CHECKED_BACKENDS = tuple(b.name for b in (PALLAS, INTERPRET, TRITON))
MXFP4 = "mxfp4"   # w_dtype of packed MXFP4 weights, dequant FAST
MXFP4_EXACT = "mxfp4-exact"   # w_dtype of packed MXFP4 weights, dequant EXACT


def mxfp4_dtypes() -> dict:
    """{w_dtype name: pallas_kernels.mxfp4.Mxfp4Dequant} of packed MXFP4 weights."""
    from pallas_kernels.mxfp4 import Mxfp4Dequant
    return {MXFP4: Mxfp4Dequant.FAST, MXFP4_EXACT: Mxfp4Dequant.EXACT}


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """One kernel configuration.

    op: one of OPS; m, k, n, groups: x [m, k] times weights [groups, k, n]
    (situ_mlp_up: groups 1); x_dtype / w_dtype: dtype names (w_dtype MXFP4 or
    MXFP4_EXACT for packed weights, by their dequant); tiles: the tiling's
    printable form (``tiles_of``); backend: a KernelBackend of one of
    CHECKED_FAMILIES (a name in CHECKED_BACKENDS is read as one); beta /
    linear_beta: the SiTU betas of the fused ops (None for grouped_matmul);
    k_order_axis: packed weights' Mxfp4Weights.k_order_axis (None, 1 or 2;
    None for other weights).
    """

    op: str
    m: int
    k: int
    n: int
    groups: int
    x_dtype: str
    w_dtype: str
    tiles: str
    backend: KernelBackend
    beta: float | None = None
    linear_beta: float | None = None
    k_order_axis: int | None = None

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise ValueError(f"KernelConfig: op {self.op!r} is not one of {OPS}")
        object.__setattr__(self, "backend", checked_backend(self.backend))
        if self.k_order_axis not in (None, 1, 2):
            raise ValueError(f"KernelConfig: k_order_axis must be None, 1 or 2, got "
                             f"{self.k_order_axis!r}")
        if self.k_order_axis is not None and self.w_dtype not in (MXFP4, MXFP4_EXACT):
            raise ValueError(f"KernelConfig: k_order_axis {self.k_order_axis} needs packed "
                             f"MXFP4 weights, not {self.w_dtype}")

    @property
    def num_weights(self) -> int:
        return 1 if self.op == "grouped_matmul" else 2

    @property
    def name(self) -> str:
        """e.g. ``grouped_situ_glu:m64,k32,n16,g4:bfloat16/bfloat16:row_major/1-64-128-64:interpret``
        (beta suffix ``:b1.0/l0.5`` on the fused ops; weights in K order:
        ``bfloat16/mxfp4-k2``). No spaces."""
        betas = ("" if self.beta is None else
                 f":b{self.beta:g}" + ("" if self.linear_beta is None else f"/l{self.linear_beta:g}"))
        order = "" if self.k_order_axis is None else f"-k{self.k_order_axis}"
        return (f"{self.op}:m{self.m},k{self.k},n{self.n},g{self.groups}:"
                f"{self.x_dtype}/{self.w_dtype}{order}:{self.tiles}:{self.backend.name}{betas}")

    def to_json(self) -> dict:
        """The fields as JSON values (the backend by its name)."""
        return {**dataclasses.asdict(self), "backend": self.backend.name}


def checked_backend(backend: Backend) -> KernelBackend:
    """``backend`` (a KernelBackend or a name other than "auto") as a
    KernelBackend of one of CHECKED_FAMILIES; ValueError otherwise."""
    if not isinstance(backend, KernelBackend) and parse_backend(backend) is BackendName.AUTO:
        raise ValueError(f"KernelConfig: backend {backend!r} is not one of {CHECKED_BACKENDS}")
    resolved = resolve(backend)
    if resolved.family not in CHECKED_FAMILIES:
        raise ValueError(f"KernelConfig: backend {resolved.name!r} is not one of "
                         f"{CHECKED_BACKENDS}")
    return resolved


def table_key(config: KernelConfig) -> tuple:
    """The committed table's key of this launch: (op, M, K, N, groups, num_weights, dtype)."""
    dtype = jnp.result_type(jnp.dtype(config.x_dtype), jnp.dtype(config.w_dtype)).name
    op = "mlp" if config.op == "situ_mlp_up" else "grouped"
    return (op, config.m, config.k, config.n, config.groups, config.num_weights, dtype)


def describe_tiles(kind: str, tiles: object | None) -> str:
    """``kind/v1-v2-...``: a tiling dataclass's field values in field order."""
    if tiles is None:
        return kind
    values = [dataclasses.asdict(tiles)[f.name] for f in dataclasses.fields(tiles)]
    return kind + "/" + "-".join("d" if v is None else str(v) for v in values)


def tiles_of(op: str, m: int, k: int, n: int, groups: int, x_dtype: str, w_dtype: str,
             backend: KernelBackend) -> str:
    """The tiling the backend's dispatch picks for this launch from the
    committed table (a tuned pick aside), printed."""
    from pallas_kernels.grouped_matmul import mosaic_sm90, tile_choice

    num_weights = 1 if op == "grouped_matmul" else 2
    if backend.family is Family.TRITON:
        from pallas_kernels.grouped_matmul.triton_sm80 import default_tiles
        return describe_tiles("triton", default_tiles(m, groups, num_weights,
                                                      jnp.dtype(x_dtype).itemsize,
                                                      w_dtype in (MXFP4, MXFP4_EXACT)))
    if w_dtype == MXFP4_EXACT:   # EXACT weights: the exact row-major kernel
        return "mxfp4 exact row_major"
    if w_dtype == MXFP4:   # the Mosaic MXFP4 dispatch (mxfp4_vjp.kernel_module)
        from pallas_kernels.grouped_matmul import mosaic_sm90_mxfp4_swap_ab
        block_t = mosaic_sm90_mxfp4_swap_ab.block_t_for(m, groups, num_weights)
        return "mxfp4 row_major" if block_t is None else f"mxfp4 swap_ab t{block_t}"
    if m == 0 or n == 0:
        return "empty"
    dtype = jnp.result_type(jnp.dtype(x_dtype), jnp.dtype(w_dtype)).name
    if op == "situ_mlp_up":
        cfg = tile_choice.mlp_config(m, k, n, dtype, tuned=False)
        return describe_tiles("mlp", cfg or mosaic_sm90.default_config(m, 1, 2))
    swap_ab = tile_choice.grouped_config(m, k, n, groups, num_weights, dtype, tuned=False)
    if swap_ab is not None:
        return describe_tiles("swap_ab", swap_ab)
    return describe_tiles("row_major", mosaic_sm90.default_config(m, groups, num_weights))


def grouped_config(op: str, x_MK, w_GKN, backend: Backend, beta: float | None = None,
                   linear_beta: float | None = None) -> KernelConfig:
    """The KernelConfig of a grouped launch (x_MK [M, K], w_GKN [G, K, N] array
    or Mxfp4Weights; only shapes and dtypes are read: tracers are fine) on
    ``backend`` (checked_backend)."""
    from pallas_kernels.mxfp4 import Mxfp4Dequant, Mxfp4Weights

    backend = checked_backend(backend)

    m, k = x_MK.shape
    groups, _, n = w_GKN.shape
    k_order_axis = None
    if isinstance(w_GKN, Mxfp4Weights):
        w_dtype = MXFP4 if w_GKN.dequant is Mxfp4Dequant.FAST else MXFP4_EXACT
        k_order_axis = w_GKN.k_order_axis
    else:
        w_dtype = jnp.dtype(w_GKN.dtype).name
    x_dtype = jnp.dtype(x_MK.dtype).name
    return KernelConfig(op=op, m=m, k=k, n=n, groups=groups, x_dtype=x_dtype, w_dtype=w_dtype,
                        tiles=tiles_of(op, m, k, n, groups, x_dtype, w_dtype, backend),
                        backend=backend, beta=beta, linear_beta=linear_beta,
                        k_order_axis=k_order_axis)


def mlp_config(x_TD, gate_DF, backend: Backend, beta: float,
               linear_beta: float | None) -> KernelConfig:
    """The KernelConfig of a situ_mlp_up launch (x_TD [T, D], gate_DF [D, F])
    on ``backend`` (checked_backend)."""
    backend = checked_backend(backend)
    m, k = x_TD.shape
    n = gate_DF.shape[1]
    x_dtype, w_dtype = jnp.dtype(x_TD.dtype).name, jnp.dtype(gate_DF.dtype).name
    return KernelConfig(op="situ_mlp_up", m=m, k=k, n=n, groups=1, x_dtype=x_dtype,
                        w_dtype=w_dtype,
                        tiles=tiles_of("situ_mlp_up", m, k, n, 1, x_dtype, w_dtype, backend),
                        backend=backend, beta=beta, linear_beta=linear_beta)


# The kernels' sources: every module of these packages (dispatch, kernels,
# tilings, the committed tile table, interpret-mode support).
_SOURCE_DIRS = ("grouped_matmul", "situ_mlp")
_SOURCE_FILES = ("situ.py", "mxfp4.py", "interpret_compat.py", "backend.py", "hardware.py")


@functools.cache
def source_hash() -> str:
    """sha256 (16 hex digits) over the kernel source files and the package's
    data (the tile table), by relative path."""
    root = pathlib.Path(__file__).resolve().parent.parent
    paths = sorted([p for d in _SOURCE_DIRS for p in (root / d).glob("*.py")]
                   + [root / f for f in _SOURCE_FILES] + sorted((root / "data").glob("*.json")))
    digest = hashlib.sha256()
    for path in paths:
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


_NVIDIA_DRIVER_FILE = pathlib.Path("/proc/driver/nvidia/version")


def driver_version() -> str:
    """The NVIDIA kernel driver's version line (Linux), "" where there is none."""
    try:
        return _NVIDIA_DRIVER_FILE.read_text().splitlines()[0].strip()
    except (OSError, IndexError):
        return ""


@functools.cache
def environment() -> dict[str, str]:
    """The machine and software half of a cache key (this process's first device)."""
    import jaxlib

    device = jax.devices()[0]
    return {"platform": device.platform, "device_kind": device.device_kind,
            "compute_capability": describe_devices([device]).compute_capability,
            "platform_version": device.client.platform_version,
            "driver": driver_version(),
            "jax": jax.__version__, "jaxlib": jaxlib.__version__,
            "kernel_sources": source_hash()}


def positive_env(name: str, default, parse, expected: str):
    """``parse(os.environ[name])`` (``default`` when unset or empty); a value
    that does not parse, or is not > 0, raises ValueError naming the variable
    and ``expected``."""
    text = os.environ.get(name, "")
    try:
        value = parse(text) if text else default
    except ValueError:
        raise ValueError(f"{name}={text!r}: expected {expected}") from None
    if not value > 0:
        raise ValueError(f"{name}={text!r}: expected {expected}")
    return value
