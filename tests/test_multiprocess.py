"""Multi-process ``k3jax run``: 2 processes x 4 CPU devices (gloo, loopback)
against 1 process x 8 devices and the float64 reference; the same 2
processes as 2 nodes (``--nodes 2``) with each EP dispatch form; a killed
peer (also across nodes, mid all-to-all); processes that disagree; flag
errors.

Every subprocess call has a timeout and every started process group is
killed at the end of its test, so a hang fails the test instead of the suite.
"""

from __future__ import annotations

import glob
import os
import re
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
from safetensors.numpy import load_file

from k3jax.checkpoint import make_synthetic_checkpoint
from k3jax.cli import main as cli_main
from k3jax.config import TINY
from k3jax.runtime import startup, supervision
from numerics import rel_err
from reference_np import np_moe

pytestmark = pytest.mark.tiers(
    slow=[
        "test_two_processes_match_one_process_and_float64_reference",
        "test_killed_peer_ends_the_survivor_with_a_clear_error",
        "test_two_processes_as_two_nodes_match_one_process",
        "test_processes_that_disagree_stop_with_a_clear_error",
        "test_a_process_that_fails_is_reported_by_every_process",
        "test_processes_agree_on_the_kernel_backend_per_configuration",
        "test_processes_agree_on_the_mxfp4_experts_dequant",
    ],
    integration=["test_the_worker_exit_code_passes_through_the_child"])

LAYOUT = ["--devices", "8", "--tp", "8", "--sequence-parallel", "--expert-parallel",
          "--shard-shared-expert", "--backend", "xla"]
RUN_TIMEOUT_S = 240      # a whole run on a loaded 2-core machine; a hang fails here
PEER_LOSS_LIMIT_S = 60   # the bound for a survivor to exit after a peer dies
DIST_ENV = (startup.ENV_COORDINATOR, startup.ENV_NUM_PROCESSES, startup.ENV_PROCESS_ID)
# 2 processes as 2 nodes of 4 devices: the node axis outermost, one process a node
NODES_LAYOUT = ["--devices", "8", "--dp", "2", "--tp", "4", "--nodes", "2", "--sequence-parallel",
                "--expert-parallel", "--backend", "xla"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def base_env(**extra) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in DIST_ENV and k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    env.update(extra)
    return env


def start(args, out_dir, name, env=None) -> subprocess.Popen:
    """``python -m k3jax run ARGS`` in its own process group, output to files."""
    with open(os.path.join(out_dir, f"{name}.out"), "w") as stdout, \
            open(os.path.join(out_dir, f"{name}.err"), "w") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "k3jax", "run", *args], stdout=stdout,
                                stderr=stderr, env=env or base_env(), start_new_session=True)
    proc.name, proc.out_dir = name, out_dir
    return proc


def output_of(proc) -> tuple[str, str]:
    with open(os.path.join(proc.out_dir, f"{proc.name}.out")) as f_out, \
            open(os.path.join(proc.out_dir, f"{proc.name}.err")) as f_err:
        return f_out.read(), f_err.read()


def finish(proc, timeout) -> tuple[int, str, str]:
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill(proc)
        out, err = output_of(proc)
        pytest.fail(f"{proc.name} did not finish within {timeout} s\nstdout:\n{out}\nstderr:\n{err}")
    return (code, *output_of(proc))


def kill(proc) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=30)


@pytest.fixture
def procs():
    started = []
    yield started
    for p in started:
        kill(p)


def dist_flags(port: int, process_id: int) -> list[str]:
    return ["--coordinator-address", f"127.0.0.1:{port}", "--num-processes", "2",
            "--process-id", str(process_id)]


def one_process_and_a_pair(common, y1, y2, tmp_path, procs) -> dict[str, tuple[int, str, str]]:
    """Run ``common`` as one process writing ``y1`` (named "single") and as a
    2-process run writing ``y2`` ("p0", "p1"), concurrently; every one must
    exit 0. {name: (exit code, stdout, stderr)}."""
    port = free_port()
    procs.append(start([*common, "--output", str(y1)], tmp_path, "single"))
    for i in range(2):
        procs.append(start([*common, "--output", str(y2), *dist_flags(port, i)], tmp_path, f"p{i}"))
    results = {p.name: finish(p, RUN_TIMEOUT_S) for p in procs}
    for name, (code, out, err) in results.items():
        assert code == 0, f"{name} failed ({code}):\n{out}\n{err}"
    return results


