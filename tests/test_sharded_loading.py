"""Sharded loading: each process reads only its own devices' blocks, each
block once; building a block costs about one block of host memory; a
process's peak host memory for a layer stays near its share, not the layer.

A RecordingReader logs every region read from the safetensors files. One
test runs in this process (8 CPU devices, dp 2 x tp 4, so some blocks are
replicated over the data axis); one runs 2 processes x 4 devices (EP + SP +
sharded shared expert, tp 8), this file being the worker script.
tracemalloc counts numpy allocations. On the CPU a device buffer may alias
the numpy block it was made from, so a whole load's peak includes the
process's device buffers (its share); the cost of building one block is
measured around ``CheckpointSource._read_block``.
"""

from __future__ import annotations

import collections
import gc
import glob
import json
import os
import signal
import socket
import subprocess
import sys
import tracemalloc

import numpy as np
import pytest
from safetensors.numpy import load_file

from k3jax.checkpoint import CheckpointReader, load_layer, make_synthetic_checkpoint
from k3jax.checkpoint.names import layer_prefix, layer_tensors
from k3jax.checkpoint.source import CheckpointSource
from k3jax.config import TINY
from k3jax.layout import ParallelConfig, make_mesh
from k3jax.tools.memory import param_shard_bytes

pytestmark = pytest.mark.tiers(
    slow=["test_two_processes_each_read_only_their_share"])

# Wider than TINY so weight blocks dwarf Python's own small allocations.
CFG = TINY.replace(moe_intermediate_size=128, routed_expert_hidden_size=256, num_hidden_layers=2)
LAYER = 1
PREFIX = layer_prefix(LAYER, True)
SLACK_BYTES = 256 * 1024        # Python objects made while loading a layer (module, shardings)
BLOCK_SLACK_BYTES = 256 * 1024  # ... while reading one block (tracemalloc also counts the main
                                # thread placing the blocks read before, beside the read-ahead,
                                # and on CPU devices the calls into XLA of the block's host op)
WORKER_TIMEOUT_S = 240


class RecordingReader(CheckpointReader):
    """Logs (tensor name, region as ((start, stop), ...), bytes) of every read."""

    def __init__(self, directory):
        super().__init__(directory)
        self.reads: list[tuple[str, tuple, int]] = []

    def read(self, name, index=None, out=None, workers=None):
        value = super().read(name, index, out, workers)
        if index is None:
            region = tuple((0, n) for n in value.shape)
        else:
            region = tuple((s.start, s.stop) for s in index)
        self.reads.append((name, region, value.nbytes))
        return value


def load_measured(reader, parallel, mesh):
    """(module, peak host bytes above the start while loading, [(block bytes,
    peak host bytes above the start while reading that block)])."""
    blocks = []
    read_block = CheckpointSource._read_block

    def measured_read_block(self, *args):
        start, _ = tracemalloc.get_traced_memory()
        whole_peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.reset_peak()
        out = read_block(self, *args)
        peak = tracemalloc.get_traced_memory()[1]
        blocks.append((out.nbytes, peak - start))
        load_peak[0] = max(load_peak[0], whole_peak, peak)
        return out

    load_peak = [0]
    CheckpointSource._read_block = measured_read_block
    tracemalloc.start()
    try:
        start, _ = tracemalloc.get_traced_memory()
        module = load_layer(reader, LAYER, parallel, mesh, backend="xla")
        load_peak[0] = max(load_peak[0], tracemalloc.get_traced_memory()[1])
    finally:
        tracemalloc.stop()
        CheckpointSource._read_block = read_block
    return module, load_peak[0] - start, blocks


def check_block_costs(blocks):
    """Building a block holds the block and one stored piece of it (one
    expert's slice, or the slice to transpose / pad): at most 2 blocks."""
    assert blocks
    for nbytes, peak in blocks:
        assert peak <= 2 * nbytes + BLOCK_SLACK_BYTES, (nbytes, peak)


def param(module, path):
    obj = module
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj.get_value()


def norm_region(index, shape):
    return tuple(s.indices(n)[:2] for s, n in zip(index, shape))


def block_regions(module, device_index_map):
    """{(stored tensor name, stored region)} for the blocks given by
    ``device_index_map(array)`` ({device: index}), from the names table."""
    refs = layer_tensors(True)
    regions = set()
    for path in param_shard_bytes(module):
        a = param(module, path)
        ref = refs[path]
        for index in device_index_map(a).values():
            r = norm_region(index, a.shape)
            inner = r[1:] if ref.per_expert else r
            inner = tuple(reversed(inner)) if ref.transpose else inner
            experts = range(*r[0]) if ref.per_expert else [None]
            regions |= {(ref.name(PREFIX, e), inner) for e in experts}
    return regions


def largest_block_bytes(module, device_index_map) -> int:
    biggest = 0
    for path in param_shard_bytes(module):
        a = param(module, path)
        for index in device_index_map(a).values():
            r = norm_region(index, a.shape)
            biggest = max(biggest, int(np.prod([b - s for s, b in r])) * a.dtype.itemsize)
    return biggest


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    d = tmp_path_factory.mktemp("sharded") / "ckpt"
    make_synthetic_checkpoint(d, CFG, seed=23, dtype="float32", num_files=2)
    tensors = {}
    for file in glob.glob(os.path.join(d, "*.safetensors")):
        tensors.update({n: v for n, v in load_file(file).items() if n.startswith(PREFIX)})
    return d, tensors


