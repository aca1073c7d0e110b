"""Records from the network, without a network: ``protocol.identity``, ``protocol.records``
and ``protocol.run_spec``. Every way a peer record or a run spec can be wrong is refused
with a ``RecordError`` that says what is wrong, and no input raises anything else."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
from typing import Any

import msgpack
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.p2p import PeerID
from hivemind.proto import crypto_pb2
from hivemind.utils import ValueWithExpiration
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from models.config import ModelConfig, OptimizerConfig
from node.harness.attackers import padded_record
from node.rpc.dht import PEERS_FRESH_S, RunRecordValidator, SwarmDHT, peers_fresh_s, spec_subkey
from protocol.identity import (
    IdentityError,
    decode_private_key,
    encode_private_key,
    peer_id_of,
    public_key_of,
    sign,
    verify,
)
from protocol.keys import peers_key, spec_key
from protocol.membership import claims_key, encode_claim, issue_invite, parse_invite_token
from protocol.ownership import make_run_id
from protocol.progress import Progress, decode_progress, encode_progress, progress_key
from protocol.records import (
    _PEER_DOMAIN,  # to sign payloads that PeerInfo itself would refuse to build
    MAX_CLOCK_SKEW_S,
    MAX_MEMBERSHIP_CHARS,
    MAX_RECORD_AGE_S,
    MAX_RECORD_BYTES,
    MAX_STAGES,
    PROTOCOL_VERSION,
    PeerBounds,
    PeerInfo,
    PeerState,
    RecordError,
    decode_peer_info,
    encode_peer_info,
)
from protocol.run_spec import (
    _SPEC_DOMAIN,  # to sign payloads that RunSpec itself would refuse to build
    RunSpec,
    decode_run_spec,
    earliest_spec,
    make_run_spec,
    read_spec_file,
    sign_run_spec,
    spec_differences,
    spec_file_text,
)

RUN = "records-test"
NOW = 1_700_000_000.0  # a fixed clock: these tests never read the real one


def _key(seed: int) -> Ed25519PrivateKey:
    return Ed25519PrivateKey.from_private_bytes(bytes([seed]) * 32)


KEY, OTHER = _key(1), _key(2)
PEER, OTHER_PEER = peer_id_of(KEY.public_key()), peer_id_of(OTHER.public_key())
OWNER_KEY = _key(3)
OWNER = peer_id_of(OWNER_KEY.public_key())
SPEC_RUN = make_run_id(RUN, OWNER)  # the run id a spec of RUN by OWNER carries


def _fields(key: Ed25519PrivateKey = KEY, **changes: Any) -> dict[str, Any]:
    """A valid peer record's fields, as JSON values, with ``changes`` applied."""
    fields = {
        "peer_id": peer_id_of(key.public_key()),
        "run": RUN,
        "version": PROTOCOL_VERSION,
        "device": "cpu (2 threads)",
        "throughput": [120.5, 80.0],
        "throughput_source": "measured",
        "bandwidth_up_mbps": 40.0,
        "bandwidth_down_mbps": 200.0,
        "bandwidth_source": "measured",
        "stage": 1,
        "state": "serving",
        "load": 3,
        "timestamp": NOW,
    }
    fields.update(changes)
    return fields


def _info(key: Ed25519PrivateKey = KEY, **changes: Any) -> PeerInfo:
    return PeerInfo(**_fields(key, **changes))


def _signed(payload: bytes, key: Ed25519PrivateKey = KEY) -> bytes:
    """``payload`` as raw record bytes, correctly signed by ``key``, whatever it says."""
    return msgpack.packb({"record": payload, "sig": sign(key, _PEER_DOMAIN, payload)})


def _decode(raw: Any, subkey: str | None = PEER, *, run: str = RUN, now: float = NOW) -> PeerInfo:
    return decode_peer_info(raw, subkey=subkey, run=run, now=now, max_age_s=MAX_RECORD_AGE_S)


# --- peer records: what passes --------------------------------------------------------------


def test_peer_info_round_trip():
    info = _info()
    raw = encode_peer_info(info, KEY)
    assert len(raw) < 1024  # a few hundred bytes: far under MAX_RECORD_BYTES
    assert _decode(raw) == info
    assert _decode(raw, subkey=None) == info  # a record read alone, not from a subkey
    assert info.routable
    assert info.state is PeerState.SERVING


def test_a_record_within_the_limits_of_age_and_skew_passes():
    info = _info(timestamp=NOW - MAX_RECORD_AGE_S + 1)
    assert _decode(encode_peer_info(info, KEY)) == info
    info = _info(timestamp=NOW + MAX_CLOCK_SKEW_S - 1)
    assert _decode(encode_peer_info(info, KEY)) == info


def test_a_peer_may_hold_a_second_stage():
    info = _info(second_stage=0, second_serving=True)
    assert _decode(encode_peer_info(info, KEY)) == info
    assert _info().second_stage is None and not _info().second_serving


