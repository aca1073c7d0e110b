"""Records written into a live run's DHT by a hostile peer: a raw ``hivemind.DHT`` without
our validator stores bad peer records next to a real node's, and ``swarmtrain status``
lists only what validates.

The honest node refuses bad records when asked to store them (its ``RunRecordValidator``
logs "refused a DHT record"), and that matters beyond tidiness: hivemind validates a
dictionary value as a whole when it is read from a peer, so one bad entry held by an
honest node would hide every record that node holds from every reader."""

from __future__ import annotations

import hivemind
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hivemind.utils import get_dht_time

from protocol.identity import peer_id_of
from protocol.keys import peers_key
from protocol.records import (
    MAX_RECORD_AGE_S,
    PROTOCOL_VERSION,
    PeerInfo,
    PeerState,
    encode_peer_info,
)
from tests.swarm import LOCAL, launch_node, status, stop_all, wait_until


def _present(view: dict) -> dict[str, dict]:
    return {p["peer_id"]: p for p in view["peers"]}


def _fresh() -> tuple[Ed25519PrivateKey, str]:
    key = Ed25519PrivateKey.generate()
    return key, peer_id_of(key.public_key())


def _info(run: str, peer_id: str, **changes) -> PeerInfo:
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


def _attacker(maddr: str) -> hivemind.DHT:
    """A DHT peer of the run that checks nothing: it stores and serves whatever it is given."""
    return hivemind.DHT(initial_peers=[maddr], host_maddrs=[LOCAL], start=True)


def test_bad_records_from_a_peer_are_refused_and_a_good_one_is_listed(tmp_path):
    run = "attacked"
    node = launch_node(tmp_path, "honest", run, extra=["--stage", "0"])
    attacker = None
    try:
        assert node.wait_serving() == 0
        attacker = _attacker(node.maddr)
        key = peers_key(run)
        expires = get_dht_time() + 120

        (_, malformed_id), (x_key, x_id), (w_key, _) = _fresh(), _fresh(), _fresh()
        (a_key, a_id), (v_key, v_id), (s_key, s_id) = _fresh(), _fresh(), _fresh()
        bad = {
            "malformed bytes": (malformed_id, b"\xc1 not a record"),
            "wrong signature": (x_id, encode_peer_info(_info(run, x_id), w_key)),
            "impersonation": (a_id, encode_peer_info(_info(run, node.peer_id), a_key)),
            "future version": (
                v_id,
                encode_peer_info(_info(run, v_id, version=PROTOCOL_VERSION + 1), v_key),
            ),
            "stale": (
                s_id,
                encode_peer_info(
                    _info(run, s_id, timestamp=get_dht_time() - MAX_RECORD_AGE_S - 30), s_key
                ),
            ),
            # The honest node's own slot, overwritten with a forged record that outlives it.
            "hijack": (
                node.peer_id,
                encode_peer_info(_info(run, node.peer_id, stage=1, load=999), w_key),
            ),
        }
        refusals = {
            "malformed bytes": "record is not valid msgpack",
            "wrong signature": f"bad signature on the record of peer {x_id}",
            "impersonation": f"record of peer {node.peer_id} stored under another peer's key {a_id}",
            "future version": f"peer {v_id} speaks protocol version {PROTOCOL_VERSION + 1}",
            "stale": f"record of peer {s_id} is",
            "hijack": f"bad signature on the record of peer {node.peer_id}",
        }
        for subkey, value in bad.values():
            attacker.store(key, subkey=subkey, value=value, expiration_time=expires + 600)

        # The control: stored the same way, by the same peer, but valid. It must appear,
        # or this test would pass with a validator that refused everything.
        good_key, good_id = _fresh()
        assert attacker.store(
            key,
            subkey=good_id,
            value=encode_peer_info(_info(run, good_id), good_key),
            expiration_time=expires,
        )

        view = wait_until(
            lambda: (v := status(run, node.maddr)) and good_id in _present(v) and v,
            30,
            "status to list the record the attacker's DHT stored correctly signed",
        )
        present = _present(view)
        assert set(present) == {node.peer_id, good_id}, f"listed: {sorted(present)}"
        assert present[node.peer_id]["stage"] == 0 and present[node.peer_id]["load"] == 0
        assert present[good_id]["stage"] == 1 and present[good_id]["state"] == "serving"

        for what, reason in refusals.items():
            wait_until(
                lambda reason=reason: reason in node.output(),
                10,
                f"the honest node to refuse the {what} record ({reason!r})",
            )
        assert "refused a DHT record of run attacked" in node.output()
        assert good_id not in node.output(), "the good record was refused"
    finally:
        if attacker is not None:
            attacker.shutdown()
        stop_all([node])


def test_a_record_that_goes_stale_in_storage_hides_no_one(tmp_path):
    """A record valid when stored, with a DHT expiration later than its age limit: once it
    is older than ``MAX_RECORD_AGE_S`` it is stale, but it must not take the records stored
    next to it down with it."""
    run = "aging"
    node = launch_node(tmp_path, "honest", run, extra=["--stage", "0"])
    attacker = None
    try:
        assert node.wait_serving() == 0
        attacker = _attacker(node.maddr)
        key, peer_id = _fresh()
        stale_at = get_dht_time() + 3
        info = _info(run, peer_id, timestamp=stale_at - MAX_RECORD_AGE_S)
        assert attacker.store(
            peers_key(run),
            subkey=peer_id,
            value=encode_peer_info(info, key),
            expiration_time=get_dht_time() + 600,
        )
        wait_until(
            lambda: peer_id in _present(status(run, node.maddr)), 30, "the aging record to be listed"
        )
        wait_until(lambda: get_dht_time() > stale_at + 1, 10, "the record to go stale")
        present = _present(status(run, node.maddr))
        assert peer_id not in present
        assert node.peer_id in present, "a stale record hid the honest node's record"
    finally:
        if attacker is not None:
            attacker.shutdown()
        stop_all([node])
