"""Compiling for H200 GPUs on a machine without one (deviceless AOT).

jax 0.11.2 compiles for CUDA from a CPU-only process when the CUDA plugin is
installed (the ``gpu-compile`` extra) and ``JAX_PLATFORMS=cpu``: XLA's GPU
pipeline runs (latency-hiding schedule, buffer assignment) and Mosaic GPU
kernels go through LLVM and ptxas. Nothing is allocated and no GPU is touched.

    topo = h200_topology(8)                    # 8 compile-only H200 devices
    mesh = h200_mesh(ParallelConfig(tp=8))     # the (data, tensor) mesh on them
    with ptxas_dump() as reports:              # Mosaic kernels' ptxas reports
        compiled = jax.jit(f).lower(*abstract_args_on(mesh)).compile()
    reports()                                  # [PtxasReport(...), ...]

The target (``k3jax/data/h200.txtpb``) says where each number comes from.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import jax
from jax.sharding import AxisType, Mesh

from k3jax.layout import MESH_AXES, ParallelConfig, make_mesh
from k3jax.tools.kernel_sass import DEQUANT_KERNELS, KStepSass, NoKStepLoop, disassemble, k_step_count
from k3jax.xla_options import GPU_COMPILER_OPTIONS, GPU_XLA_FLAGS

TARGET_FILE = Path(__file__).resolve().parents[1] / "data" / "h200.txtpb"
GPU_COMPILE_EXTRA = "gpu-compile"


class GpuCompileUnavailable(RuntimeError):
    """The CUDA plugin or ptxas this needs is not installed."""


def h200_target_config() -> str:
    """The H200 GpuTargetConfigProto text (k3jax/data/h200.txtpb)."""
    return TARGET_FILE.read_text()


def _nvcc_wheel_bin() -> Path | None:
    """The bin folder of the ``nvidia-cuda-nvcc`` wheel (ptxas), if installed."""
    try:
        import nvidia
    except ImportError:
        return None
    for root in getattr(nvidia, "__path__", []):
        for sub in ("cu13/bin", "cuda_nvcc/bin"):
            candidate = Path(root) / sub
            if (candidate / "ptxas").exists():
                return candidate
    return None


def pin_wheel_ptxas() -> Path:
    """Put the nvidia-cuda-nvcc wheel's ptxas first on PATH (Mosaic looks on
    PATH before the wheel; XLA uses the wheel's), so one ptxas compiles all."""
    bin_dir = _nvcc_wheel_bin()
    if bin_dir is None:
        raise GpuCompileUnavailable(
            f"ptxas not found: install the {GPU_COMPILE_EXTRA} extra "
            f"(pip install 'k3jax[{GPU_COMPILE_EXTRA}]')")
    path = os.environ.get("PATH", "")
    if not path.startswith(str(bin_dir) + os.pathsep):
        os.environ["PATH"] = str(bin_dir) + os.pathsep + path
    return bin_dir / "ptxas"


@functools.lru_cache(maxsize=8)
def h200_topology(num_devices: int, nodes: int = 1):
    """``num_devices`` compile-only H200 devices on ``nodes`` hosts of
    num_devices / nodes each (topology "1 x nodes x per-node"; a device's
    ``process_index`` is its host)."""
    if num_devices < 1 or nodes < 1 or num_devices % nodes:
        raise ValueError(f"num_devices must be a positive multiple of nodes, got {num_devices} "
                         f"over {nodes}")
    from jax.experimental import topologies
    pin_wheel_ptxas()
    try:
        return topologies.get_topology_desc(platform="cuda", target_config=h200_target_config(),
                                            topology=f"1x{nodes}x{num_devices // nodes}")
    except (NotImplementedError, RuntimeError, ValueError) as e:
        raise GpuCompileUnavailable(
            f"cannot compile for CUDA here ({type(e).__name__}: {str(e).splitlines()[0]}); "
            f"install the {GPU_COMPILE_EXTRA} extra and run with JAX_PLATFORMS=cpu") from None


def h200_mesh(parallel: ParallelConfig) -> Mesh:
    """The mesh of ``parallel`` over compile-only H200 devices, one host a
    node (``k3jax.layout.make_mesh``: Auto axis types; over several nodes
    NODE outermost, each node's devices those of one host)."""
    devices = h200_topology(parallel.num_devices, parallel.nodes).devices
    if parallel.nodes > 1:
        return make_mesh(parallel, devices)
    return jax.make_mesh((parallel.dp, parallel.tp), MESH_AXES, axis_types=(AxisType.Auto,) * 2,
                         devices=devices)


@dataclasses.dataclass(frozen=True)
class PtxasReport:
    """ptxas's resource report for one Mosaic GPU kernel (sm_90a), with the
    launch's dynamic shared memory and grid from Mosaic's MLIR dump (0 / ()
    when the dump did not show them)."""

    name: str
    registers: int
    spill_store_bytes: int
    spill_load_bytes: int
    warnings: tuple[str, ...]
    smem_bytes: int = 0          # dynamic shared memory per block requested at launch
    grid: tuple[int, ...] = ()   # blocks (x, y, z)
    k_step: KStepSass | None = None   # the consumer K step's SASS (MXFP4 kernels only)

    @property
    def spill_bytes(self) -> int:
        return self.spill_store_bytes + self.spill_load_bytes


