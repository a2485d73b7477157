"""``k3jax plan``: placeholder until its issue lands."""


def add_parser(sub) -> None:
    p = sub.add_parser("plan", help="(not yet available)")
    p.set_defaults(main=main)


def main(args, prog: str) -> int:
    raise SystemExit(f"{prog}: not implemented yet")