def test_a_peer_without_a_stage_is_valid_but_not_routable():
    info = _info(stage=None, state="joining")
    assert _decode(encode_peer_info(info, KEY)) == info
    assert not info.routable


def test_an_unreachable_peer_is_never_routable_and_old_records_read_unknown():
    assert not _info(reachable=False).routable
    assert _info(reachable=True).routable and _info().routable  # unknown: routable
    assert _decode(encode_peer_info(_info(reachable=False), KEY)).reachable is False
    old = json.loads(_info().model_dump_json())
    del old["reachable"]  # a record from a node that predates the field
    assert _decode(_signed(json.dumps(old).encode())).reachable is None


# --- peer records: each rejection, by what is wrong -----------------------------------------


def test_oversized_record_is_refused_before_parsing():
    with pytest.raises(RecordError, match=f"exceeds the limit of {MAX_RECORD_BYTES}"):
        _decode(b"\x80" * (MAX_RECORD_BYTES + 1))


def test_non_bytes_record_is_refused():
    with pytest.raises(RecordError, match="must be bytes, got str"):
        _decode(encode_peer_info(_info(), KEY).decode("latin-1"))


@pytest.mark.parametrize("raw", [b"\xc1", b"\x92\x01", b"", b"\x81\x01\x02"])
def test_non_msgpack_record_is_refused(raw):
    # 0xc1 is never used; a truncated array; nothing; a map with an int key
    with pytest.raises(RecordError, match="not valid msgpack"):
        _decode(raw)


@pytest.mark.parametrize(
    "envelope",
    [
        [b"{}", b"sig"],
        {"record": b"{}"},
        {"record": b"{}", "sig": b"", "extra": b""},
        {"record": "{}", "sig": b""},
        {"record": b"{}", "sig": None},
        b"just bytes",
        7,
    ],
)
def test_wrong_envelope_is_refused(envelope):
    with pytest.raises(RecordError, match="envelope must be a map of exactly"):
        _decode(msgpack.packb(envelope))


@pytest.mark.parametrize(
    ("changes", "what"),
    [
        (
            {"throughput": [-1.0, 80.0]},
            r"throughput\.0: Input should be greater than or equal to 0",
        ),
        ({"throughput": [math.nan, 80.0]}, r"throughput\.0: Input should be a finite number"),
        ({"bandwidth_up_mbps": math.inf}, "bandwidth_up_mbps: Input should be a finite number"),
        ({"bandwidth_down_mbps": 1e10}, "bandwidth_down_mbps: Input should be less than or equal"),
        ({"bandwidth_down_mbps": 10**400}, "bandwidth_down_mbps: Input should be a finite number"),
        ({"throughput": []}, "throughput: Tuple should have at least 1 item"),
        ({"throughput": [1.0] * 257, "stage": 0}, "throughput: Tuple should have at most 256"),
        ({"stage": 2}, "stage 2 is out of range for 2 stages"),
        ({"stage": -1}, "stage: Input should be greater than or equal to 0"),
        ({"load": -1}, "load: Input should be greater than or equal to 0"),
        ({"timestamp": math.nan}, "timestamp: Input should be a finite number"),
        ({"state": "hacking"}, "state: Input should be 'joining', 'loading', 'serving' or"),
        ({"throughput_source": "guessed"}, "throughput_source: Input should be 'measured' or"),
        ({"device": "x" * 65}, "device: String should have at most 64 characters"),
        ({"run": "../etc"}, "run: Value error, run name '../etc' must be 1-64 letters"),
        ({"run": ""}, "run: Value error, run name '' must be"),
        ({"version": -1}, "version: Input should be greater than or equal to 0"),
        ({"peer_id": "QmNotAnEd25519Peer"}, "peer_id: Value error, peer id 'QmNotAnEd25519Peer'"),
        ({"admin": True}, "admin: Extra inputs are not permitted"),
        ({"load": 1.5}, "load: Input should be a valid integer, got a number with a fractional"),
        ({"second_stage": 1}, "second stage 1 must be another of the 2 stages than its first"),
        ({"second_stage": 2}, "second stage 2 must be another of the 2 stages"),
        ({"stage": None, "second_stage": 0}, r"second stage 0 must be .* its first \(None\)"),
        ({"second_serving": True}, "second_serving without a second stage"),
    ],
)
def test_malformed_record_is_refused_naming_the_field(changes, what):
    # Correctly signed by the peer it names: only the content is wrong.
    raw = _signed(json.dumps(_fields(**changes)).encode())
    with pytest.raises(RecordError, match=f"malformed peer record: .*{what}"):
        _decode(raw)


