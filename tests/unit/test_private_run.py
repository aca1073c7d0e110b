"""Private runs without a swarm: the owner's node invites itself with the key at the
default path, and ``run invite`` refuses bad input in one line."""

from __future__ import annotations

import re
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from node.cli.main import main
from node.daemon.settings import NodeSettings
from node.daemon.start import invite_for
from node.files import load_or_create_key
from node.rpc.membership import prove_membership
from protocol.identity import peer_id_of
from protocol.run_spec import (
    make_run_spec,
)


def test_the_owners_node_finds_its_key_at_the_default_path(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    key = load_or_create_key(Path("~/.swarmtrain/owner.key"))
    spec = make_run_spec("lab", "tiny", 2, owner=peer_id_of(key.public_key()), private=True)
    me = peer_id_of(Ed25519PrivateKey.generate().public_key())
    invite = invite_for(NodeSettings(run=spec.run), me)(spec)
    assert invite is not None, "the owner's node needs no invite"
    assert prove_membership(spec.membership, me, invite) is not None
    other = peer_id_of(Ed25519PrivateKey.generate().public_key())
    monkeypatch.setenv("HOME", str(tmp_path / "elsewhere"))  # no owner key: no invite
    assert invite_for(NodeSettings(run=spec.run), other)(spec) is None


def test_run_invite_refuses_bad_input_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HOME", str(tmp_path))
    key_file = tmp_path / "owner.key"
    assert main(["run", "create", "lab", "--private", "--owner-key", str(key_file),
                 "--out", str(tmp_path / "lab.spec.json")]) == 0  # fmt: skip
    run = re.search(r"created private run (\S+)", capsys.readouterr().out).group(1)
    owner = ["--run", run, "--owner-key", str(key_file)]
    for args, what in [
        ([*owner, "--peer", "x"], "is not a peer id"),
        ([*owner, "--expires", "3"], "needs a unit"),
        ([*owner, "--expires", "0m"], "needs a unit"),
        (["--run", run], "no owner key at"),  # someone else, with no owner key
    ]:
        assert main(["run", "invite", *args]) == 2, args
        captured = capsys.readouterr()
        assert captured.out == "" and len(captured.err.strip().splitlines()) == 1, captured
        assert what in captured.err, captured.err
    assert not (tmp_path / ".swarmtrain" / "owner.key").exists(), "no key made for a non-owner"
    other_key = tmp_path / "other.key"
    load_or_create_key(other_key)
    assert main(["run", "invite", "--run", run, "--owner-key", str(other_key)]) == 2
    assert "only the run's owner can invite" in capsys.readouterr().err
    assert main(["run", "invite", *owner, "--expires", "90m"]) == 0
    assert capsys.readouterr().out.startswith("swarmtrain-invite:")
