"""Flags and set-up shared by the sub-commands: devices, the parallel layout,
dtypes and the kernel backend."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp

from k3jax.cli import replicas
from k3jax.cli.machine import device_count_problem
from k3jax.config import MATH_KEYS, PRESETS, TENSOR_KEYS, K3Config, preset, read_hf_config
from k3jax.files import atomic_write, check_writable
from k3jax.layout import (
    DEFAULT_SHARED_OVERLAP,
    EpDispatch,
    EpDispatchError,
    LayoutError,
    Mxfp4ShardError,
    ParallelConfig,
    SharedOverlap,
)
from k3jax.layout.parallel import SCATTER_DTYPES, SHARD_SHARED_EXPERT_ENV
from pallas_kernels import interpret_compat

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
BACKENDS = ("auto", "xla", "pallas", "interpret", "triton")


MAX_MESH_DEVICES = 1 << 20
"""The largest mesh a layout flag may ask for (XLA counts devices in int32;
planning a mesh of 2^20 devices takes seconds)."""
MAX_TOKENS = 1 << 20
"""The largest --tokens of a planned, compiled or checked layer (the
activations of 2^20 K3 tokens alone are 15 GB in bfloat16)."""


class UsageError(Exception):
    """A bad combination of flags: reported on one line, exit code 2."""


def _int_at_least(text: str, minimum: int, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"expected {what}, got {value}")
    return value


def positive_int(text: str) -> int:
    return _int_at_least(text, 1, "a positive integer")


def token_count(text: str) -> int:
    """--tokens: 1..MAX_TOKENS."""
    value = _int_at_least(text, 1, "a positive integer")
    if value > MAX_TOKENS:
        raise argparse.ArgumentTypeError(f"expected at most {MAX_TOKENS:,} tokens, got {value:,}")
    return value


def non_negative_int(text: str) -> int:
    return _int_at_least(text, 0, "an integer >= 0")


def non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}")
    return value


def check_output(path: str | None, flag: str) -> None:
    """Before any work: a UsageError naming ``flag`` unless ``path`` can be written."""
    if path is not None and (why := check_writable(path)):
        raise UsageError(f"{flag} {path}: {why}")


def check_backend(backend: str, platform: str) -> None:
    """--backend pallas / triton need the work to run on GPUs (Mosaic GPU /
    Triton kernels);
    ``platform``: that of the devices the work runs on."""
    from pallas_kernels.backend import BackendName, parse_backend

    name = parse_backend(backend)
    if name is BackendName.PALLAS and platform != "gpu":
        raise UsageError(f"--backend pallas needs a Hopper GPU, and the devices here are "
                         f"{platform}; use --backend interpret (or xla) instead")
    if name is BackendName.TRITON and platform != "gpu":
        raise UsageError(f"--backend triton needs a CUDA GPU (sm_80 or newer), and the devices "
                         f"here are {platform}; use --backend xla instead")


def report_errors(work: Callable[[], int], prog: str) -> int:
    """Run a sub-command's ``work``; a UsageError exits 2, a runtime error
    (ValueError, OSError, RuntimeError, MemoryError) exits 1, each with one
    line on stderr (a stalled or under-threaded interpret-mode kernel: its
    own message)."""
    try:
        return work()
    except UsageError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except MemoryError as e:
        print(f"{prog}: error: out of memory{f': {e}' if str(e) else ''}", file=sys.stderr)
        return 1
    except (ValueError, OSError, RuntimeError) as e:
        print(f"{prog}: error: {interpret_compat.take_error_line() or one_line(e)}",
              file=sys.stderr)
        return 1


def one_line(error: BaseException) -> str:
    """An error's message on one line (its first, or its type's name)."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def warn(prog: str, text: str) -> None:
    """One warning line on stderr."""
    print(f"{prog}: warning: {text}", file=sys.stderr, flush=True)


def warn_config_defaults(prog: str, where: str, defaults: dict, keys) -> None:
    """The one warning line naming the absent config keys of ``keys`` and
    the defaults used for them; nothing when none is absent."""
    from k3jax.config import describe_defaults

    absent = [k for k in keys if k in defaults]
    if absent:
        warn(prog, f"{where} has {describe_defaults(absent, defaults)}")


def print_result(result: Any, as_json: bool, print_human: Callable[[Any], None]) -> int:
    """Print a report (anything with ``to_json()``) as JSON or in its human
    form ``print_human(result)``; exit status 0."""
    if as_json:
        print(result.to_json())
    else:
        print_human(result)
    return 0


