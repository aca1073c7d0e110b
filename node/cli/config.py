"""Settings files: a subcommand's flags, read from a TOML file (``--config FILE``).

The subcommand's ``argparse`` parser is the one definition of its settings. A file's keys
are its long flags without ``--`` (``checkpoint-every = 300``, ``initial-peers = [...]``,
``no-train = true``); each value is checked and converted by the flag's own action (its
``type``, ``choices`` and ``nargs``), then becomes the parser's default, so that a flag
given on the command line wins over the file. A flag added to a parser is a key of its
files and a line of its template with no change here.

Light, like ``node.cli.args``: the standard library only.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import json
import re
import sys
import textwrap
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CONFIG_FLAG = "--config"


class ConfigError(ValueError):
    """A settings file that cannot be used; the message names the file, the line where it
    is known, and the key."""


@dataclass(frozen=True)
class Setting:
    """One flag of a parser as a key of its settings file."""

    key: str  # the long flag without "--"
    action: argparse.Action

    @property
    def is_switch(self) -> bool:
        """A flag that takes no value (``--one-stage``): ``true`` in a file gives it."""
        return isinstance(self.action, argparse._StoreConstAction | argparse.BooleanOptionalAction)

    @property
    def is_list(self) -> bool:
        """A flag that takes several values (``nargs``), or is given several times: a
        TOML list in a file."""
        nargs = self.action.nargs
        repeated = isinstance(self.action, argparse._AppendAction)
        return repeated or nargs in ("*", "+") or (isinstance(nargs, int) and nargs > 1)


def settings_of(parser: argparse.ArgumentParser) -> dict[str, Setting]:
    """The keys a settings file of ``parser`` may hold: each option with a long flag that
    stores a value or a switch (not ``--help``, ``--version``, ``--config`` itself, nor
    positional arguments and nested subcommands), in the parser's order."""
    found: dict[str, Setting] = {}
    for action in parser._actions:
        longs = [s for s in action.option_strings if s.startswith("--")]
        if not longs or CONFIG_FLAG in longs:
            continue
        supported = argparse._StoreAction | argparse._StoreConstAction | argparse._AppendAction
        if isinstance(action, supported | argparse.BooleanOptionalAction):
            key = longs[0][2:]
            found[key] = Setting(key, action)
    return found


def add_config_argument(parser: argparse.ArgumentParser) -> None:
    """``--config FILE`` on ``parser``: ``use_config_file`` reads the file before argv is
    parsed; this action only stores the path (so that ``--help`` lists it)."""
    parser.add_argument(
        CONFIG_FLAG,
        type=Path,
        metavar="FILE",
        help="read settings from this TOML file (keys: the long flags without --; "
        "`swarmtrain config init` writes a template); flags given here override it",
    )


def config_file_in(argv: Sequence[str]) -> Path | None:
    """The ``--config`` path that argparse will find in ``argv`` (one subcommand's
    arguments), or None; also in its ``--config=FILE`` and abbreviated forms."""
    finder = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    finder.add_argument(CONFIG_FLAG, type=Path)
    try:
        found, _ = finder.parse_known_args(list(argv))
    except argparse.ArgumentError:
        return None  # a --config without its FILE: the command's parser says so
    return found.config


