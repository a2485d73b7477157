"""``k3jax compile``: one layer compiled for H200 GPUs on this machine, without
a GPU (k3jax.tools.compile): the compiler's per-device bytes against the planner's,
the collective schedule, and with ``--backend pallas`` every Mosaic GPU
kernel's registers, spills, shared memory and grid. Never touches a GPU: the
process compiles with JAX_PLATFORMS=cpu for compile-only CUDA devices."""

from __future__ import annotations

import argparse
import sys

from k3jax.cli import replicas
from k3jax.cli.common import (
    UsageError,
    add_layer_flags,
    check_moe_only_flags,
    config_from_args,
    layer_parallel_from_args,
    layout_errors,
    layout_flags,
    non_negative_int,
    print_result,
    report_errors,
)

DEFAULT_TOKENS = 256
DEFAULT_LAYER = 1
MAX_DEVICES = 4096
"""The most compile-only GPUs a layer is compiled for (512 nodes of 8)."""


def add_parser(sub) -> None:
    p = sub.add_parser("compile", help="compile one layer for H200 GPUs (no GPU needed)",
                       description="Compile one layer's forward for dp x tp H200 GPUs on this "
                                   "machine (deviceless: compile-only CUDA devices, abstract "
                                   "weights, nothing allocated, no GPU touched) and report the "
                                   "compiler's per-device bytes, the collective schedule and, "
                                   "with --backend pallas, the Mosaic GPU kernels. Needs the "
                                   "gpu-compile extra.")
    add_layer_flags(p, default_tokens=DEFAULT_TOKENS,
                    tokens_help="global tokens of the forward")
    p.add_argument("--layer", type=non_negative_int, default=DEFAULT_LAYER,
                   help=f"layer index: 0 is the dense layer, 1 and up MoE (default {DEFAULT_LAYER})")
    p.add_argument("--backend", choices=("xla", "pallas", "triton"), default="xla",
                   help="xla (default), pallas (the Mosaic GPU kernels, compiled through ptxas) "
                        "or triton (only the layer's Triton kernels, compiled by Triton for "
                        "--compute-capability)")
    p.add_argument("--mxfp4-dequant", choices=("fast", "exact"), default="fast",
                   help="what the abstract MXFP4 experts' scale bytes are taken to allow (no "
                        "bytes are read): fast (every byte in 2..128, as in real checkpoints; "
                        "default: the fast kernels) or exact (the exact dequant kernels). A loaded "
                        "checkpoint decides it from its bytes")
    p.add_argument("--compute-capability", type=int, choices=(80, 89, 90, 100), default=None,
                   help="with --backend triton: the target GPU's compute capability (default 90)")
    p.add_argument("--grads", action="store_true",
                   help="compile the layer's training step instead: the forward and its VJP for "
                        "a cotangent of the output (what k3jax run --grads runs); fits_h200 then "
                        "means this layer's weights, gradients, activations and temporaries. "
                        "MXFP4 routed experts kept packed are frozen: only x gets their gradient "
                        "(--expert-dtype bfloat16 trains them)")
    p.set_defaults(main=main)


def main(args: argparse.Namespace, prog: str) -> int:
    # Compile-only CUDA devices come from the plugin while the process's
    # platform is the CPU: this never initializes (or touches) a GPU.
    import jax

    from pallas_kernels.backend import BackendName, parse_backend
    jax.config.update("jax_platforms", "cpu")
    if parse_backend(args.backend) is BackendName.TRITON:
        from k3jax.tools.compile_triton import print_report as print_triton
        return report_errors(lambda: print_result(_compile_triton(args), args.json, print_triton),
                             prog)
    return report_errors(lambda: print_result(_compile(args), args.json, print_report), prog)


def _compile_triton(args: argparse.Namespace):
    """The layer's Triton kernels compiled for --compute-capability (k3jax.tools.compile_triton)."""
    from k3jax.tools.compile_triton import TritonCompileReport, compile_layer_triton

    if args.grads:
        raise UsageError("--grads compiles through XLA: use it with --backend xla or pallas")
    cfg, parallel = _config_and_layout(args)
    capability = args.compute_capability or 90
    with layout_errors(parallel):
        kernels = compile_layer_triton(cfg, parallel, args.layer, tokens=args.tokens,
                                       dtype=args.dtype, expert_dtype=args.expert_dtype,
                                       capability=capability)
    return TritonCompileReport(layer=args.layer, tokens=args.tokens, parallel=parallel,
                               capability=capability, kernels=tuple(kernels))


