"""The ``swarmtrain`` command line: one subcommand per use.

Only the chosen subcommand's arguments are defined, and its module is imported only to
run it: ``swarmtrain --help`` and ``swarmtrain node --help`` import neither torch nor
hivemind (``node.cli.args``).
"""

from __future__ import annotations

import argparse
import gc
import importlib
import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NoReturn

from node.cli.args import CommandParser, add_verbose, version
from node.cli.config import ConfigError, add_config_argument, config_file_in, use_config_file
from node.cli.exit import exit_frozen


@dataclass(frozen=True)
class Command:
    summary: str
    arguments: str  # "module:function" that adds the subcommand's arguments to a parser
    handler: str  # "module:function" that runs it, given the parsed arguments
    config: bool = False  # its settings may come from a file too (--config FILE)


COMMANDS = {
    "baseline": Command(
        "train the whole model in one process (the reference)",
        "node.cli.args:baseline_arguments",
        "node.cli.baseline:run",
    ),
    "node": Command(
        "run a node daemon: join (or start) a run and serve a stage",
        "node.cli.args:node_arguments",
        "node.cli.node:run",
        config=True,
    ),
    "run": Command(
        "create a run; invite machines to a private run, or revoke them",
        "node.cli.args:run_arguments",
        "node.cli.run:run",
    ),
    "tokenizer": Command(
        "train a BPE tokenizer on local text (for run create --tokenizer)",
        "node.cli.args:tokenizer_arguments",
        "node.cli.tokenizer:run",
    ),
    "status": Command(
        "show the peers and stages of a run",
        "node.cli.args:status_arguments",
        "node.cli.status:run",
    ),
    "runs": Command(
        "list the public runs announced, and how to join one",
        "node.cli.args:runs_arguments",
        "node.cli.runs:run",
        config=True,
    ),
    "train": Command(
        "train through a run's swarm without serving a stage",
        "node.cli.args:train_arguments",
        "node.cli.train:run",
        config=True,
    ),
    "export": Command(
        "write a run's model in the Hugging Face format, from checkpoints or a live run",
        "node.cli.args:export_arguments",
        "node.cli.export:run",
    ),
    "generate": Command(
        "sample text from an exported model, or through a live run's stages",
        "node.cli.args:generate_arguments",
        "node.cli.generate:run",
    ),
    "demo": Command(
        "a local swarm that trains and survives a kill -9",
        "node.cli.args:demo_arguments",
        "node.cli.demo:run",
    ),
    "id": Command(
        "print this machine's peer id in a run (what an invite is bound to)",
        "node.cli.args:id_arguments",
        "node.cli.whoami:run",
    ),
    "config": Command(
        "print a commented settings file (swarmtrain config init > node.toml)",
        "node.cli.config:config_arguments",
        "node.cli.config:run",
    ),
    "service": Command(
        "write a systemd unit that runs a node from its settings file",
        "node.cli.service:service_arguments",
        "node.cli.service:run",
    ),
}

# Errors that say what is wrong and what to do in their message: shown as one line, exit
# status 2. Named by module, and matched only if that module was imported (an error of a
# module that was never imported cannot have been raised).
KNOWN_ERRORS = [
    ("builtins", "ValueError"),
    ("models.data", "DataError"),
    ("node.daemon.join", "NodeError"),
    ("node.rpc.dht", "DHTStartError"),
    ("node.files", "IdentityInUseError"),
    ("node.files", "KeyFileError"),
]


def _load(target: str):
    """``module:name``, imported with the cyclic garbage collector paused: an import
    allocates objects that all stay alive, and with torch and hivemind loaded the full
    collections it would trigger walk hundreds of thousands of them for nothing. What
    the import made is then frozen (``gc.freeze``): later collections skip it."""
    module, _, name = target.partition(":")
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        return getattr(importlib.import_module(module), name)
    finally:
        if was_enabled:
            gc.enable()
            gc.freeze()


def _command_in(argv: Sequence[str]) -> str | None:
    """The subcommand named in ``argv``: its first word that is not an option (the
    top-level options take no values)."""
    return next((a for a in argv if not a.startswith("-")), None)


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The parser for ``argv``: every subcommand is listed, but only the one ``argv`` names
    gets its arguments (all of them do with ``argv`` None). If ``argv`` gives that
    subcommand ``--config FILE``, the file's settings are its defaults; a file it cannot
    use is a one-line error (exit status 2) before anything starts."""
    parser = CommandParser(
        prog="swarmtrain", description="Peer-to-peer volunteer training of pipelined models."
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    add_verbose(parser)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    chosen = _command_in(argv) if argv is not None else None
    for name, command in COMMANDS.items():
        p = sub.add_parser(name, help=command.summary, description=command.summary)
        if argv is None or name == chosen:
            _define(p, command)
        if argv is not None and name == chosen and command.config:
            path = config_file_in(argv[argv.index(name) + 1 :])
            if path is not None:
                try:
                    use_config_file(p, path)
                except ConfigError as e:
                    p.error(str(e))
    return parser


def command_parser(name: str) -> argparse.ArgumentParser:
    """The parser of ``swarmtrain NAME``'s own arguments, on its own."""
    p = CommandParser(prog=f"swarmtrain {name}", description=COMMANDS[name].summary)
    _define(p, COMMANDS[name])
    return p


def _define(p: argparse.ArgumentParser, command: Command) -> None:
    add_verbose(p, default=argparse.SUPPRESS)
    _load(command.arguments)(p)
    if command.config:
        add_config_argument(p)
    _verbose_in_subcommands(p)


def _verbose_in_subcommands(parser: argparse.ArgumentParser) -> None:
    """``-v`` after a subcommand's own subcommand too (``swarmtrain run invite ... -v``)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for p in action.choices.values():
                add_verbose(p, default=argparse.SUPPRESS)
                _verbose_in_subcommands(p)


def _known(error: BaseException) -> bool:
    for module, name in KNOWN_ERRORS:
        cls = getattr(sys.modules.get(module), name, None)
        if cls is not None and isinstance(error, cls):
            return True
    return False


def _one_line(error: BaseException) -> str:
    """An error's message on one line; of a settings check, its first complaint only."""
    pydantic = sys.modules.get("pydantic")
    if pydantic is not None and isinstance(error, pydantic.ValidationError):
        from protocol.records import first_error

        return first_error(error, error.title)
    return " ".join(str(error).split())  # one line, whatever the message holds


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(argv).parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return _load(COMMANDS[args.command].handler)(args)
    except KeyboardInterrupt:
        print(f"swarmtrain {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if not _known(e):
            raise
        print(f"swarmtrain {args.command}: error: {_one_line(e)}", file=sys.stderr)
        return 2


def entry() -> NoReturn:
    """The ``swarmtrain`` command and ``python -m node.cli``: ``main``, then exit with its
    status (``node.cli.exit.exit_frozen``). Call ``main`` to run a command in-process."""
    exit_frozen(main())
