"""A run's spec never changes: the owner's tools refuse a different spec under an existing
run id, and peers that see two specs signed for one id all keep the first."""

from __future__ import annotations

import asyncio

import pytest

from node import events
from node.files import load_or_create_key
from node.rpc.dht import SpecConflict, SwarmDHT
from protocol.identity import peer_id_of
from protocol.run_spec import make_run_spec, sign_run_spec
from tests.swarm import LOCAL


def test_peers_keep_the_first_of_two_specs_for_one_run_id(tmp_path, event_log):
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
            assert (await dht.spec()).raw == first.raw
            (conflict,) = events.read_events(event_log, "spec.conflict")
            assert conflict["run"] == run and "2 -> 3 stages" in conflict["changes"]
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
