"""Mosaic GPU interpret mode never stops silently (pallas_kernels/interpret_compat.py).

* XLA:CPU's pool size is what ``xla_pool_threads`` says (checked against the
  threads a fresh process starts).
* A kernel whose waits could take every pool thread raises PoolTooSmallError
  before anything waits.
* A wait that is never satisfied (an mbarrier no thread arrives at, a device
  that never reaches the all-device meeting) ends with InterpretStall naming
  who waited for what, within the stall bound (K3JAX_INTERPRET_STALL_S).
* ``k3jax run`` reports a stall as one line and exits 1.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.sharding import Mesh, PartitionSpec

from k3jax.checkpoint import make_synthetic_checkpoint
from k3jax.cli import main
from k3jax.config import TINY
from pallas_kernels import interpret_compat
from pallas_kernels.grouped_matmul import mosaic_sm90, mosaic_sm90_swap_ab

STALL_S = 1.0


@pytest.fixture
def short_stall(monkeypatch):
    """The stall bound at STALL_S; the failed kernel's state forgotten afterwards."""
    interpret_compat.install()
    monkeypatch.setenv(interpret_compat.STALL_ENV, str(STALL_S))
    interpret_compat.take_error_line()
    yield
    interpret_compat.reset_state()


def _kernel(body, num_threads, scratch=()):
    return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((128,), jnp.float32),
                        scratch_types=list(scratch), num_threads=num_threads, thread_name="wg",
                        interpret=plgpu.InterpretGPUParams())


def test_pool_rule_matches_the_threads_xla_starts():
    code = ("import os, jax, jax.numpy as jnp; (jnp.ones(2) + 1).block_until_ready(); "
            "names = [open(f'/proc/self/task/{t}/comm').read().strip() "
            "for t in os.listdir('/proc/self/task')]; print(names.count('tf_XLAEigen'))")
    for value in ("5", None):
        env = {k: v for k, v in os.environ.items() if k not in ("PJRT_NPROC", "NPROC")}
        if value is not None:
            env["PJRT_NPROC"] = value
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                             text=True, timeout=120, check=True).stdout
        saved = {k: os.environ.pop(k) for k in ("PJRT_NPROC", "NPROC") if k in os.environ}
        try:
            if value is not None:
                os.environ["PJRT_NPROC"] = value
            want = interpret_compat.xla_pool_threads()
        finally:
            os.environ.pop("PJRT_NPROC", None)
            os.environ.update(saved)
        assert int(out.split()[-1]) == want, (value, out)


def test_thread_bound_covers_the_kernels():
    """MAX_THREADS_PER_DEVICE holds the largest CTA of warpgroups times the largest cluster."""
    configs = [v for v in vars(mosaic_sm90).values() if isinstance(v, mosaic_sm90.TileConfig)]
    widest_cta = max(cfg.num_compute_wgs for cfg in configs) + 1
    assert widest_cta * max(mosaic_sm90_swap_ab.CLUSTER_SIZES) <= interpret_compat.MAX_THREADS_PER_DEVICE
    assert interpret_compat.pool_threads_needed(1, 1) == 1  # one inline thread: nothing blocks
    assert interpret_compat.pool_threads_needed(2, 1) == 3  # two device programs meet
    assert interpret_compat.pool_threads_needed(2, 2) == 7  # + two warpgroups each


def test_pool_too_small_raises_before_waiting(short_stall, monkeypatch):
    monkeypatch.setenv("PJRT_NPROC", "3")  # what the check reads; 2 warpgroups need 4
    f = _kernel(lambda o_ref, bar: plgpu.barrier_wait(bar), 2, [plgpu.Barrier(num_arrivals=1)])
    with pytest.raises(Exception, match="PJRT_NPROC=4"):
        jax.block_until_ready(jax.jit(f)())
    line = interpret_compat.take_error_line()
    assert line is not None and "\n" not in line and "needs 4" in line and "has 3" in line


def test_mbarrier_nobody_arrives_at_is_a_stall(short_stall):
    f = _kernel(lambda o_ref, bar: plgpu.barrier_wait(bar), 2, [plgpu.Barrier(num_arrivals=1)])
    start = time.monotonic()
    with pytest.raises(Exception, match="GPU interpret mode stalled"):
        jax.block_until_ready(jax.jit(f)())
    assert time.monotonic() - start < 60
    line = interpret_compat.take_error_line()
    assert line is not None and "\n" not in line, line
    assert "Warpgroup" in line and f"waited {STALL_S:g} s at an mbarrier" in line, line
    assert "0 of 1 arrivals" in line and interpret_compat.STALL_ENV in line, line


def test_device_that_never_arrives_is_a_stall(short_stall):
    """Only device 0 of 2 runs the kernel: it waits at the all-device meeting."""
    f = _kernel(lambda o_ref: None, 1)

    def per_device(x):
        ran = jax.lax.cond(jax.lax.axis_index("x") == 0, lambda: f()[:1],
                           lambda: jnp.zeros((1,), jnp.float32))
        return x + ran

    mesh = Mesh(np.array(jax.devices()[:2]), ("x",))
    g = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=PartitionSpec("x"),
                              out_specs=PartitionSpec("x")))
    start = time.monotonic()
    with pytest.raises(Exception, match="stalled"):
        jax.block_until_ready(g(jnp.zeros((2,), jnp.float32)))
    assert time.monotonic() - start < 60
    line = interpret_compat.take_error_line()
    assert line is not None and "\n" not in line, line
    assert (f"a simulated device waited {STALL_S:g} s at the end of a grid point "
            "for the other 1 device(s)") in line, line


@pytest.mark.slow
def test_cli_reports_a_stall_in_one_line_and_exits_1(short_stall, monkeypatch, tmp_path, capsys):
    """A zero bound makes the first all-device meeting a stall (the first
    device there finds the other absent)."""
    monkeypatch.setenv(interpret_compat.STALL_ENV, "0")
    ckpt = tmp_path / "ckpt"
    make_synthetic_checkpoint(ckpt, TINY, 11, dtype="float32")
    x = np.random.default_rng(3).standard_normal((5, TINY.hidden_size)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    argv = ["run", "--checkpoint", str(ckpt), "--layer", "0", "--input", str(tmp_path / "x.npy"),
            "--output", str(tmp_path / "y.npy"), "--backend", "interpret", "--dtype", "float32",
            "--devices", "2", "--tp", "2"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("k3jax run: error: GPU interpret mode stalled"), err
    assert not (tmp_path / "y.npy").exists()
