"""``k3jax bench``: sweep global token counts for the shared expert under
sequence parallelism (replicated vs sharded) and the whole MoE layer."""

from __future__ import annotations

import argparse
import json
import sys

from k3jax.cli.common import (
    BACKENDS,
    MAX_TOKENS,
    UsageError,
    add_model_source_flags,
    check_backend,
    check_output,
    config_from_args,
    non_negative_float,
    non_negative_int,
    positive_int,
    report_errors,
    request_devices,
)
from k3jax.layout import DEFAULT_SHARED_OVERLAP, SharedOverlap
from pallas_kernels import interpret_compat

DEFAULT_CPU_DEVICES = 8
DEFAULT_CPU_SCALE = 16
CPU_MIN_HIDDEN = 448


def default_cpu_scale(hidden: int) -> int:
    """16 for K3 (hidden 7168 -> 448); smaller configs are scaled less, never
    below a hidden width of 448 (1 for the tiny presets)."""
    return min(DEFAULT_CPU_SCALE, max(1, hidden // CPU_MIN_HIDDEN))
DEFAULTS = {"cpu": {"repeats": 5, "warmup": 1}, "accelerator": {"repeats": 20, "warmup": 3}}


def token_list(text: str) -> list[int]:
    bad = argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise bad from None
    if not values or any(v < 1 for v in values):
        raise bad
    if max(values) > MAX_TOKENS:
        raise argparse.ArgumentTypeError(f"expected at most {MAX_TOKENS:,} tokens, got {max(values):,}")
    if sorted(set(values)) != values:
        raise argparse.ArgumentTypeError(f"token counts must be increasing and distinct, got {text!r}")
    return values


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="token sweep: replicated vs sharded shared expert",
                       description="Sweep global token counts for the shared expert under sequence "
                                   "parallelism (replicated vs sharded) and the whole MoE layer "
                                   "(SP + EP, either shared-expert layout). Runs on simulated CPU "
                                   "devices by default and on the accelerators when there are at "
                                   "least two.")
    add_model_source_flags(p)
    p.add_argument("--scale", type=positive_int,
                   help=f"divide hidden, intermediate and latent widths by S (kept divisible by the "
                        f"device count; default on the CPU: hidden / {CPU_MIN_HIDDEN} up to "
                        f"{DEFAULT_CPU_SCALE}, i.e. 16 for k3 and 1 for tiny; 1 on accelerators)")
    p.add_argument("--experts", type=positive_int,
                   help="routed experts (default: the config's; on the CPU at most 32)")
    p.add_argument("--top-k", type=positive_int,
                   help="experts per token (default: the config's; on the CPU at most 2)")
    p.add_argument("--tokens", type=token_list,
                   help="global token counts, comma-separated (default: docs/spec.md §6's sweep "
                        "8,32,128,256,512,1024,2048)")
    p.add_argument("--repeats", type=positive_int, help="timed samples per point "
                   "(median reported; default 5 on the CPU, 20 on accelerators)")
    p.add_argument("--warmup", type=non_negative_int, help="untimed calls first "
                   "(at least one always runs, to compile; default 1 on the CPU, 3 on accelerators)")
    p.add_argument("--min-sample-ms", type=non_negative_float, default=1.0,
                   help="each sample repeats the call until it lasts this long (default 1.0)")
    p.add_argument("--devices", type=positive_int,
                   help=f"devices (tensor-axis size); default: every accelerator when there are "
                        f">= 2, else {DEFAULT_CPU_DEVICES} simulated CPU devices")
    p.add_argument("--platform", choices=("auto", "cpu", "gpu", "tpu"), default="auto",
                   help="auto: accelerators when >= 2 are present, else the CPU")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                   help="parameters and activations (auto: float32 on the CPU, bfloat16 otherwise)")
    p.add_argument("--backend", choices=BACKENDS, default="auto", help="kernel backend")
    p.add_argument("--skip-moe-layer", action="store_true", help="only the shared-expert sweep")
    p.add_argument("--shared-overlap", choices=[o.value for o in SharedOverlap],
                   default=DEFAULT_SHARED_OVERLAP.value,
                   help="how the sharded shared expert meets its rows: 'auto' (the committed "
                        "table's pick per token count), 'ring' (overlapped collective matmul), "
                        "'none' (all-gather + reduce-scatter of the rows) or 'weights' "
                        "(all-gather the weight shards, replicated MLP on own rows) "
                        f"(default {DEFAULT_SHARED_OVERLAP.value})")
    p.add_argument("--seed", type=non_negative_int, default=0)
    p.add_argument("--json", metavar="OUT.json", help="write the results as JSON ('-': stdout, "
                                                      "the table then goes to stderr)")
    p.add_argument("--plot", metavar="OUT.png", help="latency vs tokens plot (PNG)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(main=main)


def main(args: argparse.Namespace, prog: str) -> int:
    return report_errors(lambda: _bench(args), prog)


def _check_output(path: str | None, flag: str, suffix: str) -> None:
    if path is None or path == "-" and flag == "--json":
        return
    if path == "-":
        raise UsageError(f"{flag} cannot write to stdout")
    if not path.lower().endswith(suffix):
        raise UsageError(f"{flag} {path}: expected a {suffix} file name")
    check_output(path, flag)


def _select_devices(args):
    """(devices, simulated): the accelerators, or simulated CPU devices."""
    import jax

    try:
        accelerators = [d for d in jax.devices() if d.platform != "cpu"]
    except RuntimeError:
        accelerators = []
    if args.platform in ("gpu", "tpu"):
        accelerators = [d for d in accelerators if d.platform == args.platform]
        want = args.devices or len(accelerators)
        if len(accelerators) < max(want, 2):
            raise UsageError(f"--platform {args.platform}: {len(accelerators)} device(s) found, "
                             f"the sweep needs {max(want, 2)}")
        return accelerators[:want], False
    if args.platform == "auto" and len(accelerators) >= max(args.devices or 2, 2):
        return accelerators[:args.devices or len(accelerators)], False
    if args.platform == "auto" and accelerators:
        print(f"note: {len(accelerators)} {accelerators[0].platform} device(s) cannot hold a "
              f"tensor axis of {args.devices or 2}+; using simulated CPU devices", file=sys.stderr)
    count = args.devices or DEFAULT_CPU_DEVICES
    try:
        cpus = jax.devices("cpu")
    except RuntimeError as e:
        raise UsageError(f"no CPU backend for simulated devices: {e}") from None
    if len(cpus) < count:
        raise UsageError(f"{count} CPU devices requested, {len(cpus)} available")
    return cpus[:count], True


def _bench(args: argparse.Namespace) -> int:
    from pallas_kernels.backend import BackendName, parse_backend
    _check_output(args.json, "--json", ".json")
    _check_output(args.plot, "--plot", ".png")
    if args.devices is not None and args.devices < 2:
        raise UsageError("--devices must be >= 2: sequence parallelism splits tokens over the tensor axis")
    base, source = config_from_args(args)

    request_devices(args.devices or DEFAULT_CPU_DEVICES)   # a no-op once JAX has started
    if parse_backend(args.backend) is BackendName.INTERPRET:
        interpret_compat.reserve_pool_threads(args.devices or DEFAULT_CPU_DEVICES)
    from k3jax.files import atomic_write
    from k3jax.tools.token_sweep import DEFAULT_TOKENS, default_experts, plot_result, run_bench, scale_config

    devices, simulated = _select_devices(args)
    n = len(devices)
    platform = devices[0].platform
    check_backend(args.backend, platform)
    kind = "cpu" if platform == "cpu" else "accelerator"
    scale = args.scale or (default_cpu_scale(base.hidden_size) if platform == "cpu" else 1)
    experts, top_k = default_experts(base, n, platform)
    experts, top_k = args.experts or experts, args.top_k or top_k
    if experts % n:
        raise UsageError(f"experts {experts} is not divisible by the {n} devices (EP); pass --experts")
    try:
        cfg = scale_config(base, scale, n, num_experts=experts, top_k=top_k)
    except ValueError as e:
        raise UsageError(str(e)) from None
    dtype = args.dtype if args.dtype != "auto" else ("float32" if platform == "cpu" else "bfloat16")
    repeats = args.repeats or DEFAULTS[kind]["repeats"]
    warmup = args.warmup if args.warmup is not None else DEFAULTS[kind]["warmup"]
    benchmarks = ("shared_expert",) if args.skip_moe_layer else ("shared_expert", "moe_layer")

    out = sys.stderr if args.json == "-" else sys.stdout
    print(f"k3jax bench: {source} scaled 1/{scale} (hidden {cfg.hidden_size}, shared intermediate "
          f"{cfg.shared_intermediate_size}, latent {cfg.routed_expert_hidden_size}, experts "
          f"{cfg.num_experts} top-{cfg.num_experts_per_token}), {n} {platform} device(s)"
          f"{' simulated' if simulated else ''}, {dtype}, {repeats} repeats after {warmup} warm-up",
          file=out)
    tokens = args.tokens or list(DEFAULT_TOKENS)
    total = len(benchmarks) * 2 * len(tokens)
    with _progress(total, args.no_progress) as advance:
        result = run_bench(cfg, devices, tokens=tokens, repeats=repeats, warmup=warmup,
                           dtype=dtype, backend=args.backend, benchmarks=benchmarks,
                           min_sample_ms=args.min_sample_ms, seed=args.seed, source=source,
                           scale=scale, simulated=simulated,
                           shared_overlap=SharedOverlap(args.shared_overlap), progress=advance)
    print_table(result, out)
    if args.json == "-":
        print(json.dumps(result.to_dict(), indent=2))
    elif args.json:
        text = json.dumps(result.to_dict(), indent=2) + "\n"
        atomic_write(args.json, lambda f: f.write(text), mode="w")
        print(f"wrote {args.json}", file=out)
    if args.plot:
        plot_result(result, args.plot)
        print(f"wrote {args.plot}", file=out)
    return 0


class _progress:
    """A tqdm bar on stderr; ``advance(label)`` moves it one step."""

    def __init__(self, total: int, disable: bool):
        self.total, self.disable = total, disable

    def __enter__(self):
        from tqdm import tqdm

        self.bar = tqdm(total=self.total, file=sys.stderr, disable=self.disable, unit="point",
                        dynamic_ncols=True)

        def advance(label: str) -> None:
            self.bar.set_postfix_str(label, refresh=False)
            self.bar.update(1)
        return advance

    def __exit__(self, *exc):
        self.bar.close()
        return False


def print_table(result, file) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(file=file, width=140)
    comps = result.comparisons
    table = Table(title="Median latency (ms) per global token count; ratio = sharded / replicated "
                        "(> 1: the sharded shared expert is slower)")
    table.add_column("tokens", justify="right")
    titles = {"shared_expert": "shared expert", "moe_layer": "MoE layer"}
    for name in comps:
        for col in ("replicated", "sharded", "form", "ratio"):
            table.add_column(f"{titles[name]} {col}", justify="right")
    for i, t in enumerate(result.tokens):
        row = [str(t)]
        for comp in comps.values():
            ratio = comp.ratio[i]
            row += [f"{comp.replicated.median_ms[i]:.3f}", f"{comp.sharded.median_ms[i]:.3f}",
                    comp.sharded.forms[i], f"[{'red' if ratio > 1 else 'green'}]{ratio:.2f}[/]"]
        table.add_row(*row)
    console.print(table)
    for name, comp in comps.items():
        cross = comp.crossover(result.tokens)
        text = (f"from T = {cross} on the sharded shared expert is slower" if cross is not None
                else "the sharded shared expert is not slower at the largest token count")
        console.print(f"crossover ({titles[name]}): {text}", highlight=False)
