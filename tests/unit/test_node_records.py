"""The DHT validator of a run's records: its verdicts do not change as records age, and
it refuses what it cannot read without raising."""

from __future__ import annotations

import msgpack
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.utils import get_dht_time
from hypothesis import given, settings
from hypothesis import strategies as st

from node.rpc.dht import RunRecordValidator
from protocol.identity import peer_id_of
from protocol.keys import peers_key, spec_key
from protocol.records import (
    MAX_RECORD_AGE_S,
    encode_peer_info,
)
from tests.records import peer_info


def _fresh() -> tuple[Ed25519PrivateKey, str]:
    key = Ed25519PrivateKey.generate()
    return key, peer_id_of(key.public_key())


def _record(key: str, subkey, value, expiration: float, raw: bool = False) -> DHTRecord:
    dumps = DHTProtocol.serializer.dumps
    return DHTRecord(
        DHTID.generate(source=key).to_bytes(),
        subkey if raw else dumps(subkey),
        value if raw else dumps(value),
        expiration,
    )


def test_validator_verdicts_do_not_change_as_records_age(monkeypatch):
    run, t = "validator", 1_700_000_000.0
    validator = RunRecordValidator(run)
    key, peer_id = _fresh()
    value = encode_peer_info(peer_info(run, peer_id, timestamp=t), key)
    fresh_for_its_age = _record(peers_key(run), peer_id, value, t + MAX_RECORD_AGE_S)
    outlives_its_age = _record(peers_key(run), peer_id, value, t + MAX_RECORD_AGE_S + 1)
    for now in (t, t + MAX_RECORD_AGE_S / 2, t + MAX_RECORD_AGE_S + 1, t + 10_000):
        monkeypatch.setattr("node.rpc.dht.get_dht_time", lambda now=now: now)
        assert validator.validate(fresh_for_its_age), now
        assert not validator.validate(outlives_its_age), now
    monkeypatch.setattr("node.rpc.dht.get_dht_time", lambda: t - 3600)  # dated an hour ahead
    assert not validator.validate(fresh_for_its_age)


def test_validator_refuses_what_it_cannot_read_without_raising():
    run, now = "validator", get_dht_time()
    validator = RunRecordValidator(run)
    key, peer_id = _fresh()
    good = encode_peer_info(peer_info(run, peer_id), key)
    assert validator.validate(_record(peers_key(run), peer_id, good, now + 10))
    assert validator.validate(_record("someone/else", peer_id, b"\xc1", now + 10))  # not ours
    dumps = DHTProtocol.serializer.dumps
    # hivemind's serializer builds its own types from ext codes, and they raise what they
    # raise: ValueError (0x40, a tuple), KeyError and RuntimeError (0x51, a tensor descriptor)
    broken_tuple = msgpack.packb(msgpack.ExtType(0x40, b"\xc1"))
    no_dtype = msgpack.packb(msgpack.ExtType(0x51, msgpack.packb({"size": 5})))
    bad_device = msgpack.packb(
        msgpack.ExtType(
            0x51,
            msgpack.packb(
                {"dtype": None, "layout": None, "device_type": "?", "device_index": 0, "size": [1]}
            ),
        )
    )
    for record in [
        _record(peers_key(run), peer_id, b"\xc1", now + 10),
        _record(peers_key(run), b"\xc1", dumps(good), now + 10, raw=True),
        _record(peers_key(run), dumps(peer_id), b"\xc1", now + 10, raw=True),
        _record(peers_key(run), dumps(peer_id), broken_tuple, now + 10, raw=True),
        _record(peers_key(run), dumps(peer_id), no_dtype, now + 10, raw=True),
        _record(peers_key(run), bad_device, dumps(good), now + 10, raw=True),
        _record(spec_key(run), dumps(None), bad_device, now + 10, raw=True),
        _record(peers_key(run), 12345, good, now + 10),
        _record(peers_key(run), peer_id, {"not": "bytes"}, now + 10),
        _record(spec_key(run), None, b"\xc1", now + 10),
    ]:
        assert validator.validate(record) is False


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=64), st.binary(max_size=512), st.booleans())
def test_validator_never_raises(subkey, value, spec):
    run = "validator"
    key = spec_key(run) if spec else peers_key(run)
    record = _record(key, subkey, value, get_dht_time() + 10, raw=True)
    assert RunRecordValidator(run).validate(record) in (True, False)
