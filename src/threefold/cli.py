"""The command line: `threefold <command> ...`.

Each command lives in its own module exposing `add_arguments(parser)` and `run(args) -> int`;
this file only dispatches and turns user errors into one line and exit code 2. Only the chosen
command's module is imported, and command modules import torch only when they run, so
`threefold --help`, `threefold train --help`, `plan` and `schedule` start without it.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from .errors import UserError

COMMANDS = {
    "train": ("threefold.train.command", "train a model (locally with --nproc, or under torchrun)"),
    "plan": ("threefold.planner.command", "predict memory and speed of layouts and find the fastest that fits"),
    "ckpt": ("threefold.checkpoint.command", "inspect, verify and export checkpoints"),
    "parity": ("threefold.train.parity", "run one job under several layouts and compare losses and weights"),
    "schedule": ("threefold.pipeline.command", "simulate, check and draw a pipeline schedule"),
    "data": ("threefold.train.data_command", "train a tokenizer and prepare token shards for training"),
    "runs": ("threefold.train.runs_command", "where a run directory's wall time went (goodput, over its restarts)"),
}


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse's own mistakes follow the same one-line, exit-2 rule
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The parser; with `only`, the other commands are listed but their options not built."""
    parser = _Parser(prog="threefold", description="Train large PyTorch models across many processes.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name, (module, help_text) in COMMANDS.items():
        command_parser = sub.add_parser(name, help=help_text, description=help_text)
        if only is None or name == only:
            importlib.import_module(module).add_arguments(command_parser)
    return parser


# Libraries that other libraries import on their own (transformers imports torchao when it is
# installed) and that log at import: torchao the optional CUDA kernels it cannot load on this
# machine, torch's pytree a deprecation torchao's registrations trigger. Their lines would break
# the one-line error rule and fill every rank's log; errors still show.
QUIET_AT_IMPORT = ("torchao", "torch.utils._pytree")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    for name in QUIET_AT_IMPORT:
        logging.getLogger(name).setLevel(logging.ERROR)
    chosen = next((a for a in argv if not a.startswith("-")), None)
    args = build_parser(only=chosen if chosen in COMMANDS else "").parse_args(argv)
    module = importlib.import_module(COMMANDS[args.command][0])
    try:
        return module.run(args)
    except UserError as e:
        print(e.line(), file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
