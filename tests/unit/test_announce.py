"""The run directory: owner-signed run announcements, the DHT's check of them, and the rule
by which a reader lists runs (only those with live peers, largest first, then newest),
which a flood of announcements from fresh keys cannot get around."""

from __future__ import annotations

import asyncio
import json

import msgpack
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.utils import get_dht_time

from node.cli.main import build_parser
from node.cli.runs import Found, find_runs, render, view
from node.rpc.dht import DirectoryValidator
from protocol.announce import (
    _ANNOUNCE_DOMAIN,
    MAX_ANNOUNCE_AGE_S,
    RunAnnouncement,
    announcement_of,
    decode_announcement,
    encode_announcement,
    listing,
    live_figures,
    vouch_order,
)
from protocol.identity import peer_id_of, sign
from protocol.keys import RUNS_KEY, peers_key
from protocol.ownership import make_run_id
from protocol.records import MAX_RATE, PROTOCOL_VERSION, PeerState, RecordError
from protocol.run_spec import make_run_spec
from tests.records import peer_info

NOW = 1_700_000_000.0
OWNER_KEY = Ed25519PrivateKey.from_private_bytes(bytes([3]) * 32)
OTHER_KEY = Ed25519PrivateKey.from_private_bytes(bytes([4]) * 32)
OWNER = peer_id_of(OWNER_KEY.public_key())
OTHER = peer_id_of(OTHER_KEY.public_key())
RUN = make_run_id("open", OWNER)
PEERS = [peer_id_of(Ed25519PrivateKey.from_private_bytes(bytes([i]) * 32).public_key())
         for i in range(10, 16)]  # fmt: skip


def _announcement(**changes) -> RunAnnouncement:
    fields = dict(
        owner=OWNER,
        run=RUN,
        version=PROTOCOL_VERSION,
        preset="tiny",
        n_layer=4,
        n_embd=64,
        data="stdlib",
        peers=2,
        stage_throughput=(100.0, 80.0),
        created=NOW - 3600,
        timestamp=NOW,
    )
    return RunAnnouncement(**(fields | changes))


def _decode(raw: bytes, subkey: object = RUN, now: float = NOW) -> RunAnnouncement:
    return decode_announcement(raw, subkey=subkey, now=now, max_age_s=MAX_ANNOUNCE_AGE_S)


def _forged(key: Ed25519PrivateKey, record: RunAnnouncement | None = None, **changes) -> bytes:
    """A valid announcement's fields (``record``'s, by default ``_announcement()``'s) with
    ``changes`` (unchecked), signed by ``key``: what an attacker can put on the wire."""
    fields = (record or _announcement()).model_dump(mode="json") | changes
    payload = json.dumps(fields).encode()
    return msgpack.packb({"record": payload, "sig": sign(key, _ANNOUNCE_DOMAIN, payload)})


def test_an_announcement_round_trips_and_names_its_owner_and_figures():
    record = _announcement()
    assert _decode(encode_announcement(record, OWNER_KEY)) == record
    assert record.peer_id == OWNER and record.stages == 2


def test_only_the_owner_named_in_the_run_id_can_sign_an_announcement():
    with pytest.raises(ValueError, match="this key is not the owner"):
        encode_announcement(_announcement(), OTHER_KEY)
    # Another key signs an announcement that names the real owner: a bad signature.
    with pytest.raises(RecordError, match=f"bad signature on the record of peer {OWNER}"):
        _decode(_forged(OTHER_KEY))
    # Another key signs for the run as its own owner: the run id's fingerprint is not its.
    with pytest.raises(RecordError, match=f"run '{RUN}' does not belong to owner {OTHER}"):
        _decode(_forged(OTHER_KEY, owner=OTHER))
    # ... and an announcement cannot even be built that way.
    with pytest.raises(ValueError, match="does not belong to owner"):
        _announcement(owner=OTHER)