@pytest.mark.parametrize("missing", ["timestamp", "peer_id", "stage", "version"])
def test_record_missing_a_field_is_refused(missing):
    fields = _fields()
    del fields[missing]
    with pytest.raises(RecordError, match=f"malformed peer record: {missing}: Field required"):
        _decode(_signed(json.dumps(fields).encode()))


@pytest.mark.parametrize("payload", [b"not json", b"[1, 2]", b"\xff\xfe", b"null", b""])
def test_record_that_is_not_a_json_object_is_refused(payload):
    with pytest.raises(RecordError, match="malformed peer record"):
        _decode(_signed(payload))


def test_record_under_another_peers_subkey_is_refused():
    # Correctly signed by OTHER, about OTHER, but written into PEER's slot: impersonation.
    raw = encode_peer_info(_info(OTHER), OTHER)
    with pytest.raises(
        RecordError, match=f"record of peer {OTHER_PEER} stored under another peer's key {PEER}"
    ):
        _decode(raw, subkey=PEER)
    assert _decode(raw, subkey=OTHER_PEER).peer_id == OTHER_PEER


def test_record_signed_by_a_different_key_is_refused():
    # A record about PEER, under PEER's subkey, signed by someone else.
    raw = encode_peer_info(_info(KEY), OTHER)
    with pytest.raises(RecordError, match=f"bad signature on the record of peer {PEER}"):
        _decode(raw)


def test_tampered_record_is_refused():
    raw = encode_peer_info(_info(), KEY)
    envelope = msgpack.unpackb(raw)
    tampered = envelope["record"].replace(b'"load":3', b'"load":0')
    assert tampered != envelope["record"]
    forged = msgpack.packb({"record": tampered, "sig": envelope["sig"]})
    with pytest.raises(RecordError, match=f"bad signature on the record of peer {PEER}"):
        _decode(forged)
    truncated_sig = msgpack.packb({"record": envelope["record"], "sig": envelope["sig"][:-1]})
    with pytest.raises(RecordError, match="bad signature"):
        _decode(truncated_sig)


def test_signature_for_another_kind_of_message_is_refused():
    payload = json.dumps(_fields()).encode()
    raw = msgpack.packb({"record": payload, "sig": sign(KEY, b"swarmtrain/other", payload)})
    with pytest.raises(RecordError, match="bad signature"):
        _decode(raw)


def test_record_from_a_future_protocol_version_is_refused():
    raw = encode_peer_info(_info(version=PROTOCOL_VERSION + 1), KEY)  # correctly signed
    with pytest.raises(
        RecordError,
        match=f"speaks protocol version {PROTOCOL_VERSION + 1}, we speak {PROTOCOL_VERSION}",
    ):
        _decode(raw)


def test_record_of_another_run_is_refused():
    raw = encode_peer_info(_info(run="other-run"), KEY)
    with pytest.raises(RecordError, match=f"is for run 'other-run', not '{RUN}'"):
        _decode(raw)


def test_record_from_the_future_is_refused():
    raw = encode_peer_info(_info(timestamp=NOW + MAX_CLOCK_SKEW_S + 60), KEY)
    with pytest.raises(RecordError, match=r"dated \d+ s in the future"):
        _decode(raw)


def test_stale_or_replayed_record_is_refused():
    raw = encode_peer_info(_info(timestamp=NOW - MAX_RECORD_AGE_S - 1), KEY)
    with pytest.raises(RecordError, match=r"is 121 s old \(limit 120 s\): stale or replayed"):
        _decode(raw)
    # The same bytes were valid when fresh: a replay is refused only by its age.
    assert _decode(raw, now=NOW - MAX_RECORD_AGE_S)


# --- identities -----------------------------------------------------------------------------


def test_peer_id_round_trip_and_libp2p_encoding():
    for seed in range(5):
        public = _key(seed).public_key()
        peer_id = peer_id_of(public)
        assert peer_id.startswith("12D3KooW")
        assert public_key_of(peer_id) == public
        # Built independently, from libp2p's protobuf and an identity multihash.
        proto = crypto_pb2.PublicKey(
            key_type=crypto_pb2.Ed25519, data=public.public_bytes_raw()
        ).SerializeToString()
        assert PeerID(bytes([0x00, len(proto)]) + proto).to_base58() == peer_id


@pytest.mark.parametrize(
    ("peer_id", "what"),
    [
        ("", "must be a short string"),
        ("1" * 65, "must be a short string"),
        (12345, "must be a short string"),
        (None, "must be a short string"),
        ("12D3KooW0OIl", "is not base58"),  # 0, O, I and l are not base58
        ("QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N", "not an Ed25519 identity peer id"),
        ("12D3KooWabc", "not an Ed25519 identity peer id"),
        (PEER[:-1], "not an Ed25519 identity peer id"),
        (PEER + "1", "not an Ed25519 identity peer id"),
    ],
)
def test_peer_ids_that_are_not_ed25519_identities_are_refused(peer_id, what):
    with pytest.raises(IdentityError, match=what):
        public_key_of(peer_id)
    assert not verify(peer_id, b"d", b"payload", b"\0" * 64)  # never raises


