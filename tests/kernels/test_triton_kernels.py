"""The Triton kernels (``--backend triton``, CUDA sm_80+) checked without a GPU.

1. Interpreter: the kernel bodies run in Triton's interpreter (a subprocess
   with TRITON_INTERPRET=1, tests/kernels/triton_interpret_cases.py) on fresh
   random float32 inputs, ragged and empty groups, NaN rows past
   sum(group_sizes), dense and MXFP4 weights, decode and prefill tiles, and
   match the float32 XLA reference (measured 2.4e-7..3.4e-6 relative). bf16 is not
   run there: the interpreter's bf16 tl.dot is wrong (triton issue 11584).
2. Cubins: every bf16 / MXFP4 configuration at K3 shapes compiles for sm_80 and
   sm_90 (Triton's bundled ptxas) without spills and within the shared
   memory limit; sm_89 and sm_100 compile one config each (the full table:
   ``python -m k3jax.tools.triton_compile 80 89 90 100``).
3. A whole MoE layer with backend="triton" lowers for CUDA through
   jax-triton on compile-only H200 devices (k3jax.tools.aot): three
   triton_kernel_call custom calls whose PTX targets the requested sm, and
   the same layer compiles through XLA's GPU pipeline for sm_90.
4. "auto" on described devices; dispatch of backend="triton".

Measured on the shared 2-core host: 60 s of CPU time in all (`time`, user),
3.5 min wall under load; the interpreter subprocess alone about 20 s CPU.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernel_cases as kc
from k3jax.tools import triton_compile
from pallas_kernels import backend as backend_lib
from pallas_kernels import grouped_matmul, grouped_situ_glu, situ_mlp_up
from pallas_kernels.backend import DeviceDescription, choose_backend
from pallas_kernels.grouped_matmul import triton_sm80
from pallas_kernels.situ_mlp import triton_sm80 as mlp_triton_sm80
from pallas_kernels.triton_target import target_capability, triton_target

pytestmark = pytest.mark.tiers(
    compile=[
        "test_every_configuration_compiles_without_spills",
        "test_other_architectures_compile",
        "test_moe_layer_lowers_and_compiles_for_cuda",
        "test_benchmark_triton_configs_lower_for_sm90",
    ])

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(os.path.dirname(_HERE))

# float32 kernel vs float32 XLA (measured 2.4e-7..2.8e-7 plain, 4.5e-7..3.4e-6 with the SiTU
# epilogue, whose tanh is built from exp).
TOL_INTERPRET = 1e-5


def _case(name, op, m, k, n, g, pattern, *, mxfp4=False, poison=True, seed):
    return dict(name=name, op=op, mxfp4=mxfp4, m=m, k=k, n=n, g=g, pattern=pattern,
                poison=poison, seed=seed)


# k = 96 / n = 80 are not multiples of the blocks (masked K and N edges).
INTERPRET_CASES = [
    _case("matmul_ragged_empty", "matmul", 40, 96, 80, 5, "zeros_skewed", seed=11),
    _case("matmul_tail_nan", "matmul", 40, 96, 80, 5, "sum_lt_m", seed=12),
    _case("matmul_all_empty", "matmul", 24, 96, 80, 3, "all_empty", seed=13),
    _case("situ_ragged_empty", "situ", 40, 96, 80, 5, "zeros_skewed", seed=14),
    _case("situ_tail_nan", "situ", 37, 96, 80, 4, "sum_lt_m", seed=15),
    _case("matmul_mxfp4_ragged", "matmul", 40, 96, 80, 5, "zeros_skewed", mxfp4=True, seed=16),
    _case("situ_mxfp4_tail_nan", "situ", 40, 96, 80, 5, "sum_lt_m", mxfp4=True, seed=17),
    # >= 128 rows per group: prefill tiles (128-row blocks)
    _case("situ_prefill", "situ", 272, 64, 48, 2, "uniform", seed=18),
    _case("matmul_mxfp4_prefill", "matmul", 260, 64, 48, 2, "sum_lt_m", mxfp4=True, seed=19),
    # the dense MLP: one group holding every row
    _case("mlp_one_group", "situ", 33, 96, 80, 1, "one_group_all", poison=False, seed=20),
]
# identity x: the output is the in-kernel dequantized weight, bit for bit
DECODE_CASE = _case("mxfp4_decode_exact", "mxfp4_decode", 64, 64, 48, 1, "one_group_all",
                    mxfp4=True, poison=False, seed=21)


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    """Run every case once in the interpreter subprocess; {name/key: array}."""
    out = tmp_path_factory.mktemp("triton_interpret") / "out.npz"
    env = {**os.environ, "TRITON_INTERPRET": "1", "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join([_ROOT, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, os.path.join(_HERE, "triton_interpret_cases.py"),
         json.dumps(INTERPRET_CASES + [DECODE_CASE]), str(out)],
        env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return dict(np.load(out))


@pytest.mark.parametrize("case", INTERPRET_CASES, ids=[c["name"] for c in INTERPRET_CASES])
def test_interpreter_matches_xla_reference(case, interpreted):
    out, ref = interpreted[f"{case['name']}/out"], interpreted[f"{case['name']}/ref"]
    sizes = interpreted[f"{case['name']}/sizes"]
    # outputs start as NaN in the runner: no NaN = every row was written
    kc.assert_grouped_output(out, ref, sizes, TOL_INTERPRET, case["name"])
    if sizes.sum():  # the reference is not trivially zero
        assert np.abs(ref[:sizes.sum()]).max() > 0.1
    block_m = int(interpreted[f"{case['name']}/block_m"])
    assert block_m == (128 if case["m"] >= 128 * case["g"] else 16), case["name"]


def test_in_kernel_mxfp4_dequantization_is_bit_exact(interpreted):
    """Scale bytes 0..252 (incl. the flush-to-zero bytes 0 and 1): every
    dequantized value equals dequant's exactly (the identity product
    turns -0.0 into +0.0: x @ w adds +0 terms, so zeros compare by value)."""
    out = interpreted["mxfp4_decode_exact/out"]
    ref = interpreted["mxfp4_decode_exact/ref"]
    assert out.shape == ref.shape == (64, 48) and np.isfinite(ref).all()
    assert np.count_nonzero(ref) > 0.5 * ref.size and np.abs(ref).max() > 1e30
    assert np.abs(ref[ref != 0]).min() < 1e-36  # values near the smallest normal
    np.testing.assert_array_equal(out, ref)
    nonzero = ref != 0
    np.testing.assert_array_equal(out[nonzero].view(np.uint32), ref[nonzero].view(np.uint32))


def test_interpreter_does_not_leak():
    """The interpreter ran in a subprocess: this process compiles for real."""
    assert os.environ.get("TRITON_INTERPRET", "0") in ("", "0")


# -- 2. cubins -------------------------------------------------------------------

PRODUCTION = [c for c in triton_compile.kernel_configs(dtypes=(jnp.bfloat16,))]


def _check_report(report: triton_compile.CubinReport) -> None:
    assert 0 < report.registers <= 255, report
    assert report.spill_store_bytes == 0 and report.spill_load_bytes == 0, report
    assert 0 < report.shared_bytes <= report.smem_limit, report


@pytest.mark.parametrize("capability", [80, 90])
def test_every_configuration_compiles_without_spills(capability):
    names = [c.name for c in PRODUCTION]
    assert len(names) == len(set(names)) == 10  # {gate_up, down} x {bf16, mxfp4} x 2 + MLP x 2
    for config in PRODUCTION:
        _check_report(triton_compile.compile_cubin(config, capability))


@pytest.mark.parametrize("capability", [89, 100])
def test_other_architectures_compile(capability):
    config = next(c for c in PRODUCTION if c.name == "gate_up_situ/mxfp4/decode")
    _check_report(triton_compile.compile_cubin(config, capability))


def test_ptxas_report_parsing():
    text = ("ptxas info    : Compiling entry function 'k' for 'sm_80'\n"
            "ptxas info    : Function properties for k\n"
            "    8 bytes stack frame, 12 bytes spill stores, 4 bytes spill loads\n"
            "ptxas info    : Used 168 registers, used 1 barriers, 380 bytes cmem[0]\n")
    assert triton_compile.parse_ptxas(text) == (168, 12, 4)
    with pytest.raises(RuntimeError, match="unexpected ptxas"):
        triton_compile.parse_ptxas("nothing")


# -- 3. a MoE layer lowered and compiled for CUDA -----------------------------------


def _triton_calls(lowered) -> list[tuple[str, str]]:
    """(sm target, kernel name) of each triton_kernel_call in a lowered module,
    read from its zlib-compressed kernel proto (which holds the PTX)."""
    from jax._src.lib.mlir import ir
    found = []

    def walk(op):
        for region in op.regions:
            for block in region.blocks:
                for inner in block.operations:
                    if (inner.operation.name == "stablehlo.custom_call"
                            and ir.StringAttr(inner.attributes["call_target_name"]).value
                            == "triton_kernel_call"):
                        proto = zlib.decompress(
                            ir.StringAttr(inner.attributes["backend_config"]).value_bytes)
                        target = re.search(rb"\.target (sm_\w+)", proto).group(1).decode()
                        entry = re.search(rb"\.entry (\w+)", proto).group(1).decode()
                        found.append((target, entry))
                    walk(inner.operation)

    walk(lowered.compiler_ir("stablehlo").operation)
    return found


def test_moe_layer_lowers_and_compiles_for_cuda():
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec

    from k3jax.config import TINY
    from k3jax.layout import ParallelConfig, make_layout
    from k3jax.modules import AbstractSource, KimiMoE
    from k3jax.modules.moe import moe_forward
    from k3jax.tools.aot import h200_mesh

    parallel = ParallelConfig(tp=2, sequence_parallel=True, expert_parallel=True)
    mesh = h200_mesh(parallel)  # compile-only H200 devices: nothing runs
    layout = make_layout(TINY, parallel, mesh, backend="triton", dtype=jnp.bfloat16)
    layer = KimiMoE(layout, mesh, source=AbstractSource())
    forward = moe_forward(layer.layout, layer.mesh)
    weights = nnx.to_pure_dict(nnx.state(layer))

    def x_spec(tokens):  # a new shape per target: the target is read when tracing
        return jax.ShapeDtypeStruct((tokens, TINY.hidden_size), jnp.bfloat16,
                                    sharding=NamedSharding(mesh, PartitionSpec()))

    with triton_target(80):  # A100: lowered only (XLA's GPU compiler here targets the H200)
        lowered = jax.jit(forward).trace(x_spec(37), weights).lower()
    expected = ["grouped_situ_glu_kernel", "grouped_matmul_kernel", "grouped_situ_glu_kernel"]
    assert _triton_calls(lowered) == [("sm_80", k) for k in expected]  # routed up, down, shared
    with triton_target(90):  # H200: through XLA's GPU pipeline (deviceless)
        lowered = jax.jit(forward).trace(x_spec(40), weights).lower()
        assert _triton_calls(lowered) == [("sm_90a", k) for k in expected]
        hlo = lowered.compile().as_text()
    assert len(re.findall(r'custom_call_target="triton_kernel_call"', hlo)) == 3


def test_triton_target_scope():
    assert target_capability() is None
    with triton_target(89):
        assert target_capability() == 89
    assert target_capability() is None
    with pytest.raises(ValueError, match=">= 80"):
        with triton_target(75):
            pass


# -- 4. backend selection and dispatch ---------------------------------------------


@pytest.mark.parametrize("platform, capability, installed, expected", [
    ("gpu", "9.0", True, "pallas"),      # H100 / H200: Mosaic
    ("gpu", "9.0", False, "pallas"),
    ("gpu", "8.0", True, "triton"),      # A100
    ("gpu", "8.6", True, "triton"),      # A10 / RTX 30
    ("gpu", "8.9", True, "triton"),      # L40S
    ("gpu", "10.0", True, "triton"),     # B200
    ("gpu", "12.0", True, "triton"),     # RTX 50
    ("gpu", "8.0", False, "xla"),        # no jax-triton
    ("gpu", "7.0", True, "xla"),         # V100: below sm_80
    ("gpu", "gfx942", True, "xla"),      # ROCm
    ("gpu", "", True, "xla"),
    ("cpu", "", True, "xla"),
    ("tpu", "", True, "xla"),
])
def test_auto_choice(platform, capability, installed, expected):
    assert choose_backend(DeviceDescription(platform, capability, installed)).name == expected


def test_auto_on_this_host_and_triton_dispatch(monkeypatch):
    assert backend_lib.resolve_backend("auto") == "xla"  # the CPU
    assert backend_lib.resolve_backend("triton") == "triton"
    calls = []

    def spy(name):
        def fn(x, *args, **kwargs):
            calls.append(name)
            return jnp.zeros((x.shape[0], args[0].shape[-1]), x.dtype)
        return fn

    for module, name in ((triton_sm80, "grouped_matmul"), (triton_sm80, "grouped_situ_glu"),
                         (mlp_triton_sm80, "situ_mlp_up")):
        monkeypatch.setattr(module, name, spy(f"{module.__name__}.{name}"))
    x, (wg, wu) = kc.grouped_inputs(0, 12, 8, 16, 3, jnp.float32, num_weights=2)
    sizes = jnp.array([4, 0, 6], jnp.int32)
    grouped_matmul(x, wg, sizes, backend="triton")
    grouped_situ_glu(x, wg, wu, sizes, backend="triton", beta=4.0, linear_beta=25.0)
    situ_mlp_up(x, wg[0], wu[0], backend="triton", beta=4.0, linear_beta=25.0)
    prefix = "pallas_kernels."
    assert calls == [prefix + "grouped_matmul.triton_sm80.grouped_matmul",
                     prefix + "grouped_matmul.triton_sm80.grouped_situ_glu",
                     prefix + "situ_mlp.triton_sm80.situ_mlp_up"]


def test_entry_point_validation():
    x = jnp.zeros((8, 64), jnp.bfloat16)
    packed = jnp.zeros((2, 16, 32), jnp.uint8)   # [G, N, K/2]
    scale = jnp.zeros((2, 2, 16), jnp.uint8)
    sizes = jnp.array([4, 4], jnp.int32)
    with pytest.raises(ValueError, match=r"packed \[G, N, K/2\] = \[2, 16, 32\].*\[2, 32, 16\]"):
        # the codes as [G, K/2, N] (the old orientation) against scales for N = 32
        triton_sm80.grouped_matmul_mxfp4(x, jnp.swapaxes(packed, 1, 2), scale, sizes)
    with pytest.raises(ValueError, match=r"scales \[G, K/32, N\] = \[2, 2, 16\].*\[2, 3, 16\]"):
        triton_sm80.grouped_matmul_mxfp4(x, packed, jnp.zeros((2, 3, 16), jnp.uint8), sizes)
    with pytest.raises(ValueError, match=r"group_sizes_G must be int \[G=2\], got int32\[3\]"):
        triton_sm80.grouped_matmul_mxfp4(x, packed, scale, jnp.array([4, 4, 0], jnp.int32))
    with pytest.raises(ValueError, match="must be uint8"):
        triton_sm80.grouped_matmul_mxfp4(x, packed.astype(jnp.int8), scale, sizes)
    with pytest.raises(ValueError, match="K a multiple of 32"):
        triton_sm80.grouped_matmul_mxfp4(x[:, :48], packed[..., :24], scale[:, :1], sizes)
    with pytest.raises(ValueError, match="float16"):
        triton_sm80.grouped_matmul_mxfp4(x.astype(jnp.float16), packed, scale, sizes)
    with pytest.raises(ValueError, match="int32"):
        triton_sm80.plan(num_rows=8, k=64, n=16, num_groups=2, x_dtype=jnp.int32, fused=False,
                         mxfp4=False)
    # empty shapes never launch a kernel
    empty = triton_sm80.grouped_matmul(jnp.zeros((0, 64), jnp.bfloat16),
                                       jnp.zeros((2, 64, 16), jnp.bfloat16), sizes)
    assert empty.shape == (0, 16)


def test_benchmark_triton_configs_lower_for_sm90():
    """The benchmark's Triton rows (bf16 and MXFP4 grouped, MLP) at the smoke
    plan's shapes lower for sm_90 through jax-triton (the GPU run's pre-flight)."""
    from benchmarks import cases, lower_check

    assert lower_check.lower_all_triton(cases.SMOKE) == 0
    labels = {c.label for c in cases.grouped_cases(cases.SMOKE, mxfp4=True)}
    assert labels == {"gate_up_situ", "down", "gate_up_situ_mxfp4", "down_mxfp4"}
