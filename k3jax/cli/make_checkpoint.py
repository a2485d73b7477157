"""``k3jax make-checkpoint``: a synthetic checkpoint in the docs/spec.md §3 layout."""

from __future__ import annotations

import argparse
import os
import shutil

from k3jax.cli.common import UsageError, non_negative_int, positive_int, report_errors
from k3jax.cli.machine import memory_problem
from k3jax.config import PRESETS, preset
from k3jax.files import directory_problem

CHOICES = sorted(PRESETS)
FULL_SIZE = "k3"   # ~1 TB of weights: only with --num-experts (and usually --num-layers)


def add_parser(sub) -> None:
    p = sub.add_parser("make-checkpoint", help="write a synthetic checkpoint",
                       description="Write a deterministic synthetic checkpoint (config.json + "
                                   "safetensors) in the HF layout of docs/spec.md §3.")
    p.add_argument("directory", help="output directory (must not exist, or be empty; a symbolic "
                                     "link is followed)")
    p.add_argument("--preset", choices=CHOICES, default="tiny",
                   help="a built-in config; k3 (the full-size shapes, ~1 TB of weights) needs "
                        "--num-experts")
    p.add_argument("--num-experts", type=positive_int, metavar="N",
                   help="the preset's shapes with N routed experts (at least its "
                        "num_experts_per_token, a multiple of its num_expert_group)")
    p.add_argument("--num-layers", type=positive_int, metavar="M",
                   help="write the first M layers (default: all of the preset's)")
    p.add_argument("--seed", type=non_negative_int, default=0)
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="bfloat16",
                   help="dtype of the stored weights (router bias is always float32)")
    p.add_argument("--experts", choices=("dense", "mxfp4"), default="dense",
                   help="routed experts as plain weights or MXFP4 weight_packed/weight_scale")
    p.add_argument("--num-files", type=positive_int, default=1,
                   help="split the tensors over N files with a model.safetensors.index.json "
                        "(at most one file per tensor)")
    p.set_defaults(main=main)


def main(args: argparse.Namespace, prog: str) -> int:
    return report_errors(lambda: _make(args), prog)


def _make(args: argparse.Namespace) -> int:
    from k3jax.checkpoint.writer import (
        checkpoint_bytes,
        make_synthetic_checkpoint,
        synthetic_tensor_count,
    )

    target = _target(args.directory)
    existing = os.path.dirname(os.path.abspath(target))   # missing parents are made
    while not os.path.isdir(existing):
        if os.path.exists(existing):
            raise UsageError(f"{args.directory}: {existing} is not a directory")
        existing = os.path.dirname(existing)
    if why := directory_problem(existing):
        raise UsageError(f"{args.directory}: {why}")
    cfg = _config(args)
    nbytes = checkpoint_bytes(cfg, args.dtype, args.experts)
    free = shutil.disk_usage(existing).free
    if nbytes > free:
        raise UsageError(f"the checkpoint needs {nbytes / 1e9:.2f} GB, {existing} has "
                         f"{free / 1e9:.2f} GB free")
    if why := memory_problem(nbytes, "the checkpoint (built in memory before it is written)"):
        raise UsageError(why)
    count = synthetic_tensor_count(cfg, args.experts)
    if args.num_files > count:
        raise UsageError(f"--num-files {args.num_files}: the {args.preset} checkpoint has only "
                         f"{count} tensors")
    make_synthetic_checkpoint(target, cfg, args.seed, dtype=args.dtype,
                              experts=args.experts, num_files=args.num_files)
    print(f"wrote {args.preset} checkpoint ({cfg.num_hidden_layers} layers, {cfg.num_experts} "
          f"routed experts, seed {args.seed}, {args.dtype}, experts {args.experts}, "
          f"{nbytes / 1e9:.2f} GB) to {args.directory}")
    return 0


def _target(directory: str) -> str:
    """The directory to write: ``directory``, or the final target of the
    symbolic link it names (the link stays); it must be missing or empty."""
    target = os.path.realpath(directory) if os.path.islink(directory) else directory
    if os.path.islink(target):
        raise UsageError(f"{directory} is a symbolic link loop")
    via = f" (the target of the link {directory})" if target != directory else ""
    if os.path.exists(target) and (not os.path.isdir(target) or os.listdir(target)):
        raise UsageError(f"{target}{via} exists and is not an empty directory")
    return target


def _config(args: argparse.Namespace):
    """The preset with --num-experts / --num-layers applied; usage errors name the flag."""
    cfg = preset(args.preset)
    if args.preset == FULL_SIZE and args.num_experts is None:
        raise UsageError(f"--preset {FULL_SIZE} is ~1 TB of weights: give --num-experts N "
                         f"(and --num-layers M) for a K3-shaped checkpoint of a chosen size")
    changes = {}
    if args.num_experts is not None:
        changes["num_experts"] = args.num_experts
    if args.num_layers is not None:
        if args.num_layers > cfg.num_hidden_layers:
            raise UsageError(f"--num-layers {args.num_layers}: the {args.preset} preset has "
                             f"{cfg.num_hidden_layers} layers")
        changes["num_hidden_layers"] = args.num_layers
        changes["first_k_dense_replace"] = min(cfg.first_k_dense_replace, args.num_layers)
    try:
        return cfg.replace(**changes)
    except ValueError as e:
        raise UsageError(f"--num-experts {args.num_experts}: {e}") from None
