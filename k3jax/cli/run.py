"""``k3jax run``: one layer's forward (or several layers' in sequence) from a checkpoint, on any layout."""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import numpy as np

from k3jax.cli import replicas
from k3jax.cli.common import (
    BACKENDS,
    DTYPES,
    UsageError,
    add_device_flags,
    add_parallel_flags,
    atomic_save_npy,
    check_backend,
    layout_errors,
    non_negative_int,
    parallel_from_args,
    pick_devices,
    positive_int,
    report_errors,
    request_devices,
    require_devices,
)
from k3jax.cli.run_setup import (
    DEFAULT_SEED,
    check_flags,
    check_layout,
    layer_range,
    open_run,
)
from k3jax.layout.parallel import NODE
from k3jax.runtime import agreement, startup, supervision
from pallas_kernels import interpret_compat


def add_parser(sub) -> None:
    p = sub.add_parser("run", help="run one layer's forward on a mesh",
                       description="Run layer N of a checkpoint (or the tiny synthetic default) "
                                   "on [T, hidden] float32 input.")
    p.add_argument("--checkpoint", metavar="DIR",
                   help="checkpoint directory (default: a tiny synthetic K3-shaped checkpoint)")
    p.add_argument("--layer", type=non_negative_int, default=None,
                   help="layer index (default 1, the first MoE layer)")
    p.add_argument("--layers", type=layer_range, metavar="A:B", default=None,
                   help="layers A..B-1 instead of --layer, loaded together (one progress bar) "
                        "and run in sequence, each layer's output the next one's input")
    p.add_argument("--input", metavar="X.npy", help="float32 [T, hidden] (default: random, T=7)")
    p.add_argument("--output", metavar="Y.npy", help="where to write float32 [T, hidden]")
    p.add_argument("--expert-load", metavar="OUT.json",
                   help="write each MoE layer's router statistics as one JSON object keyed by "
                        "layer index: tokens_per_expert, tokens_per_device (mesh device order), "
                        "tokens_per_node, mean_score_per_expert, imbalance {device, node} "
                        "(max / mean tokens)")
    p.add_argument("--cotangent", metavar="DY.npy",
                   help="float32 [T, hidden], the input's shape: the cotangent of the output for "
                        "--grads (needs --grads)")
    p.add_argument("--grads", metavar="OUT.safetensors",
                   help="write the gradients for --cotangent (the layer's VJP, in its layout): the "
                        "input's as 'input' and each trainable weight's under its checkpoint "
                        "tensor name, all float32. Not written (frozen): the router's "
                        "e_score_correction_bias (used for selection only: zero gradient) and "
                        "MXFP4 routed experts kept packed (--mxfp4 packed); with --mxfp4 "
                        "dequantize they get gradients like dense experts")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                   help="parameter and activation dtype")
    p.add_argument("--repeat", type=positive_int, metavar="R",
                   help="after the first forward (which compiles, and is not timed), run it R "
                        "more times and report their median time")
    p.add_argument("--mxfp4", choices=("packed", "dequantize"), default="packed",
                   help="MXFP4 routed experts: keep packed in device memory (0.53125 B/param, "
                        "dequantized in the forward) or dequantize to --dtype on load")
    p.add_argument("--backend", choices=BACKENDS, default="auto",
                   help="kernels: auto (Pallas on a Hopper GPU, Triton on other CUDA GPUs "
                        "sm_80+, else XLA), xla, pallas, interpret, triton")
    add_device_flags(p)
    add_parallel_flags(p)
    startup.add_distributed_flags(p)
    p.set_defaults(main=main)


def main(args: argparse.Namespace, prog: str) -> int:
    try:
        spec = _process_spec(args)
        if spec is not None:
            check_flags(args, spec)
    except UsageError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    if spec is not None:  # the work runs in a supervised child: see k3jax.runtime.supervision
        payload = {k: v for k, v in vars(args).items() if k != "main"}
        return supervision.supervise(f"{__name__}:worker_main", {**payload, "prog": prog}, spec, prog)
    return report_errors(lambda: _run(args), prog)


