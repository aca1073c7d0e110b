"""Records written into a live run's DHT by a hostile peer: a raw ``hivemind.DHT`` without
our validator stores bad peer records next to a real node's, and ``swarmtrain status``
lists only what validates.

The honest node refuses bad records when asked to store them (its ``RunRecordValidator``
writes a ``record.refused`` event), and that matters beyond tidiness: hivemind validates a
dictionary value as a whole when it is read from a peer, so one bad entry held by an
honest node would hide every record that node holds from every reader."""

from __future__ import annotations

import time

from hivemind.utils import get_dht_time

from node.harness.attackers import attacker_dht, forge_progress, own_record
from node.harness.local_swarm import NodeProcess
from protocol.keys import peers_key
from protocol.records import (
    MAX_RECORD_AGE_S,
    PROTOCOL_VERSION,
    encode_peer_info,
)
from tests.records import peer_info
from tests.swarm import StatusWatch, launch_node, stop_all, wait_until
from tests.unit.test_node_records import _fresh

WATCH_REPLAY_S = 10.0  # how long status must list the node's own record, not a replay


def _present(view: dict) -> dict[str, dict]:
    return {p["peer_id"]: p for p in view["peers"]}


def _refusals(node) -> list[str]:
    """Why the node refused each DHT record of its run it refused so far."""
    return [e["reason"] for e in node.events("record.refused") if e["run"] == node.run_id]


def test_bad_records_from_a_peer_are_refused_and_a_good_one_is_listed(tmp_path):
    run = "attacked"
    node = launch_node(tmp_path, "honest", run, extra=["--stage", "0"])
    run = node.run_id
    attacker = watch = None
    try:
        assert node.wait_serving() == 0
        watch = StatusWatch(run, node.maddr)
        attacker = attacker_dht(node.maddr)
        key = peers_key(run)
        expires = get_dht_time() + 60  # within every record's freshness but the stale one's

        (_, malformed_id), (_, x_id), (w_key, _) = _fresh(), _fresh(), _fresh()
        (a_key, a_id), (v_key, v_id), (s_key, s_id) = _fresh(), _fresh(), _fresh()
        bad = {
            "malformed bytes": (malformed_id, b"\xc1 not a record"),
            "wrong signature": (x_id, encode_peer_info(peer_info(run, x_id), w_key)),
            "impersonation": (a_id, encode_peer_info(peer_info(run, node.peer_id), a_key)),
            "future version": (
                v_id,
                encode_peer_info(peer_info(run, v_id, version=PROTOCOL_VERSION + 1), v_key),
            ),
            "stale": (
                s_id,
                encode_peer_info(
                    peer_info(run, s_id, timestamp=get_dht_time() - MAX_RECORD_AGE_S - 30), s_key
                ),
            ),
            # The honest node's own slot, with a forged record that moves it to stage 1.
            "hijack": (
                node.peer_id,
                encode_peer_info(peer_info(run, node.peer_id, stage=1, load=999), w_key),
            ),
        }
        refusals = {
            "malformed bytes": "record is not valid msgpack",
            "wrong signature": f"bad signature on the record of peer {x_id}",
            "impersonation": f"record of peer {node.peer_id} stored under another peer's key "
            f"{a_id}",
            "future version": f"peer {v_id} speaks protocol version {PROTOCOL_VERSION + 1}",
            "stale": f"record of peer {s_id} expires",
            "hijack": f"bad signature on the record of peer {node.peer_id}",
        }
        for subkey, value in bad.values():
            attacker.store(key, subkey=subkey, value=value, expiration_time=expires)

        # The control: stored the same way, by the same peer, but valid. It must appear,
        # or this test would pass with a validator that refused everything.
        good_key, good_id = _fresh()
        assert attacker.store(
            key,
            subkey=good_id,
            value=encode_peer_info(peer_info(run, good_id), good_key),
            expiration_time=expires,
        )

        view = watch.wait(
            lambda v: good_id in _present(v) and v,
            60,
            "status to list the record the attacker's DHT stored correctly signed",
        )
        present = _present(view)
        assert set(present) == {node.peer_id, good_id}, f"listed: {sorted(present)}"
        assert present[node.peer_id]["stage"] == 0 and present[node.peer_id]["load"] == 0
        assert present[good_id]["stage"] == 1 and present[good_id]["state"] == "serving"

        for what, reason in refusals.items():
            wait_until(
                lambda reason=reason: any(reason in r for r in _refusals(node)),
                10,
                f"the honest node to refuse the {what} record ({reason!r})",
            )
        assert not [r for r in _refusals(node) if good_id in r], "the good record was refused"
        assert node.stop() == 0  # unharmed: it still stops cleanly (and removes its sockets)
    finally:
        if watch is not None:
            watch.close()
        if attacker is not None:
            attacker.shutdown()
        stop_all([node])


