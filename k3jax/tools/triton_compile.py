"""Compile the Triton kernels to cubins without a GPU and report their resources.

``triton.compile(ASTSource(...), target=GPUTarget("cuda", cc, 32))`` runs
Triton's whole pipeline (TTIR -> TTGIR -> LLVM -> PTX -> ptxas) on the CPU with
the ptxas bundled in the triton wheel (CUDA 12.8; ``ptxas-blackwell``, 12.9,
for sm_100+). Register and spill counts come from ``ptxas -v`` on that PTX
(Triton reads them from the loaded module, which needs a GPU), shared memory
from the kernel metadata.

    reports = compile_all((80, 89, 90, 100))     # [CubinReport, ...] at K3 shapes, EP 8
    compile_all((90,), kernel_configs((jnp.bfloat16,), KernelShapes(local_experts=56)))
    print(format_table(reports))
    python -m k3jax.tools.triton_compile 80 90  # the same, from a shell

``k3jax compile --backend triton`` reports these like the Mosaic kernels.
"""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
import tempfile

import jax.numpy as jnp
import triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability
from triton.compiler import ASTSource

from pallas_kernels.grouped_matmul import triton_sm80
from pallas_kernels.hardware import H200

CAPABILITIES = (80, 89, 90, 100)
# Opt-in shared memory per block (CUDA programming guide, compute capabilities
# table); sm_100 keeps sm_90's opt-in limit.
SMEM_LIMIT = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: H200.smem_per_block_optin,
              100: H200.smem_per_block_optin, 120: 99 * 1024}



@dataclasses.dataclass(frozen=True)
class KernelShapes:
    """Per-device shapes the kernels are compiled for. Default: K3 (docs/spec.md §1) at
    EP 8: 112 local experts, latent L = 3584, expert intermediate I = 3072,
    the shared expert's MLP D = 7168 -> F = 6144 (tp 1), top-k 16; decode at 64
    tokens, prefill at 8192 (which tile set a launch gets depends on rows / G)."""

    local_experts: int = 112
    latent: int = 3584
    inter: int = 3072
    hidden: int = 7168
    mlp_inter: int = 6144
    top_k: int = 16
    decode_tokens: int = 64
    prefill_tokens: int = 8192
    beta: float = 4.0
    linear_beta: float | None = 25.0


K3_EP8 = KernelShapes()
_TRITON_TYPES = {jnp.dtype(jnp.bfloat16): "bf16", jnp.dtype(jnp.float16): "fp16",
                 jnp.dtype(jnp.float32): "fp32"}

# (MXFP4 weights, x dtype) -> name; float32 x is the tests' / debugging path.
_FORMAT_NAMES = {(False, "bfloat16"): "bf16", (True, "bfloat16"): "mxfp4",
                 (False, "float32"): "f32", (True, "float32"): "mxfp4-f32"}


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """One compiled configuration: an op at K3 shapes with one tile choice."""

    name: str
    launch: triton_sm80.LaunchPlan
    x_dtype: jnp.dtype
    mxfp4: bool


@dataclasses.dataclass(frozen=True)
class CubinReport:
    config: str
    kernel: str
    capability: int
    registers: int
    spill_store_bytes: int
    spill_load_bytes: int
    shared_bytes: int
    tiles: triton_sm80.TritonTiles

    @property
    def smem_limit(self) -> int:
        return SMEM_LIMIT[self.capability]


def kernel_configs(dtypes=(jnp.bfloat16, jnp.float32),
                   shapes: KernelShapes = K3_EP8) -> list[KernelConfig]:
    """Every op x weight format x tile choice the entry points can launch, at ``shapes``
    (``k3jax compile`` passes a layout's per-device shapes)."""
    configs = []
    act = dict(beta=shapes.beta, linear_beta=shapes.linear_beta)
    ops = (("gate_up_situ", True, shapes.latent, shapes.inter),
           ("down", False, shapes.inter, shapes.latent))
    for dtype in map(jnp.dtype, dtypes):
        for phase, tokens in (("decode", shapes.decode_tokens), ("prefill", shapes.prefill_tokens)):
            rows = tokens * shapes.top_k
            for op, fused, k, n in ops:
                for mxfp4 in (False, True):
                    launch = triton_sm80.plan(num_rows=rows, k=k, n=n,
                                              num_groups=shapes.local_experts, x_dtype=dtype,
                                              fused=fused, mxfp4=mxfp4, **act)
                    fmt = _FORMAT_NAMES[mxfp4, dtype.name]
                    configs.append(KernelConfig(f"{op}/{fmt}/{phase}", launch, dtype, mxfp4))
            launch = triton_sm80.plan(num_rows=tokens, k=shapes.hidden, n=shapes.mlp_inter,
                                      num_groups=1, x_dtype=dtype, fused=True, mxfp4=False, **act)
            configs.append(KernelConfig(f"mlp_up_situ/{_FORMAT_NAMES[False, dtype.name]}/{phase}",
                                        launch, dtype, False))
    return configs


