"""The ``daca`` command line. Each subcommand lives in its own module and registers here."""

from __future__ import annotations

import argparse
import importlib
import sys

import daca

# name -> (module, help). A module defines ``add_arguments(parser)`` and ``run(args) -> int``.
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("daca.train_cli", "RL-train a masked diffusion LM (default: tiny model, Sudoku)"),
    "pretrain": ("daca.pretrain", "train the embedded tiny masked diffusion LM from scratch"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="daca",
        description="DACA-GRPO: RL post-training of masked diffusion language models.",
    )
    parser.add_argument("--version", action="version", version=f"daca {daca.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    module, _ = COMMANDS[args.command]
    return importlib.import_module(module).run(args) or 0


if __name__ == "__main__":
    sys.exit(main())