def worker_main(payload: dict) -> int:
    """One process of a multi-process run (the child that supervision.supervise starts)."""
    prog = payload["prog"]
    args = argparse.Namespace(**payload)
    args_spec = _process_spec(args)
    try:
        return _run(args, args_spec)
    except agreement.ProcessMismatchError as e:  # every process raises it: a normal exit
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 1
    except startup.DistributedError as e:        # joining failed: its own line
        print(f"{prog}: error: {e}", file=sys.stderr)
        supervision.abandon(1)
    except UsageError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        supervision.abandon(2)
    except (ValueError, OSError, RuntimeError) as e:
        print(f"{prog}: error: {supervision.explain_error(e, args_spec)}", file=sys.stderr)
        supervision.abandon(1)


def _process_spec(args: argparse.Namespace) -> startup.ProcessSpec | None:
    try:
        return startup.spec_from_args(args.coordinator_address, args.num_processes,
                                      args.process_id)
    except ValueError as e:
        raise UsageError(str(e)) from None


def _run(args: argparse.Namespace, spec: startup.ProcessSpec | None = None) -> int:
    from pallas_kernels.backend import BackendName, parse_backend
    local_devices = check_flags(args, spec)
    parallel = parallel_from_args(args, args.devices)
    leader = spec is None or spec.is_leader
    say = print if leader else (lambda *a, **k: None)

    from k3jax.checkpoint import make_synthetic_checkpoint
    from k3jax.config import TINY

    with tempfile.TemporaryDirectory(prefix="k3jax-tiny-") as tmp:
        if args.checkpoint is None:
            path = os.path.join(tmp, "ckpt")
            make_synthetic_checkpoint(path, TINY, seed=DEFAULT_SEED, dtype="float32")
            say(f"no --checkpoint: using the tiny synthetic K3-shaped checkpoint (seed {DEFAULT_SEED})")
        else:
            path = args.checkpoint
        if spec is None:   # every check that needs no device, before any device starts
            opened = open_run(args, path)
            check_layout(args, opened, parallel)
        request_devices(local_devices)
        if parse_backend(args.backend) is BackendName.INTERPRET:
            interpret_compat.reserve_pool_threads(local_devices)
        if spec is not None:
            startup.initialize(spec)

        import jax
        import jax.numpy as jnp
        from flax import nnx

        from k3jax.checkpoint import load_layers
        from k3jax.layout import make_mesh
        from k3jax.tools.memory import format_bytes, param_shard_bytes
        from k3jax.variables import WEIGHTS

        check_backend(args.backend, jax.default_backend())
        require_devices(parallel.num_devices)
        if spec is not None:
            opened = _agree(args, spec, parallel, path)
        reader, cfg, layer, layers, x, dy = opened
        placements = replicas.placements_from_args(args, cfg, parallel, layers)
        mesh = make_mesh(parallel, pick_devices(parallel.num_devices))
        with layout_errors(parallel, mxfp4_fix="--mxfp4 dequantize"):
            modules = load_layers(reader, layers, parallel, mesh, dtype=DTYPES[args.dtype],
                                  backend=args.backend, mxfp4=args.mxfp4, progress=True,
                                  expert_placements=placements)
        module = modules[0]

        graphdefs, state = zip(*(nnx.split(_stats_on(m, True)) for m in modules))
        for m in modules:    # the gradients' program (--grads) runs without statistics
            _stats_on(m, False)
        forward = jax.jit(lambda state, x: _in_sequence(graphdefs, state, x))
        x_dev = jnp.asarray(x) if spec is None else agreement.replicated(x, mesh)
        if spec is not None and parse_backend(args.backend) is not BackendName.XLA:
            _agree_kernel_backends(spec, forward, state, x_dev)
        t0 = time.perf_counter()
        y, loads = jax.block_until_ready(forward(state, x_dev))   # compiles: never timed
        first = time.perf_counter() - t0
        if spec is not None:
            print(f"{spec.tag} first forward done ({first * 1e3:.1f} ms, with compilation)",
                  flush=True)
        times = []
        for _ in range(args.repeat or 0):
            t0 = time.perf_counter()
            y, loads = jax.block_until_ready(forward(state, x_dev))
            times.append(time.perf_counter() - t0)
        grads = None if dy is None else _gradients(module, layer, x_dev, dy, mesh, spec,
                                                         reader.prefix)

    if spec is None:
        y_host = np.asarray(jax.device_get(y), dtype=np.float32)
    else:  # every process takes part in the gather; process 0 reports and writes
        y_host = agreement.gather(y).astype(np.float32)
    if not np.all(np.isfinite(y_host)):
        raise RuntimeError("the forward produced NaN or inf; no output written")
    from k3jax.modules.router_stats import expert_load_json

    expert_load = {str(i): expert_load_json(load) for i, load in zip(layers, loads)
                   if load is not None}
    if not leader:
        print(f"{spec.tag} done; process 0 writes the output", flush=True)
        return 0

    kinds = ", ".join("MoE" if cfg.is_moe_layer(i) else "dense MLP" for i in layers)
    what = f"layer {layer}" if len(layers) == 1 else f"layers {layers[0]}..{layers[-1]} in sequence"
    print(f"{what} ({kinds}), T={x.shape[0]}, hidden={cfg.hidden_size}, dtype={args.dtype}, "
          f"backend={args.backend}")
    print(f"mesh: {dict(mesh.shape)} on {len(mesh.devices.flat)} {mesh.devices.flat[0].platform} device(s)")
    if NODE in mesh.shape:
        print(_describe_nodes(mesh))
    total = 0
    for i, m in zip(layers, modules):
        if len(layers) > 1:
            print(f"layer {i}:")
        print(_describe_layout(m, cfg.is_moe_layer(i), x.shape[0]))
        per_param = param_shard_bytes(m)
        arrays = {".".join(map(str, path)): var.get_value()
                  for path, var in nnx.to_flat_state(nnx.state(m, WEIGHTS))}
        for name, value in sorted(per_param.items()):
            array = arrays[name]
            print(f"  {name:18s} {str(list(array.shape)):18s} {str(array.sharding.spec):28s} "
                  f"{format_bytes(value)}/device")
        total += sum(per_param.values())
    print(f"parameter bytes per device: {total} ({format_bytes(total)})")
    if times:
        print(f"forward: median {statistics.median(times) * 1e3:.3f} ms over {len(times)} timed "
              f"runs after the first, compiling one ({first * 1e3:.1f} ms)")
    print(f"output: [{y_host.shape[0]}, {y_host.shape[1]}] float32, mean |y| = "
          f"{float(np.mean(np.abs(y_host))):.6f}")
    for i, stats in expert_load.items():
        print(f"{'' if len(expert_load) == 1 else f'layer {i} '}device imbalance: "
              f"{stats['imbalance']['device']:.2f} (max / mean routed tokens per device, "
              f"{len(stats['tokens_per_device'])} devices; node: {stats['imbalance']['node']:.2f})")
    if args.output:
        atomic_save_npy(args.output, y_host)
        print(f"wrote {args.output}")
    if args.expert_load:
        _save_expert_load(args.expert_load, expert_load)
    if grads is not None:
        _save_gradients(args.grads, grads)
    return 0


