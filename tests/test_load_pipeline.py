"""The loader's pipeline (k3jax.checkpoint.pipeline): the read-ahead thread
holds at most its byte budget (blocks read and not released plus every
staging buffer), reuses staging buffers, hands every block over intact and
in order, raises a failed read where the block is taken, and stops; and
``read_layers``, the host side of a load alone, reads exactly the bytes
``load_layers`` places."""

from __future__ import annotations

import threading
import time
import weakref

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from k3jax.checkpoint import (
    CheckpointError,
    CheckpointReader,
    load_layer,
    make_synthetic_checkpoint,
    read_layers,
)
from k3jax.checkpoint.load import local_bytes
from k3jax.checkpoint.pipeline import Prefetcher, Staging
from k3jax.checkpoint.source import CheckpointSource
from k3jax.config import TINY
from k3jax.layout import ExpertStorage, ParallelConfig, make_layout, make_mesh
from k3jax.modules import layer_decls

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


def test_packed_codes_are_interleaved_on_the_device_and_1d_blocks_aliased(ckpt, monkeypatch):
    """Packed MXFP4 codes, read [E, out, in/2] as stored, are interleaved into
    the word layout on the device (interleave_codes), so their blocks are
    staging copies like the transposed ones; on a CPU device a block without
    a device op (1-D) is the parameter itself (device_put aliases it, no
    copy). Where device_put copies (an accelerator) every block is staged."""
    import jax

    from k3jax.checkpoint import source as source_module
    from k3jax.checkpoint.pipeline import devices_copy_blocks
    from pallas_kernels.mxfp4_words import deinterleave_words

    parallel = ParallelConfig()
    mesh = make_mesh(parallel)
    assert not devices_copy_blocks(mesh)
    put = jax.device_put
    aliased = {}   # id of a placed 1-D block's device buffer -> whether it is the block's memory
    codes = []     # the uint8 3-D blocks read (packed codes, as stored)

    def spy(x, device=None, *args, **kw):
        y = put(x, device, *args, **kw)
        if isinstance(x, np.ndarray) and x.ndim == 1:
            aliased[y.unsafe_buffer_pointer()] = y.unsafe_buffer_pointer() == x.ctypes.data
        if isinstance(x, np.ndarray) and x.dtype == np.uint8 and x.ndim == 3:
            codes.append(x.copy())
        return y
    monkeypatch.setattr(jax, "device_put", spy)
    module = load_layer(ckpt, 1, parallel, mesh, backend="xla", dtype=jnp.bfloat16)
    (shard,) = module.router_bias_E[...].addressable_shards
    assert aliased.get(shard.data.unsafe_buffer_pointer()), "router_bias_E"   # uncopied
    for name in ("w1_packed_EFL", "w3_packed_EFL", "w2_packed_ELF"):
        held = deinterleave_words(np.asarray(getattr(module, name)[...]))
        assert any(c.shape == held.shape and np.array_equal(c, held) for c in codes), name
    monkeypatch.setattr(jax, "device_put", put)

    plans = []

    class Spy(source_module.Prefetcher):
        def __init__(self, read_block, plan, staging, budget=None):
            plans.append({key[0]: staged for key, _, staged, _ in plan})
            super().__init__(read_block, plan, staging, budget)
    monkeypatch.setattr(source_module, "Prefetcher", Spy)
    layout = make_layout(CFG, parallel, mesh, backend="xla", experts=ExpertStorage.MXFP4,
                         dtype=jnp.bfloat16)
    decls = layer_decls(layout, 1)
    for copies in (False, True):
        monkeypatch.setattr(source_module, "devices_copy_blocks", lambda mesh: copies)
        source = CheckpointSource(CheckpointReader(ckpt), 1)
        source.check(decls)
        assert source.read_blocks(decls, mesh) == local_bytes(decls, mesh)
        staged = plans[-1]
        assert all(staged[n] for n in ("w1_packed_EFL", "w3_packed_EFL", "w2_packed_ELF"))
        assert staged["w1_scale_ELF"] and staged["w2_scale_EFL"] and staged["shared.gate_DF"]
        assert staged["router_bias_E"] is copies            # 1-D: held as stored too
