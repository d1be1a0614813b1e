"""The ``freescale`` console script: one parser, subcommands contributed by each package.

Each module in ``COMMAND_MODULES`` exposes ``register(subparsers)``, which adds its subcommands
and sets ``func`` on them. Heavy imports (torch, ray) happen inside the handlers, so ``--help``
stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from freescale import __version__

COMMAND_MODULES = ("freescale.datasets", "freescale.planning", "freescale.demo", "freescale.report", "trainer.cli", "freescale.simulate")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="freescale",
        description="Load-balanced sequence batching for sequential recommenders.",
    )
    parser.add_argument("--version", action="version", version=f"freescale {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as exc:
        print(f"freescale {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