def test_sign_and_verify_bind_key_domain_and_payload():
    sig = sign(KEY, b"domain", b"payload")
    assert verify(PEER, b"domain", b"payload", sig)
    assert not verify(OTHER_PEER, b"domain", b"payload", sig)
    assert not verify(PEER, b"domain2", b"payload", sig)
    assert not verify(PEER, b"domain", b"payload!", sig)
    assert not verify(PEER, b"domain", b"payload", sig[:-1] + bytes([sig[-1] ^ 1]))
    assert not verify(PEER, b"domain", b"payload", b"short")


def test_private_key_round_trip_in_libp2p_encoding():
    data = encode_private_key(KEY)
    parsed = crypto_pb2.PrivateKey.FromString(data)  # what p2pd reads with -id
    assert parsed.key_type == crypto_pb2.Ed25519
    assert parsed.data == KEY.private_bytes_raw() + KEY.public_key().public_bytes_raw()
    decoded = decode_private_key(data)
    assert decoded.private_bytes_raw() == KEY.private_bytes_raw()
    assert peer_id_of(decoded.public_key()) == PEER


@pytest.mark.parametrize(
    ("mangle", "what"),
    [
        (lambda d: d[:-1], "not an Ed25519 libp2p private key"),
        (lambda d: d + b"\0", "not an Ed25519 libp2p private key"),
        (lambda d: b"", "not an Ed25519 libp2p private key"),
        (lambda d: bytes([0x08, 0x00]) + d[2:], "not an Ed25519 libp2p private key"),  # RSA
        (lambda d: d[:-1] + bytes([d[-1] ^ 1]), "corrupt: its public half does not match"),
        (lambda d: d[:4] + bytes([d[4] ^ 1]) + d[5:], "corrupt: its public half does not match"),
    ],
)
def test_corrupt_private_key_is_refused(mangle, what):
    with pytest.raises(IdentityError, match=what):
        decode_private_key(mangle(encode_private_key(KEY)))


# --- run specs ------------------------------------------------------------------------------


def _spec_fields(**changes: Any) -> dict[str, Any]:
    fields = json.loads(make_run_spec(RUN, "tiny", 2, owner=OWNER).model_dump_json())
    fields.update(changes)
    return fields


def _raw_spec(fields: dict[str, Any], key: Ed25519PrivateKey = OWNER_KEY) -> bytes:
    payload = json.dumps(fields).encode()
    return msgpack.packb({"spec": payload, "sig": sign(key, _SPEC_DOMAIN, payload)})


def test_run_spec_round_trip():
    spec = make_run_spec(RUN, "tiny", 3, owner=OWNER, compression="float16", lr=1e-3)
    assert spec.run == SPEC_RUN and spec.run.startswith(f"{RUN}@")
    decoded = decode_run_spec(sign_run_spec(spec, OWNER_KEY).raw, run=SPEC_RUN).spec
    assert decoded == spec
    assert decoded.model == ModelConfig(**spec.arch)
    assert decoded.optim == OptimizerConfig(**{**spec.optimizer, "betas": (0.9, 0.95)})
    assert decoded.optim.lr == 1e-3
    assert decoded.n_stages == 3
    assert [decoded.stage_range(i) for i in range(3)][-1].end == decoded.model.n_blocks


@pytest.mark.parametrize(
    ("boundaries", "what"),
    [
        ([[0, 3], [4, 6]], "leaves blocks 3..3 in no stage"),
        ([[0, 4], [3, 6]], "overlaps the previous stage"),
        ([[0, 3], [3, 7]], r"out of range \[0, 6\)"),
        ([[0, 3], [3, 3], [3, 6]], r"stage 1 \[3, 3\) is empty"),
        ([[0, 3]], "stages end at block 3, but the model has 6 blocks"),
        ([], "boundaries: Tuple should have at least 1 item"),
        ([[0, 3, 5], [5, 6]], r"boundaries\.0: Tuple should have at most 2 items"),
    ],
)
def test_run_spec_with_bad_boundaries_is_refused(boundaries, what):
    fields = _spec_fields(boundaries=boundaries)
    with pytest.raises(ValidationError):
        RunSpec(**fields)
    with pytest.raises(RecordError, match=f"malformed run spec: .*{what}"):
        decode_run_spec(_raw_spec(fields), run=SPEC_RUN)


