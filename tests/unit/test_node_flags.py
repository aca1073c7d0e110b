"""The command line as the README tells it: every flag the README names is a flag of the
command it names (or of some command, in prose), with the default the README says; and
``swarmtrain node``'s flags reach the settings they name."""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from node.cli.args import MAX_RESUME_HOLD_S
from node.cli.main import COMMANDS, build_parser, command_parser
from node.cli.node import settings_from
from node.daemon.settings import STUCK_AFTER_S
from protocol.assignment import DEFAULT_PARAMS, Params

README = Path(__file__).resolve().parents[2] / "README.md"
FLAG = r"(?<![\w-])--[a-z][a-z0-9-]*"
# Flags the README gives to other programs than swarmtrain.
OTHER_PROGRAMS = {"--now": "systemctl", "--netem": "scripts.netem"}


def _parsers(parser: argparse.ArgumentParser, name: str) -> Iterator[tuple[str, set[str]]]:
    """``name`` and its options, then each of its subcommands' (``run create``), in turn."""
    yield name, {o for a in parser._actions for o in a.option_strings}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub, p in action.choices.items():
                yield from _parsers(p, f"{name} {sub}")


def _defaults() -> dict[str, list[object]]:
    """Each flag of any command -> its defaults (one per command that has it)."""
    defaults: dict[str, list[object]] = {}
    for name in COMMANDS:
        for action in command_parser(name)._actions:
            for option in action.option_strings:
                defaults.setdefault(option, []).append(action.default)
    return defaults


OPTIONS = dict(p for name in COMMANDS for p in _parsers(command_parser(name), name))
TEXT = README.read_text()


def test_every_flag_the_readme_names_is_a_flag_of_swarmtrain() -> None:
    known = set().union(*OPTIONS.values()) | set(OTHER_PROGRAMS)
    unknown = sorted(set(re.findall(FLAG, TEXT)) - known)
    assert not unknown, f"README.md names flags that no swarmtrain command has: {unknown}"


def test_a_command_line_in_the_readme_gives_only_that_commands_flags() -> None:
    checked, wrong = 0, []
    for line in TEXT.splitlines():
        m = re.match(r"\s*(?:sudo\s+)?swarmtrain\s+([a-z]+)(?:\s+([a-z]+))?", line)
        if m is None:
            continue
        command, sub = m.groups()
        name = f"{command} {sub}" if f"{command} {sub}" in OPTIONS else command
        assert name in OPTIONS, f"README.md runs an unknown command: {line.strip()}"
        code = line.split("#")[0]  # not the comment after it
        wrong += [f"{name} {f}" for f in re.findall(FLAG, code) if f not in OPTIONS[name]]
        checked += 1
    assert checked >= 20, "the README's command lines were not found"
    assert not wrong, f"README.md gives commands flags they do not have: {wrong}"


def test_a_default_the_readme_states_for_a_flag_is_the_flags_default() -> None:
    """``--flag`` ... ``(default N`` within a sentence: N is that flag's default."""
    defaults = _defaults()
    stated = re.findall(r"`(--[a-z][a-z0-9-]*)`[^`(.]{0,60}\(default (\d+(?:\.\d+)?)", TEXT)
    assert len(stated) >= 3, "the README's stated defaults were not found"
    for flag, value in stated:
        assert float(value) in defaults[flag], f"README.md: {flag} default {value}"


def _node(*flags: str) -> argparse.Namespace:
    argv = ["node", "--run", "r", *flags]
    return build_parser(argv).parse_args(argv)


def test_resume_hold_reaches_the_placement_rule() -> None:
    settings = settings_from(_node("--resume-hold", "30", "--rebalance-period", "7"))
    params = settings.placement_params
    assert params.resume_hold_s == 30.0 and params.mean_period_s == 7.0
    assert settings_from(_node()).placement_params == Params(mean_period_s=60.0)
    assert _node().resume_hold == DEFAULT_PARAMS.resume_hold_s  # the flag's default is the rule's
    assert settings_from(_node("--resume-hold", "0")).placement_params.resume_hold_s == 0.0


def test_stuck_after_reaches_the_watchdog_and_defaults_to_its_30_s() -> None:
    assert settings_from(_node("--stuck-after", "10")).stuck_after_s == 10.0
    assert settings_from(_node()).stuck_after_s == STUCK_AFTER_S == 30.0


@pytest.mark.parametrize("value", ["0", "-5", "soon"])
def test_a_stuck_after_that_is_not_a_positive_number_is_refused_in_one_line(value, capsys) -> None:
    with pytest.raises(SystemExit) as e:
        _node("--stuck-after", value)
    assert e.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert "--stuck-after" in line


@pytest.mark.parametrize("value", ["-1", str(MAX_RESUME_HOLD_S + 1), "nan", "soon"])
def test_a_resume_hold_out_of_bounds_is_refused_in_one_line(value: str, capsys) -> None:
    with pytest.raises(SystemExit) as e:
        _node("--resume-hold", value)
    assert e.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert "--resume-hold" in line