def _in_sequence(graphdefs, states, x):
    """Each layer's output is the next one's input: (the last output as
    float32, [each layer's ExpertLoad, None for a dense layer])."""
    import jax.numpy as jnp
    from flax import nnx

    from k3jax.modules import KimiMoE
    from k3jax.modules.router_stats import RouterStats, expert_loads

    loads = []
    for graphdef, state in zip(graphdefs, states):
        module = nnx.merge(graphdef, state)
        if isinstance(module, KimiMoE) and module.router_stats:
            x, stats = nnx.capture(module, RouterStats)(x)
            loads.append(expert_loads(stats)[()])
        else:
            x = module(x)
            loads.append(None)
    return x.astype(jnp.float32), loads


def _stats_on(module, on: bool):
    """``module`` with its router statistics ``on`` (MoE layers; a dense one as it is)."""
    from k3jax.modules import KimiMoE

    if isinstance(module, KimiMoE):
        module.router_stats = on
    return module


def _save_expert_load(path: str, expert_load: dict) -> None:
    import json

    from k3jax.files import atomic_write

    atomic_write(path, lambda f: f.write(json.dumps(expert_load, indent=1) + "\n"), mode="w")
    print(f"wrote {path}: router statistics of {len(expert_load)} MoE layer(s)")


def _gradients(module, layer: int, x_dev, dy: np.ndarray, mesh,
               spec: startup.ProcessSpec | None, prefix: str) -> dict[str, np.ndarray] | None:
    """{"input": dx, checkpoint name: gradient} as float32 on the host, each
    name as the checkpoint spells it (``prefix``: its "language_model." or "").
    In a multi-process run every process takes part in the gathers; process 0
    gets the dict, the others None."""
    import jax
    import jax.numpy as jnp

    from k3jax.grads import checkpoint_tensors, layer_grads

    dy_dev = jnp.asarray(dy) if spec is None else agreement.replicated(dy, mesh)
    g = layer_grads(module, x_dev, dy_dev)

    def host(a) -> np.ndarray:
        a = a.astype(jnp.float32)
        return np.asarray(jax.device_get(a)) if spec is None else agreement.gather(a)

    dx = host(g.dx_TD)
    weights = {path: host(v) for path, v in sorted(g.weights.items())}
    if spec is not None and not spec.is_leader:
        return None
    named = checkpoint_tensors(module, layer, weights, replicas="sum")   # slots summed per expert
    out = {"input": dx, **{prefix + name: a for name, a in named.items()}}
    bad = [name for name, a in out.items() if not np.all(np.isfinite(a))]
    if bad:
        raise RuntimeError(f"the gradient of {bad[0]} holds NaN or inf; no gradients written")
    return out