@pytest.mark.parametrize(
    ("changes", "what"),
    [
        ({"arch": {**_spec_fields()["arch"], "n_head": 3}}, "must be divisible by n_head"),
        ({"arch": {**_spec_fields()["arch"], "tie_embeddings": True}}, "tie_embeddings=True"),
        (
            {"arch": {**_spec_fields()["arch"], "n_layers": 4}},
            "unexpected keyword argument 'n_layers'",
        ),
        ({"optimizer": {**_spec_fields()["optimizer"], "lr": 0}}, "lr must be > 0"),
        (
            {"compression": "zip"},
            "compression: Input should be 'none', 'float16', 'uint8', 'int4' or 'int2'",
        ),
        ({"seed": -1}, "seed: Input should be greater than or equal to 0"),
        ({"private": "maybe"}, "private: Input should be a valid boolean"),
        ({"coowner": OWNER}, "coowner: Extra inputs are not permitted"),
    ],
)
def test_run_spec_with_bad_settings_is_refused(changes, what):
    with pytest.raises(RecordError, match=f"malformed run spec: .*{what}"):
        decode_run_spec(_raw_spec(_spec_fields(**changes)), run=SPEC_RUN)


def test_run_spec_of_another_version_or_run_is_refused():
    future = _raw_spec(_spec_fields(version=PROTOCOL_VERSION + 1))
    with pytest.raises(RecordError, match=f"protocol version {PROTOCOL_VERSION + 1}, we speak"):
        decode_run_spec(future, run=SPEC_RUN)
    with pytest.raises(RecordError, match=f"spec is for run '{SPEC_RUN}', not 'another'"):
        decode_run_spec(_raw_spec(_spec_fields()), run="another")


def test_a_spec_not_signed_by_the_runs_owner_is_refused():
    fields = _spec_fields()
    with pytest.raises(RecordError, match="is not signed by its owner"):
        decode_run_spec(_raw_spec(fields, key=OTHER), run=SPEC_RUN)
    # Claiming another owner does not help: the run id names the owner's fingerprint.
    forged = {**fields, "owner": OTHER_PEER}
    with pytest.raises(RecordError, match="does not belong to owner"):
        decode_run_spec(_raw_spec(forged, key=OTHER), run=SPEC_RUN)
    # Nor does signing a spec whose bytes differ from what the owner signed.
    raw = msgpack.unpackb(_raw_spec(fields))
    tampered = raw["spec"].replace(b'"private": false', b'"private": true')
    assert tampered != raw["spec"]
    raw["spec"] = tampered
    with pytest.raises(RecordError, match="is not signed by its owner"):
        decode_run_spec(msgpack.packb(raw), run=SPEC_RUN)
    with pytest.raises(ValueError, match="not the owner"):
        sign_run_spec(make_run_spec(RUN, "tiny", 2, owner=OWNER), OTHER)


def test_a_run_id_without_an_owner_has_no_valid_spec():
    with pytest.raises(RecordError, match="names no owner"):
        decode_run_spec(_raw_spec({**_spec_fields(), "run": RUN}), run=RUN)


def test_spec_file_round_trip_and_tampering():
    signed = sign_run_spec(make_run_spec(RUN, "tiny", 2, owner=OWNER, private=True), OWNER_KEY)
    text = spec_file_text(signed)
    assert read_spec_file(text) == signed
    assert '\\"private\\":true' in text  # readable in the file
    with pytest.raises(RecordError, match="is not signed by its owner"):
        read_spec_file(text.replace('\\"private\\":true', '\\"private\\":false'))
    with pytest.raises(RecordError, match="not a swarmtrain spec file"):
        read_spec_file("{}")


@pytest.mark.parametrize(
    "raw",
    [
        b"\x80" * (MAX_RECORD_BYTES + 1),
        "a string",
        b"\xc1",
        msgpack.packb([1]),
        msgpack.packb({"spec": 5, "sig": b""}),
        msgpack.packb({"other": b"{}"}),
        msgpack.packb({"spec": b"{not json", "sig": b""}),
        msgpack.packb({"spec": b"{}"}),
    ],
)
def test_malformed_run_spec_bytes_are_refused(raw):
    with pytest.raises(RecordError, match="run spec"):
        decode_run_spec(raw, run=SPEC_RUN)


# --- anything at all: decoded, or refused with a RecordError --------------------------------

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner),
    max_leaves=12,
)
MSGPACK = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=20)
    | st.binary(max_size=40),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.text(max_size=10) | st.sampled_from(["record", "sig", "spec"]), inner)
    ),
    max_leaves=12,
)
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _decodes_or_refuses(decode, raw) -> None:
    with contextlib.suppress(RecordError):  # anything else fails the test
        decode(raw)


@FUZZ
@given(st.binary(max_size=1024))
def test_arbitrary_bytes_decode_or_raise_record_error(raw):
    _decodes_or_refuses(_decode, raw)
    _decodes_or_refuses(lambda r: decode_run_spec(r, run=SPEC_RUN), raw)


