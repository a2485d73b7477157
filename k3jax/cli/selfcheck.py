"""``k3jax selfcheck``: check every kernel configuration one layer launches
against the XLA path on this machine (pallas_kernels.selfcheck), and with
``--tune`` time the candidate tilings first (pallas_kernels.selfcheck.tune).

The layer is built on --devices devices with abstract weights and its
forward traced once: each launch asks the check at trace time, so the table
lists exactly the launches the layer makes, each with its verdict, its
error, the wall time of its check and whether the result came from the cache.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import sys

from k3jax.cli.common import (
    BACKENDS,
    UsageError,
    add_device_flags,
    add_layer_flags,
    check_backend,
    check_moe_only_flags,
    config_from_args,
    device_flags,
    layout_errors,
    non_negative_int,
    parallel_from_args,
    pick_devices,
    report_errors,
    request_devices,
    require_devices,
)
from k3jax.cli.machine import memory_problem
from pallas_kernels import interpret_compat

DEFAULT_TOKENS = 256
DEFAULT_LAYER = 1


def add_parser(sub) -> None:
    p = sub.add_parser("selfcheck", help="check this machine's kernels against XLA (cached)",
                       description="Trace one layer's forward and check every kernel "
                                   "configuration it launches against the XLA path on fresh "
                                   "random inputs; results are cached per machine "
                                   "(K3JAX_CACHE_DIR). A configuration that fails runs XLA.")
    add_flags(p)
    p.add_argument("--tune", action="store_true",
                   help="time the candidate tilings of each launch first (as k3jax tune), check "
                        "each, cache the fastest; later runs use it")
    p.set_defaults(main=main)


def add_flags(p: argparse.ArgumentParser) -> None:
    """The flags selfcheck and tune share: layer, layout, devices, backend, --strict."""
    add_layer_flags(p, default_tokens=DEFAULT_TOKENS, tokens_help="global tokens of the forward")
    add_device_flags(p)
    p.add_argument("--layer", type=non_negative_int, default=DEFAULT_LAYER,
                   help=f"layer index: 0 is the dense layer, 1 and up MoE (default {DEFAULT_LAYER})")
    p.add_argument("--backend", choices=BACKENDS, default="auto",
                   help="the kernels to check: auto (Pallas on Hopper, Triton on other CUDA GPUs "
                        "sm_80+), pallas, triton, interpret (CPU), xla (nothing to check)")
    p.add_argument("--strict", action="store_true",
                   help="exit 1 on the first configuration that fails its check "
                        "(as K3JAX_SELFCHECK=strict)")


def main(args: argparse.Namespace, prog: str) -> int:
    return report_errors(lambda: print_checks(args, layer_checks(args, tune=args.tune)), prog)


def check_backend_here(backend: str, platform: str) -> None:
    """A UsageError naming ``backend`` when this machine cannot run it."""
    import jax

    from pallas_kernels.backend import BackendName, cuda_capability, describe_devices, parse_backend

    check_backend(backend, platform)
    name = parse_backend(backend)
    if name is BackendName.TRITON and importlib.util.find_spec("jax_triton") is None:
        raise UsageError("--backend triton needs jax-triton and triton: pip install 'k3jax[triton]'")
    if name in (BackendName.PALLAS, BackendName.TRITON):
        capability = cuda_capability(describe_devices(jax.devices()[:1]))
        if name is BackendName.PALLAS and (capability is None or capability // 10 != 9):
            raise UsageError(f"--backend pallas needs a Hopper GPU (sm_90), and this one is "
                             f"sm_{capability}; use --backend triton or xla")
        if name is BackendName.TRITON and (capability is None or capability < 80):
            raise UsageError(f"--backend triton needs a CUDA GPU sm_80 or newer, and this one is "
                             f"sm_{capability}")


def layer_checks(args: argparse.Namespace, *, tune: bool):
    """The Records of the layer the flags describe (run_layer_checks)."""
    from pallas_kernels.backend import BackendName, parse_backend
    cfg, _ = config_from_args(args)
    parallel = parallel_from_args(args, args.devices)
    if args.pad_under_ep:
        try:
            parallel = dataclasses.replace(parallel, pad_under_ep=True)
        except ValueError as e:
            raise UsageError(str(e)) from None
    if args.layer >= cfg.num_hidden_layers:
        raise UsageError(f"--layer {args.layer}: the model has layers 0..{cfg.num_hidden_layers - 1}")
    check_moe_only_flags(args, cfg, [args.layer])
    if why := memory_problem(args.tokens * cfg.hidden_size * 4, f"--tokens {args.tokens}"):
        raise UsageError(why)
    request_devices(parallel.num_devices, device_flags(args))
    if parse_backend(args.backend) is BackendName.INTERPRET:
        interpret_compat.reserve_pool_threads(1)
    import jax

    check_backend_here(args.backend, jax.default_backend())
    require_devices(parallel.num_devices)

    with layout_errors(parallel):
        return run_layer_checks(cfg, parallel, args.layer, tokens=args.tokens,
                                backend=args.backend, dtype=args.dtype,
                                expert_dtype=args.expert_dtype, tune=tune, strict=args.strict)


def print_checks(args: argparse.Namespace, records) -> int:
    """Print the Records as JSON (--json) or a table; exit status 0."""
    from pallas_kernels.selfcheck.cache import cache_dir

    out = {"checks": [r.to_json() for r in records], "cache_dir": str(cache_dir())}
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        print_table(out, args.backend)
    return 0


def run_layer_checks(cfg, parallel, layer: int, *, tokens: int, backend: str, dtype: str,
                     expert_dtype: str, tune: bool = False, strict: bool = False):
    """Trace layer ``layer``'s forward for ``tokens`` global rows on this
    process's devices with abstract weights; return the selfcheck Records of
    every kernel configuration it launches (fresh: this process's earlier
    decisions and traces are forgotten first, the cache is not). The check
    runs even under K3JAX_SELFCHECK=0; ``strict`` (or K3JAX_SELFCHECK=strict)
    raises SelfCheckError at the first failure."""
    import jax
    from flax import nnx

    from k3jax.layout import make_mesh
    from k3jax.tools.compile import layer_on_mesh
    from pallas_kernels.selfcheck import gate

    built = layer_on_mesh(cfg, parallel, layer, make_mesh(parallel, pick_devices(parallel.num_devices)),
                          tokens=tokens, backend=backend, dtype=dtype, expert_dtype=expert_dtype)
    module, x_TD = built.module, built.x_TD
    graph, state = nnx.split(module)
    gate.reset()
    jax.clear_caches()   # a launch traced before (this process) would not ask the check again
    gate.force_mode("strict" if strict or gate.mode() == "strict" else "1")
    gate.force_tune(tune)
    try:
        jax.jit(lambda state, x_TD: nnx.merge(graph, state)(x_TD)).trace(state, x_TD)
    finally:
        gate.force_mode(None)
        gate.force_tune(None)
    return gate.records()


def print_table(out: dict, backend: str, file=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(file=file or sys.stdout, width=200)
    checks = out["checks"]
    if not checks:
        console.print(f"backend {backend}: the layer launches no kernel to check", highlight=False)
        return
    table = Table(title=f"Kernel self-check (cache {out['cache_dir']})")
    for column, justify in (("configuration", "left"), ("verdict", "left"), ("runs", "left"),
                            ("max rel err", "right"), ("seconds", "right"), ("cached", "left"),
                            ("tuned tiling", "left")):
        table.add_column(column, justify=justify)
    for c in checks:
        err = "-" if c["max_rel_err"] is None else f"{c['max_rel_err']:.2e}"
        verdict = c["verdict"] + (f" ({c['error']})" if c["error"] else "")
        table.add_row(c["config"], verdict, c["backend"], err, f"{c['seconds']:.2f}",
                      str(c["cached"]), c["tuned"] or "-")
    console.print(table)
