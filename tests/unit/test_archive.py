"""Archive nodes: their signed records, the rule of where a stage's state comes from, and
the archive's disk check."""

from __future__ import annotations

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.utils import get_dht_time

from node.daemon.archive import bytes_needed, check_disk
from node.daemon.join import NodeError
from node.rpc.dht import RunRecordValidator
from protocol.archive import ArchiveRecord, Start, decode_archive, encode_archive, start_from
from protocol.identity import peer_id_of
from protocol.keys import archives_key, peers_key
from protocol.records import PROTOCOL_VERSION, RecordError
from protocol.run_spec import make_run_spec

RUN = "archive-test"
NOW = 1_700_000_000.0
KEY = Ed25519PrivateKey.from_private_bytes(bytes([7]) * 32)
OTHER = Ed25519PrivateKey.from_private_bytes(bytes([8]) * 32)
PEER = peer_id_of(KEY.public_key())


def _record(**changes) -> ArchiveRecord:
    fields = dict(
        peer_id=PEER,
        run=RUN,
        version=PROTOCOL_VERSION,
        epochs=(4, None),
        steps=(8, None),
        timestamp=NOW,
    )
    return ArchiveRecord(**(fields | changes))


def _decode(raw: bytes, subkey: str | None = PEER, now: float = NOW) -> ArchiveRecord:
    return decode_archive(raw, subkey=subkey, run=RUN, now=now, max_age_s=120)


@pytest.mark.parametrize(
    "live, saved, archived, start",
    [
        ([], None, [], Start.INITIAL),
        ([0], None, [], Start.PEERS),
        ([7, 9], 9, [9], Start.PEERS),  # a tie: live peers are the run as it is now
        ([7, 9], 10, [], Start.CHECKPOINT),  # ours is newer: they catch up from us
        ([7], 3, [8], Start.ARCHIVE),
        ([], 3, [], Start.CHECKPOINT),
        ([], None, [0], Start.ARCHIVE),
        ([], 3, [2, 5], Start.ARCHIVE),
        ([], 5, [5], Start.CHECKPOINT),  # a tie: our own, no download
        ([], 6, [2, 5], Start.CHECKPOINT),
    ],
)
def test_a_stage_starts_from_the_newest_of_live_peers_checkpoint_and_archives(
    live, saved, archived, start
):
    assert start_from(live, saved, archived) is start


def test_an_archive_record_round_trips_and_says_what_it_holds():
    record = _record()
    assert _decode(encode_archive(record, KEY)) == record
    assert record.epoch_of(0) == 4 and record.epoch_of(1) is None and record.epoch_of(9) is None


@pytest.mark.parametrize(
    "changes, error",
    [
        (dict(steps=(8,)), "2 epochs but 1 steps"),
        (dict(steps=(None, None)), "epoch without a step"),
        (dict(epochs=(-1, None)), "greater than or equal to 0"),
        (dict(epochs=()), "at least 1"),
    ],
)
def test_a_malformed_archive_record_cannot_be_built(changes, error):
    with pytest.raises(ValueError, match=error):
        _record(**changes)


def test_a_forged_stale_or_misplaced_archive_record_is_refused():
    raw = encode_archive(_record(), KEY)
    with pytest.raises(RecordError, match="bad signature"):
        _decode(encode_archive(_record(), OTHER))  # signed by someone else than PEER
    with pytest.raises(RecordError, match="under another peer's key"):
        _decode(raw, subkey=peer_id_of(OTHER.public_key()))
    with pytest.raises(RecordError, match="stale or replayed"):
        _decode(raw, now=NOW + 600)
    with pytest.raises(RecordError, match="is for run"):
        decode_archive(raw, subkey=PEER, run="another", now=NOW, max_age_s=120)


def test_the_dht_refuses_archive_records_that_do_not_validate():
    validator = RunRecordValidator(RUN)
    now = get_dht_time()
    good = encode_archive(_record(timestamp=now), KEY)

    def stored(value: bytes, expiration: float, key: str = archives_key(RUN)) -> bool:
        dumps = DHTProtocol.serializer.dumps
        source = DHTID.generate(source=key).to_bytes()
        return validator.validate(DHTRecord(source, dumps(PEER), dumps(value), expiration))

    assert stored(good, now + 30)
    assert not stored(good, now + 3600)  # would outlive its freshness in storage
    assert not stored(b"\xc1", now + 30)
    assert not stored(encode_archive(_record(timestamp=now), OTHER), now + 30)
    # An archive record under the peers' key is no peer record.
    assert not stored(good, now + 30, key=peers_key(RUN))


def test_the_archive_refuses_to_start_on_a_disk_too_small(tmp_path):
    spec = make_run_spec(RUN, "tiny", 2, owner=PEER)
    needed = bytes_needed(spec, [1000, 3000])
    assert needed == 4 * 3 * 4000  # 3 checkpoints kept and 1 being written; AdamW: 3x
    check_disk(tmp_path, needed, needed)
    with pytest.raises(NodeError, match=f"{tmp_path} has 0.00 GiB free"):
        check_disk(tmp_path, needed, needed - 1)