def _compile(args: argparse.Namespace):
    if args.compute_capability is not None:
        raise UsageError("--compute-capability needs --backend triton")
    cfg, parallel = _config_and_layout(args)
    if cfg.is_moe_layer(args.layer) and args.expert_dtype not in ("mxfp4", args.dtype):
        raise UsageError(f"--expert-dtype {args.expert_dtype} needs --dtype {args.expert_dtype} "
                         f"(float experts compile in the layer's dtype), or --expert-dtype mxfp4")
    what = "cannot train" if args.grads else "does not fit"
    try:   # a missing gpu-compile extra: GpuCompileUnavailable, a RuntimeError (exit 1)
        with layout_errors(parallel, what=what):
            return _compile_one(args, cfg, parallel)
    except ValueError as e:
        if "smem" in str(e).lower() or "shared memory" in str(e).lower():
            raise UsageError(f"{layout_flags(parallel)} --tokens {args.tokens} --backend "
                             f"{args.backend}: a kernel does not fit the H200's shared memory: "
                             f"{str(e).splitlines()[0]}") from None
        raise


def _config_and_layout(args: argparse.Namespace):
    """(config, ParallelConfig) of the flags, checked before anything
    compiles: the layer in range, no MoE-only flag for the dense layer, at
    most H200.gpus_per_node GPUs a node and MAX_DEVICES in all."""
    from pallas_kernels.hardware import H200

    parallel = layer_parallel_from_args(args)
    per_node = parallel.num_devices // parallel.nodes
    if per_node > H200.gpus_per_node:
        raise UsageError(f"{layout_flags(parallel)}: {per_node} GPUs a node, and an H200 node "
                         f"holds {H200.gpus_per_node} (spread them with --nodes)")
    if parallel.num_devices > MAX_DEVICES:
        raise UsageError(f"{layout_flags(parallel)}: {parallel.num_devices:,} GPUs; k3jax compile "
                         f"targets at most {MAX_DEVICES:,}")
    cfg, _ = config_from_args(args)
    if args.layer >= cfg.num_hidden_layers:
        raise UsageError(f"--layer {args.layer}: the model has layers 0..{cfg.num_hidden_layers - 1}")
    check_moe_only_flags(args, cfg, [args.layer])
    return cfg, parallel


def _compile_one(args: argparse.Namespace, cfg, parallel):
    """The forward's CompileReport, or with --grads the training step's."""
    from pallas_kernels.mxfp4 import Mxfp4Dequant
    dequant = Mxfp4Dequant(args.mxfp4_dequant)
    placement = (replicas.placements_from_args(args, cfg, parallel, [args.layer]) or {}).get(
        args.layer)
    if args.grads:
        from k3jax.tools.compile_grads import compile_layer_grads
        return compile_layer_grads(cfg, parallel, args.layer, tokens=args.tokens,
                                   backend=args.backend, dtype=args.dtype,
                                   expert_dtype=args.expert_dtype, mxfp4_dequant=dequant,
                                   expert_placement=placement)
    from k3jax.tools.compile import compile_layer
    return compile_layer(cfg, parallel, args.layer, tokens=args.tokens, backend=args.backend,
                         dtype=args.dtype, expert_dtype=args.expert_dtype, mxfp4_dequant=dequant,
                         expert_placement=placement)


