"""``ProgressBoard``'s view of the other peers' progress, driven with a virtual clock and
records set by hand (``refresh`` is the only part that reads the DHT: here, a fake one)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from types import SimpleNamespace

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hivemind.utils import get_dht_time

from node.averaging.progress import PEERS_REFRESH_S, PUSHED_READ_S, ProgressBoard
from protocol.identity import peer_id_of
from protocol.progress import Progress, encode_progress
from protocol.records import RecordError
from tests.averaging_peer import make_spec

TTL = 2.0


def _board() -> tuple[ProgressBoard, list[float]]:
    now = [100.0]
    dht = SimpleNamespace(peer_id="me")  # only its peer id is read outside refresh/publish
    board = ProgressBoard(
        dht, make_spec("progress"), 1, ttl_s=TTL, name="stage 1", clock=lambda: now[0]
    )
    return board, now


def test_a_peer_missing_from_a_read_stays_for_the_time_to_live():
    board, now = _board()
    assert board.alone and board.peers == 0
    board.records = [Progress("a", 3, 5)]
    assert board.view() == [Progress("a", 3, 5)] and not board.alone
    board.records = []  # one read missed it
    now[0] += TTL - 0.5
    assert board.view() == [Progress("a", 3, 5)] and board.peers == 1
    now[0] += 1.0
    assert board.view() == [] and board.peers == 0 and board.alone


def test_an_epoch_never_goes_down_and_groupmates_are_learned():
    board, now = _board()
    board.records = [Progress("a", 3, 5)]
    board.view()
    board.records = [Progress("a", 2, 9)]  # an older copy of a's record
    assert board.view() == [Progress("a", 3, 0)]
    board.learn({"b": 4})  # a groupmate the reads do not show (yet)
    assert Progress("b", 4, 0) in board.view()
    assert board.ahead_of(3) and not board.ahead_of(4)


def test_a_claim_of_being_ahead_that_was_not_proven_is_ignored_for_a_while():
    board, now = _board()
    board.records = [Progress("a", 3, 5), Progress("liar", 2**50, 0)]
    assert board.ahead(3) == ["liar"]
    board.distrust(["liar"], 60.0)  # asked for its state, it handed over none
    assert board.view() == [Progress("a", 3, 5)] and not board.ahead_of(3)
    board.records = [Progress("a", 3, 5), Progress("liar", 2**50, 0)]  # read again
    board.learn({"liar": 2**51})  # or said so in a round
    assert board.view() == [Progress("a", 3, 5)]
    now[0] += 60.0  # once the time is up, a new claim is heard (and must be proven again)
    assert board.ahead(3) == ["liar"]


def test_a_read_keeps_signed_records_of_peers_in_the_run_only():
    """Of the records under the stage's key, a read keeps those signed by the peer they
    name and whose peer has a valid peer record in the run: a record signed by a key made
    up for the occasion, or unsigned, claims nothing."""
    spec = make_spec("progress")
    keys = {name: Ed25519PrivateKey.generate() for name in ("a", "stranger", "me")}
    ids = {name: peer_id_of(k.public_key()) for name, k in keys.items()}
    now = get_dht_time()

    def signed(name: str, epoch: int) -> bytes:
        p = Progress(ids[name], epoch, 4)
        return encode_progress(p, run=spec.run, key=keys[name], timestamp=now)

    stored = {
        ids["a"]: signed("a", 3),
        ids["stranger"]: signed("stranger", 2**50),  # a valid signature, no peer record
        "12D3KooWunsigned": [2**50, 0],
        ids["me"]: signed("me", 3),
    }
    found = SimpleNamespace(
        value={k: SimpleNamespace(value=v, expiration_time=now + 5) for k, v in stored.items()}
    )
    reads = []

    async def get(key, latest, return_future):
        return found

    async def peers():
        reads.append(1)
        return [
            SimpleNamespace(peer_id=ids["a"], bandwidth_up_mbps=12.0),
            SimpleNamespace(peer_id=ids["me"], bandwidth_up_mbps=0.0),
        ]

    dht = SimpleNamespace(peer_id=ids["me"], dht=SimpleNamespace(get=get), peers=peers)
    clock = [100.0]
    board = ProgressBoard(dht, spec, 1, ttl_s=TTL, name="stage 1", clock=lambda: clock[0])
    assert board.published_at(3) is None  # nothing read yet
    assert asyncio.run(board.refresh()) == [Progress(ids["a"], 3, 4)]
    assert not board.ahead_of(3)
    assert board.uploads == {ids["a"]: 12.0, ids["me"]: 0.0}  # as their records announce
    # when a's record was stamped; the stranger's (and our own) stamps count for nothing
    assert board.published_at(3) == now and board.published_at(2**50) is None
    asyncio.run(board.refresh())  # the stranger is still unknown: not looked up again at once
    assert len(reads) == 1
    clock[0] += PEERS_REFRESH_S
    asyncio.run(board.refresh())
    assert len(reads) == 2
    # What the board keeps per peer is a's alone: records signed by made-up keys (anyone
    # can store them, a thousand a read) leave nothing behind.
    assert set(board._stamps) == set(board._expires) == {ids["a"]}


def test_a_board_forgets_peers_that_left_and_distrust_that_ran_out():
    """A node runs for days among peers that come and go: once a peer has left the view
    and its newest record is past its time to live, the board keeps nothing of it."""
    spec = make_spec("progress")
    found = SimpleNamespace(value={})

    async def get(key, latest, return_future):
        return found

    async def peers():
        return []

    dht = SimpleNamespace(peer_id="me", dht=SimpleNamespace(get=get), peers=peers)
    clock = [100.0]
    board = ProgressBoard(dht, spec, 1, ttl_s=TTL, name="stage 1", clock=lambda: clock[0])
    now = get_dht_time()
    for i in range(50):  # peers seen once each, as churn brings them
        peer = f"peer{i}"
        board._stamps[peer], board._expires[peer] = now - 2 * TTL, now - TTL
        board.learn({peer: 3})
    board.distrust(["liar"], 1.0)
    assert board.peers == 50
    clock[0] += TTL + 1.0
    assert board.view() == []
    asyncio.run(board.refresh())
    kept = (board._stamps, board._expires, board._known, board._seen, board._unproven)
    assert [len(table) for table in kept] == [0, 0, 0, 0, 0]


def test_a_dht_call_that_never_answers_counts_as_failed(monkeypatch):
    """A store or read of progress that never ends is given up after ``DHT_CALL_S``: the
    publish fails and the read keeps the records of the last one, so the loop that
    reports and reads goes on."""
    import node.averaging.progress as progress

    monkeypatch.setattr(progress, "DHT_CALL_S", 0.05)

    async def never(*args, **kwargs):
        await asyncio.sleep(3600)

    key = Ed25519PrivateKey.generate()
    dht = SimpleNamespace(
        peer_id=peer_id_of(key.public_key()), dht=SimpleNamespace(get=never, store=never)
    )
    board = ProgressBoard(dht, make_spec("progress"), 1, ttl_s=TTL, name="stage 1", key=key)
    board.records = [Progress("a", 3, 5)]

    async def body() -> tuple[bool, list[Progress]]:
        async with asyncio.timeout(5):
            return await board.publish(Progress(dht.peer_id, 3, 1)), await board.refresh()

    assert asyncio.run(body()) == (False, [Progress("a", 3, 5)])


def _pushing_board() -> tuple[ProgressBoard, dict, dict, Callable, list[float], list]:
    """A board that has read the run's peers ("a" and "me", not "stranger"), its keys and
    ids, a signer of records (name, epoch, samples, timestamp), its clock, and what the
    next DHT read returns (a list of (name, record bytes))."""
    spec = make_spec("progress")
    keys = {name: Ed25519PrivateKey.generate() for name in ("a", "stranger", "me")}
    ids = {name: peer_id_of(k.public_key()) for name, k in keys.items()}

    def signed(name: str, epoch: int, samples: int, at: float) -> bytes:
        return encode_progress(
            Progress(ids[name], epoch, samples), run=spec.run, key=keys[name], timestamp=at
        )

    stored: list[tuple[str, bytes]] = []

    async def get(key, latest, return_future):
        now = get_dht_time()
        value = {ids[n]: SimpleNamespace(value=v, expiration_time=now + 5) for n, v in stored}
        return SimpleNamespace(value=value)

    async def peers():
        return [SimpleNamespace(peer_id=ids[n], bandwidth_up_mbps=0.0) for n in ("a", "me")]

    dht = SimpleNamespace(peer_id=ids["me"], dht=SimpleNamespace(get=get), peers=peers)
    clock = [100.0]
    board = ProgressBoard(
        dht, spec, 1, ttl_s=TTL, name="stage 1", clock=lambda: clock[0], push_fresh_s=1.0
    )
    asyncio.run(board.refresh())  # reads the run's peers
    return board, keys, ids, signed, clock, stored


def test_a_pushed_record_is_checked_and_a_late_dht_copy_does_not_undo_it():
    """A push is taken only from the peer that signed it, for this run, from a peer in the
    run, and only if newer than what we hold; a DHT read that returns an older copy of
    that peer's record keeps the pushed one, and the view counts the pushing peer as
    fresh for ``push_fresh_s``."""
    board, keys, ids, signed, clock, stored = _pushing_board()
    now = get_dht_time()
    assert not board.pushes_cover_view()  # nobody in the view
    assert board.accept(signed("a", 3, 8, now), ids["a"])
    assert board.view() == [Progress(ids["a"], 3, 8)] and board.pushes_cover_view()
    # the same record again, an older one, or one from a peer without a peer record
    assert not board.accept(signed("a", 3, 8, now), ids["a"])
    assert not board.accept(signed("a", 3, 4, now - 1), ids["a"])
    assert not board.accept(signed("stranger", 3, 8, now), ids["stranger"])
    assert board.view() == [Progress(ids["a"], 3, 8)]
    # from a peer without a peer record: not even decoded; from a peer of the run, a
    # record signed by another, or garbage: refused
    assert not board.accept(b"\x00garbage", ids["stranger"])
    with pytest.raises(RecordError):
        board.accept(signed("stranger", 3, 16, now + 1), ids["a"])
    with pytest.raises(RecordError):
        board.accept(b"\x00garbage", ids["a"])
    stored.append(("a", signed("a", 3, 0, now - 2)))  # a DHT node's late copy
    assert asyncio.run(board.refresh()) == [Progress(ids["a"], 3, 8)]
    stored[:] = []  # a read that misses a: the push stands for the time to live
    assert asyncio.run(board.refresh()) == [Progress(ids["a"], 3, 8)]
    clock[0] += 1.5  # no push for longer than push_fresh_s: reads are needed again
    assert not board.pushes_cover_view() and board.view() == [Progress(ids["a"], 3, 8)]
    stored.append(("a", signed("a", 4, 0, now + 2)))  # a newer record in the DHT wins
    assert asyncio.run(board.refresh()) == [Progress(ids["a"], 4, 0)]


def test_reads_while_pushes_cover_the_view_are_rare_until_a_stranger_pushes():
    """While pushes keep the view current the DHT is read every ``PUSHED_READ_S`` (only
    to find peers that do not push yet); a push from a peer not known to be in the run (a
    joiner, whose peer record we have not read) brings reads back to the report period
    until the next read, which looks that peer up; so does a peer of the view whose last
    push is more than two periods old (a push lost or late)."""
    board, keys, ids, signed, clock, stored = _pushing_board()
    assert board.read_every(0.5) == PUSHED_READ_S
    assert board.accept(signed("a", 3, 8, get_dht_time()), ids["a"])
    assert board.view() and board.read_every(0.5) == PUSHED_READ_S
    clock[0] += 0.9  # a's next push is due every period: not late yet
    assert board.read_every(0.5) == PUSHED_READ_S
    clock[0] += 0.2
    assert board.read_every(0.5) == 0.5
    assert board.accept(signed("a", 3, 16, get_dht_time()), ids["a"])
    assert board.read_every(0.5) == PUSHED_READ_S
    assert board.read_every(2 * PUSHED_READ_S) == 2 * PUSHED_READ_S  # never below the period
    assert not board.accept(signed("stranger", 3, 8, get_dht_time()), ids["stranger"])
    assert board.read_every(0.5) == 0.5
    asyncio.run(board.refresh())
    assert board.read_every(0.5) == PUSHED_READ_S
    assert not board.accept(signed("me", 3, 8, get_dht_time()), ids["me"])  # ourselves
    board.distrust([ids["a"]], 60.0)  # a peer of the run whose claims we ignore
    assert not board.accept(signed("a", 3, 8, get_dht_time()), ids["a"])
    assert board.read_every(0.5) == PUSHED_READ_S


def test_pushes_of_a_distrusted_peer_are_ignored():
    board, keys, ids, signed, clock, stored = _pushing_board()
    board.distrust([ids["a"]], 60.0)
    assert not board.accept(signed("a", 2**40, 0, get_dht_time()), ids["a"])
    assert board.view() == []
