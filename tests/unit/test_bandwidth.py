"""Bandwidth probe settings are checked before anything is sent."""

from __future__ import annotations

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from node.measure.bandwidth import (
    MAX_PARTNERS,
    MAX_PROBE_BYTES,
    BandwidthProbe,
    partners,
)
from protocol.identity import peer_id_of
from protocol.records import PeerState
from tests.records import peer_info


def test_probe_settings_are_checked():
    with pytest.raises(ValueError, match="max_bytes must be in 1..2097152"):
        BandwidthProbe(max_bytes=MAX_PROBE_BYTES + 1)
    with pytest.raises(ValueError, match="burst_bytes >= max_bytes"):
        BandwidthProbe(max_bytes=2**20, burst_bytes=2**19)


def test_partners_are_peers_reached_first_and_few():
    """A flood of serving records from fresh keys: the peers this node has reached come
    first, whatever the flood's size, and at most ``MAX_PARTNERS`` are tried."""
    ids = [peer_id_of(Ed25519PrivateKey.generate().public_key()) for _ in range(203)]
    me, honest, sybils = ids[0], ids[1:3], ids[3:]
    records = [peer_info("run", p) for p in [me, *honest, *sybils]]
    records.append(peer_info("run", ids[-1], state=PeerState.LOADING))  # read twice
    chosen = partners(records, me, lambda p: p in honest, seed=me)
    assert len(chosen) == MAX_PARTNERS and set(chosen[:2]) == set(honest)
    assert chosen[2] in sybils and me not in chosen
    assert partners(records, me, lambda p: p in honest, seed=me) == chosen  # seeded
    assert partners([], me, lambda p: True, seed=me) == []