def _signature(config: KernelConfig) -> tuple[dict, dict, dict]:
    """(signature, constexprs, attrs) for ASTSource: pointers 16-byte aligned,
    as jax-triton declares them."""
    fn = config.launch.kernel
    x_type = "*" + _TRITON_TYPES[config.x_dtype]
    signature, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in config.launch.constexprs:
            signature[name] = "constexpr"
            continue
        if name == "meta_ptr":
            signature[name] = "*i32"
        elif config.mxfp4 and ("packed" in name or "scale" in name):
            signature[name] = "*u8"
        else:
            signature[name] = x_type
        attrs[(i,)] = [["tt.divisibility", 16]]
    return signature, dict(config.launch.constexprs), attrs


def parse_ptxas(text: str) -> tuple[int, int, int]:
    """(registers, spill store bytes, spill load bytes) from ``ptxas -v`` output."""
    registers = re.search(r"Used (\d+) registers", text)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    if registers is None or spills is None:
        raise RuntimeError(f"unexpected ptxas -v output:\n{text}")
    return int(registers.group(1)), int(spills.group(1)), int(spills.group(2))


def compile_cubin(config: KernelConfig, capability: int) -> CubinReport:
    """Compile one configuration for ``capability`` (e.g. 80) and report it."""
    signature, constexprs, attrs = _signature(config)
    source = ASTSource(config.launch.kernel, signature, constexprs, attrs)
    tiles = config.launch.tiles
    # jax_triton empties TRITON_CACHE_DIR at import (it keeps no cache): give
    # this compile a throw-away one, so nothing is shared or stale.
    with knobs.cache.scope(), tempfile.TemporaryDirectory() as cache_dir:
        knobs.cache.dir = cache_dir
        compiled = triton.compile(source, target=GPUTarget("cuda", capability, 32),
                                  options={"num_warps": tiles.num_warps,
                                           "num_stages": tiles.num_stages})
    if not compiled.asm.get("cubin"):
        raise RuntimeError(f"{config.name}: no cubin for sm_{capability}")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as ptx:
        ptx.write(compiled.asm["ptx"])
        ptx.flush()
        result = subprocess.run(
            [get_ptxas(capability).path, "-v", f"--gpu-name={sm_arch_from_capability(capability)}",
             ptx.name, "-o", "/dev/null"], capture_output=True, text=True, check=True)
    registers, spill_store, spill_load = parse_ptxas(result.stdout + result.stderr)
    return CubinReport(config=config.name, kernel=config.launch.name, capability=capability,
                       registers=registers, spill_store_bytes=spill_store,
                       spill_load_bytes=spill_load, shared_bytes=compiled.metadata.shared,
                       tiles=tiles)


def compile_all(capabilities=CAPABILITIES, configs: list[KernelConfig] | None = None
                ) -> list[CubinReport]:
    """Every configuration (default: kernel_configs()) for every capability."""
    configs = kernel_configs() if configs is None else configs
    return [compile_cubin(c, cc) for cc in capabilities for c in configs]


def format_table(reports: list[CubinReport]) -> str:
    """Markdown table: config, sm, tiles, registers, spills, shared memory vs limit."""
    lines = ["| config | sm | tile (m x n x k, warps, stages) | registers | spill st/ld B "
             "| shared KiB (limit) |", "|---|---|---|---|---|---|"]
    for r in reports:
        t = r.tiles
        lines.append(f"| {r.config} | {r.capability} | {t.block_m}x{t.block_n}x{t.block_k}, "
                     f"{t.num_warps}, {t.num_stages} | {r.registers} | {r.spill_store_bytes}/"
                     f"{r.spill_load_bytes} | {r.shared_bytes / 1024:.1f} "
                     f"({r.smem_limit // 1024}) |")
    return "\n".join(lines)


if __name__ == "__main__":
    ccs = tuple(int(a) for a in sys.argv[1:]) or CAPABILITIES
    print(format_table(compile_all(ccs)))
