"""``k3jax latency``: the whole-layer latency model's prediction
(k3jax.tools.layer_latency) of one K3 MoE layer and the dense layer on one H200
node, for every shared-expert form and the ``auto`` pick, against the
replicated shared expert; with ``--nodes N``, the dispatch latency model's
(k3jax.tools.dispatch_latency) per-layer time of every way of moving the
routed rows under expert parallelism over N nodes, and the ``auto`` pick.
Model predictions, not measurements."""

from __future__ import annotations

import argparse
import json
import sys

from k3jax.cli.common import UsageError, positive_int, report_errors

DEFAULT_TOKENS = (8, 32, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
DEFAULT_LAYOUTS = ((4, 1), (8, 1), (4, 2))          # (tp, dp), SP + EP
TARGET_RATIO = 1.05
LABEL = "model prediction (k3jax.tools.layer_latency), not a measurement"
DISPATCH_LABEL = "model prediction (k3jax.tools.dispatch_latency), not a measurement"
GPUS_PER_NODE_DEFAULT_TP = 8        # --nodes alone: tp 8, dp = nodes (8 GPUs a node)
MAX_TOKENS = 1 << 20
"""The largest --tokens: the routed kernels' cost model holds per-row
arrays (about 1 GB and 10 s at 2^20 tokens; int32 row counts overflow
past 2^27)."""


def add_parser(sub) -> None:
    p = sub.add_parser("latency", help="the whole-layer latency model (a prediction)",
                       description="Predict, with the whole-layer latency model, one K3 MoE layer "
                                   "and the dense layer on one 8 x H200 node under sequence + "
                                   "expert parallelism, for each shared-expert form (replicated, "
                                   "none, ring, weights; float32 or bf16 scatter) and the auto "
                                   "pick. Model predictions, not measurements.")
    p.add_argument("--tp", type=int, nargs="+", default=None,
                   help="tensor-parallel sizes (default: the layouts tp 4, tp 8, dp 2 x tp 4)")
    p.add_argument("--dp", type=int, nargs="+", default=None,
                   help="data-parallel sizes (default 1, with dp 2 x tp 4 in the default set)")
    p.add_argument("--tokens", type=int, nargs="+", default=list(DEFAULT_TOKENS),
                   help="global token counts (default: %(default)s)")
    p.add_argument("--layer", choices=("moe", "dense"), nargs="+", default=None,
                   help="which layers (default: both; with --nodes the MoE layer only)")
    p.add_argument("--nodes", type=positive_int, default=None,
                   help="instead of the shared-expert forms, the dispatch latency model: how "
                        "routed rows reach their experts (gather, hierarchical, all-to-all) under "
                        "expert parallelism over dp x tp GPUs on this many nodes (--nodes must "
                        "divide --dp; default tp 8, dp = nodes: 8 GPUs a node)")
    p.add_argument("--routing-skew", type=_fraction, default=0.0, metavar="F",
                   help="with --nodes: the fraction of tokens whose 16 experts all sit on one node "
                        "(default 0: uniform routing, as the committed auto table assumes)")
    p.add_argument("--load", metavar="LOAD.json", default=None,
                   help="with --nodes: per-expert token counts written by k3jax run --expert-load; "
                        "the busiest device and node of that load set the layer's time (the "
                        "layer whose busiest device is busiest, or --load-layer's)")
    p.add_argument("--placement", metavar="PLACEMENT.json", default=None,
                   help="with --load: the expert placement (k3jax balance --output) the load "
                        "is spread over; default: the layout without redundant experts")
    p.add_argument("--load-layer", type=int, default=None, metavar="N",
                   help="with --load: the layer of the load file to take")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.set_defaults(main=main)


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a fraction in [0, 1], got {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a fraction in [0, 1], got {text!r}")
    return value


def layouts_from_args(args: argparse.Namespace) -> list[tuple[int, int]]:
    """(tp, dp) pairs: the default set, or --tp x --dp (dp 1 by default; with
    only --dp, the default tps whose dp x tp fits one node)."""
    if args.tp is None and args.dp is None:
        return list(DEFAULT_LAYOUTS)
    dps = args.dp or [1]
    if args.tp is not None:
        return [(tp, dp) for tp in args.tp for dp in dps]
    from pallas_kernels.hardware import H200
    tps = sorted({tp for tp, _ in DEFAULT_LAYOUTS})
    return [(tp, dp) for tp in tps for dp in dps if tp * dp <= H200.gpus_per_node] or \
        [(tps[0], dp) for dp in dps]


def main(args: argparse.Namespace, prog: str) -> int:
    return report_errors(lambda: _latency(args), prog)


def _latency(args: argparse.Namespace) -> int:
    bad = [t for t in args.tokens if not 1 <= t <= MAX_TOKENS]
    if bad:
        raise UsageError(f"--tokens {bad[0]}: the token count must be in 1..{MAX_TOKENS:,} (the "
                         f"model's memory grows with it: about 1 GB at the top)")
    for flag, values in (("--tp", args.tp), ("--dp", args.dp)):
        if values and (bad := [v for v in values if v < 1]):
            raise UsageError(f"{flag} {bad[0]}: expected a positive integer")
    if args.nodes is not None:
        return _dispatch(args)
    if args.routing_skew:
        raise UsageError(f"--routing-skew {args.routing_skew}: needs --nodes (the dispatch model)")
    for flag, value in (("--load", args.load), ("--placement", args.placement),
                        ("--load-layer", args.load_layer)):
        if value is not None:
            raise UsageError(f"{flag} {value}: needs --nodes (the dispatch model)")
    args.layer = args.layer or ["moe", "dense"]
    from k3jax.config import K3
    from k3jax.tools import layer_latency as ll

    layouts = layouts_from_args(args)
    for tp, dp in layouts:
        try:
            ll.check_layout(K3, tp, dp, min(args.tokens))
        except ValueError as e:
            raise UsageError(f"--tp {tp} --dp {dp}: {e}; the latency model covers K3 under "
                             f"sequence + expert parallelism with the shared expert sharded "
                             f"(the layout of k3jax plan --dp {dp} --tp {tp} --sequence-parallel "
                             f"--expert-parallel --shard-shared-expert), not plain tensor "
                             f"parallelism") from None
    result = run(K3, layouts, args.tokens, args.layer,
                 progress=None if args.json else lambda m: print(m, file=sys.stderr, flush=True))
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print_tables(result)
    return 0


def run(cfg, layouts, tokens, layers, progress=None) -> dict:
    """The --json object: hardware (figures and sources), one row per
    (layer, layout, tokens, form, scatter dtype), the auto pick per (layer,
    layout, tokens), the module model against vLLM, and notes."""
    from k3jax.tools import layer_latency as ll

    rows, auto, notes, details = [], [], [], {}
    for layer in layers:
        for tp, dp in layouts:
            if progress:
                progress(f"k3jax latency: {layer} layer, tp {tp} dp {dp}, {len(tokens)} token counts")
            for t in tokens:
                ests, pick = ll.sweep(cfg, tp, dp, t, layer=layer)
                for e in ests:
                    rows.append({"layer": layer, "tp": tp, "dp": dp, "tokens": t,
                                 "form": e.form.value, "scatter_dtype": e.scatter_dtype,
                                 "layer_s": e.layer_s})
                auto.append({"layer": layer, "tp": tp, "dp": dp, "tokens": t,
                             "pick": pick.form.value, "scatter_dtype": pick.scatter_dtype,
                             "layer_s": pick.layer_s, "replicated_s": pick.replicated_s,
                             "ratio": pick.ratio})
                details[(layer, tp, dp, t)] = {(e.form, e.scatter_dtype): e for e in ests}
    for a in auto:
        if a["ratio"] > TARGET_RATIO:
            notes.append(_miss_note(a, details, ll))
    moe_dp1 = [a for a in auto if a["layer"] == "moe" and a["dp"] == 1]
    if moe_dp1 and all(a["ratio"] <= TARGET_RATIO for a in moe_dp1):
        notes.append(f"MoE layer, dp 1: auto / replicated <= {TARGET_RATIO} at every token count "
                     f"(largest {max(a['ratio'] for a in moe_dp1):.3f}; model prediction)")
    validation = ll.vllm_validation(cfg)
    worst = max(v["error_pp"] for v in validation)
    notes.append(f"module model (shared expert alone, none, float32 scatter, nothing overlapped) "
                 f"against vLLM's published tp {ll.VLLM_TP} points: largest error {worst:.1f} "
                 f"percentage points (stated bound {ll.MODULE_ERROR_PP:.0f})")
    return {"label": LABEL, "hardware": ll.hardware(), "rows": rows, "auto": auto,
            "vllm_validation": validation, "notes": notes}


def _miss_note(a: dict, details: dict, ll) -> str:
    """Why no form reaches TARGET_RATIO here, with the arithmetic."""
    ests = details[(a["layer"], a["tp"], a["dp"], a["tokens"])]
    rep = a["replicated_s"]
    best = ests[(ll.Form(a["pick"]), a["scatter_dtype"])].schedule
    wire_us = best.wire_bytes / ll.NVLINK.bytes_per_s * 1e6
    return (f"{a['layer']} tp {a['tp']} dp {a['dp']} T {a['tokens']}: no form reaches "
            f"{TARGET_RATIO} x replicated ({rep * 1e6:.1f} us, so {TARGET_RATIO * rep * 1e6:.1f} us): "
            f"the fastest, {a['pick']}/{a['scatter_dtype'] or '-'}, computes {best.compute_s * 1e6:.1f} "
            f"us and moves {best.wire_bytes / 1e6:.1f} MB a device ({wire_us:.1f} "
            f"us at {ll.NVLINK.bytes_per_s / 1e9:.0f} GB/s), exposing {best.exposed_s * 1e6:.1f} us: "
            f"{a['layer_s'] * 1e6:.1f} us, {a['ratio']:.3f} x (model prediction)")


def _short(form: str, scatter: str | None) -> str:
    return form + {"float32": " f32", "bfloat16": " bf16", None: ""}[scatter]


def print_tables(result: dict, file=None) -> None:
    """One table per (layer, tp, dp): microseconds per form, the auto pick and its ratio."""
    from rich.console import Console
    from rich.table import Table

    console = Console(file=file or sys.stdout, width=160)
    console.print(f"[bold]k3jax latency[/bold]: {result['label']}", highlight=False)
    hw = result["hardware"]
    console.print(f"{hw['name']}: dense bf16 {hw['dense_bf16_flops_per_s'] / 1e12:.0f} TFLOP/s, HBM "
                  f"{hw['hbm_copy_bytes_per_s'] / 1e12:.1f} TB/s, NVLink bus "
                  f"{hw['nvlink_bus_bytes_per_s'] / 1e9:.0f} GB/s, {hw['collective_latency_s'] * 1e6:.0f} "
                  f"us a collective, {hw['collective_sms']} of {hw['num_sms']} SMs a collective "
                  "(sources: --json)", highlight=False)
    columns = [("replicated", None), ("none", "float32"), ("none", "bfloat16"), ("ring", "float32"),
               ("ring", "bfloat16"), ("weights", None)]
    keys = sorted({(r["layer"], r["tp"], r["dp"]) for r in result["rows"]},
                  key=lambda k: (k[0] != "moe", k[1], k[2]))
    for layer, tp, dp in keys:
        console.print(f"\n[bold]{layer} layer[/bold], SP + EP, tp {tp} dp {dp}: predicted us per "
                      "device (model prediction)", highlight=False)
        table = Table()
        for name in ["tokens"] + [_short(f, s) for f, s in columns] + ["auto", "auto / rep"]:
            table.add_column(name, justify="right")
        for a in (a for a in result["auto"] if (a["layer"], a["tp"], a["dp"]) == (layer, tp, dp)):
            cells = {(r["form"], r["scatter_dtype"]): r["layer_s"] for r in result["rows"]
                     if (r["layer"], r["tp"], r["dp"], r["tokens"]) == (layer, tp, dp, a["tokens"])}
            table.add_row(str(a["tokens"]), *[f"{cells[c] * 1e6:.1f}" for c in columns],
                          _short(a["pick"], a["scatter_dtype"]), f"{a['ratio']:.3f}")
        console.print(table)
    console.print("\n[bold]Shared expert alone[/bold], none (float32 scatter, nothing overlapped) vs "
                  "replicated, tp 4: model prediction against vLLM's published points",
                  highlight=False)
    vtable = Table()
    for name in ("tokens", "model %", "vLLM %", "error (pp)"):
        vtable.add_column(name, justify="right")
    for v in result["vllm_validation"]:
        published = (f"{v['vllm_low_pct']:+.0f}" if v["vllm_low_pct"] == v["vllm_high_pct"]
                     else f"{v['vllm_low_pct']:+.0f} .. {v['vllm_high_pct']:+.0f}")
        vtable.add_row(str(v["tokens"]), f"{v['predicted_pct']:+.1f}", published, f"{v['error_pp']:.1f}")
    console.print(vtable)
    for note in result["notes"]:
        console.print(f"note: {note}", highlight=False)


# -- the dispatch model (--nodes) --------------------------------------------
def dispatch_layouts(args: argparse.Namespace) -> list[tuple[int, int]]:
    """(tp, dp) pairs for --nodes: --tp x --dp, tp 8 and dp = nodes by
    default; UsageError naming the flag for a layout the model cannot take."""
    from k3jax.config import K3
    from k3jax.tools import dispatch_latency as dl

    nodes = args.nodes
    layouts = [(tp, dp) for tp in (args.tp or [GPUS_PER_NODE_DEFAULT_TP])
               for dp in (args.dp or [nodes])]
    for tp, dp in layouts:
        if dp % nodes:
            raise UsageError(f"--nodes {nodes} does not divide --dp {dp}: the tensor axis (--tp "
                             f"{tp}) stays inside a node, so each node must hold whole tensor groups")
        try:
            dl.check_layout(K3, dp * tp, nodes, min(args.tokens))
        except ValueError as e:
            raise UsageError(f"--dp {dp} x --tp {tp} over --nodes {nodes}: {e}") from None
    return layouts


def _dispatch(args: argparse.Namespace) -> int:
    if args.layer and "dense" in args.layer:
        raise UsageError("--layer dense: the dispatch model (--nodes) covers the MoE layer only")
    from k3jax.config import K3

    layouts = dispatch_layouts(args)
    balances = _balances(args, K3, layouts)
    result = run_dispatch(K3, args.nodes, layouts, args.tokens, args.routing_skew,
                          progress=None if args.json else
                          lambda m: print(m, file=sys.stderr, flush=True), balances=balances)
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print_dispatch_tables(result)
    return 0


def _balances(args: argparse.Namespace, cfg, layouts) -> dict[int, object] | None:
    """ep -> the Balance of --load (and --placement) over each layout's EP
    devices (k3jax.cli.balance.balance_for_latency), or None without --load.
    UsageError for --placement or --load-layer without --load."""
    if args.load is None:
        for flag, value in (("--placement", args.placement), ("--load-layer", args.load_layer)):
            if value is not None:
                raise UsageError(f"{flag} {value}: needs --load")
        return None
    from k3jax.cli.balance import balance_for_latency

    return {dp * tp: balance_for_latency(args.load, args.placement, args.load_layer,
                                         cfg.num_experts, dp * tp, args.nodes)
            for tp, dp in layouts}


def run_dispatch(cfg, nodes: int, layouts, tokens, skew: float = 0.0, progress=None,
                 balances: dict | None = None) -> dict:
    """The --json object of --nodes: hardware (figures and sources), the
    routing model, per layout the expected destinations of a token's
    experts, one row per (layout, tokens, form) with its per-layer time,
    dispatch + combine time and bytes on each link (each transfer listed),
    and per (layout, tokens) the model's fastest form and the committed
    table's pick (k3jax's auto). ``balances``: ep -> the measured Balance
    (the busiest device and node) the layout's time is charged at; None:
    balanced."""
    from k3jax.layout import ep_dispatch_choice
    from k3jax.tools import dispatch_latency as dl
    from k3jax.tools import ep_destinations as ed

    routing = ed.Routing(skew)
    out_layouts, rows, auto = [], [], []
    for tp, dp in layouts:
        ep = dp * tp
        if progress:
            progress(f"k3jax latency: EP {ep} over {nodes} node(s), {len(tokens)} token counts")
        dest = ed.expected(cfg.num_experts, cfg.num_experts_per_token, ep, nodes, routing)
        out_layouts.append({"tp": tp, "dp": dp, "ep": ep, "nodes": nodes,
                            "devices_per_node": ep // nodes, "destinations": dest.as_dict()})
        balance = balances[ep] if balances else dl.BALANCED
        out_layouts[-1]["balance"] = balance.name
        for t in tokens:
            ests, fastest = dl.sweep(cfg, ep, nodes, t, routing, balance)
            rows += [{"tp": tp, "dp": dp, **e.as_dict()} for e in ests.values()]
            auto.append({"tp": tp, "dp": dp, "ep": ep, "nodes": nodes, "tokens": t,
                         "fastest": fastest, "layer_s": ests[fastest].layer_s,
                         "pick": ep_dispatch_choice.pick(ep, nodes, t),
                         "tabulated": (ep, nodes) in ep_dispatch_choice.tabulated()})
    notes = [f"pick: k3jax's auto (k3jax.layout.ep_dispatch_choice, the committed table: uniform routing; "
             f"an (ep, nodes) it does not hold gets {ep_dispatch_choice.FALLBACK_MULTI_NODE} over "
             f"several nodes, {ep_dispatch_choice.FALLBACK_ONE_NODE} on one); fastest: this run's "
             f"model under {routing.name} routing"]
    differ = [a for a in auto if a["pick"] != a["fastest"]]
    if differ:
        notes.append(f"the pick differs from this run's fastest at {len(differ)} of {len(auto)} "
                     "points (a routing other than the table's, a layout the table does not hold, "
                     "or a token count inside a table range)")
    return {"label": DISPATCH_LABEL, "hardware": dl.hardware(),
            "routing": {"name": routing.name, "node_fraction": routing.node_fraction},
            "layouts": out_layouts, "rows": rows, "auto": auto, "notes": notes}


def print_dispatch_tables(result: dict, file=None) -> None:
    """Per layout: the predicted layer time per form with the fastest and the
    pick, then each form's dispatch + combine alone and its bytes per link."""
    from rich.console import Console
    from rich.table import Table

    console = Console(file=file or sys.stdout, width=160)
    console.print(f"[bold]k3jax latency --nodes[/bold]: {result['label']}", highlight=False)
    hw = result["hardware"]
    console.print(f"{hw['name']}: NVLink bus {hw['nvlink_bus_bytes_per_s'] / 1e9:.0f} GB/s, InfiniBand "
                  f"{hw['ib_bus_bytes_per_s'] / 1e9:.0f} GB/s a NIC ({hw['nics_per_node']} a node), ring "
                  f"latency {hw['ring_base_latency_s'] * 1e6:.1f} us + "
                  f"{hw['nvlink_step_latency_s'] * 1e6:.1f} us an NVLink step, "
                  f"{hw['ib_step_latency_s'] * 1e6:.1f} us an inter-node step (sources: --json)",
                  highlight=False)
    for lay in result["layouts"]:
        ep, nodes, d = lay["ep"], lay["nodes"], lay["destinations"]
        console.print(f"\n[bold]EP {ep}[/bold] (dp {lay['dp']} x tp {lay['tp']}) over {nodes} node(s), "
                      f"{lay['devices_per_node']} GPUs a node, {result['routing']['name']} routing: a "
                      f"token's experts reach {d['nodes']:.2f} nodes ({d['remote_nodes']:.2f} remote) "
                      f"and {d['devices']:.2f} devices (expected, routing model)", highlight=False)
        mine = [r for r in result["rows"] if (r["ep"], r["tp"]) == (ep, lay["tp"])]
        forms = list(dict.fromkeys(r["form"] for r in mine))
        table = Table()
        for name in ["tokens", "rows"] + forms + ["fastest", "pick (auto)"]:
            table.add_column(name, justify="right")
        bytes_table = Table()
        bytes_table.add_column("tokens", justify="right")
        for form in forms:
            bytes_table.add_column(form, justify="right")
        for a in (a for a in result["auto"] if (a["ep"], a["tp"]) == (ep, lay["tp"])):
            cells = {r["form"]: r for r in mine if r["tokens"] == a["tokens"]}
            rows = cells[forms[0]]["rows"]
            table.add_row(str(a["tokens"]), str(rows),
                          *[f"{cells[f]['layer_s'] * 1e6:.1f}" for f in forms], a["fastest"],
                          a["pick"] + ("" if a["tabulated"] else " (fallback)"))
            bytes_table.add_row(str(a["tokens"]), *[
                f"{cells[f]['dispatch_s'] * 1e6:.1f} us, {cells[f]['ib_bytes'] / 1e6:.2f} / "
                f"{cells[f]['nvlink_bytes'] / 1e6:.2f}" for f in forms])
        console.print("MoE layer, predicted us per device (model prediction)", highlight=False)
        console.print(table)
        console.print("dispatch + combine alone: us, then MB a device on InfiniBand / NVLink "
                      "(model prediction)", highlight=False)
        console.print(bytes_table)
    for note in result["notes"]:
        console.print(f"note: {note}", highlight=False)
