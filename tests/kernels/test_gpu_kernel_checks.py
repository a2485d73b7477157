"""benchmarks.gpu_kernel_checks: the on-device correctness pass. Here it
runs a few of its cases in interpret mode, must flag a wrong or
non-deterministic kernel, and every case must lower for sm_90."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernel_cases as kc
from benchmarks import gpu_kernel_checks as checks

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = pytest.mark.tiers(
    compile=["test_every_case_lowers_for_sm90"],
    slow=["test_a_swap_ab_case_passes_in_interpret_mode"],
    integration=["test_usage_errors_exit_2"])

SMALL = [c for c in checks.CASES if c.m <= 120 and c.dtype == checks.BF16][:3]


def test_small_cases_pass_in_interpret_mode():
    assert {c.op for c in SMALL} >= {"matmul", "situ_glu"}
    rows = checks.run_checks(SMALL, "interpret", log=lambda _: None)
    assert all(r["ok"] for r in rows), rows
    assert all(0 < r["rel_err"] <= r["tol"] for r in rows), rows


def test_a_wrong_kernel_and_a_nondeterministic_one_fail(monkeypatch):
    case = SMALL[0]
    assert case.op == "matmul"
    real = checks.grouped_matmul
    monkeypatch.setattr(checks, "grouped_matmul",
                        lambda x, w, s, backend: real(x, w, s, backend="xla") * 1.05)
    [wrong] = checks.run_checks([case], "interpret", log=lambda _: None)
    assert not wrong["ok"] and "relative error" in wrong["error"]

    calls = []

    def run_number():  # host side, once per execution of the compiled program
        calls.append(1)
        return np.float32(len(calls) - 1)

    def flaky(x, w, s, backend):  # correct on the first run, one bf16 step off on the second
        bump = jax.pure_callback(run_number, jax.ShapeDtypeStruct((), jnp.float32))
        y = real(x, w, s, backend="xla")
        return (y.astype(jnp.float32) * (1 + bump * 2.0 ** -6)).astype(y.dtype)
    monkeypatch.setattr(checks, "grouped_matmul", flaky)
    [racy] = checks.run_checks([case], "interpret", log=lambda _: None)
    assert not racy["ok"] and "differ bitwise" in racy["error"]


def test_every_case_lowers_for_sm90():
    for case in checks.CASES:
        assert "mosaic_gpu" in kc.lower_for_sm90(case.fn("pallas"), *case.arg_specs()), case.name


@pytest.mark.parametrize("argv, words", [
    (["--backend", "pallas"], "needs a GPU"),
    (["--backend", "cuda"], "invalid choice"),
    (["--json", "/no/such/dir/c.json"], "--json"),
])
def test_usage_errors_exit_2(argv, words):
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu_kernel_checks", *argv],
                          capture_output=True, text=True, timeout=120, cwd=_REPO,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"}, check=False)
    assert proc.returncode == 2 and words in proc.stderr, proc.stderr


def test_cases_cover_what_the_benchmark_sweep_does_not():
    kinds = {(c.op, c.pattern, jnp.dtype(c.dtype).name) for c in checks.CASES}
    assert ("matmul", "sum_lt_m", "float32") in kinds and ("situ_glu", "sum_lt_m", "float32") in kinds
    assert {c.pattern for c in checks.CASES} >= set(checks.PATTERNS)
    assert any(c.m < 64 for c in checks.CASES)                          # less than one tile
    assert any(c.k % 64 and c.n % 128 for c in checks.CASES)           # padded K and N
    assert any(c.m >= 128 * c.groups for c in checks.CASES if c.op != "mlp")   # prefill tiles
    assert np.all([c.m > 0 for c in checks.CASES])
    # the persistent path on the device: a CTA runs many tiles and the ring wraps
    from k3jax.tools import kernel_cost
    many = [c for c in checks.CASES if c.op != "mlp" and c.k >= 1024 and kernel_cost.grouped_cost(
        kc.group_pattern(c.pattern, c.m, c.groups), c.m, c.k, c.n,
        1 if c.op == "matmul" else 2).tiles >= 1000]
    assert len(many) >= 2, "no case with >= 1000 tiles and K >= 1024"
    assert any(c.num_ctas and c.num_ctas < 8 for c in checks.CASES)  # SM count forced small
    swap_ab = [c for c in checks.CASES if c.swap_ab]   # the swap-AB (weights-on-M) kernel
    assert {c.op for c in swap_ab} == {"matmul", "situ_glu"}
    assert any(c.swap_ab.split_k > 1 for c in swap_ab) and any(c.dtype == checks.F32 for c in swap_ab)
    assert any(c.swap_ab.num_ctas and c.k >= 1024 for c in swap_ab)
    clustered = [c for c in swap_ab if c.swap_ab.cluster > 1]  # x multicast over a CTA cluster
    assert {c.swap_ab.cluster for c in clustered} >= {2, 4}
    assert any(c.swap_ab.split_k > 1 and c.dtype == checks.F32 for c in clustered)
    # the last cluster group overhangs N (TMA zero fill past N), wholly and partly
    overhang = [c.n % (c.swap_ab.cluster * c.swap_ab.block_w) for c in clustered]
    assert any(o and o % c.swap_ab.block_w == 0 for o, c in zip(overhang, clustered))
    assert any(o % c.swap_ab.block_w for o, c in zip(overhang, clustered))
    assert any(c.swap_ab.num_ctas and c.k >= 1024 for c in clustered)


@pytest.mark.parametrize("cluster", [1, 2])
def test_a_swap_ab_case_passes_in_interpret_mode(cluster):
    [case] = [c for c in checks.CASES
              if c.swap_ab and c.dtype == checks.F32 and c.swap_ab.cluster == cluster]
    [row] = checks.run_checks([case], "interpret", log=lambda _: None)
    assert row["ok"] and 0 < row["rel_err"] <= row["tol"], row