@FUZZ
@given(MSGPACK)
def test_arbitrary_msgpack_decodes_or_raises_record_error(value):
    raw = msgpack.packb(value)
    _decodes_or_refuses(_decode, raw)
    _decodes_or_refuses(lambda r: decode_run_spec(r, run=SPEC_RUN), raw)


@FUZZ
@given(st.dictionaries(st.sampled_from(sorted(_fields())) | st.text(max_size=8), JSON, max_size=4))
def test_signed_records_with_arbitrary_fields_decode_or_raise_record_error(changes):
    _decodes_or_refuses(_decode, _signed(json.dumps(_fields(**changes)).encode()))


ARCH_KEYS = st.sampled_from(sorted(ModelConfig.__dataclass_fields__)) | st.text(max_size=8)
OPTIM_KEYS = st.sampled_from(sorted(OptimizerConfig.__dataclass_fields__)) | st.text(max_size=8)


@FUZZ
@given(
    st.dictionaries(ARCH_KEYS, JSON, max_size=3),
    st.dictionaries(OPTIM_KEYS, JSON, max_size=3),
    st.dictionaries(st.sampled_from(sorted(_spec_fields())), JSON, max_size=2),
)
def test_specs_with_arbitrary_settings_decode_or_raise_record_error(arch, optimizer, top):
    fields = _spec_fields()
    fields["arch"].update(arch)
    fields["optimizer"].update(optimizer)
    fields.update(top)
    _decodes_or_refuses(lambda r: decode_run_spec(r, run=SPEC_RUN), _raw_spec(fields))


def test_a_spec_whose_arithmetic_overflows_is_refused():
    # Found by the test above: 10**400 % 1.5 raised OverflowError out of the decoder.
    arch = {**_spec_fields()["arch"], "n_embd": 10**400, "n_head": 1.5}
    with pytest.raises(RecordError, match="malformed run spec"):
        decode_run_spec(_raw_spec(_spec_fields(arch=arch)), run=SPEC_RUN)


# --- a run's spec never changes: of two for one id, every peer keeps the earliest ------------


def test_of_two_specs_for_one_run_id_every_peer_keeps_the_earliest():
    first = sign_run_spec(make_run_spec(RUN, "tiny", 2, owner=OWNER, created=NOW), OWNER_KEY)
    later = sign_run_spec(
        make_run_spec(RUN, "tiny", 3, owner=OWNER, created=NOW + 1, compression="float16"),
        OWNER_KEY,
    )
    assert earliest_spec([first, later]) == earliest_spec([later, first]) == first
    same_time = sign_run_spec(make_run_spec(RUN, "tiny", 3, owner=OWNER, created=NOW), OWNER_KEY)
    assert earliest_spec([first, same_time]) == earliest_spec([same_time, first])
    assert spec_differences(first.spec, later.spec) == [
        "2 -> 3 stages",
        "compression 'int4' -> 'float16'",
    ]
    # The same settings signed at another time describe the same run.
    again = make_run_spec(RUN, "tiny", 2, owner=OWNER, created=NOW + 99)
    assert spec_differences(first.spec, again) == []
    private = make_run_spec(RUN, "tiny", 2, owner=OWNER, private=True)
    assert spec_differences(first.spec, private) == ["private False -> True"]
    # Specs written before specs carried their creation time read as created at 0.
    fields = json.loads(msgpack.unpackb(first.raw)["spec"])
    del fields["created"]
    assert decode_run_spec(_raw_spec(fields), run=first.spec.run).spec.created == 0.0


def _dht_record(key: str, subkey: object, value: bytes, expiration: float) -> DHTRecord:
    dumps = DHTProtocol.serializer.dumps
    return DHTRecord(DHTID.generate(source=key).to_bytes(), dumps(subkey), dumps(value), expiration)


def test_the_dht_keeps_specs_under_their_hash_and_claims_within_their_invite():
    signed = sign_run_spec(make_run_spec(RUN, "tiny", 2, owner=OWNER, private=True), OWNER_KEY)
    run = signed.spec.run
    validator = RunRecordValidator(run)
    good = _dht_record(spec_key(run), spec_subkey(signed.raw), signed.raw, NOW + 60)
    assert validator.validate(good)
    assert not validator.validate(_dht_record(spec_key(run), "0" * 32, signed.raw, NOW + 60))
    assert not validator.validate(_dht_record(spec_key(run), None, signed.raw, NOW + 60))

    token = issue_invite(OWNER_KEY, run, expires=NOW + 600, issued=NOW)
    proof = parse_invite_token(token, owner=OWNER).proof(OTHER_PEER, NOW + 1)
    claim = signed.spec.membership.verify(OTHER_PEER, proof)[1]
    raw = encode_claim(claim, OWNER)
    assert validator.validate(_dht_record(claims_key(run), claim.subkey, raw, NOW + 600))
    for record in [
        _dht_record(claims_key(run), claim.subkey, raw, NOW + 3600),  # outlives its invite
        _dht_record(claims_key(run), f"{claim.invite_id}:{OWNER}", raw, NOW + 60),
        _dht_record(claims_key(run), None, raw, NOW + 60),
        _dht_record(claims_key(run), claim.subkey, b"\xc1", NOW + 60),
    ]:
        assert validator.validate(record) is False


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=64), st.binary(max_size=512))
def test_the_dht_validator_never_raises_on_claims(subkey, value):
    run = make_run_id("lab", OWNER)
    record = DHTRecord(DHTID.generate(source=claims_key(run)).to_bytes(), subkey, value, NOW)
    assert RunRecordValidator(run).validate(record) in (True, False)