def print_report(report, file=None) -> None:
    """The human form: a summary and three rich tables."""
    from rich.console import Console
    from rich.table import Table

    from k3jax.tools.plan import format_gb

    d = report.to_dict()
    console = Console(file=file or sys.stdout, width=140)
    par = report.parallel
    console.print(f"[bold]k3jax compile[/bold]: layer {report.layer} ({d['kind']}), "
                  f"{report.tokens} tokens, backend {report.backend}, {par.describe()}, "
                  f"{par.num_devices} x {d['target']['device']} ({d['target']['compute_capability']}), "
                  f"compiled in {d['compile_seconds']:.1f} s", highlight=False)
    if d.get("mxfp4_dequant"):
        console.print(f"MXFP4 experts' dequant: {d['mxfp4_dequant']} (abstract weights: "
                      f"--mxfp4-dequant)", highlight=False)
    if par.sequence_parallel and par.shard_shared_expert:
        forms = d["layout"]["overlap_forms"]
        console.print(f"SP-sharded MLP form (--shared-overlap {par.shared_overlap.value}): shared "
                      f"expert {forms['shared_expert']} ({forms['shared_expert_scatter_dtype']} "
                      f"scatter), dense MLP {forms['dense_mlp']} "
                      f"({forms['dense_mlp_scatter_dtype']} scatter)", highlight=False)

    table = Table(title="Per-device bytes from the compiler")
    for column, justify in (("what", "left"), ("bytes", "right"), ("GB", "right")):
        table.add_column(column, justify=justify)
    for kind, nbytes in d["per_device_bytes"].items():
        table.add_row(kind, f"{nbytes:,}", format_gb(nbytes))
    table.add_row("planner weights (this layer)", f"{d['planner_weight_bytes']:,}",
                  format_gb(d["planner_weight_bytes"]))
    fit = d["fit"]
    table.add_row("all layers' weights (planner)", f"{fit['model_weight_bytes']:,}",
                  format_gb(fit["model_weight_bytes"]))
    grads = d.get("grads")
    needed = ("needed: this layer's weights, activations, outputs (gradients), temporaries"
              if grads else "needed: all weights + this layer's activations, outputs, temporaries")
    table.add_row(needed, f"{fit['needed_bytes']:,}", format_gb(fit["needed_bytes"]), style="bold")
    table.add_row("H200 device memory", f"{fit['device_memory_bytes']:,}",
                  format_gb(fit["device_memory_bytes"]))
    console.print(table)
    same = "==" if d["per_device_bytes"]["weights"] == d["planner_weight_bytes"] else "!="
    if grads:
        console.print(f"training step: weight gradients {format_gb(grads['gradient_bytes'])} of "
                      f"the outputs; frozen: {', '.join(grads['frozen']) or 'none'}"
                      + (f"; x-gradient of the frozen MXFP4 experts: {grads['x_gradient']}"
                         if grads["x_gradient"] else ""), highlight=False, markup=False)
    console.print(f"weights {same} planner; fits one H200: {d['fits_h200']}; "
                  f"XLA cost analysis: {d['flops']:.3e} FLOPs, {d['bytes_accessed']:.3e} bytes "
                  f"accessed", highlight=False)

    ctable = Table(title="Collectives in schedule order (compute between start and done)")
    for column, justify in (("#", "right"), ("kind", "left"), ("bytes / device", "right"),
                            ("group", "right"), ("axes", "left"), ("async", "left"),
                            ("ops", "right"), ("FLOPs", "right"), ("scope", "left")):
        ctable.add_column(column, justify=justify)
    for i, (c, axes) in enumerate(zip(report.collectives, report.axes_of_collectives()), 1):
        scope = "/".join(s for s in ("shared_expert", "routed_experts") if s in c.op_name.split("/"))
        where = "+".join(axes) + (" (across nodes)" if "node" in axes else "")
        ctable.add_row(str(i), c.kind + (f" x{c.parts}" if c.parts > 1 else ""), f"{c.bytes:,}",
                       str(c.group), where, str(c.is_async), str(c.compute_between),
                       f"{c.flops_between:.3e}", scope)
    if not report.collectives:
        ctable.add_row("", "none", "", "", "", "", "", "", "")
    console.print(ctable)

    if report.kernels:
        ktable = Table(title="Mosaic GPU kernels (ptxas, sm_90a)")
        for column, justify in (("kernel", "left"), ("registers", "right"), ("spill bytes", "right"),
                                ("SMEM bytes", "right"), ("grid", "left"),
                                ("dequant SASS / weight", "right")):
            ktable.add_column(column, justify=justify)
        for k in report.kernels:
            per_weight = report.dequant_sass_per_weight(k)
            ktable.add_row(k.name, str(k.registers), str(k.spill_bytes), f"{k.smem_bytes:,}",
                           "x".join(map(str, k.grid)), "" if per_weight is None else f"{per_weight}")
        console.print(ktable)
    if report.peer_kernels:
        ptable = Table(title=f"Peer, not part of the layer: {report.peer_kernels[0].peer}, "
                             f"compiled for our grouped launches' shapes (ptxas, sm_90a)")
        for column, justify in (("for our kernel", "left"), ("x [m, k] @ w [G, k, n]", "left"),
                                ("peer kernel", "left"), ("registers", "right"),
                                ("spill bytes", "right"), ("SMEM bytes", "right"),
                                ("grid", "left")):
            ptable.add_column(column, justify=justify)
        for p in report.peer_kernels:
            shape = (f"[{p.launch.m}, {p.launch.k}] @ [{p.launch.groups}, {p.launch.k}, "
                     f"{p.launch.n}] x{p.launch.num_weights} {p.launch.dtype}")
            if p.report is None:
                ptable.add_row(p.launch.kernel, shape, f"rejected: {p.error}", "", "", "", "")
                continue
            ptable.add_row(p.launch.kernel, shape, p.report.name, str(p.report.registers),
                           str(p.report.spill_bytes), f"{p.report.smem_bytes:,}",
                           "x".join(map(str, p.report.grid)))
        console.print(ptable)
