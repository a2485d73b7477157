"""``k3jax run``: one layer's forward from a checkpoint, on any layout."""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import numpy as np

from k3jax.cli.common import (BACKENDS, DTYPES, UsageError, add_device_flags, add_parallel_flags,
                              atomic_save_npy, parallel_from_args, pick_devices, positive_int,
                              request_devices)

DEFAULT_TOKENS = 7
DEFAULT_SEED = 0


def add_parser(sub) -> None:
    p = sub.add_parser("run", help="run one layer's forward on a mesh",
                       description="Run layer N of a checkpoint (or the tiny synthetic default) "
                                   "on [T, hidden] float32 input.")
    p.add_argument("--checkpoint", metavar="DIR",
                   help="checkpoint directory (default: a tiny synthetic K3-shaped checkpoint)")
    p.add_argument("--layer", type=int, default=None,
                   help="layer index (default 1, the first MoE layer)")
    p.add_argument("--input", metavar="X.npy", help="float32 [T, hidden] (default: random, T=7)")
    p.add_argument("--output", metavar="Y.npy", help="where to write float32 [T, hidden]")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                   help="parameter and activation dtype")
    p.add_argument("--repeat", type=positive_int, default=1,
                   help="run the forward R times and report the median time")
    p.add_argument("--mxfp4", choices=("packed", "dequantize"), default="packed",
                   help="MXFP4 routed experts: keep packed in device memory (0.53125 B/param, "
                        "dequantized in the forward) or dequantize to --dtype on load")
    p.add_argument("--backend", choices=BACKENDS, default="auto",
                   help="kernels: auto (Pallas on a Hopper GPU, else XLA), xla, pallas, interpret")
    add_device_flags(p)
    add_parallel_flags(p)
    p.set_defaults(main=main)


def main(args: argparse.Namespace, prog: str) -> int:
    try:
        return _run(args)
    except UsageError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except (ValueError, OSError, RuntimeError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 1


def _load_input(path: str | None, hidden: int) -> np.ndarray:
    if path is None:
        rng = np.random.default_rng(DEFAULT_SEED + 1)
        return rng.standard_normal((DEFAULT_TOKENS, hidden)).astype(np.float32)
    try:
        x = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read input {path}: {e}") from None
    if x.ndim != 2 or x.shape[1] != hidden or x.shape[0] < 1:
        raise ValueError(f"input {path} must be [T, {hidden}] with T >= 1, got {list(x.shape)}")
    if x.dtype != np.float32:
        raise ValueError(f"input {path} must be float32, got {x.dtype}")
    if not np.all(np.isfinite(x)):
        raise ValueError(f"input {path} contains NaN or inf")
    return x


def _run(args: argparse.Namespace) -> int:
    num_devices = args.devices or ((args.dp or 1) * args.tp)
    parallel = parallel_from_args(args, args.devices)
    if args.output and not os.path.isdir(os.path.dirname(os.path.abspath(args.output))):
        raise UsageError(f"--output directory does not exist: {os.path.dirname(args.output)}")
    request_devices(num_devices)

    import jax
    import jax.numpy as jnp
    from flax import nnx

    from k3jax.checkpoint import CheckpointReader, load_layer, make_synthetic_checkpoint
    from k3jax.config import TINY
    from k3jax.layout import make_mesh
    from k3jax.memory import format_bytes, param_shard_bytes

    with tempfile.TemporaryDirectory(prefix="k3jax-tiny-") as tmp:
        if args.checkpoint is None:
            path = os.path.join(tmp, "ckpt")
            make_synthetic_checkpoint(path, TINY, seed=DEFAULT_SEED, dtype="float32")
            print(f"no --checkpoint: using the tiny synthetic K3-shaped checkpoint (seed {DEFAULT_SEED})")
        else:
            path = args.checkpoint
        reader = CheckpointReader(path)
        cfg = reader.config
        layer = args.layer if args.layer is not None else min(1, cfg.num_hidden_layers - 1)
        x = _load_input(args.input, cfg.hidden_size)
        mesh = make_mesh(parallel, pick_devices(parallel.num_devices))
        module = load_layer(reader, layer, parallel, mesh, dtype=DTYPES[args.dtype],
                            backend=args.backend, mxfp4=args.mxfp4)

        graphdef, state = nnx.split(module)
        forward = jax.jit(lambda state, x: nnx.merge(graphdef, state)(x).astype(jnp.float32))
        x_dev = jnp.asarray(x)
        times = []
        y = None
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            y = jax.block_until_ready(forward(state, x_dev))
            times.append(time.perf_counter() - t0)

    y_host = np.asarray(jax.device_get(y), dtype=np.float32)
    if not np.all(np.isfinite(y_host)):
        raise RuntimeError("the forward produced NaN or inf; no output written")

    kind = "MoE" if cfg.is_moe_layer(layer) else "dense MLP"
    print(f"layer {layer} ({kind}), T={x.shape[0]}, hidden={cfg.hidden_size}, dtype={args.dtype}, "
          f"backend={args.backend}")
    print(f"mesh: {dict(mesh.shape)} on {len(mesh.devices.flat)} {mesh.devices.flat[0].platform} device(s)")
    print(_describe_layout(module, cfg.is_moe_layer(layer)))
    per_param = param_shard_bytes(module)
    for name, value in sorted(per_param.items()):
        spec = _spec_of(module, name)
        print(f"  {name:18s} {str(list(_shape_of(module, name))):18s} {str(spec):28s} "
              f"{format_bytes(value)}/device")
    print(f"parameter bytes per device: {sum(per_param.values())} ({format_bytes(sum(per_param.values()))})")
    if args.repeat > 1:
        print(f"forward: median {statistics.median(times) * 1e3:.3f} ms over {args.repeat} runs "
              f"(first, with compilation: {times[0] * 1e3:.1f} ms)")
    print(f"output: [{y_host.shape[0]}, {y_host.shape[1]}] float32, mean |y| = "
          f"{float(np.mean(np.abs(y_host))):.6f}")
    if args.output:
        atomic_save_npy(args.output, y_host)
        print(f"wrote {args.output}")
    return 0


def _param(module, name: str):
    obj = module
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj.get_value()


def _shape_of(module, name: str):
    return _param(module, name).shape


def _spec_of(module, name: str):
    return _param(module, name).sharding.spec


def _describe_layout(module, is_moe: bool) -> str:
    if is_moe:
        return module.layout.describe()
    layout = module.layout
    return f"dense MLP: {layout.mode.value} ({layout.reason})"
