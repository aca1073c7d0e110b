"""Hostile input, fuzzed, with no network: every decoder of bytes from the network and
the stage server's handler code either accept what they get or refuse it with their own
typed error and a message; they never raise anything else, never allocate what a
declared size asks for, and never change a stage's parameters, gradients or optimizer
state on the way. Examples are derandomized, so a run is reproducible."""

from __future__ import annotations

import asyncio
import copy
import json
import math
import random
import struct
import time
from collections.abc import AsyncIterator, Callable
from types import SimpleNamespace

import msgpack
import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hivemind.p2p import P2P, PeerID
from hivemind.proto import runtime_pb2
from hivemind.proto.p2pd_pb2 import RPCError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from models.stages import Stage
from models.training import StageOptimizer
from node.averaging import state as stage_state
from node.pipeline import client as stage_client
from node.pipeline import wire
from node.pipeline.client import StageCallError
from node.pipeline.server import StageServer
from node.pipeline.wire import (
    FAILED,
    REFUSED,
    deserialize,
    encode_response_meta,
    serialize,
    split_message,
)
from node.rpc.service import FrameError, read_frame
from protocol.averaging import MAX_EPOCH, Progress, decode_progress, encode_progress
from protocol.identity import peer_id_of, sign
from protocol.records import (
    _PEER_DOMAIN,  # to re-sign mutated payloads, so that they reach the parser
    PeerInfo,
    RecordError,
    decode_peer_info,
    encode_peer_info,
)
from protocol.stage_messages import (
    BACKWARD,
    FORWARD,
    GRAD_OUTPUTS,
    INPUTS,
    MAX_METADATA_BYTES,
    TARGETS,
    UNIFORM_8BIT_BINS,
    StageContract,
    StageMeta,
    StageRequestError,
    check_header,
    check_meta,
    parse_request,
    wire_nbytes,
)
from tests.records import peer_info
from tests.stage_rig import (
    CFG,
    MAX_TOKENS,
    OPT,
    RUN,
    THREE,
    _assert_same,
)

# Pure decoders: cheap, so many examples; the handler and state tests build tensors.
FAST = settings(
    max_examples=300,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


SLOW = settings(FAST, max_examples=120)


NOW = 1_700_000_000.0


KEY = Ed25519PrivateKey.from_private_bytes(bytes([7]) * 32)


PEER = peer_id_of(KEY.public_key())


B, T, C = 2, CFG.block_size, CFG.n_embd


SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=12)
    | st.binary(max_size=12)
)


# What msgpack can carry (the shapes of anything a peer can put in the DHT or metadata).
VALUES = st.recursive(
    SCALARS,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=10,
)


# Special float32 values a hostile peer puts in a buffer.
SPECIAL = [math.nan, math.inf, -math.inf, 3e38, -3e38, 1e-45]


def _refuses(error: type[Exception], decode: Callable[[], object]) -> object | None:
    """Run ``decode``: its result, or None when it raised ``error`` with a message.

    Anything else (another exception type, an empty message) fails the test."""
    try:
        return decode()
    except error as e:
        assert str(e).strip(), f"{type(e).__name__} without a message"
        return None


def _mutate_bytes(data: bytes, draw) -> bytes:
    """A few byte-level mutations of ``data``: flips, truncation, insertion, splicing."""
    data = bytearray(data)
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "set", "truncate", "insert", "delete", "dup"]))
        if not data:
            op = "insert"
        i = draw(st.integers(0, max(len(data) - 1, 0)))
        if op == "flip":
            data[i] ^= 1 << draw(st.integers(0, 7))
        elif op == "set":
            data[i] = draw(st.sampled_from([0x00, 0x7F, 0x80, 0xC1, 0xCF, 0xDB, 0xDF, 0xFF]))
        elif op == "truncate":
            del data[i:]
        elif op == "insert":
            data[i:i] = draw(st.binary(min_size=1, max_size=8))
        elif op == "delete":
            del data[i : i + draw(st.integers(1, 8))]
        else:
            data[i:i] = data[i : i + draw(st.integers(1, 16))]
    return bytes(data)


def _peer_info() -> PeerInfo:
    return peer_info(RUN, PEER, throughput=(120.0, 80.0), load=3, timestamp=NOW)


VALID_RECORD = encode_peer_info(_peer_info(), KEY)


def _decode_record(raw: bytes) -> PeerInfo | None:
    return _refuses(
        RecordError,
        lambda: decode_peer_info(raw, subkey=PEER, run=RUN, now=NOW, max_age_s=120.0),
    )


def test_valid_record_decodes():
    assert _decode_record(VALID_RECORD) == _peer_info()