@contextlib.contextmanager
def layout_errors(parallel: ParallelConfig, *, what: str = "does not fit",
                  mxfp4_fix: str = "--expert-dtype bfloat16") -> Iterator[None]:
    """Turn a layout the model cannot take into a UsageError naming the flags:
    Mxfp4ShardError (packed MXFP4 experts not shardable) with ``mxfp4_fix``,
    any other LayoutError as "<layout flags> <what> this model: ..."."""
    try:
        yield
    except Mxfp4ShardError as e:
        raise UsageError(f"{e} ({mxfp4_fix})") from None
    except EpDispatchError as e:
        raise UsageError(str(e)) from None
    except LayoutError as e:
        raise UsageError(f"{layout_flags(parallel)} {what} this model: {e}") from None


def config_from_args(args: argparse.Namespace) -> tuple[K3Config, str]:
    """``--config F`` or ``--preset NAME`` (default k3) -> (config, where it
    came from). A config file that cannot be read or holds bad values raises
    ValueError / OSError (bad data, exit 1); one warning line names the keys
    it lacks that set shapes or the math, and the defaults used."""
    if args.config:
        path = args.config
        if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
            raise ValueError(f"--config {path}: a directory without a config.json")
        cfg, defaults = read_hf_config(path)
        warn_config_defaults(getattr(args, "prog", "k3jax"), f"--config {path}", defaults,
                             (*TENSOR_KEYS, *MATH_KEYS))
        return cfg, f"config {path}"
    name = args.preset or "k3"
    try:
        return preset(name), f"preset {name}"
    except ValueError as e:
        raise UsageError(str(e)) from None


def add_model_source_flags(p: argparse.ArgumentParser) -> None:
    """--config CONFIG.json | --preset NAME (read back by ``config_from_args``)."""
    src = p.add_mutually_exclusive_group()
    src.add_argument("--config", metavar="CONFIG.json",
                     help="an HF config.json (flat or text_config-nested), or a checkpoint directory")
    src.add_argument("--preset", choices=sorted(PRESETS), help="a built-in config (default k3)")


def add_layer_flags(p: argparse.ArgumentParser, *, default_tokens: int, tokens_help: str) -> None:
    """The flags of one planned or compiled layer: the model source
    (add_model_source_flags), the layout (add_parallel_flags), then what sizes
    it: --pad-under-ep, --tokens, --dtype, --expert-dtype, and --json for the output."""
    add_model_source_flags(p)
    add_parallel_flags(p)
    p.add_argument("--pad-under-ep", action="store_true",
                   help="reproduce vLLM's pre-fix behaviour: pad the MoE intermediate under EP")
    p.add_argument("--tokens", type=token_count, default=default_tokens,
                   help=f"{tokens_help} (1..{MAX_TOKENS}; default {default_tokens})")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                   help="dtype of every weight but the MXFP4 routed experts and the router bias, "
                        "and of the activations (default bfloat16)")
    p.add_argument("--expert-dtype", choices=("mxfp4", "bfloat16", "float32"), default="mxfp4",
                   help="storage of the routed experts (default mxfp4, 0.53125 B/param)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")


def add_parallel_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("layout")
    g.add_argument("--dp", type=positive_int, help="data-axis size (default: devices / tp)")
    g.add_argument("--tp", type=positive_int, default=1, help="tensor-axis size (default 1)")
    g.add_argument("--sequence-parallel", action="store_true",
                   help="split token rows over the tensor axis inside the MoE block")
    g.add_argument("--expert-parallel", action="store_true",
                   help="whole experts over dp x tp devices (no intermediate padding)")
    g.add_argument("--nodes", type=positive_int, default=1,
                   help="nodes the dp x tp devices span (a node axis outside data and tensor; "
                        "must divide --dp: the tensor axis stays inside a node; with several "
                        "processes, each node holds processes / nodes of them) (default 1)")
    g.add_argument("--ep-dispatch", choices=[f.value for f in EpDispatch],
                   default=EpDispatch.AUTO.value,
                   help="under --expert-parallel, how token rows reach their experts: "
                        "'gather' (one all-gather over every device, one reduce-scatter back), "
                        "'hierarchical' (the same in two stages, across nodes then inside; "
                        "needs --nodes > 1), 'all-to-all' (dropless ragged all-to-all to the "
                        "nodes, then devices, holding each row's experts; needs "
                        "--sequence-parallel or tp 1) or 'auto' (per token count, the dispatch "
                        "latency model's committed pick; docs/latency.md) (default auto)")
    g.add_argument("--shard-shared-expert", action="store_true", default=None,
                   help="opt in to TP-sharding the shared expert / dense MLP under sequence "
                        "parallelism (default: K3JAX_SHARD_SP_SHARED_EXPERT, else off)")
    g.add_argument("--shared-overlap", choices=[o.value for o in SharedOverlap],
                   default=DEFAULT_SHARED_OVERLAP.value,
                   help="how an SP-sharded shared expert / dense MLP meets its rows: 'auto' "
                        "(per token count, the whole-layer latency model's pick among the next "
                        "three, from a committed table; docs/latency.md), 'ring' (collective "
                        "matmul: tp - 1 ppermutes each way, each block's matmul overlapping the "
                        "next transfer), 'none' (one all-gather + one reduce-scatter of the "
                        "rows) or 'weights' (all-gather the weight shards, run the replicated "
                        "MLP on own rows; needs --sequence-parallel and --shard-shared-expert) "
                        f"(default {DEFAULT_SHARED_OVERLAP.value})")
    g.add_argument("--shared-scatter-dtype", choices=SCATTER_DTYPES, default=None,
                   help="dtype the 'none' and 'ring' forms reduce-scatter their partial sums in "
                        "(bfloat16: half the bytes, bf16 rounding) (default: float32, or under "
                        "'auto' the table's pick)")
    g.add_argument("--redundant-experts", type=non_negative_int, default=None, metavar="R",
                   help=replicas.help_lines()["--redundant-experts"])
    g.add_argument("--expert-placement", metavar="PLACEMENT.json",
                   help=replicas.help_lines()["--expert-placement"])


