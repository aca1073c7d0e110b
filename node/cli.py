"""The ``swarmtrain`` command line: one subcommand per use."""

from __future__ import annotations

import argparse
import logging
import sys

from models.data import DataError
from node import baseline, demo, export, generate, run_admin, serve, status, train
from node.daemon import NodeError
from node.dht import DHTStartError
from node.files import IdentityInUseError

COMMANDS = [
    ("baseline", baseline, "train the whole model in one process (the reference)"),
    ("node", serve, "run a node daemon: join (or start) a run and serve a stage"),
    ("run", run_admin, "create a run; invite machines to a private run, or revoke them"),
    ("status", status, "show the peers and stages of a run"),
    ("train", train, "train through a run's swarm without serving a stage"),
    ("export", export, "write a run's model, from nodes' checkpoints, in the Hugging Face format"),
    ("generate", generate, "sample text from an exported model"),
    ("demo", demo, "a local swarm that trains and survives a kill -9"),
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="swarmtrain", description="Peer-to-peer volunteer training of pipelined models."
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, module, summary in COMMANDS:
        command = sub.add_parser(name, help=summary)
        module.add_arguments(command)
        command.set_defaults(handler=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return args.handler(args)
    except (DataError, ValueError, NodeError, IdentityInUseError, DHTStartError) as e:
        print(f"swarmtrain {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"swarmtrain {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
