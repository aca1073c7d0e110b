"""The ``swarmtrain`` command line: one subcommand per use."""

from __future__ import annotations

import argparse
import logging
import sys

from models.data import DataError
from node import baseline, demo, serve, status, train
from node.daemon import NodeError
from node.dht import DHTStartError
from node.files import IdentityInUseError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="swarmtrain", description="Peer-to-peer volunteer training of pipelined models."
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("baseline", help="train the whole model in one process (the reference)")
    baseline.add_arguments(b)
    b.set_defaults(handler=baseline.run)
    n = sub.add_parser("node", help="run a node daemon: join (or start) a run and serve a stage")
    serve.add_arguments(n)
    n.set_defaults(handler=serve.run)
    s = sub.add_parser("status", help="show the peers and stages of a run")
    status.add_arguments(s)
    s.set_defaults(handler=status.run)
    t = sub.add_parser("train", help="train through a run's swarm without serving a stage")
    train.add_arguments(t)
    t.set_defaults(handler=train.run)
    d = sub.add_parser("demo", help="a local swarm that trains and survives a kill -9")
    demo.add_arguments(d)
    d.set_defaults(handler=demo.run)
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
