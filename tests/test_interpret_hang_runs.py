"""``k3jax run --backend interpret`` on the layouts whose simulated devices
and warpgroups block the most of XLA:CPU's pool threads in host callbacks,
run as a user runs them: a fresh process without the test session's XLA_FLAGS
or PJRT_NPROC, so the CLI alone sizes the pools
(pallas_kernels/interpret_compat.py).

Each run is checked against the float64 numpy reference
(test_backend_interpret.reference). Layouts:
* 8 devices, dp 2 x tp 4, sequence + expert parallel, TP-sharded shared
  expert: dense float32 experts, 16 tokens (2 token rows a device);
* 2 devices, tp 2, the same flags: MXFP4 experts, 16 tokens with the shared
  expert's ring and with its all-gather form, and 5 tokens.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from test_backend_interpret import TOL_KERNEL, TOL_MXFP4, reference

from k3jax.checkpoint import make_synthetic_checkpoint
from k3jax.config import TINY
from numerics import rel_err
from pallas_kernels import interpret_compat

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SP_EP = ["--sequence-parallel", "--expert-parallel", "--shard-shared-expert"]
CASES = {
    "dp2_tp4_dense_t16": ("dense", 16, ["--devices", "8", "--dp", "2", "--tp", "4", *SP_EP]),
    "tp2_mxfp4_t16_ring": ("mxfp4", 16, ["--devices", "2", "--tp", "2", *SP_EP,
                                         "--shared-overlap", "ring"]),
    "tp2_mxfp4_t16_none": ("mxfp4", 16, ["--devices", "2", "--tp", "2", *SP_EP,
                                         "--shared-overlap", "none"]),
    "tp2_mxfp4_t5": ("mxfp4", 5, ["--devices", "2", "--tp", "2", *SP_EP]),
}
TOL = {"dense": TOL_KERNEL, "mxfp4": TOL_MXFP4["float32"]}


def user_env() -> dict[str, str]:
    """This process's environment without what the test session adds."""
    dropped = ("XLA_FLAGS", interpret_compat.POOL_ENV, "NPROC", interpret_compat.STALL_ENV)
    env = {k: v for k, v in os.environ.items() if k not in dropped}
    env["PYTHONPATH"] = REPO
    return env


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("hang_runs")
    make_synthetic_checkpoint(root / "dense", TINY, 11, dtype="float32")
    make_synthetic_checkpoint(root / "mxfp4", TINY, 12, dtype="float32", experts="mxfp4")
    return {"dense": root / "dense", "mxfp4": root / "mxfp4"}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_interpret_run_finishes_and_matches_reference(checkpoints, tmp_path, case):
    experts, tokens, flags = CASES[case]
    x = np.random.default_rng(tokens).standard_normal((tokens, TINY.hidden_size))
    np.save(tmp_path / "x.npy", x.astype(np.float32))
    argv = [sys.executable, "-m", "k3jax", "run", "--checkpoint", str(checkpoints[experts]),
            "--layer", "1", "--input", str(tmp_path / "x.npy"), "--output",
            str(tmp_path / "y.npy"), "--backend", "interpret", "--dtype", "float32", *flags]
    done = subprocess.run(argv, env=user_env(), cwd=REPO, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"on {flags[1]} cpu device(s)" in done.stdout, done.stdout
    y = np.load(tmp_path / "y.npy")
    assert y.dtype == np.float32 and y.shape == (tokens, TINY.hidden_size)
    err = rel_err(y, reference(checkpoints[experts], 1, np.load(tmp_path / "x.npy")))
    assert err <= TOL[experts], f"interpret vs float64 reference: {err:.3g}"