_REGISTERS = re.compile(r"Used (\d+) registers")
_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


_LAUNCH = re.compile(r"gpu\.launch\b.*?blocks\([^)]*\) in \(([^)]*)\).*?"
                     r"dynamic_shared_memory_size (%[\w]+)")


def parse_ptxas(name: str, text: str, *, smem_bytes: int = 0,
                grid: tuple[int, ...] = ()) -> PtxasReport:
    """A PtxasReport from ptxas's ``-v`` output for one kernel."""
    regs = _REGISTERS.search(text)
    spills = _SPILLS.search(text)
    if regs is None:
        raise ValueError(f"ptxas report of {name} has no register count:\n{text[:500]}")
    warnings = tuple(line.strip() for line in text.splitlines() if "ptxas warning" in line)
    return PtxasReport(name=name, registers=int(regs.group(1)),
                       spill_store_bytes=int(spills.group(1)) if spills else 0,
                       spill_load_bytes=int(spills.group(2)) if spills else 0,
                       warnings=warnings, smem_bytes=smem_bytes, grid=grid)


def _mlir_constant(name: str, text: str) -> int | None:
    """The value of MLIR SSA constant ``%name`` (``%c132``, ``%c221264_i32`` or
    an ``arith.constant`` definition in ``text``)."""
    m = re.fullmatch(r"%c(\d+)(?:_i\d+)?", name)
    if m:
        return int(m.group(1))
    d = re.search(re.escape(name) + r" = arith\.constant (\d+)", text)
    return int(d.group(1)) if d else None


def parse_launch(text: str) -> tuple[int, tuple[int, ...]] | None:
    """(dynamic shared memory bytes, grid) of the first ``gpu.launch`` in a
    Mosaic GPU MLIR dump whose sizes are all constants, else None."""
    for m in _LAUNCH.finditer(text):
        grid = [_mlir_constant(v.split("=")[-1].strip(), text) for v in m.group(1).split(",")]
        smem = _mlir_constant(m.group(2), text)
        if smem is not None and all(g is not None for g in grid):
            return smem, tuple(grid)
    return None


def _launch_of(folder: Path, stem: str) -> tuple[int, tuple[int, ...]]:
    for suffix in (".after_layout_inference.txt", ".before_layout_inference.txt", ".mlir-passes.log"):
        path = folder / (stem + suffix)
        if path.exists():
            found = parse_launch(path.read_text())
            if found is not None:
                return found
    return 0, ()


@contextlib.contextmanager
def ptxas_dump() -> Iterator[Callable[[], list[PtxasReport]]]:
    """Inside: Mosaic GPU kernels compiled by this process dump their ptxas
    report and PTX (MOSAIC_GPU_DUMP_TO, read at compile time). Yields a
    function returning the reports written so far, in compile order; the
    kernels kernel_sass.DEQUANT_KERNELS names carry their K step's SASS
    counts (k_step: the PTX through the wheel's ptxas and nvdisasm; None
    where the cubin has no K-step loop, kernel_sass.NoKStepLoop)."""
    bin_dir = pin_wheel_ptxas().parent
    folder = tempfile.mkdtemp(prefix="k3jax-mosaic-")
    keys = ("MOSAIC_GPU_DUMP_TO", "MOSAIC_GPU_DUMP_PTXAS", "MOSAIC_GPU_DUMP_PTX")
    saved = {k: os.environ.get(k) for k in keys}
    os.environ["MOSAIC_GPU_DUMP_TO"] = folder
    os.environ["MOSAIC_GPU_DUMP_PTX"] = "1"
    os.environ.pop("MOSAIC_GPU_DUMP_PTXAS", None)
    counted: dict[str, KStepSass | None] = {}

    def k_step(stem: str) -> KStepSass | None:
        ptx = Path(folder) / f"{stem}.ptx"
        if not DEQUANT_KERNELS.match(stem) or not ptx.exists():
            return None
        if stem not in counted:
            try:
                counted[stem] = k_step_count(disassemble(ptx.read_text(), bin_dir))
            except NoKStepLoop:
                counted[stem] = None
        return counted[stem]

    def reports() -> list[PtxasReport]:
        files = sorted(Path(folder).glob("*.ptxas"), key=lambda p: p.stat().st_mtime_ns)
        out = []
        for p in files:
            smem, grid = _launch_of(Path(folder), p.stem)
            report = parse_ptxas(p.stem, p.read_text(), smem_bytes=smem, grid=grid)
            out.append(dataclasses.replace(report, k_step=k_step(p.stem)))
        return out

    try:
        yield reports
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        shutil.rmtree(folder, ignore_errors=True)


__all__ = ["GPU_COMPILER_OPTIONS", "GPU_XLA_FLAGS", "TARGET_FILE", "GpuCompileUnavailable",
           "PtxasReport", "h200_mesh", "h200_target_config", "h200_topology", "parse_launch",
           "parse_ptxas", "pin_wheel_ptxas", "ptxas_dump"]
