"""The loader's pipeline (k3jax.checkpoint.pipeline): the read-ahead thread
holds at most its byte budget (blocks read and not released plus every
staging buffer), reuses staging buffers, hands every block over intact and
in order, raises a failed read where the block is taken, and stops;
``read_layers``, the host side of a load alone, reads exactly the bytes
``load_layers`` places; on CPU devices the ops run on the host slab by slab
(k3jax.checkpoint.slabs) and give the device ops' bytes, and every block is
the parameter; and the loader's rate check (benchmarks.load_ratio_check, a
benchmark command) passes and fails as it says (the integration tier)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import threading
import time
import weakref

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from k3jax.checkpoint import (
    CheckpointError,
    CheckpointReader,
    load_layer,
    make_synthetic_checkpoint,
    read_layers,
)
from k3jax.checkpoint import source as source_module
from k3jax.checkpoint.load import local_bytes
from k3jax.checkpoint.pipeline import Prefetcher, Staging, interleave_codes, swap_last_axes
from k3jax.checkpoint.slabs import INTERLEAVE, TRANSPOSE, interleave_into, slabs, transpose_into
from k3jax.checkpoint.source import CheckpointSource, device_op
from k3jax.config import K3, TINY
from k3jax.formats import ExpertStorage
from k3jax.layout import ParallelConfig, make_layout, make_mesh
from k3jax.modules import layer_decls
from k3jax.variables import WEIGHTS
from pallas_kernels.mxfp4_words import interleave_word_bits, interleave_words, words_of

pytestmark = pytest.mark.tiers(integration=[
    "test_the_ratio_check_passes_at_the_first_attempt_that_holds_and_names_every_failed_one"])

CFG = TINY.replace(num_hidden_layers=2)
# (bytes, staged): staged blocks are read into staging buffers, the others are fresh
PLAN = [(100, True), (5, False), (300, True), (300, True), (20, True), (300, False), (7, True),
        (200, True), (300, True), (64, False), (250, True), (300, True)]


class Recorder:
    """A read_block that fills each block with its index, and the host bytes
    alive at every read: unreleased unstaged blocks plus every staging
    buffer not yet freed (weak references: a freed buffer drops out)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.unstaged_out = 0
        self.staging: list[weakref.ref] = []
        self.peak = 0
        self.buffers_made: set[int] = set()

    def alive(self) -> int:
        return self.unstaged_out + sum(r().nbytes for r in self.staging if r() is not None)

    def read_block(self, i, nbytes, into):
        with self.lock:
            if into is None:
                block = np.empty(nbytes, np.uint8)
                self.unstaged_out += nbytes
            else:
                assert into.nbytes >= nbytes and into.ctypes.data % 64 == 0
                if id(into) not in self.buffers_made:
                    self.buffers_made.add(id(into))
                    self.staging.append(weakref.ref(into))
                block = into[:nbytes]
            block[:] = i % 251
            self.peak = max(self.peak, self.alive())
        return block


def run_plan(plan, hold=1, delay=0.0, staging=None):
    """Take every block in order, keep the last ``hold`` unreleased (as
    InFlight does), check each block's contents; returns the Recorder."""
    rec = Recorder()
    staging = Staging() if staging is None else staging
    pre = Prefetcher(rec.read_block,
                     [((i,), n, staged, (i, n)) for i, (n, staged) in enumerate(plan)], staging)
    held = []
    try:
        for i, (n, staged) in enumerate(plan):
            block = pre.take((i,))
            assert block.nbytes == n and (block == i % 251).all()
            held.append((block, staged))
            time.sleep(delay)
            while len(held) > hold:
                old, old_staged = held.pop(0)
                with rec.lock:
                    rec.unstaged_out -= 0 if old_staged else old.nbytes
                pre.release(old)
        for old, old_staged in held:
            with rec.lock:
                rec.unstaged_out -= 0 if old_staged else old.nbytes
            pre.release(old)
    finally:
        pre.close()
    assert pre.budget == 2 * max(n for n, _ in plan)
    return rec


@pytest.mark.parametrize("delay", [0.0, 0.002], ids=["fast-consumer", "slow-consumer"])
def test_read_ahead_stays_within_its_budget_and_reuses_staging(delay):
    rec = run_plan(PLAN, delay=delay)
    assert 0 < rec.peak <= 2 * 300
    # 9 staged blocks; buffers are made only when no free one fits within the budget
    assert len(rec.buffers_made) < sum(staged for _, staged in PLAN)