@pytest.fixture(scope="module")
def problem(tmp_path_factory):
    """A tiny fp32 checkpoint and a fresh random input [13, hidden]."""
    root = tmp_path_factory.mktemp("mp")
    ckpt = root / "ckpt"
    make_synthetic_checkpoint(ckpt, TINY, seed=11, dtype="float32")
    x = np.random.default_rng(5).standard_normal((13, TINY.hidden_size)).astype(np.float32)
    np.save(root / "x.npy", x)
    np.save(root / "dy.npy", np.random.default_rng(6).standard_normal(x.shape).astype(np.float32))
    return root, ckpt, x


def layer_tensors_f64(ckpt, layer: int) -> dict[str, np.ndarray]:
    prefix = f"model.layers.{layer}.block_sparse_moe."
    tensors = {}
    for file in glob.glob(os.path.join(ckpt, "*.safetensors")):
        for name, value in load_file(file).items():
            if name.startswith(prefix):
                tensors[name[len(prefix):]] = value.astype(np.float64)
    return tensors


def test_two_processes_match_one_process_and_float64_reference(problem, tmp_path, procs):
    root, ckpt, x = problem
    port = free_port()
    common = ["--checkpoint", str(ckpt), "--input", str(root / "x.npy"), *LAYOUT,
              "--cotangent", str(root / "dy.npy")]
    y1, y2 = tmp_path / "y_1x8.npy", tmp_path / "y_2x4.npy"
    g1, g2 = tmp_path / "g_1x8.safetensors", tmp_path / "g_2x4.safetensors"
    procs.append(start([*common, "--output", str(y1), "--grads", str(g1)], tmp_path, "single"))
    # process 0 from flags, process 1 from the JAX_* environment variables
    procs.append(start([*common, "--output", str(y2), "--grads", str(g2), *dist_flags(port, 0)],
                       tmp_path, "p0"))
    procs.append(start([*common, "--output", str(y2), "--grads", str(g2)], tmp_path, "p1",
                       env=base_env(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                                    JAX_NUM_PROCESSES="2", JAX_PROCESS_ID="1")))
    results = {p.name: finish(p, RUN_TIMEOUT_S) for p in procs}
    for name, (code, out, err) in results.items():
        assert code == 0, f"{name} failed ({code}):\n{out}\n{err}"
    out0, out1 = results["p0"][1], results["p1"][1]
    assert "[process 0/2] joined the run" in out0 and "4 of 8 cpu devices here" in out0
    assert "[process 1/2] joined the run" in out1 and "4 of 8 cpu devices here" in out1
    assert "mesh: {'data': 1, 'tensor': 8} on 8 cpu device(s)" in out0
    assert f"wrote {y2}" in out0 and "wrote" not in out1      # process 0 alone writes
    assert "[Gloo]" not in out0 + out1

    got_1x8, got_2x4 = np.load(y1), np.load(y2)
    assert got_2x4.shape == x.shape and got_2x4.dtype == np.float32
    assert rel_err(got_2x4, got_1x8) < 1e-5
    want = np_moe(x, layer_tensors_f64(ckpt, 1), TINY)
    assert rel_err(got_2x4, want) < 1e-4
    # gradients: process 0 gathers and writes them; they equal the one-process run's
    assert f"wrote {g2}" in out0 and str(g2) not in out1
    grads_1x8, grads_2x4 = load_file(g1), load_file(g2)
    assert set(grads_2x4) == set(grads_1x8) and "input" in grads_2x4
    assert len(grads_2x4) == 1 + 7 + 3 * TINY.num_experts       # input, 7 weights, 3 per expert
    for name, g in grads_1x8.items():
        assert grads_2x4[name].dtype == np.float32 and grads_2x4[name].shape == g.shape, name
        if np.any(g):
            assert rel_err(grads_2x4[name], g) < 1e-5, name
        else:
            assert not np.any(grads_2x4[name]), name


