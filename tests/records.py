"""A valid peer record to start from, for tests that forge, mutate or plant records."""

from __future__ import annotations

from hivemind.utils import get_dht_time

from protocol.records import PROTOCOL_VERSION, PeerInfo, PeerState


def peer_info(run: str, peer_id: str, **changes) -> PeerInfo:
    """A serving peer of stage 1 (of 2) with declared figures, dated now unless changed."""
    fields = {
        "peer_id": peer_id,
        "run": run,
        "version": PROTOCOL_VERSION,
        "device": "cpu",
        "throughput": (50.0, 50.0),
        "throughput_source": "declared",
        "bandwidth_up_mbps": 10.0,
        "bandwidth_down_mbps": 10.0,
        "bandwidth_source": "declared",
        "stage": 1,
        "state": PeerState.SERVING,
        "load": 0,
        "timestamp": get_dht_time(),
    }
    return PeerInfo(**{**fields, **changes})
