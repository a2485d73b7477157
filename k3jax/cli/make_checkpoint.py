"""``k3jax make-checkpoint``: a synthetic checkpoint in the docs/spec.md §3 layout."""

from __future__ import annotations

import argparse
import os

from k3jax.cli.common import UsageError, non_negative_int, positive_int, report_errors
from k3jax.config import PRESETS, preset
from k3jax.files import directory_problem

# The full-size preset is ~1 TB of weights: not offered.
CHOICES = sorted(name for name in PRESETS if name != "k3")


def add_parser(sub) -> None:
    p = sub.add_parser("make-checkpoint", help="write a synthetic checkpoint",
                       description="Write a deterministic synthetic checkpoint (config.json + "
                                   "safetensors) in the HF layout of docs/spec.md §3.")
    p.add_argument("directory", help="output directory (must not exist, or be empty)")
    p.add_argument("--preset", choices=CHOICES, default="tiny",
                   help="a built-in config (not k3: the full-size model is ~1 TB of weights)")
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
    from k3jax.checkpoint.writer import make_synthetic_checkpoint, synthetic_tensor_count

    if os.path.exists(args.directory) and (not os.path.isdir(args.directory)
                                           or os.listdir(args.directory)):
        raise UsageError(f"{args.directory} exists and is not an empty directory")
    existing = os.path.dirname(os.path.abspath(args.directory))   # missing parents are made
    while not os.path.isdir(existing):
        existing = os.path.dirname(existing)
    if why := directory_problem(existing):
        raise UsageError(f"{args.directory}: {why}")
    cfg = preset(args.preset)
    count = synthetic_tensor_count(cfg, args.experts)
    if args.num_files > count:
        raise UsageError(f"--num-files {args.num_files}: the {args.preset} checkpoint has only "
                         f"{count} tensors")
    make_synthetic_checkpoint(args.directory, cfg, args.seed, dtype=args.dtype,
                              experts=args.experts, num_files=args.num_files)
    print(f"wrote {args.preset} checkpoint ({cfg.num_hidden_layers} layers, seed {args.seed}, "
          f"{args.dtype}, experts {args.experts}) to {args.directory}")
    return 0