@FAST
@given(st.data())
def test_mutated_records_decode_or_raise_record_error(data):
    _decode_record(_mutate_bytes(VALID_RECORD, data.draw))


@FAST
@given(st.data())
def test_re_signed_mutated_payloads_decode_or_raise_record_error(data):
    # A peer signs whatever it likes: the JSON parser and the schema see near-valid input.
    payload = _mutate_bytes(_peer_info().model_dump_json().encode(), data.draw)
    raw = msgpack.packb({"record": payload, "sig": sign(KEY, _PEER_DOMAIN, payload)})
    info = _decode_record(raw)
    if info is not None:
        assert info.peer_id == PEER and info.run == RUN


@FAST
@given(
    st.sampled_from(sorted(PeerInfo.model_fields)),
    VALUES | st.sampled_from([1e308, -0.0, "NaN", "Infinity", 2**31 + 1, [math.nan]]),
)
def test_re_signed_fields_of_any_value_decode_or_raise_record_error(field, value):
    fields = json.loads(_peer_info().model_dump_json())
    fields[field] = value
    try:
        payload = json.dumps(fields, allow_nan=True).encode()
    except (TypeError, ValueError):  # bytes are not JSON: send their repr instead
        payload = repr(fields).encode()
    raw = msgpack.packb({"record": payload, "sig": sign(KEY, _PEER_DOMAIN, payload)})
    info = _decode_record(raw)
    if info is not None:
        assert all(math.isfinite(t) for t in info.throughput)


WIRE_KEYS = ["run", "stage", "kind", "mb", "train"]


VALID_META = StageMeta(RUN, 1, FORWARD, 5, train=True)


def _decode_meta(raw: bytes) -> StageMeta | None:
    meta = _refuses(StageRequestError, lambda: StageMeta.decode(raw))
    if meta is not None:
        assert isinstance(meta.stage, int) and 0 <= meta.stage < 2**16
        assert meta.kind in (FORWARD, BACKWARD) and StageMeta.decode(meta.encode()) == meta
    return meta


@FAST
@given(st.binary(max_size=2 * MAX_METADATA_BYTES))
def test_arbitrary_metadata_bytes_decode_or_refuse(raw):
    _decode_meta(raw)


@FAST
@given(st.data())
def test_mutated_metadata_decodes_or_refuses(data):
    _decode_meta(_mutate_bytes(VALID_META.encode(), data.draw))


@FAST
@given(
    st.dictionaries(st.sampled_from(WIRE_KEYS) | st.text(max_size=4), VALUES, max_size=6) | VALUES
)
def test_arbitrary_metadata_structures_decode_or_refuse(raw):
    base = {"run": RUN, "stage": 0, "kind": FORWARD, "mb": 0}
    value = base | raw if isinstance(raw, dict) else raw
    meta = _decode_meta(msgpack.packb(value))
    if meta is None:
        return
    for contract in CONTRACTS.values():  # addressing checks refuse cleanly too
        for kind in (FORWARD, BACKWARD):
            _refuses(
                StageRequestError,
                lambda c=contract, k=kind: check_meta(c, meta, run_id=RUN, kind=k),
            )


CONTRACTS = {i: StageContract.for_stage(CFG, THREE[i], i, max_tokens=MAX_TOKENS) for i in range(3)}


DTYPES = ["int64", "float32", "float16", "float64", "bfloat16", "bool", "uint8", "object", ""]


COMPRESSIONS = [
    "NONE", "FLOAT16", "UNIFORM_8BIT", "MEANSTD_16BIT", "QUANTILE_8BIT", "BLOCKWISE",
    "GROUPED_4BIT", "GROUPED_2BIT",
]  # fmt: skip
# Every setting of ``RunSpec.compression``, as the fuzzed requests and responses use them.
SETTINGS = sorted(wire.COMPRESSIONS)


DIMS = st.integers(0, 2**32 - 1) | st.sampled_from([1, 2, 16, 32, 64, 2**31, 2**32 - 1])


# Enough large dimensions to overflow a float64 product (with a zero: inf * 0 = NaN).
MANY_DIMS = st.lists(st.sampled_from([0, 2**31, 2**32 - 1, 2**32 - 1]), min_size=34, max_size=80)


