"""``k3jax run``'s checks, all before any device starts: the flags, the
device count against what this machine can simulate, the checkpoint's config
and layer range, the input arrays, flags a run's layers would ignore, and the
layout on an abstract mesh (a layout the model cannot be split over is a
usage error in seconds, whatever the device count)."""

from __future__ import annotations

import argparse
import os
from typing import NamedTuple

import numpy as np

from k3jax.cli import replicas
from k3jax.cli.common import (
    UsageError,
    check_backend,
    check_device_count,
    check_moe_only_flags,
    check_output,
    device_flags,
    layout_errors,
    parallel_from_args,
    warn_config_defaults,
)
from k3jax.cli.inputs import load_cotangent, load_input
from k3jax.runtime import startup

DEFAULT_TOKENS = 7
DEFAULT_SEED = 0


def layer_range(text: str) -> tuple[int, int]:
    """``A:B`` (0 <= A < B) for --layers."""
    try:
        a, b = (int(part) for part in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected A:B (two integers), got {text!r}") from None
    if not 0 <= a < b:
        raise argparse.ArgumentTypeError(f"expected 0 <= A < B, got {text!r}")
    return a, b


def check_flags(args: argparse.Namespace, spec: startup.ProcessSpec | None) -> int:
    """Validate the flags before any JAX set-up; return the devices this
    process simulates (in a multi-process run checked here against what the
    machine can simulate; in one process by ``check_layout``)."""
    num_devices = args.devices or ((args.dp or 1) * args.tp)
    parallel_from_args(args, args.devices)
    if spec is None or spec.is_leader:   # only process 0 writes the output
        check_output(args.output, "--output")
        check_output(args.grads, "--grads")
        check_output(getattr(args, "expert_load", None), "--expert-load")
    check_grad_flags(args)
    if os.environ.get("JAX_PLATFORMS") == "cpu":   # known without starting a backend
        check_backend(args.backend, "cpu")
    if spec is not None and num_devices % spec.num_processes:
        raise UsageError(f"--devices {num_devices} (the global count) is not divisible by "
                         f"--num-processes {spec.num_processes}")
    if spec is None:
        return num_devices      # checked against the machine after the layout (check_layout)
    local = num_devices // spec.num_processes
    check_device_count(local, f"{device_flags(args)} over --num-processes {spec.num_processes}")
    return local


def check_grad_flags(args: argparse.Namespace) -> None:
    if args.layers is not None and args.layer is not None:
        raise UsageError("--layer and --layers exclude each other")
    if args.layers is not None and args.grads is not None and args.layers[1] - args.layers[0] > 1:
        raise UsageError("--grads needs a single layer (--layer N or --layers N:N+1)")
    if (args.grads is None) != (args.cotangent is None):
        given, missing = (("--grads", "--cotangent DY.npy") if args.cotangent is None
                          else ("--cotangent", "--grads OUT.safetensors"))
        raise UsageError(f"{given} needs {missing}")
    if args.grads is not None and args.output is not None and \
            os.path.realpath(args.grads) == os.path.realpath(args.output):
        raise UsageError(f"--grads and --output name the same file: {args.grads}")


class Opened(NamedTuple):
    """What a run reads before any device starts."""
    reader: object            # k3jax.checkpoint.CheckpointReader
    cfg: object               # its K3Config
    layer: int                # the first layer
    layers: list[int]
    x: np.ndarray
    dy: np.ndarray | None


def open_run(args: argparse.Namespace, path: str, *, warn: bool = True) -> Opened:
    """The checkpoint (with ``warn``, its config's absent keys that change
    the math named in one warning line), the layers (a UsageError out of range), the input
    and the cotangent (ValueError: bad data)."""
    from k3jax.checkpoint import CheckpointReader

    reader = CheckpointReader(path)
    cfg = reader.config
    if args.checkpoint is not None and warn:
        warn_config_defaults(getattr(args, "prog", "k3jax run"),
                             os.path.join(args.checkpoint, "config.json"), reader.math_defaults,
                             list(reader.math_defaults))
    what = args.checkpoint or "the tiny synthetic checkpoint"
    if args.layers is not None:
        layer, end = args.layers
        if end > cfg.num_hidden_layers:
            raise UsageError(f"--layers {layer}:{end} is out of range: {what} has "
                             f"{cfg.num_hidden_layers} layers (0..{cfg.num_hidden_layers - 1})")
        layers = list(range(layer, end))
    else:
        layer = args.layer if args.layer is not None else min(1, cfg.num_hidden_layers - 1)
        if layer >= cfg.num_hidden_layers:
            raise UsageError(f"--layer {layer} is out of range: {what} has "
                             f"{cfg.num_hidden_layers} layers (0..{cfg.num_hidden_layers - 1})")
        layers = [layer]
    check_moe_only_flags(args, cfg, layers)
    if args.input is None:
        rng = np.random.default_rng(DEFAULT_SEED + 1)
        x = rng.standard_normal((DEFAULT_TOKENS, cfg.hidden_size)).astype(np.float32)
    else:
        x = load_input(args.input, cfg.hidden_size)
    dy = None if args.cotangent is None else load_cotangent(args.cotangent, x.shape)
    return Opened(reader, cfg, layers[0], layers, x, dy)


def check_layout(args: argparse.Namespace, opened: Opened, parallel) -> None:
    """The layout of the run's config on an abstract mesh (no devices): a
    UsageError naming the flags when the model cannot be split over it (the
    storage-specific checks, packed MXFP4's 32-wide blocks, follow at load),
    then the device count against what this machine can simulate."""
    from k3jax.layout import abstract_mesh, make_layout

    with layout_errors(parallel, mxfp4_fix="--mxfp4 dequantize"):
        make_layout(opened.cfg, parallel, abstract_mesh(parallel), backend="xla")
    replicas.placements_from_args(args, opened.cfg, parallel, opened.layers)   # exit 1 naming it
    check_device_count(parallel.num_devices, device_flags(args))