def test_staging_carries_its_buffers_to_the_next_plan():
    staging = Staging()
    run_plan(PLAN, staging=staging)
    kept = {id(b) for b in staging.free}
    assert kept and staging.nbytes <= 2 * 300
    rec = run_plan(PLAN, staging=staging)
    assert rec.buffers_made & kept          # the second plan read into the first plan's buffers
    staging.clear()
    assert staging.nbytes == 0


def test_a_failed_read_is_raised_where_its_block_is_taken_and_the_thread_stops():
    def read_block(i, into):
        if i == 3:
            raise CheckpointError("tensor three is broken")
        return np.full(8, i, np.uint8) if into is None else into[:8]
    pre = Prefetcher(read_block, [((i,), 8, i % 2 == 0, (i,)) for i in range(6)], Staging())
    try:
        for i in range(3):
            pre.release(pre.take((i,)))
        with pytest.raises(CheckpointError, match="tensor three"):
            pre.take((3,))
    finally:
        pre.close()
    assert not pre._thread.is_alive()


def test_a_budget_below_a_block_is_refused():
    with pytest.raises(ValueError, match="smaller than a block"):
        Prefetcher(lambda *a: None, [((0,), 100, True, ())], Staging(), budget=50)


def test_close_stops_a_thread_waiting_for_budget():
    pre = Prefetcher(lambda i, into: into[:10], [((i,), 10, True, (i,)) for i in range(5)],
                     Staging())
    pre.take((0,))
    pre.take((1,))            # the budget (20 B) is held: the thread waits for a release
    t0 = time.perf_counter()
    pre.close()
    assert time.perf_counter() - t0 < 5 and not pre._thread.is_alive()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("pipe") / "ckpt"
    make_synthetic_checkpoint(d, CFG, seed=7, dtype="bfloat16", experts="mxfp4")
    return d


@pytest.mark.parametrize("parallel, mxfp4", [
    (ParallelConfig(), "packed"),
    (ParallelConfig(tp=8), "dequantize"),                 # padded blocks, decoded on the host
    (ParallelConfig(dp=2, tp=4, sequence_parallel=True, expert_parallel=True), "packed"),
], ids=["single", "tp8-padded-dequantized", "dp2-tp4-sp-ep"])
def test_read_layers_reads_the_bytes_load_layers_places(ckpt, eight_devices, parallel, mxfp4):
    mesh = make_mesh(parallel, eight_devices[:parallel.num_devices])
    experts = ExpertStorage.MXFP4 if mxfp4 == "packed" else ExpertStorage.MXFP4_DEQUANT
    moe = make_layout(CFG, parallel, mesh, backend="xla", experts=experts, dtype=jnp.bfloat16)
    dense = make_layout(CFG, parallel, mesh, backend="xla", dtype=jnp.bfloat16)
    want = local_bytes(layer_decls(dense, 0), mesh) + local_bytes(layer_decls(moe, 1), mesh)
    assert read_layers(ckpt, [0, 1], parallel, mesh, dtype=jnp.bfloat16, mxfp4=mxfp4,
                       workers=2) == want


def test_read_layers_keeps_every_check(tmp_path, eight_devices):
    d = tmp_path / "ckpt"
    make_synthetic_checkpoint(d, CFG, seed=8, dtype="float32")
    file = next(d.glob("*.safetensors"))
    tensors = load_file(str(file))
    name = "model.layers.1.block_sparse_moe.shared_experts.up_proj.weight"
    tensors[name][3, 5] = np.nan
    save_file(tensors, str(file))
    with pytest.raises(CheckpointError, match=f"{name} holds NaN or inf"):
        read_layers(d, [1])
    with pytest.raises(CheckpointError, match=f"{name} holds NaN or inf"):
        load_layer(d, 1, backend="xla")


def test_the_source_closes_after_reading_its_blocks(ckpt):
    reader = CheckpointReader(ckpt)
    parallel = ParallelConfig()
    mesh = make_mesh(parallel)
    layout = make_layout(CFG, parallel, mesh, backend="xla", dtype=jnp.float32)
    source = CheckpointSource(reader, 0)
    decls = layer_decls(layout, 0)
    source.check(decls)
    assert source.read_blocks(decls, mesh) == local_bytes(decls, mesh)
    assert not any(t.name == "k3jax-prefetch" and t.is_alive() for t in threading.enumerate())


