"""A run's spec never changes: the owner's tools refuse a different spec under an existing
run id, and peers that see two specs signed for one id all keep the first."""

from __future__ import annotations

import asyncio
import logging

import pytest

from node.cli.main import main
from node.daemon.node import NodeError, NodeSettings, resolve_run
from node.files import load_or_create_key
from node.rpc.dht import SpecConflict, SwarmDHT
from protocol.identity import peer_id_of
from protocol.run_spec import make_run_spec, read_spec_file, sign_run_spec
from tests.swarm import LOCAL


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    return tmp_path


def test_restarting_a_run_by_name_with_other_settings_is_refused(home):
    run, first = resolve_run(NodeSettings(run="r3", n_stages=2))
    assert first.spec.n_stages == 2
    # A restart with the same flags publishes the very same signed spec.
    again = resolve_run(NodeSettings(run="r3", n_stages=2))[1]
    assert again.raw == first.raw
    with pytest.raises(NodeError, match=r"2 -> 3 stages.*new name"):
        resolve_run(NodeSettings(run="r3", n_stages=3))
    with pytest.raises(NodeError, match="compression 'none' -> 'float16'"):
        resolve_run(NodeSettings(run="r3", n_stages=2, compression="float16"))
    # Another name is another run.
    assert resolve_run(NodeSettings(run="r4", n_stages=3))[1].spec.n_stages == 3
    recorded = home / ".swarmtrain" / "runs" / f"{run}.spec.json"
    assert read_spec_file(recorded.read_text()).raw == first.raw


def test_run_create_refuses_a_different_spec_under_an_existing_name(home, capsys):
    key = home / "owner.key"
    assert main(["run", "create", "lab", "--stages", "2", "--owner-key", str(key),
                 "--out", str(home / "a.json")]) == 0  # fmt: skip
    assert main(["run", "create", "lab", "--stages", "2", "--owner-key", str(key),
                 "--out", str(home / "b.json")]) == 0  # fmt: skip
    a, b = (read_spec_file((home / f).read_text()) for f in ("a.json", "b.json"))
    assert a.raw == b.raw, "the same flags: the same spec"
    capsys.readouterr()
    assert main(["run", "create", "lab", "--stages", "3", "--owner-key", str(key),
                 "--out", str(home / "c.json")]) == 2  # fmt: skip
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "2 -> 3 stages" in err, err
    assert not (home / "c.json").exists()
    assert main(["run", "create", "lab", "--private", "--owner-key", str(key),
                 "--out", str(home / "c.json")]) == 2  # fmt: skip


def test_peers_keep_the_first_of_two_specs_for_one_run_id(tmp_path, caplog):
    key = load_or_create_key(tmp_path / "owner.key")
    owner = peer_id_of(key.public_key())
    first = sign_run_spec(make_run_spec("twice", "tiny", 2, owner=owner, created=1000.0), key)
    later = sign_run_spec(make_run_spec("twice", "tiny", 3, owner=owner, created=2000.0), key)
    run = first.spec.run
    dht = SwarmDHT.start(run, host_maddrs=[LOCAL])
    other = None
    try:
        other = SwarmDHT.start(run, initial_peers=dht.visible_maddrs(), host_maddrs=[LOCAL])

        async def check() -> None:
            # The later spec was published first (an owner's node restarted with other
            # flags, say, with the first one already in the DHT from elsewhere).
            assert await dht.publish_spec(later)
            assert await dht.publish_spec(first), "the earlier one is stored next to it"
            with caplog.at_level(logging.WARNING, logger="node.rpc.dht"):
                assert (await dht.spec()).raw == first.raw
            assert "two specs" in caplog.text and "2 -> 3 stages" in caplog.text
            # Another peer makes the same choice, and an owner's tool that would publish
            # the later one there is refused.
            assert (await other.spec()).raw == first.raw
            with pytest.raises(SpecConflict, match="2 -> 3 stages"):
                await other.publish_spec(later)
            assert await other.publish_spec(first)

        asyncio.run(check())
    finally:
        if other is not None:
            other.shutdown()
        dht.shutdown()
