"""Who joins and leaves a run as one node sees it, and its heartbeat: pure bookkeeping,
checked through the events it emits."""

from __future__ import annotations

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from node import events
from node.daemon.watch import Heartbeat, Members
from protocol.identity import peer_id_of
from protocol.records import PeerState
from tests.records import peer_info

RUN = "watch"
ME, A, B, C, D = (peer_id_of(Ed25519PrivateKey.generate().public_key()) for _ in range(5))


def test_joins_and_departures_are_emitted_after_the_first_read(tmp_path):
    log = tmp_path / "events.jsonl"
    events.open_log(log)
    try:
        members = Members(ME, grace_s=10.0)
        members.update([peer_info(RUN, A), peer_info(RUN, ME)], now=0.0)
        members.report(first=True)
        assert members.joined == [] and members.seen == {A: 0.0}, "a was there before us"
        members.update([peer_info(RUN, A), peer_info(RUN, B, stage=0)], now=5.0)
        members.report(first=False)
        assert [p.peer_id for p in members.joined] == [B]
        # a announces it leaves; b's record goes missing, but only for less than the grace
        members.update([peer_info(RUN, A, state=PeerState.LEAVING)], now=9.0)
        members.report(first=False)
        assert members.left == [(A, "announced it")] and B in members.seen
        members.update([], now=16.0)
        members.report(first=False)
        assert members.left == [(B, "no record for 11 s")] and members.seen == {}
    finally:
        events.close_log()
    emitted = [(e["event"], e["peer"]) for e in events.read_events(log)]
    assert emitted == [("peer.joined", B), ("peer.left", A), ("peer.left", B)]
    assert events.read_events(log, "peer.joined")[0]["stage"] == 0


def test_heartbeat_counts_the_peers_of_its_stages_and_of_the_run():
    peers = [
        peer_info(RUN, A, stage=0),
        peer_info(RUN, B, stage=1, second_stage=0),
        peer_info(RUN, C, stage=1),
        peer_info(RUN, D, stage=0, state=PeerState.LEAVING),
    ]
    beat = Heartbeat.of(ME, peers, first=0, second=None, served=7, steps=2)
    assert (beat.stage_peers, beat.run_peers) == (3, 4)  # me, a, b (second stage 0); all but d
    both = Heartbeat.of(ME, peers, first=0, second=1, served=7, steps=2)
    assert both.stage_peers == 4
