"""The node's gossip view and arrival count, without a swarm: gossip overrides records
only when newer, and arrivals are counted per peer-hour over a window."""

from __future__ import annotations

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from protocol.gossip import GossipSigner
from protocol.placement import ArrivalCount


def test_gossip_overrides_records_only_when_newer():
    """The view the node decides on (``node.placement.driver.merge_gossip``), without a network:
    gossip newer than a record wins; an older one does not; a peer without a record counts
    through its gossip only while that is younger than a record would live (a killed
    peer's last word must not keep its stage looking served); a newer ``leaving`` drops
    the peer."""
    from node.placement.driver import merge_gossip
    from protocol.assignment import Claim
    from protocol.gossip import GossipView
    from tests.records import peer_info

    run, now = "merge", 1_700_000_000.0
    keys = [Ed25519PrivateKey.from_private_bytes(bytes([i]) * 32) for i in range(1, 6)]
    me, moved, stale, newcomer, gone = (GossipSigner(k, run) for k in keys)
    records = [
        peer_info(run, s.peer_id, stage=0, timestamp=now - 1.0) for s in (me, moved, stale, gone)
    ]
    view = GossipView(run, num_stages=2)
    for signer, raw in [
        (me, me.serving(1, 50.0, now)),
        (moved, moved.move(0, 1, 40.0, now)),  # newer than its record: counts
        (stale, stale.serving(1, 50.0, now - 2.0)),  # older than its record: ignored
        (newcomer, newcomer.join(1, 30.0, now - 2.0)),  # no record, young enough
        (gone, gone.leaving(0, now)),
    ]:
        view.receive(raw, signer.peer_id, now)
    kept, claims = merge_gossip(records, view.latest, me=me.peer_id, now=now, max_silence_s=3.0)
    assert {p.peer_id for p in kept} == {moved.peer_id, stale.peer_id}
    assert sorted(claims, key=lambda c: c.peer) == sorted(
        [
            Claim(moved.peer_id, 1, 40.0, serving=False),
            Claim(newcomer.peer_id, 1, 30.0, serving=False),
        ],
        key=lambda c: c.peer,
    )
    # the newcomer's join intent outlives no record: 4 s later it no longer counts
    _, later = merge_gossip([], view.latest, me=me.peer_id, now=now + 4.0, max_silence_s=3.0)
    assert [c.peer for c in later] == []
    # only peers this node reached count: a forged record or claim from a key that runs no
    # host (a sybil claiming 1e9 samples/s) neither lures peers away nor confirms a move
    reached = {moved.peer_id, newcomer.peer_id}.__contains__
    kept, claims = merge_gossip(
        records, view.latest, me=me.peer_id, now=now, max_silence_s=3.0, reached=reached
    )
    assert [p.peer_id for p in kept] == [moved.peer_id]
    assert sorted(c.peer for c in claims) == sorted([moved.peer_id, newcomer.peer_id])


def test_arrivals_are_counted_per_peer_hour_over_a_window():
    count = ArrivalCount(window_s=600.0)
    first = frozenset(f"p{i}" for i in range(10))
    count.saw(first, 0.0)  # there before us: not arrivals
    assert count.rate(0.0) is None
    count.saw(first | {"a", "b"}, 100.0)
    assert count.rate(599.0) is None  # not watched a whole window yet
    assert count.rate(600.0) == pytest.approx(2 * 6 / 12)  # 2 in 10 min, 12 present
    count.saw(first | {"a"}, 650.0)  # b left; it arrived within the window: still counted
    assert count.rate(650.0) == pytest.approx(2 * 6 / 11)
    count.saw(first | {"a"}, 800.0)  # a and b arrived more than a window ago
    assert count.rate(800.0) == 0.0
    count.saw(first - {"p0"}, 900.0)
    count.saw(first, 950.0)  # p0 was gone, and known from before the window: counted again
    assert count.rate(950.0) == pytest.approx(1 * 6 / 10)
    # A node that never asks for the rate (it stays on its stage) keeps no more than a
    # window's arrivals, however many peers come and go.
    for t in range(1000, 100_000, 10):
        count.saw(frozenset({f"churn{t}"}), float(t))
    assert len(count._times) <= 600 / 10 + 1
