"""``k3jax plan``: per-device weight bytes and one MoE forward's collectives,
planned from the modules built abstractly (no devices, nothing allocated)."""

from __future__ import annotations

import argparse
import sys

from k3jax.cli import replicas
from k3jax.cli.common import (
    UsageError,
    add_layer_flags,
    config_from_args,
    layer_parallel_from_args,
    layout_errors,
    print_result,
    report_errors,
)

DEFAULT_TOKENS = 256


def add_parser(sub) -> None:
    p = sub.add_parser("plan", help="per-device memory and collectives of a layout",
                       description="Plan the per-device weight bytes (summed over all layers) and "
                                   "the collectives of one MoE-layer forward for a layout. Dtypes "
                                   "follow the published checkpoint by default: routed experts "
                                   "MXFP4 (0.53125 B/param), everything else BF16, router bias "
                                   "float32.")
    add_layer_flags(p, default_tokens=DEFAULT_TOKENS,
                    tokens_help="global tokens of the MoE forward whose collectives are sized")
    p.set_defaults(main=main)


def main(args: argparse.Namespace, prog: str) -> int:
    return report_errors(lambda: print_result(_plan(args), args.json, print_plan), prog)


def _plan(args: argparse.Namespace):
    from k3jax.tools.plan import make_plan

    cfg, source = config_from_args(args)
    parallel = layer_parallel_from_args(args)
    placements = replicas.placements_from_args(args, cfg, parallel, None)   # every layer of it
    try:
        with layout_errors(parallel):
            return make_plan(cfg, parallel, tokens=args.tokens, dtype=args.dtype,
                             expert_dtype=args.expert_dtype, source=source,
                             expert_placement=next(iter((placements or {}).values()), None))
    except ValueError as e:
        raise UsageError(str(e)) from None


def print_plan(plan, file=None) -> None:
    """The human form: a layout summary and two rich tables."""
    from rich.console import Console
    from rich.table import Table

    from k3jax.tools.plan import COMPONENTS, format_gb, format_gib

    console = Console(file=file or sys.stdout, width=140)
    lay, cfg = plan.layout, plan.cfg
    console.print(f"[bold]k3jax plan[/bold]: {plan.source}, {lay.parallel.describe()}, "
                  f"{lay.parallel.num_devices} device(s)")
    console.print(lay.describe(), highlight=False)

    dtype_of = {"dense_mlp": plan.dtype, "shared_experts": plan.dtype,
                "router": f"{plan.dtype} + float32 bias", "latent_projections": plan.dtype,
                "routed_experts": plan.expert_dtype + (" (0.53125 B/param)"
                                                       if plan.expert_dtype == "mxfp4" else "")}
    dtype_of["redundant_experts"] = dtype_of["routed_experts"]   # replicas of routed experts
    layers = {"dense_mlp": cfg.num_dense_layers}
    table = Table(title="Per-device weight bytes, summed over all layers")
    for column, justify in (("component", "left"), ("dtype", "left"), ("layers", "right"),
                            ("bytes / layer", "right"), ("bytes / device", "right"),
                            ("GB", "right"), ("GiB", "right")):
        table.add_column(column, justify=justify)
    per_layer = {c: plan.per_layer_bytes.get("dense" if c == "dense_mlp" else "moe", {}).get(c, 0)
                 for c in COMPONENTS}
    for c in COMPONENTS:
        b = plan.per_device_bytes[c]
        table.add_row(c, dtype_of[c], str(layers.get(c, cfg.num_moe_layers)), f"{per_layer[c]:,}",
                      f"{b:,}", format_gb(b), format_gib(b))
    total = plan.per_device_bytes["total"]
    table.add_row("total", "", str(cfg.num_hidden_layers), "", f"{total:,}", format_gb(total),
                  format_gib(total), style="bold")
    console.print(table)

    console.print(f"padded MoE intermediate: {cfg.moe_intermediate_size} -> "
                  f"{plan.padded_moe_intermediate_size} (min {cfg.min_moe_intermediate_per_partition} "
                  f"per partition, {lay.expert_shards} shard(s)"
                  + (", padding applied under EP: pre-fix behaviour" if lay.parallel.pad_under_ep else "")
                  + ")", highlight=False)
    cmp = plan.comparisons
    if "shared_experts_saved" in cmp:
        console.print(f"shared experts replicated would be {format_gib(cmp['shared_experts_if_replicated'])}"
                      f" GiB per device; sharding saves {format_gib(cmp['shared_experts_saved'])} GiB "
                      f"({cmp['shared_experts_saved']:,} B)", highlight=False)
    if "routed_experts_if_padded_under_ep" in cmp:
        console.print(f"routed experts with vLLM's pre-fix padding under EP (--pad-under-ep): "
                      f"{format_gb(cmp['routed_experts_if_padded_under_ep'])} GB; with the fix: "
                      f"{format_gb(plan.per_device_bytes['routed_experts'])} GB", highlight=False)
    if "routed_experts_with_fix" in cmp:
        console.print(f"routed experts with the fix (no padding under EP): "
                      f"{format_gb(cmp['routed_experts_with_fix'])} GB; pre-fix (this plan): "
                      f"{format_gb(plan.per_device_bytes['routed_experts'])} GB", highlight=False)

    ctable = Table(title=f"Collectives of one MoE-layer forward, {plan.tokens} global tokens "
                         f"(bytes = the full per-device buffer)")
    for column, justify in (("#", "right"), ("kind", "left"), ("axis", "left"), ("group", "right"),
                            ("what", "left"), ("shape", "left"), ("dtype", "left"),
                            ("bytes / device", "right")):
        ctable.add_column(column, justify=justify)
    for i, c in enumerate(plan.collectives, 1):
        axis = "+".join(c.axes) + (" (across nodes)" if c.crosses_nodes else "")
        ctable.add_row(str(i), c.kind, axis, str(c.group), c.what,
                       "x".join(map(str, c.shape)), c.dtype, f"{c.bytes:,}")
    if not plan.collectives:
        ctable.add_row("", "none", "", "", "every device holds what it needs", "", "", "0")
    console.print(ctable)
    if plan.dispatch_buffers:
        worst = " (ragged all-to-all: sized for the worst case, dropless)" \
            if plan.layout.ep_dispatch.value == "all-to-all" else ""
        console.print(f"routed rows' exchange buffers per device{worst}: "
                      + ", ".join(f"{k} {v:,} B" for k, v in plan.dispatch_buffers.items())
                      + f"; {sum(plan.dispatch_buffers.values()):,} B in all", highlight=False)