def _progress(key: Ed25519PrivateKey = KEY, **changes: Any) -> bytes:
    fields = {"epoch": 3, "samples": 17, "run": RUN, "timestamp": NOW} | changes
    peer = peer_id_of(key.public_key())
    return encode_progress(
        Progress(peer, fields["epoch"], fields["samples"]),
        run=fields["run"],
        key=key,
        timestamp=fields["timestamp"],
    )


def test_a_progress_record_is_signed_by_the_peer_it_names():
    assert decode_progress(_progress(), subkey=PEER, run=RUN, now=NOW) == Progress(PEER, 3, 17)
    cases = {
        "unsigned [epoch, samples]": ([2**50, 0], PEER, "must be bytes"),
        "signed by another key": (_progress(OTHER), PEER, "another peer's key"),
        "of another run": (_progress(run="other-run"), PEER, "is for run"),
        "stale": (_progress(timestamp=NOW - MAX_RECORD_AGE_S - 1), PEER, "stale or replayed"),
        "from the future": (_progress(timestamp=NOW + 3600), PEER, "in the future"),
        "not a peer id subkey": (_progress(), 7, "subkey must be a peer id"),
    }
    for what, (raw, subkey, error) in cases.items():
        with pytest.raises(RecordError, match=error):
            decode_progress(raw, subkey=subkey, run=RUN, now=NOW)
            pytest.fail(what)
    envelope = msgpack.unpackb(_progress())
    envelope["record"] = envelope["record"].replace(b'"epoch":3', b'"epoch":4')
    with pytest.raises(RecordError, match="bad signature"):
        decode_progress(msgpack.packb(envelope), subkey=PEER, run=RUN, now=NOW)


def test_the_dht_refuses_unsigned_missigned_and_long_lived_progress_records(monkeypatch):
    monkeypatch.setattr("node.rpc.dht.get_dht_time", lambda: NOW)
    validator = RunRecordValidator(RUN)
    key = progress_key(RUN, 1)
    good = _dht_record(key, PEER, _progress(), NOW + 5)
    assert validator.validate(good)
    assert validator.validate(_dht_record(progress_key(RUN, 255), PEER, _progress(), NOW + 5))
    for record in [
        _dht_record(key, PEER, [2**50, 0], NOW + 5),  # the old, unsigned form
        _dht_record(key, OTHER_PEER, _progress(), NOW + 5),  # under another peer's subkey
        _dht_record(key, OTHER_PEER, _progress(KEY, run="other-run"), NOW + 5),
        _dht_record(key, PEER, _progress(), NOW + 86400),  # would outlive its freshness
        _dht_record(key, PEER, _progress(epoch=2**50), NOW + MAX_RECORD_AGE_S + 1),
    ]:
        assert validator.validate(record) is False


# --- peer records sized to their run --------------------------------------------------------


def _largest(n_stages: int, private: bool) -> PeerInfo:
    """A record of ``SPEC_RUN`` with every field at its longest."""
    return _info(
        run=SPEC_RUN,
        device="x" * 64,
        throughput=[-0.0 + 1.2345678901234567e-300] * n_stages,
        bandwidth_up_mbps=123456789.12345679,
        bandwidth_down_mbps=123456789.12345679,
        stage=n_stages - 1,
        second_stage=0,
        second_serving=True,
        load=1_000_000,
        samples_served=2**62,
        started=NOW - 1.2345678901234567,
        timestamp=NOW + 0.123456789012345,
        ttl_s=119.12345678901234,
        reachable=True,
        membership="A" * MAX_MEMBERSHIP_CHARS if private else None,
    )


@pytest.mark.parametrize("n_stages", [2, 3, 64, MAX_STAGES])
@pytest.mark.parametrize("private", [False, True])
def test_the_largest_record_a_run_needs_fits_its_bounds(n_stages, private):
    bounds = PeerBounds(n_stages, private)
    info = _largest(n_stages, private)
    size = len(encode_peer_info(info, KEY))
    bounds.check(info, size)
    assert size <= bounds.max_bytes < size + 400  # bounds that are not much looser
    if (n_stages, private) == (2, False):
        assert bounds.max_bytes < 1024  # a tenth of what the generic limits allow


