"""``k3jax make-checkpoint``: a synthetic checkpoint in the SPEC 3 layout."""

from __future__ import annotations

import argparse
import os
import sys

from k3jax.cli.common import positive_int
from k3jax.config import PRESETS, preset


def add_parser(sub) -> None:
    p = sub.add_parser("make-checkpoint", help="write a synthetic checkpoint",
                       description="Write a deterministic synthetic checkpoint (config.json + "
                                   "safetensors) in the HF layout of SPEC section 3.")
    p.add_argument("directory", help="output directory (must not exist, or be empty)")
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="bfloat16",
                   help="dtype of the stored weights (router bias is always float32)")
    p.add_argument("--experts", choices=("dense", "mxfp4"), default="dense",
                   help="routed experts as plain weights or MXFP4 weight_packed/weight_scale")
    p.add_argument("--num-files", type=positive_int, default=1,
                   help="split the tensors over N files with a model.safetensors.index.json")
    p.set_defaults(main=main)


def main(args: argparse.Namespace, prog: str) -> int:
    from k3jax.checkpoint import make_synthetic_checkpoint

    if os.path.exists(args.directory) and (not os.path.isdir(args.directory)
                                           or os.listdir(args.directory)):
        print(f"{prog}: error: {args.directory} exists and is not an empty directory", file=sys.stderr)
        return 2
    cfg = preset(args.preset)
    if args.preset == "k3":
        print(f"{prog}: error: the full-size preset is ~1 TB of weights; use a smaller preset",
              file=sys.stderr)
        return 2
    try:
        make_synthetic_checkpoint(args.directory, cfg, args.seed, dtype=args.dtype,
                                  experts=args.experts, num_files=args.num_files)
    except (ValueError, OSError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {args.preset} checkpoint ({cfg.num_hidden_layers} layers, seed {args.seed}, "
          f"{args.dtype}, experts {args.experts}) to {args.directory}")
    return 0
