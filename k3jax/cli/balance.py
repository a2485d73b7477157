"""``k3jax balance``: a placement of the routed experts with redundant
replicas, computed from measured load (k3jax.layout.expert_placement's
hierarchical balancer: experts onto nodes, then replicas onto each node's
devices), and what it does to the tokens each device and node computes.

    k3jax balance --load LOAD.json [--layer N] --redundant-experts R \\
                  --nodes N --devices D --output PLACEMENT.json
    k3jax balance --load LOAD.json --placement PLACEMENT.json --nodes N --devices D

LOAD.json is what ``k3jax run --expert-load`` writes (one object keyed by MoE
layer index). ``--devices`` is the EP size, every device of every node (dp x
tp); ``--nodes`` how many nodes they span. For each layer it prints max /
mean (token, expert) pairs per device and per node, before (the layout
without redundancy: device d holds experts [d E/D, (d + 1) E/D)) and after
(the new placement, or the one ``--placement`` names, each replica taking an
equal share of its expert's pairs). PLACEMENT.json is written whole or not at
all. Exit status: 2 for flags (E + R not divisible by D, R < 0, a layer the
load file lacks, an unwritable --output), 1 for bad files (a load of the wrong
length, a placement that drops an expert or does not fit the devices).
"""

from __future__ import annotations

import argparse
import json
import sys

from k3jax.cli.common import (
    UsageError,
    add_model_source_flags,
    check_output,
    config_from_args,
    non_negative_int,
    positive_int,
    report_errors,
)


def add_parser(sub) -> None:
    p = sub.add_parser("balance", help="place experts with redundant replicas from measured load",
                       description="Compute a placement of the routed experts with redundant "
                                   "replicas of the hot ones from a measured load (k3jax run "
                                   "--expert-load), balanced first over the nodes, then over each "
                                   "node's devices (as vLLM's EPLB), and print max / mean tokens "
                                   "per device and per node before and after.")
    p.add_argument("--load", required=True, metavar="LOAD.json",
                   help="the per-layer expert load k3jax run --expert-load wrote")
    p.add_argument("--layer", type=non_negative_int, default=None, metavar="N",
                   help="only this MoE layer of the load file (default: every layer in it)")
    p.add_argument("--redundant-experts", type=non_negative_int, default=None, metavar="R",
                   help="redundant expert slots beyond one per expert, over all devices: experts "
                        "+ R must be divisible by --devices (default 0)")
    p.add_argument("--nodes", type=positive_int, default=1, metavar="N",
                   help="nodes the EP devices span (default 1)")
    p.add_argument("--devices", type=positive_int, required=True, metavar="D",
                   help="the EP size: every device of every node (dp x tp)")
    p.add_argument("--groups", type=positive_int, default=None, metavar="G",
                   help="contiguous expert groups that stay whole on one node (default: every "
                        "expert its own group)")
    p.add_argument("--placement", metavar="PLACEMENT.json", default=None,
                   help="instead of computing one, evaluate this placement file against the load")
    p.add_argument("--output", metavar="PLACEMENT.json", default=None,
                   help="write the placement here (one placement per layer)")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    add_model_source_flags(p)
    p.set_defaults(main=main)


def main(args: argparse.Namespace, prog: str) -> int:
    return report_errors(lambda: _balance(args), prog)


def check_flags(args: argparse.Namespace, num_experts: int) -> int:
    """UsageError naming the flag for a layout the placement cannot take;
    returns R."""
    if args.placement is not None:
        for flag, given in (("--output", args.output), ("--redundant-experts",
                                                        args.redundant_experts),
                            ("--groups", args.groups)):
            if given is not None:
                raise UsageError(f"{flag}: not with --placement (the placement file fixes it)")
    R = args.redundant_experts or 0
    if args.devices % args.nodes:
        raise UsageError(f"--nodes {args.nodes} does not divide --devices {args.devices}")
    if (num_experts + R) % args.devices:
        raise UsageError(f"--redundant-experts {R}: {num_experts} experts + {R} = "
                         f"{num_experts + R} slots do not divide over --devices {args.devices}")
    if args.groups is not None and num_experts % args.groups:
        raise UsageError(f"--groups {args.groups} does not divide the {num_experts} experts")
    return R


def _balance(args: argparse.Namespace) -> int:
    from k3jax.layout import expert_placement as xp

    check_output(args.output, "--output")
    cfg, _ = config_from_args(args)
    E = cfg.num_experts
    R = check_flags(args, E)
    loads = xp.read_expert_load(args.load, E)
    if args.layer is not None:
        if args.layer not in loads:
            raise UsageError(f"--layer {args.layer}: {args.load} holds layers "
                             f"{_ranges(sorted(loads))}")
        loads = {args.layer: loads[args.layer]}
    if args.placement is not None:
        placements = xp.read_placements(args.placement)
        lacking = sorted(set(loads) - set(placements))
        if lacking:
            raise ValueError(f"{args.placement}: no placement for layer(s) {_ranges(lacking)} of "
                             f"{args.load}")
        for layer in loads:
            p = placements[layer]
            if (p.num_logical, p.ep, p.nodes) != (E, args.devices, args.nodes):
                raise ValueError(f"{args.placement}: layer {layer}'s placement is for "
                                 f"{p.num_logical} experts over {p.ep} devices on {p.nodes} "
                                 f"node(s), not {E} over --devices {args.devices} on --nodes "
                                 f"{args.nodes}")
        placements = {layer: placements[layer] for layer in loads}
    else:
        placements = {layer: xp.place_experts(load, R, args.nodes, args.devices, args.groups)
                      for layer, load in loads.items()}
    rows = report(loads, placements, args.nodes, args.devices)
    if args.output is not None:
        xp.write_placements(args.output, placements)
    if args.json:
        print(json.dumps({"load": args.load, "devices": args.devices, "nodes": args.nodes,
                          "redundant_experts": next(iter(placements.values())).redundant,
                          "output": args.output, "layers": rows}, indent=1))
    else:
        print_report(rows, args, next(iter(placements.values())).redundant)
    return 0