def test_a_stale_misplaced_oversized_or_malformed_announcement_is_refused():
    raw = encode_announcement(_announcement(), OWNER_KEY)
    with pytest.raises(RecordError, match="stale or replayed"):
        _decode(raw, now=NOW + MAX_ANNOUNCE_AGE_S + 1)
    with pytest.raises(RecordError, match="in the future"):
        _decode(raw, now=NOW - 600)
    other_run = make_run_id("other", OWNER)
    with pytest.raises(RecordError, match=f"is for run '{RUN}', not '{other_run}'"):
        _decode(raw, subkey=other_run)
    with pytest.raises(RecordError, match="subkey must be its run id"):
        _decode(raw, subkey=b"\x00")
    with pytest.raises(RecordError, match="exceeds the limit of 4096"):
        _decode(msgpack.packb({"record": b"x" * 5000, "sig": b""}))
    with pytest.raises(RecordError, match="not valid msgpack"):
        _decode(b"\xc1")
    with pytest.raises(RecordError, match="malformed run announcement record: peers"):
        _decode(_forged(OWNER_KEY, peers=-1))


@pytest.mark.parametrize(
    "changes, error",
    [
        (dict(run="open"), "names no owner"),
        (dict(stage_throughput=()), "at least 1"),
        (dict(stage_throughput=(1.0, float("nan"))), "finite number"),
        (dict(preset="Tiny Model"), "should match pattern"),
        (dict(data="x" * 65), "at most 64"),
        (dict(created=NOW + 1), "created after the announcement"),
    ],
)
def test_a_malformed_announcement_cannot_be_built(changes, error):
    with pytest.raises(ValueError, match=error):
        _announcement(**changes)


def test_the_dht_refuses_announcements_that_do_not_validate():
    validator = DirectoryValidator()
    now = get_dht_time()
    good = encode_announcement(_announcement(timestamp=now), OWNER_KEY)

    def stored(value: bytes, expiration: float, subkey: str = RUN, key: str = RUNS_KEY) -> bool:
        dumps = DHTProtocol.serializer.dumps
        source = DHTID.generate(source=key).to_bytes()
        return validator.validate(DHTRecord(source, dumps(subkey), dumps(value), expiration))

    assert stored(good, now + MAX_ANNOUNCE_AGE_S)
    assert not stored(good, now + MAX_ANNOUNCE_AGE_S + 1)  # would outlive its freshness
    assert not stored(good, now + 30, subkey=make_run_id("other", OWNER))
    assert not stored(_forged(OTHER_KEY, timestamp=now), now + 30)
    assert not stored(_forged(OTHER_KEY, owner=OTHER, timestamp=now), now + 30)
    assert not stored(b"\xc1", now + 30)
    # Other keys are other validators' to check.
    assert stored(b"\xc1", now + 30, subkey=PEERS[0], key=peers_key(RUN))


def test_the_owner_announces_a_public_run_with_its_live_figures_and_never_a_private_one():
    spec = make_run_spec("open", "tiny", 2, owner=OWNER, created=NOW - 60)
    peers = [
        peer_info(spec.run, PEERS[0], stage=0, throughput=(30.0, 30.0)),
        peer_info(spec.run, PEERS[1], stage=1, throughput=(20.0, 20.0)),
        peer_info(spec.run, PEERS[2], stage=1, throughput=(25.0, 25.0)),
        peer_info(spec.run, PEERS[3], stage=1, state=PeerState.LEAVING),
        peer_info(spec.run, PEERS[4], stage=None, state=PeerState.JOINING),
    ]
    record = announcement_of(spec, peers, now=NOW)
    assert (record.run, record.owner, record.preset, record.n_layer, record.n_embd) == (
        spec.run, OWNER, "tiny", 4, 64,
    )  # fmt: skip
    assert record.peers == 4  # the one leaving is not counted; the one joining is
    assert record.stage_throughput == (30.0, 45.0)
    assert (record.created, record.timestamp, record.data) == (NOW - 60, NOW, "stdlib")
    assert _decode(encode_announcement(record, OWNER_KEY), subkey=spec.run) == record

    private = make_run_spec("closed", "tiny", 2, owner=OWNER, private=True)
    with pytest.raises(ValueError, match="private runs are never announced"):
        announcement_of(private, peers, now=NOW)


