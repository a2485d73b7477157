"""``k3jax load-bench``: the checkpoint loader's rate against a raw read of
the same bytes, measured in one run with the page cache warm."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time

from k3jax.cli import replicas
from k3jax.cli.common import (
    DTYPES,
    UsageError,
    add_device_flags,
    add_parallel_flags,
    check_moe_only_flags,
    device_flags,
    layout_errors,
    non_negative_float,
    non_negative_int,
    parallel_from_args,
    pick_devices,
    positive_int,
    report_errors,
    request_devices,
    require_devices,
    warn_config_defaults,
)

RAW_BUFFER_BYTES = 64 << 20
"""The raw read's one reused buffer; longer runs are read in pieces of this size."""


def add_parser(sub) -> None:
    p = sub.add_parser("load-bench", help="the checkpoint loader's GB/s against a raw read",
                       description="Load one layer of a checkpoint onto the devices (the "
                                   "loader: headers, reads, checks, transfer, the parameters' "
                                   "ops: transposes, MXFP4 code interleave; on CPU devices "
                                   "those run on the host as blocks are read) and read the "
                                   "same file bytes with a plain readinto loop on one thread; "
                                   "both with the page cache warm (each runs once untimed "
                                   "first). Prints both rates (GB = 1e9 bytes) and loader / "
                                   "raw; without --json also peers from the same run: the "
                                   "loader's host side alone, and on CPU devices the reads "
                                   "and checks alone (blocks as stored: what a GPU host's CPU "
                                   "does), on accelerators the on-device ops alone.")
    p.add_argument("--checkpoint", metavar="DIR", required=True, help="checkpoint directory")
    p.add_argument("--layer", type=non_negative_int, default=None,
                   help="layer index (default 1, the first MoE layer)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16",
                   help="parameter dtype (default bfloat16)")
    p.add_argument("--mxfp4", choices=("packed", "dequantize"), default="packed",
                   help="MXFP4 routed experts: kept packed or dequantized on load")
    p.add_argument("--workers", type=positive_int, default=None,
                   help="loader threads (default: one per core this process may use)")
    p.add_argument("--repeat", type=positive_int, default=3, metavar="R",
                   help="timed runs of each, interleaved; the medians are reported (default 3)")
    p.add_argument("--json", action="store_true",
                   help='print {"bytes", "loader_GBps", "raw_GBps", "ratio"}')
    p.add_argument("--min-ratio", type=non_negative_float, default=None, metavar="R",
                   help="exit 1, with one line on stderr naming the figures, when loader / raw "
                        "(of the medians) is below R (a check: e.g. 0.30)")
    add_device_flags(p)
    add_parallel_flags(p)
    p.set_defaults(main=main)


def main(args: argparse.Namespace, prog: str) -> int:
    return report_errors(lambda: _bench(args, prog), prog)