def report(loads: dict, placements: dict, nodes: int, devices: int) -> list[dict]:
    """Per layer: tokens per device and per node (max, mean, max / mean)
    before (the layout without redundancy; None where the experts do not
    split over the devices without it) and after (the placement)."""
    from k3jax.layout import expert_placement as xp

    rows = []
    for layer, load in loads.items():
        E = len(load)
        before = xp.uniform_placement(E, 0, devices, nodes) if E % devices == 0 else None
        row = {"layer": layer, "replicated_experts": int((placements[layer].replica_count > 1).sum()),
               "before": None}
        for name, p in (("before", before), ("after", placements[layer])):
            if p is None:           # E experts do not split over the devices without redundancy
                continue
            dev, node = xp.device_loads(p, load), xp.node_loads(p, load)
            row[name] = {"device_max": float(dev.max()), "device_mean": float(dev.mean()),
                         "device": xp.imbalance(dev), "node_max": float(node.max()),
                         "node_mean": float(node.mean()), "node": xp.imbalance(node)}
        rows.append(row)
    return rows


def print_report(rows: list[dict], args: argparse.Namespace, redundant: int, file=None) -> None:
    out = file or sys.stdout
    print(f"k3jax balance: {len(rows)} layer(s) of {args.load}, EP {args.devices} over "
          f"{args.nodes} node(s), {redundant} redundant slot(s); tokens = (token, expert) pairs, "
          f"each replica an equal share of its expert's", file=out)
    print(f"{'layer':>5}  {'device max / mean (before -> after)':>44}  "
          f"{'node max / mean (before -> after)':>42}  replicated", file=out)
    for r in rows:
        b, a = r["before"] or {}, r["after"]

        def cell(kind: str) -> str:
            was = (f"{b[kind + '_max']:>9.0f} / {b[kind + '_mean']:<7.0f} {b[kind]:5.3f}" if b
                   else f"{'n/a':>9} / {a[kind + '_mean']:<7.0f} {'':5}")
            return f"{was} -> {a[kind + '_max']:>9.0f} {a[kind]:5.3f}"
        print(f"{r['layer']:>5}  {cell('device')}  {cell('node')}  {r['replicated_experts']:>10}",
              file=out)
    if len(rows) > 1:
        worst = max(rows, key=lambda r: r["after"]["device"])
        was = f", was {worst['before']['device']:.3f}" if worst["before"] else ""
        print(f"worst layer after: {worst['layer']} ({worst['after']['device']:.3f} per "
              f"device{was})", file=out)
    if args.output:
        print(f"wrote {args.output}", file=out)


def balance_for_latency(load: str, placement: str | None, layer: int | None, num_experts: int,
                        ep: int, nodes: int):
    """The dispatch latency model's ``Balance`` (k3jax.tools.ep_destinations)
    for a load file and, optionally, a placement file: layer ``layer``'s, or
    the layer whose busiest device is busiest. Without a placement, the
    layout without redundancy. For ``k3jax latency --load LOAD.json
    [--placement PLACEMENT.json] [--layer N]``; ValueError (bad data) or
    UsageError (--layer) naming the culprit."""
    from k3jax.layout import expert_placement as xp
    from k3jax.tools.ep_destinations import Balance

    loads = xp.read_expert_load(load, num_experts)
    if layer is not None:
        if layer not in loads:
            raise UsageError(f"--layer {layer}: {load} holds layers {_ranges(sorted(loads))}")
        loads = {layer: loads[layer]}
    placements = xp.read_placements(placement) if placement else {}
    out = []
    for n, counts in loads.items():
        p = placements.get(n) if placement else xp.uniform_placement(num_experts, 0, ep, nodes)
        if p is None:
            raise ValueError(f"{placement}: no placement for layer {n} of {load}")
        if (p.ep, p.nodes) != (ep, nodes):
            raise ValueError(f"{placement}: layer {n}'s placement is for {p.ep} devices on "
                             f"{p.nodes} node(s), not {ep} on {nodes}")
        out.append(Balance.from_placement(p, counts, f"layer {n} of {load}"))
    return max(out, key=lambda b: (b.device, b.node))


def _ranges(layers: list[int]) -> str:
    """1, 2, 3, 7 -> '1..3, 7'."""
    out, start = [], None
    for i, n in enumerate(layers):
        if start is None:
            start = n
        if i + 1 == len(layers) or layers[i + 1] != n + 1:
            out.append(str(start) if start == n else f"{start}..{n}")
            start = None
    return ", ".join(out)


__all__ = ["add_parser", "balance_for_latency", "check_flags", "main", "print_report", "report"]