def add_device_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--devices", type=positive_int,
                   help="devices to use; simulated CPU devices on a CPU-only host "
                        "(default: dp * tp)")


def moe_only_flags(args: argparse.Namespace) -> list[str]:
    """The given flags that only MoE layers read (the routed experts'
    placement and how packed MXFP4 experts are held), each as given.
    (``--expert-dtype`` is not one: the layout of a whole model with packed
    MXFP4 experts is checked whichever layer is compiled.)"""
    flags = ["--expert-parallel"] * bool(getattr(args, "expert_parallel", False))
    flags += ["--pad-under-ep"] * bool(getattr(args, "pad_under_ep", False))
    if getattr(args, "expert_load", None):
        flags.append(f"--expert-load {args.expert_load}")
    for name, default in (("ep_dispatch", EpDispatch.AUTO.value), ("mxfp4", "packed"),
                          ("mxfp4_dequant", "fast")):
        value = getattr(args, name, default)
        if value != default:
            flags.append(f"--{name.replace('_', '-')} {value}")
    return flags


def check_moe_only_flags(args: argparse.Namespace, cfg: K3Config, layers: list[int]) -> None:
    """A UsageError naming the MoE-only flags given for dense ``layers``
    only: they would change nothing."""
    flags = moe_only_flags(args)
    if not flags or any(cfg.is_moe_layer(i) for i in layers):
        return
    which = f"layer {layers[0]} is" if len(layers) == 1 else f"layers {layers[0]}..{layers[-1]} are"
    moe = [i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)]
    hint = f" (MoE layers: {moe[0]}..{moe[-1]})" if moe else ""
    raise UsageError(f"{' '.join(flags)}: {which} the dense MLP, with no routed experts; "
                     f"{'this flag applies' if len(flags) == 1 else 'these flags apply'} to MoE "
                     f"layers only{hint}")


def layout_flags(parallel: ParallelConfig) -> str:
    """The layout flags that give ``parallel``, for error messages."""
    flags = [f"--dp {parallel.dp}", f"--tp {parallel.tp}"]
    flags += [f"--nodes {parallel.nodes}"] * (parallel.nodes > 1)
    flags += ["--sequence-parallel"] * parallel.sequence_parallel
    flags += ["--expert-parallel"] * parallel.expert_parallel
    return " ".join(flags)


def parallel_from_args(args: argparse.Namespace, num_devices: int | None) -> ParallelConfig:
    """The ParallelConfig of the layout flags (``num_devices``: --devices,
    or None); a UsageError naming the flags for an inconsistent set or a
    mesh of more than MAX_MESH_DEVICES."""
    tp = args.tp
    for flag, value in (("--tp", tp), ("--dp", args.dp), ("--nodes", args.nodes)):
        if value is not None and value > MAX_MESH_DEVICES:
            raise UsageError(f"{flag} {value}: a mesh holds at most {MAX_MESH_DEVICES:,} devices")
    if args.dp is not None:
        dp = args.dp
    elif num_devices is not None:
        if num_devices % tp:
            raise UsageError(f"--devices {num_devices} is not divisible by --tp {tp}")
        dp = num_devices // tp
    else:
        dp = 1
    if dp * tp > MAX_MESH_DEVICES:
        raise UsageError(f"--dp {dp} x --tp {tp} = {dp * tp:,} devices: a mesh holds at most "
                         f"{MAX_MESH_DEVICES:,} devices")
    if num_devices is not None and dp * tp != num_devices:
        raise UsageError(f"--dp {dp} x --tp {tp} = {dp * tp} does not match --devices {num_devices}")
    nodes = args.nodes
    if (dp * tp) % nodes:
        raise UsageError(f"--nodes {nodes} does not divide the {dp * tp} devices (--dp {dp} x "
                         f"--tp {tp})")
    if dp % nodes:
        raise UsageError(f"--nodes {nodes} does not divide --dp {dp}: the tensor axis (--tp "
                         f"{tp}) stays inside a node, so each node must hold whole tensor groups")
    redundant = replicas.redundant_from_args(args)   # a bad --expert-placement file: exit 1
    try:
        parallel = ParallelConfig(dp=dp, tp=tp, nodes=nodes, ep_dispatch=EpDispatch(args.ep_dispatch),
                                  redundant_experts=redundant,
                                  sequence_parallel=args.sequence_parallel,
                                  expert_parallel=args.expert_parallel,
                                  shard_shared_expert=args.shard_shared_expert,
                                  shared_overlap=SharedOverlap(args.shared_overlap),
                                  shared_scatter_dtype=args.shared_scatter_dtype)
    except ValueError as e:
        raise UsageError(str(e)) from None
    check_weights_form(parallel)
    return parallel