def test_each_block_read_once_from_its_own_region(checkpoint, eight_devices):
    d, tensors = checkpoint
    layer_bytes = sum(v.nbytes for v in tensors.values())
    parallel = ParallelConfig(dp=2, tp=4, sequence_parallel=True, expert_parallel=True,
                              shard_shared_expert=True)
    mesh = make_mesh(parallel, eight_devices)
    reader = RecordingReader(d)
    module, peak, blocks = load_measured(reader, parallel, mesh)

    def local(a):
        return a.sharding.addressable_devices_indices_map(a.shape)
    counts = collections.Counter((name, region) for name, region, _ in reader.reads)
    assert set(counts) == block_regions(module, local)
    assert max(counts.values()) == 1      # blocks replicated over 'data' are read once

    # the assembled parameters are the checkpoint's tensors (transposed, stacked)
    refs = layer_tensors(True)
    for path in param_shard_bytes(module):
        ref, got = refs[path], np.asarray(param(module, path))
        if ref.per_expert:
            want = np.stack([tensors[ref.name(PREFIX, e)].T for e in range(CFG.num_experts)])
        else:
            want = tensors[ref.name(PREFIX)]
            want = want.T if ref.transpose else want
        np.testing.assert_array_equal(got, want, err_msg=path)

    check_block_costs(blocks)
    expert_blocks = [(n, p) for n, p in blocks if n == max(n for n, _ in blocks)]
    print(f"1 process x 8 devices: peak host {peak} B for a {layer_bytes} B layer; "
          f"largest block {expert_blocks[0][0]} B built with peak {max(p for _, p in expert_blocks)} B")


# -- two processes --------------------------------------------------------------------

def _worker(port: int, process_id: int, ckpt: str, out: str) -> None:
    """One of two processes: load the layer, record reads and peak host memory."""
    import jax
    jax.config.update("jax_num_cpu_devices", 4)
    from k3jax.runtime import startup
    spec = startup.ProcessSpec(f"127.0.0.1:{port}", 2, process_id)
    startup.initialize(spec)
    parallel = ParallelConfig(tp=8, sequence_parallel=True, expert_parallel=True,
                              shard_shared_expert=True)
    mesh = make_mesh(parallel, jax.devices())
    reader = RecordingReader(ckpt)
    load_layer(reader, LAYER, parallel, mesh, backend="xla")   # XLA compiles the loader's ops
    gc.collect()                                              # once a process: not counted
    reader.reads.clear()
    module, peak, blocks = load_measured(reader, parallel, mesh)
    def local(a):
        return a.sharding.addressable_devices_indices_map(a.shape)
    with open(out, "w") as f:
        json.dump({"reads": reader.reads, "peak": peak, "blocks": blocks,
                   "largest_block": largest_block_bytes(module, local),
                   "mesh_processes": [d.process_index for d in mesh.devices.flat]}, f)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_each_read_only_their_share(checkpoint, tmp_path):
    d, tensors = checkpoint
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_") and k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    procs = [subprocess.Popen([sys.executable, __file__, str(port), str(i), str(d),
                               str(tmp_path / f"p{i}.json")], env=env, start_new_session=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    try:
        logs = [p.communicate(timeout=WORKER_TIMEOUT_S)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=30)
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log
    results = [json.loads((tmp_path / f"p{i}.json").read_text()) for i in range(2)]

    E, per_device = CFG.num_experts, CFG.num_experts // 8
    shared = CFG.shared_intermediate_size
    layer_bytes = sum(v.nbytes for v in tensors.values())
    replicated = ["gate.weight", "gate.e_score_correction_bias", "routed_expert_down_proj.weight",
                  "routed_expert_up_proj.weight", "routed_expert_norm.weight"]
    replicated_bytes = sum(tensors[PREFIX + n].nbytes for n in replicated)
    for p, res in enumerate(results):
        reads = [(name[len(PREFIX):], tuple(map(tuple, region)), b) for name, region, b in res["reads"]]
        # EP: mesh position k holds experts [k*E/8, (k+1)*E/8); these are the positions of p
        mine = [k for k, owner in enumerate(res["mesh_processes"]) if owner == p]
        want_experts = {e for k in mine for e in range(k * per_device, (k + 1) * per_device)}
        assert len(want_experts) == E // 2
        for w in ("w1", "w2", "w3"):
            got = {int(n.split(".")[1]) for n, *_ in reads if n.startswith("experts.") and
                   n.endswith(f".{w}.weight")}
            assert got == want_experts, (p, w, sorted(got))
        # the shared expert is split over the tensor axis: p reads only its columns / rows
        cols = shared // 8
        want_rows = {(k * cols, (k + 1) * cols) for k in mine}
        for n, axis in (("shared_experts.gate_proj.weight", 0), ("shared_experts.up_proj.weight", 0),
                        ("shared_experts.down_proj.weight", 1)):
            got = {region[axis] for m, region, _ in reads if m == n}
            assert got == want_rows, (p, n, got)
        for n in replicated:   # every process needs these whole, once
            assert [r for m, r, _ in reads if m == n] == [tuple((0, s) for s in tensors[PREFIX + n].shape)]

        read_bytes = sum(b for *_, b in reads)
        assert read_bytes == (layer_bytes - replicated_bytes) // 2 + replicated_bytes
        print(f"process {p} of 2: read {read_bytes} of {layer_bytes} B "
              f"({read_bytes / layer_bytes:.3f} of the layer), peak host {res['peak']} B "
              f"({res['peak'] / layer_bytes:.3f}), largest block {res['largest_block']} B")
        check_block_costs(res["blocks"])
        # its share (kept as CPU device buffers) plus about one block in flight
        assert res["peak"] <= read_bytes + 2 * res["largest_block"] + SLACK_BYTES
        assert res["peak"] < 0.75 * layer_bytes


if __name__ == "__main__":
    _worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
