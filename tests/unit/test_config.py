"""Settings files (``--config FILE``): the template reads back as the defaults, flags on the
command line win over the file, and a file that cannot be used is refused with the key
and its line before the command runs."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest

from node.cli.args import CommandParser, node_arguments
from node.cli.config import ConfigError, parse_config, settings_of, template
from node.cli.main import COMMANDS, build_parser, command_parser, main
from tests.unit.test_cli import PEER

MADDR = f"/ip4/127.0.0.1/tcp/31337/p2p/{PEER}"
seen: list[argparse.Namespace] = []  # what the stand-in handler was given


def _record(args: argparse.Namespace) -> int:
    seen.append(args)
    return 0


@pytest.fixture
def handler(monkeypatch):
    """``swarmtrain node`` and ``train`` run ``_record`` instead of starting anything."""
    seen.clear()
    for name in ("node", "train"):
        stand_in = dataclasses.replace(COMMANDS[name], handler=f"{__name__}:_record")
        monkeypatch.setitem(COMMANDS, name, stand_in)
    return seen


def _file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "node.toml"
    path.write_text(text)
    return path


def _parse(argv: list[str]) -> argparse.Namespace:
    return build_parser(argv).parse_args(argv)


@pytest.mark.parametrize("command", ["node", "train"])
def test_the_template_lists_every_setting_and_reads_back_as_the_defaults(command, tmp_path):
    parser = command_parser(command)
    text = template(parser, command)
    for key in settings_of(parser):
        assert f"\n{key} = " in text or f"\n# {key} = " in text, key
    values = parse_config(parser, text, tmp_path / "node.toml")
    defaults = {a.dest: a.default for a in parser._actions}
    assert values and all(defaults[dest] == value for dest, value in values.items())


def test_a_flag_added_to_the_parser_is_a_key_with_no_change_elsewhere(tmp_path):
    parser = CommandParser(prog="swarmtrain node")
    node_arguments(parser)
    parser.add_argument("--a-new-flag", default="127.0.0.1:8080", help="where the page is")
    assert '\n# where the page is\na-new-flag = "127.0.0.1:8080"\n' in template(parser, "node")
    values = parse_config(parser, 'a-new-flag = "auto"\n', tmp_path / "node.toml")
    assert values == {"a_new_flag": "auto"}


def test_flags_on_the_command_line_override_the_file(tmp_path, handler):
    config = _file(
        tmp_path,
        'run = "myrun"\n'
        "checkpoint-every = 30\n"
        "stages = 3\n"
        f'initial-peers = ["{MADDR}"]\n'
        "no-train = true\n"
        'checkpoint-dir = "ckpt"\n'
        'events = "~/events.jsonl"\n',
    )
    assert main(["node", "--checkpoint-every", "10", "--config", str(config), "--stage", "1"]) == 0
    args = handler[-1]
    assert args.checkpoint_every == 10.0  # the flag, wherever it stands
    assert (args.run, args.stages, args.initial_peers) == ("myrun", 3, [MADDR])
    assert args.no_train is True and args.stage == 1
    assert args.heartbeat == 60.0  # in neither: the parser's default
    assert args.checkpoint_dir == tmp_path / "ckpt"  # relative to the file, not the cwd
    assert args.events == Path("~/events.jsonl").expanduser()


@pytest.mark.parametrize("form", [["--config", "{}"], ["--config={}"], ["--conf", "{}"]])
def test_every_spelling_of_the_flag_reads_the_file(form, tmp_path):
    config = _file(tmp_path, "stages = 4\n")
    argv = ["node", *(a.format(config) for a in form)]
    assert _parse(argv).stages == 4


def test_a_switch_set_false_in_the_file_is_the_flag_not_given(tmp_path):
    config = _file(tmp_path, "one-stage = false\nverbose = true\n")
    assert _parse(["node", "--config", str(config)]).one_stage is False
    assert _parse(["node", "--config", str(config), "--one-stage"]).one_stage is True
    assert _parse(["node", "--config", str(config)]).verbose is True


def test_settings_the_command_requires_may_come_from_the_file(tmp_path):
    config = _file(tmp_path, f'run = "r@x"\ninitial-peers = ["{MADDR}"]\nmicro-batches = 5\n')
    args = _parse(["train", "--config", str(config)])
    assert (args.run, args.initial_peers, args.micro_batches) == ("r@x", [MADDR], 5)


def test_an_unknown_key_is_named_with_its_line(tmp_path):
    path = tmp_path / "node.toml"
    text = 'run = "r"\n\n# a comment\ncheckpoint_every = 30\n'
    with pytest.raises(ConfigError) as e:
        parse_config(command_parser("node"), text, path)
    assert str(e.value) == (
        f"{path} line 4: unknown key 'checkpoint_every' (did you mean 'checkpoint-every'?)"
    )
    with pytest.raises(ConfigError, match=r"line 2: unknown key 'node'"):
        parse_config(command_parser("node"), 'run = "r"\n[node]\nstages = 2\n', path)


@pytest.mark.parametrize(
    ("line", "says"),
    [
        ('stages = "3"', r"stages: expected a number, got the text \"3\""),
        ("stages = 0", "stages: must be 1 or more, got 0"),
        ("rebalance-period = -1.5", "rebalance-period: must be more than 0, got -1.5"),
        ("preset = 5", "preset: expected text in quotes, got 5"),
        ('device = "gpu"', r"device: \"gpu\" is not one of \"auto\", \"cpu\""),
        ('one-stage = "yes"', r"one-stage: expected true or false, got \"yes\""),
        (f'initial-peers = "{MADDR}"', "initial-peers: expected a list"),
        ('initial-peers = ["/ip4/1.2.3.4/tcp/1"]', "initial-peers: .*p2p"),
        ("stage = [1]", r"stage: expected a single value, got \[1\]"),
    ],
)
def test_a_wrong_value_is_named_with_its_key_and_line(line, says, tmp_path):
    path = tmp_path / "node.toml"
    with pytest.raises(ConfigError, match=f"^{path} line 3: {says}"):
        parse_config(command_parser("node"), f'run = "r"\n# {line}\n{line}\n', path)


def test_a_malformed_file_is_refused_in_one_line_before_the_command_runs(tmp_path, handler, capsys):
    config = _file(tmp_path, 'run = "r"\nstages = \n')
    with pytest.raises(SystemExit) as e:
        main(["node", "--config", str(config)])
    assert e.value.code == 2 and handler == []
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("swarmtrain node: error: ")
    assert f"{config}: not valid TOML" in err and "line 2" in err


def test_a_missing_file_is_refused_in_one_line(tmp_path, handler, capsys):
    with pytest.raises(SystemExit) as e:
        main(["node", "--config", str(tmp_path / "nope.toml")])
    assert e.value.code == 2 and handler == []
    assert "cannot read" in capsys.readouterr().err


def test_config_init_prints_the_template(capsys):
    assert main(["config", "init"]) == 0
    out = capsys.readouterr().out
    assert out == template(command_parser("node"), "node")
    assert "\ncheckpoint-every = 300.0\n" in out and '\n# spec = "SPEC"\n' in out
    assert main(["config", "init", "train"]) == 0
    assert "\n# run = " in capsys.readouterr().out  # required, no default: to fill in


def test_other_kinds_of_flag_read_as_argparse_would_take_them(tmp_path):
    parser = CommandParser(prog="swarmtrain x")
    parser.add_argument("--tag", action="append", type=int, help="repeatable")
    parser.add_argument("--pair", nargs=2, help="two values")
    parser.add_argument("--watch", nargs="?", type=float, const=5.0, help="optional value")
    parser.add_argument("--color", action=argparse.BooleanOptionalAction, default=True)
    path = tmp_path / "x.toml"
    text = 'tag = [1, 2]\npair = ["a", "b"]\nwatch = true\ncolor = false\n'
    values = parse_config(parser, text, path)
    assert values == {"tag": [1, 2], "pair": ["a", "b"], "watch": 5.0, "color": False}
    assert parse_config(parser, "watch = 2\n", path) == {"watch": 2.0}
    with pytest.raises(ConfigError, match=r"line 1: pair: expected 2 values, got 1"):
        parse_config(parser, 'pair = ["a"]\n', path)
    assert "\ncolor = true\n" in template(parser, "x")
