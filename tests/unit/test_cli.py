"""What the ``swarmtrain`` command line decides without starting anything: verbosity
flags and the light argument module."""

from __future__ import annotations

import pytest

PEER = "12D3KooWRBy97UB99e3J6hiPesre1MZeuNQvfan4gBziswrRJsNK"  # a valid id; nobody runs it


@pytest.mark.parametrize(
    "argv",
    [
        ["-v", "node", "--run", "r"],
        ["node", "-v", "--run", "r"],
        ["node", "--run", "r", "--verbose"],
        ["status", "--run", "r", "--initial-peers", f"/ip4/127.0.0.1/tcp/1/p2p/{PEER}", "-v"],
        ["run", "invite", "--run", "r", "-v"],
    ],
    ids=" ".join,
)
def test_verbose_before_or_after_the_subcommand(argv):
    from node.cli.main import build_parser

    assert build_parser(argv).parse_args(argv).verbose is True


def test_not_verbose_by_default():
    from node.cli.main import build_parser

    argv = ["node", "--run", "r"]
    assert build_parser(argv).parse_args(argv).verbose is False


def test_daemon_errors_read_as_one_line():
    from node.rpc.dht import _start_failure

    busy = RuntimeError(
        "Daemon failed to start: 2026/12/01 15:45:15 failed to listen on any addresses: "
        "[listen tcp4 127.0.0.1:45123: bind: address already in use]"
    )
    text = _start_failure(busy, [], ["/ip4/127.0.0.1/tcp/45123"])
    assert "cannot listen on /ip4/127.0.0.1/tcp/45123: address already in use" in text
    other = _start_failure(RuntimeError("Daemon failed to start: boom\nmore"), [], [])
    assert "\n" not in other and "boom" in other
    # hivemind's DHT refuses a peer whose clock is more than 3 s off (its words, verbatim)
    skewed = ValueError("local time must be within 3 seconds  of others(local: "
                        "1796414657.98202, peer: 1796414652.99232)")  # fmt: skip
    text = _start_failure(skewed, [], [])
    assert text.startswith("this machine's clock is 5.0 s ahead of an initial peer's"), text
    assert "timedatectl set-ntp true" in text


def test_light_module_knows_the_corpus_name():
    from models.data import STDLIB
    from node.cli.args import STDLIB as light

    assert light == STDLIB


def test_run_create_sets_compressed_diloco_and_refuses_it_in_one_line(tmp_path, capsys):
    from node.cli.main import main
    from protocol.run_spec import read_spec_file

    base = ["run", "create", "zip", "--owner-key", str(tmp_path / "owner.key")]
    out = tmp_path / "zip.spec.json"
    zipped = ["--averaging-density", "0.1", "--averaging-compression", "uint8"]
    assert main([*base, "--averaging", "diloco", *zipped, "--out", str(out)]) == 0
    averaging = read_spec_file(out.read_text()).spec.averaging
    assert (averaging.mode, averaging.density, averaging.compression) == ("diloco", 0.1, "uint8")
    capsys.readouterr()
    for wrong in (zipped, ["--averaging", "diloco", "--averaging-density", "0"]):
        assert main([*base, *wrong, "--out", str(tmp_path / "no.json")]) == 2, wrong
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "density" in err and "pydantic" not in err, err
        assert not (tmp_path / "no.json").exists()


def test_the_light_module_names_the_specs_default_compressions():
    from node.cli import args
    from protocol import run_spec

    assert args.DEFAULT_COMPRESSION == run_spec.DEFAULT_COMPRESSION
    assert args.DEFAULT_AVERAGING_COMPRESSION == run_spec.DEFAULT_AVERAGING_COMPRESSION


def test_the_light_module_names_the_routing_window():
    from node.cli.args import WINDOW as light
    from protocol.routing import WINDOW

    assert light == WINDOW


def test_run_create_and_a_new_nodes_spec_default_to_int4_boundaries_and_8_bit_rounds(tmp_path):
    from node.cli.main import build_parser, main
    from protocol.run_spec import read_spec_file

    out = tmp_path / "home.spec.json"
    argv = ["run", "create", "home", "--owner-key", str(tmp_path / "owner.key"), "--out", str(out)]
    assert main(argv) == 0
    spec = read_spec_file(out.read_text()).spec
    assert (spec.compression, spec.averaging.compression) == ("int4", "uint8")
    node = build_parser(["node", "--run", "r"]).parse_args(["node", "--run", "r"])
    assert node.compression is None  # a new run's default, or a restarted run's own