def _bench(args: argparse.Namespace, prog: str) -> int:
    parallel = parallel_from_args(args, args.devices)
    reader = _recording_reader(args.checkpoint)   # the config and headers: no device yet
    cfg = reader.config
    layer = args.layer if args.layer is not None else min(1, cfg.num_hidden_layers - 1)
    if layer >= cfg.num_hidden_layers:
        raise UsageError(f"--layer {layer} is out of range: {args.checkpoint} has "
                         f"{cfg.num_hidden_layers} layers (0..{cfg.num_hidden_layers - 1})")
    check_moe_only_flags(args, cfg, [layer])
    placements = replicas.placements_from_args(args, cfg, parallel, [layer])
    warn_config_defaults(prog, os.path.join(args.checkpoint, "config.json"),
                         reader.math_defaults, list(reader.math_defaults))
    request_devices(parallel.num_devices, device_flags(args))

    import jax
    from flax import nnx

    from k3jax.checkpoint import load_layer, read_layers
    from k3jax.checkpoint.host import default_workers
    from k3jax.checkpoint.source import ops_on_host
    from k3jax.layout import make_mesh

    require_devices(parallel.num_devices)
    mesh = make_mesh(parallel, pick_devices(parallel.num_devices))
    on_host = ops_on_host(mesh)

    def load() -> float:
        on_device.clear()                    # the previous load's parameters go first
        t0 = time.perf_counter()
        with layout_errors(parallel, mxfp4_fix="--mxfp4 dequantize"):
            module = load_layer(reader, layer, parallel, mesh, dtype=DTYPES[args.dtype],
                                mxfp4=args.mxfp4, workers=args.workers,
                                expert_placement=(placements or {}).get(layer))
        jax.block_until_ready(jax.tree.leaves(nnx.state(module)))
        seconds = time.perf_counter() - t0
        on_device[:] = [] if on_host else _device_op_params(module)
        return seconds
    on_device: list = []   # (device op, parameter): what the devices do to the last load

    def read_host_side(host_ops: bool | None = None) -> float:
        t0 = time.perf_counter()
        read_layers(reader, [layer], parallel, mesh, dtype=DTYPES[args.dtype], mxfp4=args.mxfp4,
                    workers=args.workers, host_ops=host_ops, expert_placements=placements)
        return time.perf_counter() - t0

    load()                                   # warms the page cache, compiles the ops
    regions = reader.take_regions()
    nbytes = sum(n for _, _, n in regions)
    raw_read(reader, regions)                # warm
    if not args.json:
        _time_device_ops(on_device)          # compiles the peer's device ops
    loader_s, raw_s, device_s, host_s, stored_s, fresh_s = [], [], [], [], [], []
    for _ in range(args.repeat):
        loader_s.append(load())
        raw_s.append(raw_read(reader, regions))
        if not args.json:
            fresh_s.append(raw_read(reader, regions, fresh=True))
            host_s.append(read_host_side())
            if on_host:
                stored_s.append(read_host_side(host_ops=False))
            else:
                device_s.append(_time_device_ops(on_device))
    loader = nbytes / statistics.median(loader_s) / 1e9
    raw = nbytes / statistics.median(raw_s) / 1e9
    if args.json:
        print(json.dumps({"bytes": nbytes, "loader_GBps": loader, "raw_GBps": raw,
                          "ratio": loader / raw}))
        return _check_ratio(args, prog, layer, nbytes, loader, raw)
    kind = "MoE" if cfg.is_moe_layer(layer) else "dense MLP"
    workers = args.workers or default_workers()
    print(f"layer {layer} ({kind}) of {args.checkpoint}: {nbytes} bytes ({nbytes / 1e9:.3f} GB) "
          f"in {len(regions)} reads, {args.dtype}, MXFP4 {args.mxfp4}, on "
          f"{len(mesh.devices.flat)} {mesh.devices.flat[0].platform} device(s)")
    print(f"loader:   {loader:8.3f} GB/s  (median of {args.repeat}: "
          f"{statistics.median(loader_s):.3f} s; {workers} worker thread(s))")
    print(f"raw read: {raw:8.3f} GB/s  (median of {args.repeat}: {statistics.median(raw_s):.3f} s; "
          f"one thread, readinto a reused buffer)")
    print(f"ratio:    {loader / raw:8.3f}")
    fresh = nbytes / statistics.median(fresh_s) / 1e9
    print(f"peer: the raw read into new memory (the same reads into one new buffer of "
          f"{nbytes / 1e9:.3f} GB, as parameters are new memory), {fresh:.3f} GB/s, "
          f"{fresh / raw:.3f} of the raw read (median of {args.repeat}: "
          f"{statistics.median(fresh_s):.3f} s); the loader runs at {loader / fresh:.3f} of it")
    host = nbytes / statistics.median(host_s) / 1e9
    what = ("reads, checks, the ops on the host" if on_host else "reads, checks, staging")
    print(f"peer: the loader's host side alone ({what}; nothing placed), "
          f"{host:.3f} GB/s, {host / raw:.3f} of the raw read (median of {args.repeat}: "
          f"{statistics.median(host_s):.3f} s)")
    if on_host:
        as_stored = nbytes / statistics.median(stored_s) / 1e9
        print(f"peer: the reads and checks alone (blocks as stored, staging, no op: what a GPU "
              f"host's CPU does), {as_stored:.3f} GB/s, {as_stored / raw:.3f} of the raw read "
              f"(median of {args.repeat}: {statistics.median(stored_s):.3f} s)")
        print("peer: the on-device ops alone: none (on CPU devices the transposes and the "
              "MXFP4 code interleave run on the host as blocks are read, slab by slab)")
    moved = sum(a.nbytes for _, a in on_device)
    if moved:
        print(f"peer: the on-device ops alone (transposes, MXFP4 code interleave), "
              f"{moved / 1e9:.3f} GB of the layer's parameters, "
              f"{moved / statistics.median(device_s) / 1e9:.3f} GB/s (median of "
              f"{args.repeat}: {statistics.median(device_s):.3f} s)")
    return _check_ratio(args, prog, layer, nbytes, loader, raw)