def test_processes_agree_on_the_mxfp4_experts_dequant(tmp_path, procs):
    """Packed MXFP4 experts, one scale byte outside FAST_SCALES in the last
    expert, which only process 1 reads (EP over 8 devices, 4 a process):
    process 0's own bytes are all fast, yet it reports the agreed EXACT (so
    both compile the same program), and the output equals one process's and
    the float64 reference of the decoded codes."""
    from k3jax.checkpoint.writer import synthetic_tensors, write_checkpoint
    from pallas_kernels.mxfp4 import dequant_numpy
    tensors = dict(synthetic_tensors(TINY, 12, dtype="float32", experts="mxfp4"))
    last = f"model.layers.1.block_sparse_moe.experts.{TINY.num_experts - 1}.w2.weight_scale"
    tensors[last][0, 0] = 129
    ckpt = tmp_path / "ckpt"
    write_checkpoint(ckpt, TINY, tensors.items())
    x = np.random.default_rng(7).standard_normal((13, TINY.hidden_size)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    common = ["--checkpoint", str(ckpt), "--input", str(tmp_path / "x.npy"), *LAYOUT]
    y1, y2 = tmp_path / "y_1x8.npy", tmp_path / "y_2x4.npy"
    results = one_process_and_a_pair(common, y1, y2, tmp_path, procs)
    assert "MXFP4 experts' dequant: exact" in results["p0"][1]
    assert "MXFP4 experts' dequant: exact" in results["single"][1]
    got = np.load(y2)
    assert rel_err(got, np.load(y1)) < 1e-5
    prefix = "model.layers.1.block_sparse_moe."
    decoded = {}
    for name, value in tensors.items():
        if not name.startswith(prefix) or name.endswith("weight_scale"):
            continue
        if name.endswith("weight_packed"):
            name = name[:-len("_packed")]
            value = dequant_numpy(value, tensors[name + "_scale"])
        decoded[name[len(prefix):]] = value.astype(np.float64)
    assert rel_err(got, np_moe(x, decoded, TINY)) < 1e-4


@pytest.mark.parametrize("form", ["gather", "hierarchical", "all-to-all"])
def test_two_processes_as_two_nodes_match_one_process(problem, tmp_path, procs, form):
    """Each process is one node (its 4 devices one block of the node axis);
    every dispatch form's output equals one process on 8 devices, and the
    float64 reference."""
    root, ckpt, x = problem
    common = ["--checkpoint", str(ckpt), "--input", str(root / "x.npy"), *NODES_LAYOUT,
              "--ep-dispatch", form]
    y1, y2 = tmp_path / "y_1x8.npy", tmp_path / "y_2nodes.npy"
    results = one_process_and_a_pair(common, y1, y2, tmp_path, procs)
    out0 = results["p0"][1]
    assert "mesh: {'node': 2, 'data': 1, 'tensor': 4} on 8 cpu device(s)" in out0
    assert "nodes=2 (4 devices each)" in out0 and f"rows by {form}" in out0
    got = np.load(y2)
    assert rel_err(got, np.load(y1)) < 1e-5
    assert rel_err(got, np_moe(x, layer_tensors_f64(ckpt, 1), TINY)) < 1e-4


@pytest.mark.parametrize("victim, layout", [(1, LAYOUT), (0, LAYOUT),
                                            (1, [*NODES_LAYOUT, "--ep-dispatch", "all-to-all"])],
                         ids=["kill-process-1", "kill-coordinator", "kill-node-1-all-to-all"])
def test_killed_peer_ends_the_survivor_with_a_clear_error(problem, tmp_path, procs, victim, layout):
    root, ckpt, _ = problem
    port = free_port()
    common = ["--checkpoint", str(ckpt), "--input", str(root / "x.npy"), *layout,
              "--repeat", "100000000"]
    for i in range(2):
        procs.append(start([*common, *dist_flags(port, i)], tmp_path, f"p{i}"))
    dead, survivor = procs[victim], procs[1 - victim]
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while f"[process {victim}/2] first forward done" not in output_of(dead)[0]:
        assert dead.poll() is None and survivor.poll() is None, \
            f"a process ended before the kill:\n{output_of(dead)}\n{output_of(survivor)}"
        assert time.monotonic() < deadline, f"no first forward:\n{output_of(dead)}"
        time.sleep(0.2)

    os.killpg(dead.pid, signal.SIGKILL)           # the whole "host": supervisor and worker
    killed_at = time.monotonic()
    code, out, err = finish(survivor, PEER_LOSS_LIMIT_S)
    print(f"survivor exited {time.monotonic() - killed_at:.1f} s after the kill: {err.strip()}")

    assert code == 1, (code, out, err)
    me = 1 - victim
    # XLA's heartbeat check names the lost peer; gloo may notice first, as a collective
    # whose connection was reset: either way one line that says a peer was lost.
    reason = ((f"process {victim} has stopped responding" if victim
               else "it lost the coordinator at 127.0.0.1")
              + "|a collective with its peers failed \\(most likely a peer process died")
    assert re.search(rf"k3jax run: error: process {me} of 2 stopped because (?:{reason})", err), err
    assert "Check failure stack trace" not in err and "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err                    # one clear line, nothing else
    report = re.search(r"XLA's report: (\S+)\)", err)
    if report:                                     # the heartbeat path keeps XLA's log
        with open(report.group(1)) as f:
            assert "Check failure stack trace" in f.read()
        os.unlink(report.group(1))


def test_processes_that_disagree_stop_with_a_clear_error(problem, tmp_path, procs):
    root, ckpt, _ = problem
    other = tmp_path / "ckpt_split"                # the same tensors in two files
    make_synthetic_checkpoint(other, TINY, seed=11, dtype="float32", num_files=2)
    port = free_port()
    common = ["--input", str(root / "x.npy"), *LAYOUT, "--output", str(tmp_path / "y.npy")]
    procs.append(start([*common, "--checkpoint", str(ckpt), "--layer", "1",
                        *dist_flags(port, 0)], tmp_path, "p0"))
    procs.append(start([*common, "--checkpoint", str(other), "--layer", "2",
                        *dist_flags(port, 1)], tmp_path, "p1"))
    for p in procs:
        code, out, err = finish(p, RUN_TIMEOUT_S)
        assert code == 1, (p.name, code, out, err)
        assert "the processes disagree on" in err, err
        assert "layer (process 0: 1, process 1: 2)" in err, err
        assert re.search(r"checkpoint files \(process 0: \w+, process 1: \w+\)", err), err
        assert "config (" not in err and "input (" not in err    # those agree
    assert not (tmp_path / "y.npy").exists()


def test_a_process_that_fails_is_reported_by_every_process(problem, tmp_path, procs):
    root, ckpt, _ = problem
    port = free_port()
    common = ["--input", str(root / "x.npy"), *LAYOUT]
    procs.append(start([*common, "--checkpoint", str(ckpt), *dist_flags(port, 0)], tmp_path, "p0"))
    procs.append(start([*common, "--checkpoint", str(tmp_path / "missing"), *dist_flags(port, 1)],
                       tmp_path, "p1"))
    for p in procs:
        code, out, err = finish(p, RUN_TIMEOUT_S)
        assert code == 1, (p.name, code, out, err)
        assert "process 1 failed: checkpoint directory not found" in err, err


@pytest.mark.parametrize("flags, message", [
    (["--num-processes", "2", "--process-id", "0"], "needs --coordinator-address"),
    (["--coordinator-address", "127.0.0.1:1234", "--num-processes", "2"], "needs --process-id"),
    (["--coordinator-address", "127.0.0.1:1234", "--num-processes", "2", "--process-id", "2"],
     "--process-id must be in 0..1"),
    (["--coordinator-address", "localhost", "--num-processes", "2", "--process-id", "0"],
     "must be HOST:PORT"),
    (["--coordinator-address", "127.0.0.1:1234", "--process-id", "0"], "need --num-processes"),
    (["--devices", "6", "--tp", "2", "--coordinator-address", "127.0.0.1:1234",
      "--num-processes", "4", "--process-id", "0"], "--devices 6 (the global count) is not divisible"),
])
def test_bad_multi_process_flags_are_usage_errors(flags, message, capsys, monkeypatch):
    for name in DIST_ENV:
        monkeypatch.delenv(name, raising=False)
    assert cli_main(["run", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


def test_environment_fallbacks():
    env = {"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234", "JAX_NUM_PROCESSES": "2",
           "JAX_PROCESS_ID": "1"}
    assert startup.spec_from_args(None, None, None, env) == \
        startup.ProcessSpec("10.0.0.1:1234", 2, 1)
    # flags win over the environment
    assert startup.spec_from_args("h:9", None, 0, env) == startup.ProcessSpec("h:9", 2, 0)
    assert startup.spec_from_args(None, None, None, {}) is None
    assert startup.spec_from_args(None, None, None, {"JAX_COORDINATOR_ADDRESS": "h:1"}) is None
    with pytest.raises(ValueError, match="JAX_PROCESS_ID must be an integer"):
        startup.spec_from_args(None, None, None, {**env, "JAX_PROCESS_ID": "one"})


@pytest.mark.parametrize("name, value, message", [
    ("K3JAX_HEARTBEAT_TIMEOUT", "abc", "$K3JAX_HEARTBEAT_TIMEOUT must be an integer, got 'abc'"),
    ("K3JAX_INIT_TIMEOUT", "0", "$K3JAX_INIT_TIMEOUT must be a positive number of seconds, got 0"),
])
def test_bad_timeouts_are_usage_errors_before_the_worker_starts(name, value, message, capsys,
                                                                monkeypatch):
    for var in DIST_ENV:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv(name, value)
    monkeypatch.setattr(supervision, "supervise", lambda *a: pytest.fail("the worker started"))
    flags = ["--coordinator-address", "127.0.0.1:1234", "--num-processes", "2", "--process-id", "0"]
    assert cli_main(["run", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


def test_the_worker_exit_code_passes_through_the_child():
    """abandon(2) in a worker (a usage error) leaves the child with exit code 2
    and no traceback."""
    p = subprocess.run([sys.executable, "-c", "from k3jax.runtime.supervision import child_main; "
                        "child_main()", "k3jax.runtime.supervision:abandon", "2"],
                       capture_output=True, text=True, timeout=120, env=base_env())
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr


def test_processes_agree_on_the_kernel_backend_per_configuration(problem, tmp_path, procs):
    """Every check fails on process 1 (the perturbation hook) and passes on
    process 0: both run every launch on xla, and the output matches the
    single-process xla run."""
    root, ckpt, x = problem
    port = free_port()
    flags = ["--checkpoint", str(ckpt), "--input", str(root / "x.npy"), "--devices", "2",
             "--tp", "2", "--sequence-parallel", "--expert-parallel"]
    y_ref, y_mp = tmp_path / "y_ref.npy", tmp_path / "y_mp.npy"
    assert cli_main(["run", *flags, "--backend", "xla", "--output", str(y_ref)]) == 0
    env = dict(K3JAX_SELFCHECK="1", K3JAX_CACHE_DIR=str(tmp_path / "cache0"))
    procs.append(start([*flags, "--backend", "interpret", "--output", str(y_mp),
                        *dist_flags(port, 0)], tmp_path, "p0", base_env(**env)))
    env.update(K3JAX_CACHE_DIR=str(tmp_path / "cache1"), K3JAX_SELFCHECK_PERTURB="*")
    procs.append(start([*flags, "--backend", "interpret", *dist_flags(port, 1)], tmp_path, "p1",
                       base_env(**env)))
    errs = []
    for p in procs:
        code, out, err = finish(p, RUN_TIMEOUT_S)
        assert code == 0, (p.name, code, out, err)
        errs.append(err)
    agreed = re.findall(r"(\w+):\S+ runs xla on every process", errs[0])
    failed = re.findall(r"(\w+):\S+ failed its check \(mismatch", errs[1])
    assert sorted(agreed) == sorted(failed) == ["grouped_matmul", "grouped_situ_glu", "situ_mlp_up"]
    assert rel_err(np.load(y_mp), np.load(y_ref)) <= 1e-5