def test_on_cpu_devices_every_block_is_its_parameter(ckpt, monkeypatch):
    """On CPU devices the transposes and the codes' interleave run on the host
    as each block is read, so every parameter's device buffer is the host
    block the loader made (device_put aliases it, no copy) and the
    read-ahead stages nothing. Where the ops run on the devices (host_ops
    False) the blocks they change are staging copies; where device_put
    copies (an accelerator) every block is."""
    from k3jax.checkpoint.pipeline import devices_copy_blocks

    parallel = ParallelConfig()
    mesh = make_mesh(parallel)
    assert not devices_copy_blocks(mesh) and source_module.ops_on_host(mesh)
    put = jax.device_put
    placed = set()   # addresses of the host blocks place_blocks put on a device

    def spy(x, device=None, *args, **kw):
        if isinstance(x, np.ndarray):
            placed.add(x.ctypes.data)
        return put(x, device, *args, **kw)
    monkeypatch.setattr(jax, "device_put", spy)
    module = load_layer(ckpt, 1, parallel, mesh, backend="xla", dtype=jnp.bfloat16)
    monkeypatch.setattr(jax, "device_put", put)
    for path, v in nnx.to_flat_state(nnx.state(module, WEIGHTS)):
        (shard,) = v.get_value().addressable_shards
        assert shard.data.unsafe_buffer_pointer() in placed, path   # the block itself

    plans = []

    class Spy(source_module.Prefetcher):
        def __init__(self, read_block, plan, staging, budget=None):
            plans.append({key[0]: staged for key, _, staged, _ in plan})
            super().__init__(read_block, plan, staging, budget)
    monkeypatch.setattr(source_module, "Prefetcher", Spy)
    layout = make_layout(CFG, parallel, mesh, backend="xla", experts=ExpertStorage.MXFP4,
                         dtype=jnp.bfloat16)
    decls = layer_decls(layout, 1)
    tensors = source_module.layer_tensors(True)
    for copies, host_ops in ((False, None), (False, False), (True, None)):
        monkeypatch.setattr(source_module, "devices_copy_blocks", lambda mesh: copies)
        source = CheckpointSource(CheckpointReader(ckpt), 1, host_ops=host_ops)
        source.check(decls)
        assert source.read_blocks(decls, mesh) == local_bytes(decls, mesh)
        staged = plans[-1]
        changed = {d.name for d in decls if device_op(tensors[d.name]) is not None}
        assert {"w1_packed_EFL", "w2_scale_EFL", "shared.gate_DF"} <= changed
        want = ({d.name for d in decls} if copies else set() if host_ops is None else changed)
        assert {name for name, s in staged.items() if s} == want, (copies, host_ops)


@pytest.fixture(scope="module")
def f32_ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("pipe32") / "ckpt"
    make_synthetic_checkpoint(d, CFG, seed=9, dtype="float32")
    return d


@pytest.mark.parametrize("which, parallel, dtype", [
    ("ckpt", ParallelConfig(), jnp.bfloat16),
    ("f32_ckpt", ParallelConfig(tp=8), jnp.bfloat16),                 # padded blocks, cast
    ("ckpt", ParallelConfig(dp=2, tp=4, sequence_parallel=True, expert_parallel=True),
     jnp.float32),
], ids=["mxfp4-single", "f32-tp8-padded-to-bf16", "mxfp4-ep8-to-f32"])
@pytest.mark.parametrize("slab_bytes", [None, 1000], ids=["slabs", "tiny-slabs"])
def test_host_ops_give_the_device_ops_bytes(request, eight_devices, monkeypatch, which, parallel,
                                            dtype, slab_bytes):
    """Every parameter loaded with the ops on the host (slab by slab; with
    1000-byte slabs, experts split along their rows and several slabs a
    worker) is bitwise the one the device ops make from the stored blocks."""
    ckpt = request.getfixturevalue(which)
    mesh = make_mesh(parallel, eight_devices[:parallel.num_devices])

    def params(host_ops):
        monkeypatch.setattr(source_module, "ops_on_host", lambda mesh: host_ops)
        module = load_layer(ckpt, 1, parallel, mesh, backend="xla", dtype=dtype, workers=2)
        return {path: np.asarray(v.get_value())
                for path, v in nnx.to_flat_state(nnx.state(module, WEIGHTS))}
    if slab_bytes is not None:
        host_op = source_module.host_op
        monkeypatch.setattr(source_module, "host_op", lambda ref: None if host_op(ref) is None
                            else dataclasses.replace(host_op(ref), slab_bytes=slab_bytes))
    on_host, on_device = params(True), params(False)
    assert sorted(on_host) == sorted(on_device)
    for path, a in on_host.items():
        b = on_device[path]
        assert a.dtype == b.dtype and a.shape == b.shape, path
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8), err_msg=str(path))