def test_a_record_cannot_go_stale_in_storage_and_hide_everyone(tmp_path):
    """A record valid when stored goes stale later. Had an honest peer stored one whose DHT
    expiration outlives its freshness, every reader would refuse that peer's whole peer
    dictionary, hiding the run's peers until the record expired (it did, before the
    validator bounded expirations). Now such a record is refused at store, and one stored
    with an expiration within its freshness vanishes as it goes stale."""
    run = "aging"
    node = launch_node(tmp_path, "honest", run, extra=["--stage", "0"])
    run = node.run_id
    attacker = watch = None
    try:
        assert node.wait_serving() == 0
        watch = StatusWatch(run, node.maddr)
        attacker = attacker_dht(node.maddr)
        watch.view()  # status is up: its views come every second or so from now on
        dated = get_dht_time() - MAX_RECORD_AGE_S + 15  # fresh for 15 s more
        (long_key, long_id), (short_key, short_id) = _fresh(), _fresh()
        for key, peer_id, expiration in [
            (long_key, long_id, dated + MAX_RECORD_AGE_S + 600),
            (short_key, short_id, dated + MAX_RECORD_AGE_S),
        ]:
            value = encode_peer_info(peer_info(run, peer_id, timestamp=dated), key)
            attacker.store(peers_key(run), subkey=peer_id, value=value, expiration_time=expiration)

        present = watch.wait(
            lambda v: (p := _present(v)) and short_id in p and p,
            10,
            "the record that expires with its freshness to be listed",
        )
        assert long_id not in present
        assert f"record of peer {long_id} expires 720 s after it is dated" in " ".join(
            _refusals(node)
        )

        wait_until(lambda: get_dht_time() > dated + MAX_RECORD_AGE_S + 1, 20, "staleness")
        present = _present(watch.view())
        assert node.peer_id in present, "a stale record hid the honest node's record"
        assert set(present) == {node.peer_id}
        assert node.stop() == 0
    finally:
        if watch is not None:
            watch.close()
        if attacker is not None:
            attacker.shutdown()
        stop_all([node])


def test_a_replayed_record_does_not_hide_a_live_node_nor_is_an_extra_stage_listed(tmp_path):
    """A node's own record, re-stored by an attacker after it aged, with an expiration
    that outlives the node's fresh records, would displace them (the DHT keeps a
    subkey's value with the latest expiration). A record names how long it lives, and is
    stored to expire exactly then, so that a replay is refused and the node's newest
    record stays listed. A self-consistent record for a stage the run does not have (its
    throughput names 6 stages, of a 2-stage run) is not listed either."""
    run = "replayed"
    node = launch_node(tmp_path, "honest", run, extra=["--stage", "0"])
    run = node.run_id
    attacker = watch = None
    try:
        assert node.wait_serving() == 0
        watch = StatusWatch(run, node.maddr)
        attacker = attacker_dht(node.maddr)
        key = peers_key(run)

        raw, dated = wait_until(
            lambda: own_record(attacker, run, node.peer_id), 20, "the node's record in the DHT"
        )
        wait_until(lambda: get_dht_time() > dated + 5, 10, "the record to age 5 s")
        attacker.store(key, subkey=node.peer_id, value=raw, expiration_time=dated + 110)
        extra_key, extra_id = _fresh()
        extra = peer_info(run, extra_id, stage=5, throughput=(50.0,) * 6)
        attacker.store(
            key, subkey=extra_id, value=encode_peer_info(extra, extra_key),
            expiration_time=get_dht_time() + 60,
        )  # fmt: skip

        wait_until(
            lambda: any("a replayed or altered record" in r for r in _refusals(node)),
            10,
            "the honest node to refuse the replay",
        )
        ages = []
        present = _present(watch.view())
        watched = time.monotonic()
        while True:  # every view for 10 s: the node's record stays its newest, one period old
            assert set(present) == {node.peer_id}, f"listed: {sorted(present)}"
            ages.append(present[node.peer_id]["age_s"])
            if time.monotonic() - watched > WATCH_REPLAY_S:
                break
            present = _present(watch.next())
        assert len(ages) >= 5 and max(ages) < 5, f"the node's listed record aged: {ages}"
    finally:
        if watch is not None:
            watch.close()
        if attacker is not None:
            attacker.shutdown()
        stop_all([node])


def _epoch(node) -> int:
    rounds = node.events("averaging.round")
    return rounds[-1]["epoch"] if rounds else 0


def test_a_forged_claim_of_being_far_ahead_does_not_stop_the_steps(tmp_path):
    """Progress records per stage claiming epoch 2^50 made every peer wait to catch up with
    a state nobody could hand over: no stage stepped again. Now a record must be signed by
    the peer it names (an unsigned claim is refused by every node's DHT), its peer must
    have a valid peer record in the run (a claim signed by a key made up for it is ignored),
    and a claim of being ahead is believed only once the state is downloaded (a peer of the
    run that claims it and does not prove it is ignored for a while): the stages step on."""
    nodes = [launch_node(tmp_path, "s0", "forged", extra=["--stage", "0"], train=True)]
    run = nodes[0].run_id
    nodes.append(
        launch_node(
            tmp_path, "s1", run, initial_peers=[nodes[0].maddr], extra=["--stage", "1"], train=True
        )
    )
    attacker = None
    try:
        for n in nodes:
            n.wait_serving()
        wait_until(lambda: all(_epoch(n) >= 2 for n in nodes), 90, "both stages to step")
        attacker = attacker_dht(nodes[0].maddr)
        refused = {n.name: len(_refusals(n)) for n in nodes}
        liars = forge_progress(attacker, run, 2)
        unsigned, stranger, member = liars["unsigned"], liars["stranger"], liars["member"]

        def named(n: NodeProcess) -> set[str]:
            return {p for e in n.events("progress.unproven") for p in e["peers"]}

        # The member's claim is read, asked to be proven, and then ignored; the stages
        # step on past it (they may step before a node reads the claims at all: wait for
        # the reading first).
        wait_until(lambda: all(member in named(n) for n in nodes), 120, "the claim to be read")
        forged = {n.name: _epoch(n) for n in nodes}
        wait_until(
            lambda: all(_epoch(n) >= forged[n.name] + 3 for n in nodes),
            120,
            f"both stages to step 3 more times past the forged claims (at {forged})",
        )
        assert any(len(_refusals(n)) > refused[n.name] for n in nodes), "the unsigned claim"
        for n in nodes:
            assert not named(n) & {unsigned, stranger}, (n.name, named(n))
    finally:
        if attacker is not None:
            attacker.shutdown()
        stop_all(nodes)