def check_weights_form(parallel: ParallelConfig) -> None:
    """UsageError unless ``--shared-overlap weights`` has an SP-sharded MLP to
    gather the weights of (--sequence-parallel and --shard-shared-expert, or
    K3JAX_SHARD_SP_SHARED_EXPERT=1)."""
    if parallel.shared_overlap is not SharedOverlap.WEIGHTS:
        return
    if not parallel.sequence_parallel:
        raise UsageError("--shared-overlap weights needs --sequence-parallel (and "
                         "--shard-shared-expert): without sequence parallelism no MLP is "
                         "SP-sharded")
    if not parallel.shard_shared_expert:
        raise UsageError("--shared-overlap weights needs --shard-shared-expert (or "
                         f"{SHARD_SHARED_EXPERT_ENV}=1) under --sequence-parallel: "
                         "a replicated shared expert has no shards to gather")


def layer_parallel_from_args(args: argparse.Namespace) -> ParallelConfig:
    """parallel_from_args for a planned or compiled layer (no device count),
    with ``--pad-under-ep`` (add_layer_flags) applied."""
    parallel = parallel_from_args(args, None)
    if not args.pad_under_ep:
        return parallel
    try:
        return dataclasses.replace(parallel, pad_under_ep=True)
    except ValueError as e:
        raise UsageError(str(e)) from None


def device_flags(args: argparse.Namespace) -> str:
    """The flags that set a command's device count, for error messages."""
    if getattr(args, "devices", None):
        return f"--devices {args.devices}"
    dp, tp = getattr(args, "dp", None), getattr(args, "tp", 1)
    return " x ".join([f"--dp {dp}"] * (dp is not None) + [f"--tp {tp}"])


def check_device_count(count: int, flags: str) -> None:
    """A UsageError naming ``flags`` (the flags that asked for ``count``
    devices) when this process cannot simulate that many CPU devices
    (k3jax.cli.machine); checked before any device starts."""
    if why := device_count_problem(count):
        raise UsageError(f"{flags}: {why}")


def request_devices(count: int, flags: str | None = None) -> None:
    """Before JAX's backend starts: make ``count`` CPU devices available in
    case the host has fewer accelerators, after ``check_device_count``
    (``flags``: the flags that asked for them, for its error; default
    "--devices COUNT"). Never lowers a count already set (in-process
    callers, tests), and a no-op once JAX's backend has started:
    ``pick_devices`` then reports any shortfall."""
    check_device_count(count, flags or f"--devices {count}")
    if jax.config.jax_num_cpu_devices >= count:
        return
    try:
        jax.config.update("jax_num_cpu_devices", count)
    except RuntimeError:     # "should be updated before backends are initialized"
        pass


def pick_devices(count: int) -> list[jax.Device]:
    """``count`` devices of the default backend, else simulated CPU devices."""
    devices = jax.devices()
    if len(devices) >= count:
        return devices[:count] if jax.process_count() == 1 else devices
    cpus = jax.devices("cpu")
    if len(cpus) < count:
        raise RuntimeError(f"{count} devices requested, {len(devices)} {jax.default_backend()} "
                           f"and {len(cpus)} CPU devices available")
    return cpus[:count]


def require_devices(count: int) -> None:
    """A UsageError naming --devices when an accelerator host has fewer than
    ``count`` devices: simulated CPU devices stand in on CPU-only hosts only."""
    backend = jax.default_backend()
    if backend != "cpu" and jax.device_count() < count:
        raise UsageError(f"--devices {count}: only {jax.device_count()} {backend} device(s) here "
                         f"(simulated CPU devices are used on CPU-only hosts only)")


def atomic_save_npy(path: str, array) -> None:
    """Write ``array`` to ``path`` as .npy; a failure leaves no file."""
    import numpy as np
    atomic_write(path, lambda f: np.save(f, array))