@pytest.mark.parametrize("shape, itemsize, row_axis, slab_bytes", [
    ((56, 3072, 1792), 1, -2, INTERLEAVE.slab_bytes),   # K3 codes: one whole expert a slab
    ((56, 3072, 1792), 1, -2, 4 << 20),   # 5.25 MiB an expert: split in 2 along its rows
    ((56, 112, 3072), 1, -1, TRANSPOSE.slab_bytes),     # K3 scales: experts grouped
    ((7168, 6144), 2, -1, TRANSPOSE.slab_bytes),        # a K3 BF16 weight held [in, out]
    ((4, 1000, 3000), 4, -1, 1 << 20),    # experts larger than a slab: split along their rows
    ((3, 7, 5), 1, -2, 8),
])
def test_slabs_cover_a_block_once_in_equal_parts(shape, itemsize, row_axis, slab_bytes):
    parts = slabs(shape, itemsize, row_axis, slab_bytes)
    seen = np.zeros(shape, np.int32)
    for part in parts:
        seen[part] += 1
    assert (seen == 1).all()
    sizes = [seen[part].size * itemsize for part in parts]
    row = itemsize * (shape[-2] if row_axis == -1 else shape[-1])    # one stored row
    assert max(sizes) <= max(slab_bytes, row), (max(sizes), slab_bytes)
    assert len({seen[part].shape for part in parts}) <= 2      # one compile, or two
    if shape[0] == 56:
        assert len({seen[part].shape for part in parts}) == 1


def test_slabs_name_what_they_cannot_split():
    with pytest.raises(ValueError, match=r"2-D or 3-D .* \[8\]"):
        slabs((8,), 1, -1, 64)
    with pytest.raises(ValueError, match="row_axis is -1 or -2, got 0"):
        slabs((8, 8), 1, 0, 64)
    assert slabs((0, 8), 2, -1, 64) == []


@pytest.mark.parametrize("dtype", [np.uint8, ml_dtypes.bfloat16, np.float16, np.float32])
def test_the_host_ops_are_the_device_ops(dtype):
    """transpose_into / interleave_into write, into a strided place in a wider
    array, the bytes swap_last_axes / interleave_codes return."""
    rng = np.random.default_rng(0)
    device = jax.devices()[0]
    bits = rng.integers(0, 1 << 16, (3, 40, 24)).astype(np.uint16)
    stored = np.ascontiguousarray((bits.astype(np.float32) - 3e4).astype(dtype))
    wide = np.zeros((3, 24, 50), dtype)
    transpose_into(stored, wide[:, :, 5:45], device)
    want = np.asarray(swap_last_axes(jax.device_put(stored, device)))
    np.testing.assert_array_equal(wide[:, :, 5:45].view(np.uint8), want.view(np.uint8))
    assert not wide[:, :, :5].any() and not wide[:, :, 45:].any()
    codes = rng.integers(0, 256, (3, 40, 24), dtype=np.uint8)
    out = np.zeros((3, 41, 24), np.uint8)
    interleave_into(codes, out[:, 1:], device)
    np.testing.assert_array_equal(out[:, 1:], np.asarray(interleave_codes(jnp.asarray(codes))))
    assert not out[:, 0].any()


def test_the_host_ops_name_what_they_cannot_take():
    device = jax.devices()[0]
    with pytest.raises(ValueError, match="no unsigned view of float64"):
        transpose_into(np.zeros((2, 2)), np.zeros((2, 2)), device)
    with pytest.raises(ValueError, match=r"n a multiple of 4, got uint8 \[2, 6\]"):
        interleave_into(np.zeros((2, 6), np.uint8), np.zeros((2, 6), np.uint8), device)