def test_a_record_sized_past_its_run_is_refused():
    bounds = PeerBounds(2, private=False)
    with pytest.raises(RecordError, match="names 256 stages; the run has 2"):
        bounds.check(_info(throughput=[1e9] * MAX_STAGES), 100)
    with pytest.raises(RecordError, match="membership proof in a public run"):
        bounds.check(_info(membership="A" * 100), 100)
    with pytest.raises(RecordError, match="is 5000 bytes; a record of this run takes at most"):
        bounds.check(_info(), 5000)
    PeerBounds(2, private=True).check(_info(membership="A" * 100), 500)
    with pytest.raises(ValueError, match="n_stages"):
        PeerBounds(0, private=False)


def test_a_sybil_record_is_padded_to_the_largest_size_its_run_lets_through():
    bounds = PeerBounds(2, private=False)
    info = _info(throughput=[1e9, 1e9], timestamp=NOW + 0.123456789)
    raw = padded_record(info, KEY, bounds.max_bytes)
    assert bounds.max_bytes - 1 <= len(raw) <= bounds.max_bytes
    read = _decode(raw)
    bounds.check(read, len(raw))
    assert len(read.device) == 64 and read.throughput == (1e9, 1e9)
    with pytest.raises(ValueError, match="more than 100"):
        padded_record(info, KEY, 100)


def test_the_dht_validator_bounds_peer_records_once_it_has_seen_the_spec():
    signed = sign_run_spec(make_run_spec(RUN, "tiny", 2, owner=OWNER), OWNER_KEY)
    run = signed.spec.run
    validator = RunRecordValidator(run)
    fat = _info(run=run, throughput=[1e9] * MAX_STAGES)
    lean = _info(run=run, throughput=[1e9, 1e9])
    fat_record = _dht_record(peers_key(run), PEER, encode_peer_info(fat, KEY), NOW + 60)
    lean_record = _dht_record(peers_key(run), PEER, encode_peer_info(lean, KEY), NOW + 60)
    assert validator.validate(fat_record)  # no spec seen yet: the generic limits
    assert validator.validate(_dht_record(spec_key(run), spec_subkey(signed.raw), signed.raw,
                                          NOW + 60))  # fmt: skip
    assert validator.bounds == PeerBounds(2, private=False)
    assert not validator.validate(fat_record)
    assert validator.validate(lean_record)


def test_a_verified_record_is_read_again_without_verifying_but_still_checked(monkeypatch):
    raw = encode_peer_info(_info(), KEY)
    assert _decode(raw) == _info()
    monkeypatch.setattr("protocol.records.verify", lambda *a: pytest.fail("verified again"))
    assert _decode(raw) == _info()
    with pytest.raises(RecordError, match="stored under another peer's key"):
        _decode(raw, subkey=OTHER_PEER)
    with pytest.raises(RecordError, match="stale or replayed"):
        _decode(raw, now=NOW + MAX_RECORD_AGE_S + 1)
    with pytest.raises(RecordError, match="is for run"):
        _decode(raw, run="another")
    with pytest.raises(RecordError, match="must be bytes"):
        _decode([raw])


class _CountingDHT:
    """A hivemind DHT holding ``records`` (peer id -> signed bytes) under every key, that
    counts reads."""

    def __init__(self, records: dict[str, bytes]) -> None:
        self.records, self.reads = records, 0

    async def get(self, key: str, latest: bool, return_future: bool) -> ValueWithExpiration:
        self.reads += 1
        await asyncio.sleep(0.01)  # a read takes a while: readers asked at once overlap
        items = {k: ValueWithExpiration(v, NOW + 60) for k, v in self.records.items()}
        return ValueWithExpiration(items, NOW + 60)


def test_whole_reads_of_the_peers_asked_at_once_share_one_read_of_the_dht(monkeypatch):
    monkeypatch.setattr("node.rpc.dht.get_dht_time", lambda: NOW)
    keys = [_key(10 + i) for i in range(3)]
    records = {peer_id_of(k.public_key()): encode_peer_info(_info(k), k) for k in keys}
    fake = _CountingDHT(records)
    swarm = SwarmDHT(fake, RUN)  # type: ignore[arg-type]

    async def body() -> list[list[PeerInfo]]:
        return await asyncio.gather(*(swarm.peers() for _ in range(4)))

    reads = asyncio.run(body())
    assert fake.reads == 1 and all(len(r) == 3 for r in reads)
    chosen = asyncio.run(swarm.peers(select=lambda ids: ids[:1]))  # fresh: no new read
    assert fake.reads == 1 and len(chosen) == 1


def test_a_large_runs_read_of_its_peers_is_shared_longer():
    assert peers_fresh_s(3) == PEERS_FRESH_S
    assert peers_fresh_s(2000) == 8 * PEERS_FRESH_S  # a flood's records cost a read in 8