def _check_ratio(args: argparse.Namespace, prog: str, layer: int, nbytes: int, loader: float,
                 raw: float) -> int:
    """0, or 1 with one line on stderr when loader / raw is below --min-ratio."""
    if args.min_ratio is None or loader / raw >= args.min_ratio:
        return 0
    print(f"{prog}: loader / raw read {loader / raw:.3f} is below --min-ratio "
          f"{args.min_ratio:g}: loader {loader:.3f} GB/s, raw read {raw:.3f} GB/s (medians of "
          f"{args.repeat} interleaved runs each, layer {layer} of {args.checkpoint}, "
          f"{nbytes} bytes)", file=sys.stderr)
    return 1


def _device_op_params(module) -> list:
    """(device op, parameter) for each of the module's parameters the loader
    changes on the device (checkpoint.source.device_op: a transpose, the
    MXFP4 codes' interleave)."""
    from flax import nnx

    from k3jax.checkpoint.names import layer_tensors
    from k3jax.checkpoint.source import device_op
    from k3jax.variables import WEIGHTS

    refs = layer_tensors(module.__class__.__name__ == "KimiMoE")
    out = []
    for path, v in nnx.to_flat_state(nnx.state(module, WEIGHTS)):
        op = device_op(refs[".".join(map(str, path))])
        if op is not None:
            out.append((op, v.get_value()))
    return out


def _time_device_ops(ops: list) -> float:
    """Seconds to run each (op, array)'s device op once on its devices (the
    loader's on-device step, compiled by its warm-up)."""
    import jax

    t0 = time.perf_counter()
    jax.block_until_ready([op(a) for op, a in ops])
    return time.perf_counter() - t0


def _recording_reader(directory: str):
    """A CheckpointReader that records (name, index, bytes) of every region read."""
    from k3jax.checkpoint import CheckpointReader

    class RecordingReader(CheckpointReader):
        def __init__(self, directory):
            super().__init__(directory)
            self._regions: list[tuple[str, list | None, int]] = []
            self._regions_lock = threading.Lock()

        def read(self, name, index=None, out=None, workers=None):
            value = super().read(name, index, out, workers)
            with self._regions_lock:
                self._regions.append((name, None if index is None else list(index), value.nbytes))
            return value

        def take_regions(self) -> list[tuple[str, list | None, int]]:
            with self._regions_lock:
                regions, self._regions = self._regions, []
            return regions
    return RecordingReader(directory)


def raw_read(reader, regions, fresh: bool = False) -> float:
    """Seconds to read the file bytes of ``regions`` ((name, index, bytes)
    as the loader read them) with plain readinto calls on one thread, into
    one reused buffer; with ``fresh``, one after the other into one new
    64-byte aligned buffer as long as all of them, made in the timed span
    (new memory, as a loader's parameters are: the kernel maps and zeroes
    each page on its first touch)."""
    from k3jax.checkpoint.host import aligned_empty

    files: dict[str, object] = {}
    try:
        t0 = time.perf_counter()
        if fresh:
            into = memoryview(aligned_empty((sum(n for _, _, n in regions),), "uint8"))
        else:
            into = memoryview(bytearray(RAW_BUFFER_BYTES))
        at = 0
        for name, index, _ in regions:
            file, runs = reader.runs(name, index)
            if file not in files:
                files[file] = open(os.path.join(reader.directory, file), "rb", buffering=0)
            f = files[file]
            for _, offset, size in runs:
                f.seek(offset)
                while size > 0:
                    if fresh:
                        got = f.readinto(into[at:at + size])
                        at += got
                    else:
                        got = f.readinto(into[:min(size, RAW_BUFFER_BYTES)])
                    if not got:
                        raise OSError(f"{file}: short read at byte {f.tell()}")
                    size -= got
        return time.perf_counter() - t0
    finally:
        for f in files.values():
            f.close()