def _fresh_announcement(i: int, **changes) -> RunAnnouncement:
    """A run of a fresh owner key (a flood costs nothing but keys)."""
    key = Ed25519PrivateKey.from_private_bytes(i.to_bytes(32, "big"))
    owner = peer_id_of(key.public_key())
    return _announcement(owner=owner, run=make_run_id(f"flood{i}", owner), **changes)


def test_runs_are_listed_largest_first_then_newest_with_the_figures_the_reader_counted():
    big = _announcement(run=make_run_id("big", OWNER), created=NOW - 7200)
    old = _announcement(run=make_run_id("old", OWNER), created=NOW - 7200)
    new = _announcement(run=make_run_id("new", OWNER), created=NOW - 60)
    live = {
        big.run: [peer_info(big.run, p, stage=i % 2) for i, p in enumerate(PEERS[:3])],
        old.run: [peer_info(old.run, PEERS[0], stage=0), peer_info(old.run, PEERS[1], stage=1)],
        new.run: [peer_info(new.run, PEERS[0], stage=0), peer_info(new.run, PEERS[1], stage=1)],
    }
    listed = listing([old, new, big], live)
    assert [r.announcement.run for r in listed] == [big.run, new.run, old.run]
    # Counted from the records read (each declares 50 samples/s), not as announced.
    assert (listed[0].peers, listed[0].stage_throughput) == (3, (100.0, 50.0))
    assert (listed[0].throughput, listed[0].bottleneck_stage) == (50.0, 1)


def test_a_flood_of_announcements_from_fresh_keys_cannot_push_a_real_run_out():
    real = _announcement()
    flood = [
        _fresh_announcement(i, peers=10**6, stage_throughput=(1e9, 1e9), created=NOW)
        for i in range(1, 200)
    ]
    live = {real.run: [peer_info(real.run, PEERS[0])]} | {a.run: [] for a in flood}
    listed = listing([*flood, real], live)
    assert [r.announcement.run for r in listed] == [real.run]  # claims count for nothing
    # A reader looks the runs up in an order of its own: not the order announced, and
    # not one an announcement can choose; each reader has its own.
    order = vouch_order([*flood, real], seed=1)
    assert sorted(order) == sorted(a.run for a in [*flood, real])
    assert order != vouch_order([*flood, real], seed=2)
    assert order == vouch_order([real, *reversed(flood)], seed=1)
    # A run that was not looked up (the reader's deadline) is not listed either.
    assert listing([real], {}) == []


class _Directory:
    """A stand-in for ``SwarmDHT`` as ``find_runs`` uses it: the directory holds
    ``announced``; a run's lookup returns ``peers[run]``, or never returns if absent."""

    def __init__(self, announced, peers, run: str | None = None) -> None:
        self.announced, self.peers_of, self.run = announced, peers, run

    async def announcements(self):
        return self.announced

    async def known_peers(self) -> int:
        return 1

    def of_run(self, run: str):
        return _Directory(self.announced, self.peers_of, run)

    async def peers(self):
        if self.run not in self.peers_of:
            await asyncio.Event().wait()  # a lookup that hangs past the reader's deadline
        return self.peers_of[self.run]


def test_a_reader_lists_what_it_checked_in_time_and_counts_the_rest():
    listed, empty, hung = (_fresh_announcement(i) for i in (1, 2, 3))
    directory = _Directory(
        [listed, empty, hung], {listed.run: [peer_info(listed.run, PEERS[0])], empty.run: []}
    )
    found = asyncio.run(find_runs(directory, timeout_s=0.5, seed=0))
    assert [r.announcement.run for r in found.listed] == [listed.run]
    assert (found.announced, found.no_live_peers, found.not_checked) == (3, 1, 1)
    nothing = asyncio.run(find_runs(_Directory([], {}), timeout_s=5, seed=0))
    assert nothing == Found([], 0, 0, 0)