def _save_gradients(path: str, grads: dict[str, np.ndarray]) -> None:
    from safetensors.numpy import save

    from k3jax.files import atomic_write

    atomic_write(path, lambda f: f.write(save(grads)))
    print(f"wrote {path}: {len(grads)} float32 gradients ('input' and {len(grads) - 1} weights)")


def _agree(args: argparse.Namespace, spec: startup.ProcessSpec, parallel, path: str):
    """Open the checkpoint and the input, then check that every process has
    the same run (flags, config, checkpoint files, input) before any device work."""
    import hashlib
    import json

    import jax

    print(f"{spec.tag} joined the run at {spec.coordinator}: {jax.local_device_count()} of "
          f"{jax.device_count()} {jax.default_backend()} devices here", flush=True)
    items, error, opened = None, None, None
    try:
        opened = open_run(args, path, warn=spec.is_leader)
        reader, cfg, layer, x = opened.reader, opened.cfg, opened.layer, opened.x
        config_json = json.dumps(cfg.to_hf_dict(), sort_keys=True).encode()
        items = {"jax version": jax.__version__, "devices": str(parallel.num_devices),
                 "layout": parallel.describe(),
                 "layer": str(layer) if args.layers is None else "%d:%d" % args.layers,
                 "dtype": args.dtype,
                 "backend": args.backend, "MXFP4 handling": args.mxfp4,
                 "repeat": str(args.repeat),
                 "config": "sha256:" + hashlib.sha256(config_json).hexdigest()[:16],
                 "checkpoint files": reader.fingerprint(),
                 "input": agreement.fingerprint_array(x),
                 "cotangent": "-" if opened.dy is None else agreement.fingerprint_array(opened.dy)}
    except (UsageError, ValueError, OSError) as e:
        error = str(e)
    agreement.check_agreement(spec, items, error)
    return opened


def _agree_kernel_backends(spec: startup.ProcessSpec, forward, state, x_dev) -> None:
    """Trace ``forward`` (each kernel launch checks itself on this process's
    devices: pallas_kernels.selfcheck), then make every process run the
    backend all of them agree on per configuration (agreement.agree_backends)."""
    import jax

    from pallas_kernels.selfcheck import gate

    forward.trace(state, x_dev)
    mine = {r.config.name: r.backend for r in gate.records()}
    agreed = agreement.agree_backends(spec, mine)
    gate.agree(agreed)
    changed = sorted(name for name, backend in agreed.items() if mine.get(name) != backend)
    for name in changed:
        gate.note(f"{spec.tag} k3jax selfcheck: {name} runs {agreed[name]} on every process "
                  f"(its check failed on another)")
    if changed:   # retrace with the agreed backends
        jax.clear_caches()


def _describe_nodes(mesh) -> str:
    """One line: which processes and devices form each node (index n of NODE)."""
    parts = []
    for n in range(mesh.shape[NODE]):
        devices = mesh.devices[n].ravel()
        procs = sorted({d.process_index for d in devices})
        span = f"{procs[0]}" if len(procs) == 1 else f"{procs[0]}-{procs[-1]}"
        parts.append(f"node {n}: process{'es' if len(procs) > 1 else ''} {span}, "
                     f"devices {[d.id for d in devices]}")
    return "nodes: " + "; ".join(parts)


def _describe_layout(module, is_moe: bool, tokens: int) -> str:
    """The module's layout with the shared-overlap form picked for ``tokens``."""
    if is_moe:
        return module.layout.for_tokens(tokens).describe()
    layout = module.layout.for_tokens(tokens, module.dtype)
    return f"dense MLP: {layout.mode.value} ({layout.reason})"