@FAST
@given(
    st.sampled_from(sorted(CONTRACTS)),
    st.sampled_from([INPUTS, TARGETS, GRAD_OUTPUTS]),
    st.sampled_from(DTYPES) | st.text(max_size=10),
    st.lists(DIMS, max_size=6),
    st.sampled_from(COMPRESSIONS) | st.text(max_size=10),
    st.none() | st.tuples(st.integers(1, 8), st.integers(1, 16)),
)
def test_declared_headers_are_checked_without_allocating(i, role, dtype, shape, comp, batch):
    contract = CONTRACTS[i]
    out = _refuses(
        StageRequestError,
        lambda: check_header(
            contract, role, dtype=dtype, shape=shape, compression=comp, batch=batch
        ),
    )
    if out is None:
        return
    (b, t), nbytes = out
    assert 1 <= b * t <= contract.max_tokens and t <= contract.block_size
    numel = math.prod(shape)
    assert nbytes == wire_nbytes(comp, dtype, numel) <= contract.max_message_bytes


def _tensor_of(draw, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A tensor a hostile peer could send: ordinary values, with specials planted."""
    n = math.prod(shape)
    if dtype.is_floating_point:
        t = torch.randn(n, generator=torch.Generator().manual_seed(draw(st.integers(0, 9))))
        for _ in range(draw(st.integers(0, 2)) if n else 0):
            t[draw(st.integers(0, n - 1))] = draw(st.sampled_from(SPECIAL))
    else:
        lo_hi = draw(st.sampled_from([(0, CFG.vocab_size), (-5, 5), (250, 260), (-(2**62), 2**62)]))
        t = torch.randint(lo_hi[0], lo_hi[1], (n,), dtype=torch.int64)
    return t.to(dtype).reshape(shape)


@SLOW
@given(st.data())
def test_decoded_tensors_are_checked(data):
    draw = data.draw
    i = draw(st.sampled_from(sorted(CONTRACTS)))
    contract = CONTRACTS[i]
    kind = draw(st.sampled_from([FORWARD, BACKWARD]))
    meta = StageMeta(RUN, i, kind, 0, train=kind == FORWARD and draw(st.booleans()))
    tensors = []
    for _ in range(draw(st.integers(0, 3))):
        ndim = draw(st.integers(0, 4))
        shape = tuple(draw(st.sampled_from([0, 1, 2, 3, 16, 17, 32, 33])) for _ in range(ndim))
        if math.prod(shape) > 4096:
            shape = shape[:2]
        dtype = draw(st.sampled_from([torch.int64, torch.float32, torch.float64, torch.int32]))
        tensors.append(_tensor_of(draw, shape, dtype))
    request = _refuses(StageRequestError, lambda: parse_request(contract, meta, tensors))
    if request is None:
        return
    for t in (
        request.inputs,
        getattr(request, "targets", None),
        getattr(request, "grad_outputs", None),
    ):
        if t is None:
            continue
        if t.is_floating_point():
            assert t.dtype == torch.float32 and bool(torch.isfinite(t).all())
        else:
            assert t.dtype == torch.int64 and 0 <= int(t.min()) <= int(t.max()) < CFG.vocab_size


@FAST
@given(
    st.lists(st.integers(1, 8), min_size=1, max_size=3),
    st.binary(min_size=8, max_size=8) | st.sampled_from([struct.pack("<q", UNIFORM_8BIT_BINS)]),
    st.data(),
)
def test_8bit_decoding_of_any_buffer_of_the_declared_size(shape, bins, data):
    numel = math.prod(shape)
    rest = data.draw(
        st.binary(min_size=4 * UNIFORM_8BIT_BINS + numel, max_size=4 * UNIFORM_8BIT_BINS + numel)
    )
    wire = runtime_pb2.Tensor(
        dtype="float32",
        size=shape,
        compression=runtime_pb2.CompressionType.UNIFORM_8BIT,
        buffer=bins + rest,
    )
    assert len(wire.buffer) == wire_nbytes("UNIFORM_8BIT", "float32", numel)
    t = _refuses(StageRequestError, lambda: deserialize(wire))
    if t is not None:
        assert tuple(t.shape) == tuple(shape) and t.dtype == torch.float32


@FAST
@given(
    st.sampled_from(SETTINGS),
    st.lists(st.sampled_from(SPECIAL + [0.0, 1.0, -2.5]), min_size=1, max_size=64),
)
def test_special_values_survive_encoding_and_are_refused_after_decoding(compression, values):
    # hivemind's encodings keep them for the request's checks to refuse; grouped low-bit
    # codes cannot hold them, and their decoding refuses the group that carried them.
    hidden = torch.tensor(values * (B * T * C // len(values) + 1))[: B * T * C].reshape(B, T, C)
    decoded = _refuses(StageRequestError, lambda: deserialize(serialize(hidden, compression)))
    if decoded is None:
        assert compression in ("int4", "int2") and not bool(torch.isfinite(hidden).all())
        return
    assert decoded.shape == hidden.shape
    out = _refuses(
        StageRequestError,
        lambda: parse_request(CONTRACTS[1], StageMeta(RUN, 1, FORWARD, 0), [decoded]),
    )
    if out is not None:
        assert bool(torch.isfinite(out.inputs).all())


class _Servers:
    """One ``StageServer`` per stage of ``THREE``, not attached to any P2P: ``_serve`` is
    the handler's whole logic (receive, check, compute, reply) without the stream."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.servers = {}
        for i, blocks in enumerate(THREE):
            stage = Stage(CFG, blocks)
            self.servers[i] = StageServer(
                stage, StageOptimizer(stage, OPT), CONTRACTS[i], RUN, receive_timeout=5.0
            )

    def close(self) -> None:
        for server in self.servers.values():
            asyncio.run(server.shutdown())


@pytest.fixture(scope="module")
def offline_servers():
    servers = _Servers()
    yield servers
    servers.close()


def _snapshot(server: StageServer) -> dict:
    """Everything a request could change, copied: parameters, gradients, AdamW state,
    step and sample counts."""
    named = dict(server.stage.named_parameters())
    names = {id(p): n for n, p in named.items()}
    state = {}
    for p, entries in server.optimizer.optimizer.state.items():
        for key, value in entries.items():
            state[f"{names[id(p)]}/{key}"] = torch.as_tensor(value).clone()
    return {
        "params": {n: p.detach().clone() for n, p in named.items()},
        "grads": {n: None if p.grad is None else p.grad.clone() for n, p in named.items()},
        "adamw": state,
        "counts": (server.optimizer.step_count, server.optimizer.samples),
    }


def _assert_unchanged(server: StageServer, before: dict) -> None:
    after = _snapshot(server)
    for part in ("params", "grads", "adamw"):
        _assert_same(after[part], before[part])
    assert after["counts"] == before["counts"]


def _valid_request(i: int, kind: str, train: bool, compression: str):
    """A valid request to stage ``i`` of ``THREE``: (metadata, serialized tensors)."""
    g = torch.Generator().manual_seed(i)
    tokens = torch.randint(0, CFG.vocab_size, (B, T), generator=g)
    hidden = torch.randn(B, T, C, generator=g)
    inputs = tokens if i == 0 else hidden
    if kind == FORWARD:
        tensors = [inputs] + ([tokens] if i == 2 else [])
    else:
        tensors = [inputs, torch.randn(B, T, C, generator=g)]
    meta = StageMeta(RUN, i, kind, 3, train=train).encode()
    return meta, [serialize(t, compression) for t in tensors]


VALID_COMBOS = [(0, FORWARD, False), (0, BACKWARD, False), (1, FORWARD, False)]


VALID_COMBOS += [(1, BACKWARD, False), (2, FORWARD, False), (2, FORWARD, True)]


def _mutate_tensor(draw, wire: runtime_pb2.Tensor) -> runtime_pb2.Tensor:
    """One to three changes to a serialized tensor: what it declares, or its buffer."""
    wire = copy.deepcopy(wire)
    ops = ["dtype", "size", "dim", "compression", "buffer", "empty", "special"]
    for op in draw(st.lists(st.sampled_from(ops), min_size=1, max_size=3)):
        if op == "dtype":
            wire.dtype = draw(st.sampled_from(DTYPES) | st.text(max_size=8))
        elif op == "size":
            wire.size[:] = draw(st.lists(DIMS, max_size=5) | MANY_DIMS)
        elif op == "dim" and wire.size:
            wire.size[draw(st.integers(0, len(wire.size) - 1))] = draw(DIMS)
        elif op == "compression":
            wire.compression = draw(st.integers(0, 9))
        elif op == "buffer":
            wire.buffer = _mutate_bytes(wire.buffer, draw)
        elif op == "empty":
            wire.buffer = b""
        elif op == "special" and wire.compression == 0 and len(wire.buffer) >= 8:
            buffer = bytearray(wire.buffer)
            if wire.dtype == "float32":
                at = 4 * draw(st.integers(0, len(buffer) // 4 - 1))
                buffer[at : at + 4] = struct.pack("<f", draw(st.sampled_from(SPECIAL)))
            else:
                at = 8 * draw(st.integers(0, len(buffer) // 8 - 1))
                buffer[at : at + 8] = struct.pack("<q", draw(st.sampled_from([-1, 256, 2**62])))
            wire.buffer = bytes(buffer)
    return wire


def _mutate_messages(draw, messages: list[runtime_pb2.ExpertRequest]) -> list:
    """Stream-level mutations: truncation, reordering, misplaced metadata, split chunks."""
    messages = [copy.deepcopy(m) for m in messages]
    op = draw(st.sampled_from(["truncate", "drop", "dup", "swap", "late_meta", "split", "empty"]))
    at = draw(st.integers(0, len(messages) - 1))
    if op == "truncate":
        messages = messages[:at]
    elif op == "drop":
        del messages[at]
    elif op == "dup":
        messages.insert(at, copy.deepcopy(messages[at]))
    elif op == "swap":
        other = draw(st.integers(0, len(messages) - 1))
        messages[at], messages[other] = messages[other], messages[at]
    elif op == "late_meta":
        messages[at].metadata = messages[0].metadata or b"\x80"
    elif op == "split" and messages[at].tensors:
        # A valid continuation chunk, or one that carries a size but no dtype.
        part = messages[at].tensors[-1]
        cut = draw(st.integers(0, len(part.buffer)))
        tail = runtime_pb2.Tensor(buffer=part.buffer[cut:])
        if draw(st.booleans()):
            tail.size[:] = [1]
        part.buffer = part.buffer[:cut]
        messages.insert(at + 1, runtime_pb2.ExpertRequest(tensors=[tail]))
    elif op == "empty":
        messages.insert(at, runtime_pb2.ExpertRequest())
    return messages


@st.composite
def _hostile_requests(draw):
    """(stage, handler kind, messages): a valid request to some stage, then mutated."""
    i, kind, train = draw(st.sampled_from(VALID_COMBOS))
    compression = draw(st.sampled_from(SETTINGS))
    meta, tensors = _valid_request(i, kind, train, compression)
    handler = kind
    for _ in range(draw(st.integers(1, 3))):
        # Tensors weigh more: metadata has fewer ways to be wrong.
        ops = ["meta", "meta_fields", "tensor", "tensor", "tensor", "tensors", "handler", "none"]
        op = draw(st.sampled_from(ops))
        if op == "meta":
            meta = _mutate_bytes(meta, draw)
        elif op == "meta_fields":
            fields = msgpack.unpackb(StageMeta(RUN, i, kind, 3, train=train).encode())
            fields[draw(st.sampled_from(WIRE_KEYS))] = draw(
                VALUES | st.sampled_from([0, 1, 2, 3, 2**16 - 1, FORWARD, BACKWARD, True])
            )
            meta = msgpack.packb(fields)
        elif op == "tensor" and tensors:
            at = draw(st.integers(0, len(tensors) - 1))
            tensors[at] = _mutate_tensor(draw, tensors[at])
        elif op == "tensors":
            what = draw(st.sampled_from(["drop", "dup", "reverse"]))
            if what == "drop" and tensors:
                tensors.pop(draw(st.integers(0, len(tensors) - 1)))
            elif what == "dup" and tensors:
                tensors.append(copy.deepcopy(tensors[0]))
            else:
                tensors.reverse()
        elif op == "handler":
            handler = BACKWARD if handler == FORWARD else FORWARD
    messages = list(split_message(runtime_pb2.ExpertRequest, meta, tensors))
    if draw(st.booleans()):
        messages = _mutate_messages(draw, messages)
    return i, handler, messages


def _serve_offline(server: StageServer, kind: str, messages: list) -> list | StageRequestError:
    """Run the handler's logic on ``messages``: its response, or the refusal it raised."""

    async def requests() -> AsyncIterator[runtime_pb2.ExpertRequest]:
        for m in messages:
            yield m

    context = SimpleNamespace(remote_id=PeerID.from_base58(PEER))
    try:
        return asyncio.run(server._serve(kind, requests(), context))
    except StageRequestError as e:
        return e


@SLOW
@given(_hostile_requests())
def test_handler_refuses_hostile_requests_and_keeps_its_state(offline_servers, request_):
    i, kind, messages = request_
    server = offline_servers.servers[i]
    before = _snapshot(server)
    rejected = server.counters.rejected
    # RuntimeError("stage failed: ...") is what the handler raises when something other
    # than a refusal went wrong: it is not caught here, so it fails the test.
    out = _serve_offline(server, kind, messages)
    assert server.load == 0
    if isinstance(out, StageRequestError):
        assert str(out).startswith(REFUSED) and len(REFUSED) < len(str(out)) < 400
        assert server.counters.rejected == rejected + 1
        _assert_unchanged(server, before)
        return
    assert out and out[0].metadata  # a response
    meta = StageMeta.decode(messages[0].metadata)
    if meta.kind == FORWARD and not meta.train:
        _assert_unchanged(server, before)


def test_valid_requests_are_served_offline(offline_servers):
    # The fuzzing above starts from these: each must be served as it is.
    for i, kind, train in VALID_COMBOS:
        for compression in SETTINGS:
            meta, tensors = _valid_request(i, kind, train, compression)
            messages = list(split_message(runtime_pb2.ExpertRequest, meta, tensors))
            out = _serve_offline(offline_servers.servers[i], kind, messages)
            assert isinstance(out, list), (i, kind, train, compression, out)


def test_huge_finite_activations_are_refused_not_answered_with_nan(offline_servers):
    # Finite inputs whose forward overflows: every peer of the stage would return NaN.
    for i, train in [(1, False), (2, False), (2, True)]:
        server = offline_servers.servers[i]
        before = _snapshot(server)
        huge = torch.full((B, T, C), 3e38)
        tokens = torch.zeros(B, T, dtype=torch.int64)
        tensors = [serialize(huge)] + ([serialize(tokens)] if i == 2 else [])
        meta = StageMeta(RUN, i, FORWARD, 0, train=train).encode()
        out = _serve_offline(
            server, FORWARD, list(split_message(runtime_pb2.ExpertRequest, meta, tensors))
        )
        assert isinstance(out, StageRequestError), (i, train)
        assert "non-finite" in str(out)
        _assert_unchanged(server, before)


def test_a_peer_with_non_finite_parameters_fails_rather_than_refuses():
    # Non-finite outputs from finite inputs are the peer's fault here: the caller should
    # retry on another peer of the stage (``stage failed``), not drop the micro-batch.
    stage = Stage(CFG, THREE[1])
    server = StageServer(stage, StageOptimizer(stage, OPT), CONTRACTS[1], RUN)
    try:
        with torch.no_grad():
            next(stage.parameters()).view(-1)[0] = math.nan
        meta, tensors = _valid_request(1, FORWARD, False, "none")
        messages = list(split_message(runtime_pb2.ExpertRequest, meta, tensors))
        with pytest.raises(RuntimeError, match=f"^{FAILED}.*parameters are non-finite"):
            _serve_offline(server, FORWARD, messages)
    finally:
        asyncio.run(server.shutdown())


class _ReplayP2P:
    """Stands in for a ``P2P`` whose peer answers with ``responses`` (then, optionally,
    an error), whatever it was asked: the stream's bytes, framed as a server frames them."""

    def __init__(self, responses: list, error: str | None = None) -> None:
        self.responses = responses
        self.error = error

    async def call_binary_stream_handler(self, peer, name):
        reader = asyncio.StreamReader()
        for r in self.responses:
            reader.feed_data(_frame(r))
        if self.error is not None:
            body = RPCError(message=self.error).SerializeToString()
            reader.feed_data(_ERROR + len(body).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER) + body)
        reader.feed_eof()
        return None, reader, _NullWriter()


class _NullWriter:
    """A stream writer that takes whatever the client sends."""

    def write(self, data: bytes) -> None:
        pass

    async def drain(self) -> None:
        pass

    def close(self) -> None:
        pass


@st.composite
def _hostile_responses(draw):
    """(call kind, the stage's responses): a valid response, mutated."""
    call = draw(st.sampled_from(["forward", "loss", "backward"]))
    g = torch.Generator().manual_seed(1)
    if call == "loss":
        tensors = [torch.tensor(2.5), torch.randn(B, T, C, generator=g)]
    else:
        tensors = [torch.randn(B, T, C, generator=g)]
    compression = draw(st.sampled_from(SETTINGS))
    wires = [serialize(t, compression) for t in tensors]
    n = len(wires)
    op = draw(st.sampled_from(["tensor", "tensor", "declare", "count", "meta", "none", "drop"]))
    at = draw(st.integers(0, len(wires) - 1))
    if op == "tensor":
        wires[at] = _mutate_tensor(draw, wires[at])
    elif op == "declare":  # an enormous (or empty but enormous) declared shape
        wires[at].size[:] = draw(MANY_DIMS)
        wires[at].buffer = draw(st.sampled_from([b"", wires[at].buffer[:64]]))
    elif op == "count":
        n = draw(st.integers(-2, 12))
    elif op == "drop":
        wires.pop()
    meta = encode_response_meta(n) if n >= 0 else msgpack.packb({"tensors": n})
    if op == "meta":
        meta = _mutate_bytes(meta, draw)
    messages = list(split_message(runtime_pb2.ExpertResponse, meta, wires))
    if draw(st.booleans()):
        messages = _mutate_messages(draw, messages)
    error = draw(st.none() | st.sampled_from([REFUSED + "no", FAILED + "oops", "", "\x00\xff"]))
    return call, messages, error


@SLOW
@given(_hostile_responses())
def test_client_decodes_hostile_responses_or_raises_stage_call_error(response):
    call, messages, error = response
    p2p = _ReplayP2P(messages, error)
    peer = PeerID.from_base58(PEER)
    tokens = torch.zeros(B, T, dtype=torch.int64)
    hidden = torch.zeros(B, T, C)
    kw = {"run_id": RUN, "timeout": 5.0}

    async def body():
        if call == "forward":
            out = await stage_client.forward(p2p, peer, hidden, stage=1, **kw)
            assert out.shape[:2] == (B, T) and bool(torch.isfinite(out).all())
        elif call == "loss":
            loss, grad = await stage_client.loss(
                p2p, peer, hidden, tokens, stage=2, train=True, **kw
            )
            assert loss.shape == () and grad.shape == hidden.shape
        else:
            grad = await stage_client.backward(p2p, peer, hidden, hidden, stage=1, **kw)
            assert grad.shape == hidden.shape and bool(torch.isfinite(grad).all())

    _refuses(StageCallError, lambda: asyncio.run(body()))


def test_client_refuses_a_response_declaring_an_enormous_tensor():
    # Found by the fuzzing above: the product of the declared dimensions overflowed a
    # float to inf (OverflowError) or, with a zero among them, to NaN (ValueError).
    # And torch cannot shape an empty tensor whose other dimensions overflow its strides.
    hidden = torch.zeros(B, T, C)
    for size in ([2**32 - 1] * 40, [2**32 - 1] * 40 + [0], [2**31] * 3 + [0], [7] * 5000):
        wire = runtime_pb2.Tensor(dtype="float32", size=size, buffer=b"")
        message = runtime_pb2.ExpertResponse(metadata=encode_response_meta(1), tensors=[wire])
        started = time.monotonic()
        with pytest.raises(StageCallError, match="malformed response"):
            asyncio.run(
                stage_client.forward(
                    _ReplayP2P([message]), PeerID.from_base58(PEER), hidden, run_id=RUN, stage=1
                )
            )
        assert time.monotonic() - started < 1.0


@FAST
@given(VALUES | st.sampled_from([PEER, "x" * 129, ""]), VALUES, st.data())
def test_progress_records_decode_or_raise_record_error(subkey, value, data):
    good = encode_progress(Progress(PEER, 3, 17), run=RUN, key=KEY, timestamp=NOW)
    for raw in (value, _mutate_bytes(good, data.draw)):
        p = _refuses(
            RecordError, lambda raw=raw: decode_progress(raw, subkey=subkey, run=RUN, now=NOW)
        )
        if p is not None:
            assert 0 <= p.epoch < MAX_EPOCH and 0 <= p.samples < MAX_EPOCH
            assert type(p.epoch) is int and type(p.samples) is int and p.peer_id == subkey


def test_progress_round_trip():
    p = Progress(PEER, 3, 17)
    raw = encode_progress(p, run=RUN, key=KEY, timestamp=NOW)
    # What hivemind stores and reads back (msgpack) decodes to the same record.
    raw = msgpack.unpackb(msgpack.packb(raw))
    assert decode_progress(raw, subkey=PEER, run=RUN, now=NOW) == p


def _donor(mode: str):
    """A middle stage after one AdamW step: (module, metadata, tensors) as captured."""
    torch.manual_seed(3)
    stage = Stage(CFG, THREE[1])
    opt = StageOptimizer(stage, OPT)
    h = torch.randn(B, T, C)
    stage(h).square().sum().backward()
    opt.accumulated(B)
    opt.step()
    momentum = None
    if mode == "diloco":
        momentum = [torch.randn_like(p) for _, p in stage_state.trainable(stage)]
    metadata, tensors = stage_state.capture(
        stage, opt, epoch=2, mode=mode, peer=PEER, momentum=momentum
    )
    return stage, metadata, tensors


DONORS = {mode: _donor(mode) for mode in ("gradient", "diloco")}


def _mutate_tensor_value(draw, t: object) -> object:
    if not isinstance(t, torch.Tensor):
        return t
    op = draw(st.sampled_from(["dtype", "shape", "special", "scalar", "object", "empty"]))
    if op == "dtype":
        dtype = draw(
            st.sampled_from([torch.float16, torch.float64, torch.bfloat16, torch.int64, torch.bool])
        )
        return t.to(dtype)
    if op == "shape":
        return t.reshape(-1) if t.dim() != 1 else t[:-1]
    if op == "special" and t.numel():
        t = t.clone()
        t.view(-1)[draw(st.integers(0, t.numel() - 1))] = draw(st.sampled_from(SPECIAL))
        return t
    if op == "scalar":
        return torch.tensor(draw(st.sampled_from(SPECIAL + [-1.0, 2.0**60])))
    if op == "object":
        return draw(VALUES)
    return torch.empty(0)


@SLOW
@given(st.sampled_from(["gradient", "diloco"]), st.data())
def test_downloaded_states_parse_or_raise_state_error(mode, data):
    draw = data.draw
    stage, metadata, tensors = DONORS[mode]
    metadata = copy.deepcopy(metadata)
    tensors = list(tensors)
    for _ in range(draw(st.integers(1, 3))):
        op = draw(st.sampled_from(["field", "delete", "adamw", "tensor", "tensors", "mode"]))
        if op == "field":
            metadata[draw(st.sampled_from(sorted(metadata)))] = draw(VALUES)
        elif op == "delete":
            metadata.pop(draw(st.sampled_from(sorted(metadata))), None)
        elif op == "adamw" and metadata.get("adamw"):
            entries = metadata["adamw"]
            at = draw(st.integers(0, len(entries) - 1))
            entries[at] = draw(
                VALUES
                | st.tuples(st.integers(-2, 40), st.sampled_from(["step", "exp_avg", "x"])).map(
                    list
                )
            )
        elif op == "tensor" and tensors:
            at = draw(st.integers(0, len(tensors) - 1))
            tensors[at] = _mutate_tensor_value(draw, tensors[at])
        elif op == "tensors" and tensors:
            what = draw(st.sampled_from(["drop", "dup", "shuffle"]))
            if what == "drop":
                tensors.pop(draw(st.integers(0, len(tensors) - 1)))
            elif what == "dup":
                tensors.append(tensors[0])
            else:
                random.Random(draw(st.integers(0, 99))).shuffle(tensors)
        elif op == "mode":
            metadata["momentum"] = not metadata.get("momentum")
    parsed = _refuses(
        stage_state.StateError, lambda: stage_state.parse(metadata, tensors, stage, mode=mode)
    )
    if parsed is None:
        return
    # Whatever parses can be applied, and leaves finite parameters and moments.
    target = copy.deepcopy(stage)
    opt = StageOptimizer(target, OPT)
    stage_state.apply(parsed, target, opt)
    assert all(bool(torch.isfinite(p).all()) for p in target.parameters())
    for entries in opt.optimizer.state.values():
        assert all(bool(torch.isfinite(v).all()) for v in entries.values())


def test_captured_states_parse():
    for mode, (stage, metadata, tensors) in DONORS.items():
        state = stage_state.parse(metadata, tensors, stage, mode=mode)
        assert state.step == 1 and state.epoch == 2 and state.source == PEER
        assert (state.momentum is not None) == (mode == "diloco")


_MESSAGE, _ERROR = P2P.MESSAGE_MARKER, P2P.ERROR_MARKER


def _frame(message) -> bytes:
    """One message of a hivemind stream, as hivemind frames it."""
    body = message.SerializeToString()
    return _MESSAGE + len(body).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER) + body


END = _ERROR + (0).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER)  # hivemind's end of stream


def test_read_frame_refuses_before_reading_a_body():
    request = runtime_pb2.ExpertRequest(metadata=b"m" * 100)
    n = len(request.SerializeToString())

    def read(raw: bytes, max_bytes: int = 1024) -> tuple[object, int]:
        """What ``read_frame`` makes of ``raw`` (a message, None or a FrameError), and how
        many bytes of it it left unread."""

        async def feed():
            reader = asyncio.StreamReader()
            reader.feed_data(raw)
            reader.feed_eof()
            try:
                out = await read_frame(reader, runtime_pb2.ExpertRequest, max_bytes)
            except FrameError as e:
                out = e
            return out, len(await reader.read())

        return asyncio.run(feed())

    assert read(_frame(request)) == (request, 0)
    end, left = read(END)
    assert isinstance(end, RPCError) and left == 0
    huge = _MESSAGE + (2**62).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER) + bytes(100)
    garbage = _MESSAGE + (4).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER) + b"\xff" * 4
    for raw, max_bytes, words, unread in [
        (huge, 1024, "a frame of 4611686018427387904 bytes exceeds the limit of 1024", 100),
        (_frame(request), 64, f"a frame of {n} bytes exceeds the limit of 64", n),
        (b"\x07" + bytes(20), 1024, "with marker b'\\x07'", 20),
        (garbage, 1024, "a frame of 4 bytes is not a ExpertRequest", 0),
    ]:
        error, left = read(raw, max_bytes)
        assert isinstance(error, FrameError) and words in str(error), error
        assert left == unread