def test_live_figures_count_present_peers_and_routable_throughput():
    peers = [
        peer_info(RUN, PEERS[0], stage=0, throughput=(12.0, 1.0)),
        peer_info(RUN, PEERS[0], stage=0, throughput=(12.0, 1.0)),  # read twice: one peer
        peer_info(RUN, PEERS[1], stage=1, state=PeerState.LOADING),  # not routable yet
        peer_info(RUN, PEERS[2], stage=1, state=PeerState.LEAVING),
    ]
    assert live_figures(peers, 2) == (2, (24.0, 0.0))
    assert live_figures([], 3) == (0, (0.0, 0.0, 0.0))


def test_the_listing_shows_each_run_on_one_line_and_says_how_to_join():
    record = _announcement()
    listed = listing([record], {RUN: [peer_info(RUN, PEERS[0], stage=0)]})
    found = Found(listed=listed, announced=3, no_live_peers=1, not_checked=1)
    maddr = f"/ip4/127.0.0.1/tcp/31337/p2p/{PEERS[0]}"
    v = view(found, [maddr], NOW)
    assert v["runs"][0] | {"announced": None} == {
        "run": RUN, "owner": OWNER, "model": "tiny", "n_layer": 4, "n_embd": 64, "stages": 2,
        "data": "stdlib", "peers": 1, "throughput": 0.0, "bottleneck_stage": 1,
        "stage_throughput": [50.0, 0.0], "created": NOW - 3600, "age_s": 3600.0,
        "announced": None,
    }  # fmt: skip
    assert v["runs"][0]["announced"] == {"peers": 2, "stage_throughput": [100.0, 80.0],
                                         "age_s": 0.0}  # fmt: skip
    assert v["join"] == f"swarmtrain node --run RUN_ID --initial-peers {maddr}"
    text = render(v).splitlines()
    assert text[1].split() == [RUN, "tiny", "4x64", "2", "1", "0.0", "1h00m", "stdlib"]
    assert text[3] == f"join one: {v['join']}"
    assert "1 announced runs not listed: no live peer found" in text
    assert any("1 announced runs not checked within --timeout" in line for line in text)
    assert render(view(Found([], 0, 0, 0), [maddr], NOW)) == "no public run listed"


def test_runs_takes_its_initial_peers_from_a_settings_file(tmp_path):
    maddr = f"/ip4/192.0.2.10/tcp/31337/p2p/{PEERS[0]}"
    path = tmp_path / "community.toml"
    path.write_text(f'initial-peers = ["{maddr}"]\n')
    argv = ["runs", "--config", str(path), "--json"]
    args = build_parser(argv).parse_args(argv)
    assert (args.initial_peers, args.json, args.timeout) == ([maddr], True, 20.0)


def test_claims_summing_past_the_bounds_saturate_and_the_announcement_still_builds():
    """A thousand sybil records each claiming 1e9 samples/s on a stage: the stage's total
    saturates at what an announcement may hold, so the owner's announcement is valid (and
    signed, and stored) whatever strangers claim."""
    spec = make_run_spec("open", "tiny", 2, owner=OWNER, created=NOW - 60)
    keys = [Ed25519PrivateKey.from_private_bytes((100 + i).to_bytes(32, "big")) for i in range(50)]
    sybils = [
        peer_info(spec.run, peer_id_of(k.public_key()), stage=0, throughput=(MAX_RATE, 0.0))
        for k in keys
    ]
    honest = peer_info(spec.run, PEERS[0], stage=1, throughput=(10.0, 10.0))
    assert live_figures([*sybils, honest], 2) == (51, (MAX_RATE, 10.0))
    record = announcement_of(spec, [*sybils, honest], now=NOW)
    assert record.stage_throughput == (MAX_RATE, 10.0)
    assert _decode(encode_announcement(record, OWNER_KEY), subkey=spec.run) == record