def test_interleave_word_bits_is_interleave_words_on_words():
    codes = np.random.default_rng(1).integers(0, 256, (5, 64), dtype=np.uint8)
    want = words_of(interleave_words(codes))
    np.testing.assert_array_equal(interleave_word_bits(words_of(codes)), want)
    np.testing.assert_array_equal(np.asarray(jax.jit(interleave_word_bits)(
        jnp.asarray(words_of(codes)))), want)
    with pytest.raises(ValueError, match="takes uint32 words, got uint8"):
        interleave_word_bits(codes)


def test_fast_synthetic_tensors_are_the_same_tensors_in_random_bits():
    from k3jax.checkpoint.writer import FAST_SCALE_BYTES, synthetic_tensors

    for dtype in ("bfloat16", "float32", "float16"):
        slow = dict(synthetic_tensors(CFG, 3, dtype=dtype, experts="mxfp4"))
        fast = dict(synthetic_tensors(CFG, 3, dtype=dtype, experts="mxfp4", fast=True))
        assert list(fast) == list(slow)
        for name, a in fast.items():
            assert (a.shape, a.dtype) == (slow[name].shape, slow[name].dtype), name
            if name.endswith("weight_scale"):
                assert FAST_SCALE_BYTES.start <= a.min() and a.max() < FAST_SCALE_BYTES.stop
            elif a.dtype != np.uint8:
                values = a.astype(np.float32)
                assert np.isfinite(values).all() and np.abs(values).max() < 2, name
        codes = np.concatenate([a.ravel() for n, a in fast.items() if n.endswith("_packed")])
        assert len(np.unique(codes)) == 256                      # every byte occurs


# -- the loader's rate against a raw read (benchmarks.load_ratio_check) ---------------
def test_the_ratio_checks_checkpoint_has_the_mix_of_a_k3_layer():
    from benchmarks.load_ratio_check import config, layer_mix

    small, k3 = layer_mix(config()), layer_mix(K3.replace(num_experts=56))
    assert small.keys() == k3.keys()
    for part in small:
        assert abs(small[part] - k3[part]) < 0.002, (part, small, k3)
    assert config().hidden_size * 2 == K3.hidden_size and config().num_experts == 56


def test_the_ratio_check_passes_at_the_first_attempt_that_holds_and_names_every_failed_one(
        tmp_path):
    """``python -m benchmarks.load_ratio_check`` (a benchmark command, not a
    suite test: the suite holds no timing threshold): on its checkpoint,
    written into --dir once and reused, a ratio no loader reaches (1e6)
    fails every attempt, exit 1, with load-bench's line for each and one
    line naming each attempt's ratio; a ratio of 0 passes at the first
    attempt, exit 0, with its JSON line; a bad --repeat is a usage error."""
    import json
    import re

    ckpt = str(tmp_path / "half")
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}

    def check(*args):
        return subprocess.run([sys.executable, "-m", "benchmarks.load_ratio_check", "--dir", ckpt,
                               "--repeat", "1", *args], env=env, cwd=repo, capture_output=True,
                              text=True, timeout=300, check=False)
    failed = check("--min-ratio", "1e6", "--attempts", "2")
    assert failed.returncode == 1, failed.stderr[-2000:]
    runs = [json.loads(line) for line in failed.stdout.splitlines()]
    assert len(runs) == 2 and all(r["ratio"] > 0 and r["bytes"] == runs[0]["bytes"] for r in runs)
    assert failed.stderr.count("is below --min-ratio 1e+06") == 2, failed.stderr
    shown = ", ".join(f"{r['ratio']:.3f}" for r in runs)
    assert re.search(rf"load_ratio_check: the loader held less than 1e\+06 of the raw read in "
                     rf"each of 2 attempts \(ratios {re.escape(shown)}; medians of 1 runs each\)",
                     failed.stderr), failed.stderr
    held = check("--min-ratio", "0")
    assert held.returncode == 0, held.stderr[-2000:]
    (run,) = [json.loads(line) for line in held.stdout.splitlines()]
    assert run["bytes"] == runs[0]["bytes"] and run["loader_GBps"] > 0 and run["raw_GBps"] > 0
    usage = check("--attempts", "0")
    assert usage.returncode == 2 and "--repeat and --attempts must be >= 1" in usage.stderr