def use_config_file(parser: argparse.ArgumentParser, path: Path) -> dict[str, Any]:
    """Read ``path`` and make its values ``parser``'s defaults, so that flags given on the
    command line override them; returns those defaults (by ``dest``). Raises
    ``ConfigError`` for a file that is missing, is not TOML, or holds an unknown key or a
    value the flag would refuse: nothing is changed then."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read {path}: {getattr(e, 'strerror', None) or e}") from None
    defaults = parse_config(parser, text, path)
    parser.set_defaults(**defaults)
    for action in parser._actions:
        if action.option_strings and action.dest in defaults:
            action.required = False  # the file gives it
    return defaults


def parse_config(parser: argparse.ArgumentParser, text: str, path: Path) -> dict[str, Any]:
    """The values of a settings file's ``text`` for ``parser``, by ``dest``, converted as
    the flags would convert them on the command line. Paths are expanded (``~``) and taken
    relative to the file's directory. A switch set to ``false`` is left out: it means the
    flag is not given. Raises ``ConfigError`` naming the key and its line."""
    try:
        table = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None
    settings = settings_of(parser)
    values: dict[str, Any] = {}
    for key, value in table.items():
        where = _where(path, text, key)
        setting = settings.get(key)
        if setting is None:
            close = difflib.get_close_matches(key, list(settings), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"{where}: unknown key {key!r}{hint}")
        try:
            converted = _convert(setting, value, path.parent)
        except (argparse.ArgumentTypeError, TypeError, ValueError) as e:
            raise ConfigError(f"{where}: {key}: {e}") from None
        if converted is not _NOT_GIVEN:
            values[setting.action.dest] = converted
    return values


_NOT_GIVEN = object()


def _convert(setting: Setting, value: Any, base: Path) -> Any:
    action = setting.action
    if setting.is_switch:
        if not isinstance(value, bool):
            raise TypeError(f"expected true or false, got {_toml(value)}")
        if isinstance(action, argparse.BooleanOptionalAction):
            return value
        return action.const if value else _NOT_GIVEN
    if setting.is_list:
        if not isinstance(value, list):
            raise TypeError(f"expected a list, [...], got {_toml(value)}")
        if action.nargs == "+" and not value:
            raise ValueError("expected at least one value")
        if isinstance(action.nargs, int) and action.nargs > 1 and len(value) != action.nargs:
            raise ValueError(f"expected {action.nargs} values, got {len(value)}")
        return [_scalar(action, v, base) for v in value]
    if action.nargs == "?" and isinstance(value, bool):  # the flag alone: its const
        return action.const if value else _NOT_GIVEN
    return _scalar(action, value, base)


def _scalar(action: argparse.Action, value: Any, base: Path) -> Any:
    """``value`` converted by the action's ``type`` as the same text on the command line
    would be; a number where the flag takes text, or text where it takes a number, is a
    wrong type rather than something to guess about."""
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise TypeError(f"expected a single value, got {_toml(value)}")
    text = str(value)
    converted = action.type(text) if callable(action.type) else text
    number = isinstance(converted, int | float) and not isinstance(converted, bool)
    if isinstance(value, str) and number:
        raise TypeError(f"expected a number, got the text {_toml(value)} (drop the quotes)")
    if not isinstance(value, str) and not number:
        raise TypeError(f"expected text in quotes, got {_toml(value)}")
    if isinstance(converted, Path):
        converted = converted.expanduser()
        if not converted.is_absolute():
            converted = base / converted
    if action.choices is not None and converted not in action.choices:
        choices = ", ".join(_toml(c) for c in action.choices)
        raise ValueError(f"{_toml(value)} is not one of {choices}")
    return converted


def _where(path: Path, text: str, key: str) -> str:
    """``FILE line N`` for the line that sets top-level ``key`` (a key, a dotted key or a
    table header), or ``FILE`` alone if no line does."""
    names = "|".join(re.escape(k) for k in (key, json.dumps(key), f"'{key}'"))
    pattern = re.compile(rf"^\s*(?:\[\[?\s*)?(?:{names})\s*[=.\]]")
    for number, line in enumerate(text.splitlines(), start=1):
        if pattern.match(line):
            return f"{path} line {number}"
    return str(path)


def template(parser: argparse.ArgumentParser, command: str) -> str:
    """A commented settings file for ``parser``: each key with its help text, set to its
    default; keys with no default are commented out with a placeholder. Read back, it
    gives the parser's defaults."""
    lines = [
        f"# Settings of `swarmtrain {command}`: `swarmtrain {command} --config THIS_FILE`.",
        "# Keys are the command's flags without --; a flag given on the command line",
        "# overrides the file. Relative paths are relative to this file's directory, and ~",
        "# is your home. A flag that takes no value is set with true.",
    ]
    for setting in settings_of(parser).values():
        action = setting.action
        lines.append("")
        help_text = _help(action, parser.prog)
        if action.required:
            help_text += " (required)"
        lines += textwrap.wrap(help_text, 86, initial_indent="# ", subsequent_indent="# ")
        if action.choices is not None:
            lines.append(f"# one of: {', '.join(_toml(c) for c in action.choices)}")
        lines.append(_template_line(setting))
    return "\n".join(lines) + "\n"


def _template_line(setting: Setting) -> str:
    action, key = setting.action, setting.key
    default = action.default
    unset = default is None or default is argparse.SUPPRESS or default == ""
    if setting.is_switch:
        if isinstance(action, argparse.BooleanOptionalAction) and not unset:
            return f"{key} = {_toml(bool(default))}"
        return f"# {key} = true" if unset else f"{key} = false"
    if unset:
        placeholder = action.metavar or action.dest.upper()
        if isinstance(placeholder, tuple):
            placeholder = " ".join(placeholder)
        text_typed = action.type in (None, str, Path)
        shown = _toml(placeholder) if text_typed else placeholder
        if setting.is_list:
            shown = f"[{shown}]"
        return f"# {key} = {shown}"
    return f"{key} = {_toml(default)}"


def _help(action: argparse.Action, prog: str) -> str:
    text = " ".join((action.help or "").split())
    if "%" in text:
        params = {k: v for k, v in vars(action).items() if v is not argparse.SUPPRESS}
        with contextlib.suppress(KeyError, TypeError, ValueError):  # then as written
            text = text % dict(params, prog=prog)
    return text


def _toml(value: Any) -> str:
    """``value`` as a TOML value (a string for anything that is not a number, a boolean
    or a list)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{...}"
    return json.dumps(str(value), ensure_ascii=False)


# ``swarmtrain config``


def config_arguments(p: argparse.ArgumentParser) -> None:
    """``swarmtrain config``."""
    from node.cli.main import COMMANDS

    actions = p.add_subparsers(dest="action", required=True)
    init = actions.add_parser("init", help="print a commented settings file with the defaults")
    init.add_argument(
        "for_command",
        nargs="?",
        default="node",
        choices=[name for name, c in COMMANDS.items() if c.config],
        metavar="COMMAND",
        help="the command whose settings to write (default: node)",
    )


def run(args: argparse.Namespace) -> int:
    from node.cli.main import command_parser

    sys.stdout.write(template(command_parser(args.for_command), args.for_command))
    return 0
