"""The parts of stage RPCs that need no daemon: the chunk assembler's limits, ban
lists, call timeouts, membership forgiveness, and ``protocol.stage_messages`` alone."""

from __future__ import annotations

import asyncio
import time

import msgpack
import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import runtime_pb2

from models.stages import Stage, StageRange
from models.training import StageOptimizer
from node.pipeline import client as client_module
from node.pipeline.server import StageServer
from node.pipeline.wire import MAX_CHUNK_BYTES, Assembler, serialize, split_message
from node.rpc.membership import NOT_A_MEMBER
from node.rpc.service import BAN_AFTER
from protocol.identity import peer_id_of
from protocol.ownership import make_run_id
from protocol.routing import BanList, CallTimer
from protocol.stage_messages import (
    BACKWARD,
    FORWARD,
    GRAD_OUTPUTS,
    INPUTS,
    MAX_MICRO_BATCH_ID,
    TARGETS,
    StageContract,
    StageMeta,
    StageRequestError,
    check_header,
    check_tensor,
    parse_request,
    wire_nbytes,
)
from tests.stage_rig import (
    CFG,
    MAX_TOKENS,
    OPT,
    RUN,
    TWO,
    _batch,
    _run,
    _tensor,
)


def test_assembler_refuses_oversized_input_at_the_first_chunk():
    def declared(_, header):  # what a header check returns: the buffer's exact size
        return len(header.buffer) if header.size == [1] else int(header.size[0]) * 4

    big = serialize(torch.zeros(2**18))  # 1 MiB, sent as 16 chunks of 64 KiB
    messages = split_message(runtime_pb2.ExpertRequest, b"m", [big])
    assembler = Assembler(2**19, declared)
    with pytest.raises(StageRequestError, match="request of 1048577 bytes exceeds"):
        assembler.add(next(messages))
    assert assembler.received == 1  # only the metadata: no tensor bytes were kept

    fine = Assembler(2**21, declared)
    for message in split_message(runtime_pb2.ExpertRequest, b"m", [big]):
        fine.add(message)
    (out,) = fine.tensors()
    assert out.buffer == big.buffer and list(out.size) == [2**18]

    for bad, words in [
        (runtime_pb2.ExpertRequest(tensors=[_tensor("", [], b"x")]), "without a tensor header"),
        (
            runtime_pb2.ExpertRequest(
                tensors=[_tensor("float32", [1], b"\0" * (MAX_CHUNK_BYTES + 1))]
            ),
            "exceeds 1048576 bytes",
        ),
    ]:
        with pytest.raises(StageRequestError, match=words):
            Assembler(2**30, declared).add(bad)
    late = Assembler(2**30, declared)
    late.add(runtime_pb2.ExpertRequest(metadata=b"m"))
    with pytest.raises(StageRequestError, match="only allowed in the first"):
        late.add(runtime_pb2.ExpertRequest(metadata=b"m"))
    short = Assembler(2**30, declared)
    short.add(runtime_pb2.ExpertRequest(tensors=[_tensor("float32", [8], b"\0" * 16)]))
    with pytest.raises(StageRequestError, match="has 16 bytes, its header declares 32"):
        short.tensors()


def test_ban_list_bans_after_repeated_strikes_within_a_window():
    bans = BanList(duration_s=60.0, strikes=5, window_s=60.0)
    assert bans.strike("a", 0.0) is None and bans.until("a", 0.0) is None  # one never bans
    for t in (1.0, 2.0, 3.0):
        assert bans.strike("a", t) is None
    assert bans.strike("a", 4.0) == 64.0
    assert bans.until("a", 10.0) == 64.0 and bans.banned(10.0) == {"a"}
    assert bans.strike("a", 20.0) is None and bans.until("a", 20.0) == 64.0  # not extended
    assert bans.until("a", 64.0) is None and bans.banned(64.0) == frozenset()

    for t in (100.0, 101.0, 102.0, 103.0, 170.0, 171.0, 172.0, 173.0):
        assert bans.strike("b", t) is None  # 4 and 4, over a minute apart

    for cause in ("membership", "membership", "membership", ""):
        bans.strike("c", 200.0, cause)
    bans.forgive("c", "membership")  # the other cause's strike stays
    for _ in range(3):
        assert bans.strike("c", 201.0) is None
    assert bans.strike("c", 201.0) == 261.0

    client = BanList(duration_s=15.0)  # the trainer's: a failed peer is banned at once
    assert client.strike("p", 0.0) == 15.0 and client.ban("q", 1.0) == 16.0
    assert client.banned(2.0) == {"p", "q"}

    small = BanList(strikes=2, max_peers=2)
    for peer in "pqr":
        small.strike(peer, 0.0)  # p's strike is forgotten: two peers are remembered
    assert small.strike("p", 1.0) is None and small.strike("r", 1.0) == 16.0
    with pytest.raises(ValueError, match="strikes"):
        BanList(strikes=0)


def test_call_timeout_follows_the_stage_calls_and_backs_off():
    timer = CallTimer(floor_s=1.0, ceiling_s=30.0)
    assert timer.timeout(0) == 30.0  # nothing known yet: the longest wait
    timer.succeeded(0, 2.0)
    assert timer.timeout(0) == pytest.approx(2 * 2.0 + 4 * 1.0)  # first answer: deviation d/2
    for _ in range(50):
        timer.succeeded(0, 2.0)  # steady calls: twice their duration, the deviation gone
    assert timer.timeout(0) == pytest.approx(4.0, rel=0.01)
    assert timer.timeout(1) == 30.0  # per stage
    for _ in range(50):
        timer.succeeded(1, 0.01)
    assert timer.timeout(1) == 1.0  # never under the floor
    timer.timed_out(0)
    assert timer.timeout(0) == pytest.approx(8.0, rel=0.01)  # doubled after a timeout ...
    for _ in range(10):
        timer.timed_out(0)
    assert timer.timeout(0) == 30.0  # ... up to the ceiling
    timer.succeeded(0, 2.0)
    assert timer.timeout(0) == pytest.approx(4.0, rel=0.01)  # and reset by an answer
    with pytest.raises(ValueError, match="floor_s <= ceiling_s"):
        CallTimer(floor_s=5.0, ceiling_s=1.0)


def test_refusals_as_a_non_member_are_forgiven_once_admitted():
    # A trainer whose invite a restarted server forgot is refused until it presents it
    # again: that must not add up to a ban with its later mistakes.
    x, _ = _batch()
    caller = PeerID.from_base58(peer_id_of(Ed25519PrivateKey.generate().public_key()))
    admitted: set[str] = set()
    stage = Stage(CFG, TWO[0])
    contract = StageContract.for_stage(CFG, TWO[0], 0, max_tokens=MAX_TOKENS)
    server = StageServer(
        stage,
        StageOptimizer(stage, OPT),
        contract,
        RUN,
        admission=lambda peer: None if peer in admitted else NOT_A_MEMBER + "no invite",
    )
    context = P2PContext(handle_name="test", local_id=caller, remote_id=caller)

    async def serve(run: str) -> None:
        async def requests():
            meta = StageMeta(run, 0, FORWARD, 1).encode()
            for message in split_message(runtime_pb2.ExpertRequest, meta, [serialize(x)]):
                yield message

        await server._serve(FORWARD, requests(), context)

    def banned() -> bool:
        return server.callers.until(caller.to_base58(), time.monotonic()) is not None

    async def body():
        for _ in range(BAN_AFTER - 1):
            with pytest.raises(StageRequestError, match="not a member"):
                await serve(RUN)
        admitted.add(caller.to_base58())
        await serve(RUN)
        for _ in range(BAN_AFTER - 1):
            with pytest.raises(StageRequestError, match="request for run 'other'"):
                await serve("other")
        assert not banned()
        with pytest.raises(StageRequestError, match="request for run 'other'"):
            await serve("other")
        assert banned() and server.counters.rejected == 2 * BAN_AFTER - 1

    try:
        _run(body())
    finally:
        asyncio.run(server.shutdown())


C0 = StageContract.for_stage(CFG, TWO[0], 0, max_tokens=MAX_TOKENS)


C1 = StageContract.for_stage(CFG, TWO[1], 1, max_tokens=MAX_TOKENS)


def test_contract_roles_and_defaults():
    assert C0.takes_tokens and not C0.returns_loss and C1.returns_loss
    assert C0.roles(FORWARD) == (INPUTS,) and C0.roles(BACKWARD) == (INPUTS, GRAD_OUTPUTS)
    assert C1.roles(FORWARD) == (INPUTS, TARGETS)
    assert C1.roles(FORWARD, infer=True) == (INPUTS,) == C0.roles(FORWARD, infer=True)
    with pytest.raises(StageRequestError, match="last stage"):
        C1.roles(BACKWARD)
    default = StageContract.for_stage(CFG, TWO[1], 1)
    assert default.max_tokens == 32 * CFG.block_size
    assert default.max_message_bytes >= 2 * default.max_tokens * CFG.n_embd * 4
    with pytest.raises(ValueError, match="out of range"):
        StageContract.for_stage(CFG, StageRange(2, 9), 1)


def test_meta_round_trip_and_refusals():
    meta = StageMeta(RUN, 1, FORWARD, 2**63 - 1, train=True)
    assert StageMeta.decode(meta.encode()) == meta
    assert StageMeta.decode(StageMeta(RUN, 0, BACKWARD, 0).encode()).train is False
    inference = StageMeta(RUN, 1, FORWARD, 0, infer=True)
    assert StageMeta.decode(inference.encode()) == inference
    assert b"infer" not in meta.encode(), "a flag travels only when set"
    bad = [
        ({"run": "", "stage": 0, "kind": FORWARD, "mb": 0}, "run id"),
        ({"run": RUN, "stage": True, "kind": FORWARD, "mb": 0}, "stage must be"),
        ({"run": RUN, "stage": -1, "kind": FORWARD, "mb": 0}, "stage must be"),
        ({"run": RUN, "stage": 0, "kind": "sideways", "mb": 0}, "kind must be"),
        ({"run": RUN, "stage": 0, "kind": FORWARD, "mb": 2**64 - 1}, "micro-batch id"),
        ({"run": RUN, "stage": 0, "kind": FORWARD, "mb": 1.5}, "micro-batch id"),
        ({"run": RUN, "stage": 0, "kind": FORWARD, "mb": 0, "train": 1}, "train must be"),
        ({"run": RUN, "stage": 0, "kind": BACKWARD, "mb": 0, "train": True}, "only meaningful"),
        ({"run": RUN, "stage": 0, "kind": FORWARD}, r"lacks keys \['mb'\]"),
        ({"run": RUN, "stage": 0, "kind": FORWARD, "mb": 0, "infer": 1}, "infer must be"),
        ({"run": RUN, "stage": 0, "kind": BACKWARD, "mb": 0, "infer": True}, "only meaningful"),
        (
            {"run": RUN, "stage": 0, "kind": FORWARD, "mb": 0, "train": True, "infer": True},
            "without train",
        ),
        ({"run": RUN, "stage": 0, "kind": FORWARD, "mb": 0, "logits": True}, "unknown metadata"),
    ]
    for raw, words in bad:
        with pytest.raises(StageRequestError, match=words):
            StageMeta.decode(msgpack.packb(raw))
    for data in [b"", b"\x93\x01", b"\xd9\x05ab", msgpack.packb({1: 2})]:
        with pytest.raises(StageRequestError):
            StageMeta.decode(data)


def test_header_checks_give_byte_counts_before_reading():
    bt, n = check_header(C0, INPUTS, dtype="int64", shape=(4, 16), compression="NONE")
    assert bt == (4, 16) and n == 4 * 16 * 8
    _, n = check_header(
        C1, INPUTS, dtype="float32", shape=(2, 16, 32), compression="FLOAT16", batch=None
    )
    assert n == 2 * 16 * 32 * 2
    assert wire_nbytes("UNIFORM_8BIT", "float32", 10) == 8 + 1024 + 10
    refusals = [
        (C1, INPUTS, "float32", (2, 16, 64), "NONE", None, r"hidden states \(B, T, 32\), got"),
        (C0, INPUTS, "int64", (2, 16, 1), "NONE", None, r"token ids \(B, T\), got \(2, 16, 1\)"),
        (C0, INPUTS, "int64", (0, 16), "NONE", None, "B >= 1"),
        (C0, INPUTS, "int64", (1, 17), "NONE", None, "exceeds the block size 16"),
        (C0, INPUTS, "int64", (5, 16), "NONE", None, "80 tokens exceed the limit of 64"),
        (C0, INPUTS, "float32", (2, 16), "NONE", None, "dtype int64, got float32"),
        (C1, INPUTS, "float32", (2, 16, 32), "MEANSTD_16BIT", None, "compression"),
        (C1, TARGETS, "int64", (2, 8), "NONE", (2, 16), "do not match"),
        (C0, GRAD_OUTPUTS, "float32", (3, 16, 32), "NONE", (2, 16), "do not match"),
    ]
    for contract, role, dtype, shape, comp, batch, words in refusals:
        with pytest.raises(StageRequestError, match=words):
            check_header(contract, role, dtype=dtype, shape=shape, compression=comp, batch=batch)


def test_decoded_tensor_checks():
    x, y = _batch(2)
    h = torch.randn(2, 16, 32)
    assert check_tensor(C0, INPUTS, x) == (2, 16)
    negative = x.clone()
    negative[1, 3] = -1
    with pytest.raises(StageRequestError, match=r"id -1, out of range \[0, 256\)"):
        check_tensor(C0, INPUTS, negative)
    inf = h.clone()
    inf[0, 0, :2] = float("inf")
    with pytest.raises(StageRequestError, match="2 non-finite"):
        check_tensor(C1, INPUTS, inf)

    request = parse_request(C1, StageMeta(RUN, 1, FORWARD, 0, train=True), [h, y])
    assert request.targets is y and request.inputs is h
    request = parse_request(C1, StageMeta(RUN, 1, FORWARD, 0, infer=True), [h])
    assert request.targets is None and request.inputs is h
    with pytest.raises(StageRequestError, match=r"carries 1 tensors \['inputs'\], got 2"):
        parse_request(C1, StageMeta(RUN, 1, FORWARD, 0, infer=True), [h, y])
    request = parse_request(C0, StageMeta(RUN, 0, BACKWARD, 0), [x, h])
    assert request.grad_outputs is h
    with pytest.raises(StageRequestError, match="carries 2 tensors"):
        parse_request(C0, StageMeta(RUN, 0, BACKWARD, 0), [x])
    with pytest.raises(StageRequestError, match="grad_outputs"):
        parse_request(C0, StageMeta(RUN, 0, BACKWARD, 0), [x, h[:, :8]])


class _Writer:
    closed = False

    def close(self) -> None:
        self.closed = True


def test_idle_streams_are_reused_until_closed_idle_or_too_many(monkeypatch):
    async def body():
        now = [100.0]
        monkeypatch.setattr(client_module.time, "monotonic", lambda: now[0])
        sessions = client_module._Sessions()
        key = (PeerID.from_base58(peer_id_of(Ed25519PrivateKey.generate().public_key())), "h")
        assert sessions.take(key) is None
        streams = [client_module._Stream(asyncio.StreamReader(), _Writer()) for _ in range(10)]
        for stream in streams:
            sessions.give_back(key, stream)
        kept = streams[: client_module.MAX_IDLE_STREAMS]
        assert [s.writer.closed for s in streams] == [s not in kept for s in streams]
        assert sessions.take(key) is kept[-1]  # the most recently used first
        kept[-2].reader.feed_eof()  # the server closed it
        assert sessions.take(key) is kept[-3] and kept[-2].writer.closed
        now[0] += client_module.IDLE_S  # the rest idled out: closed, not reused
        assert sessions.take(key) is None
        assert all(s.writer.closed for s in kept[:-3])

    asyncio.run(body())


def test_idle_streams_close_on_time_without_a_call_and_with_their_peer(monkeypatch):
    """No call needs to come: an idle stream is closed ``IDLE_S`` after its last call
    (then no timer is left), and at once when its peer leaves the caller's view."""
    monkeypatch.setattr(client_module, "IDLE_S", 0.2)

    async def body():
        sessions = client_module._Sessions()
        a, b = (PeerID.from_base58(peer_id_of(Ed25519PrivateKey.generate().public_key()))
                for _ in range(2))  # fmt: skip
        early = client_module._Stream(asyncio.StreamReader(), _Writer())
        sessions.give_back((a, "h"), early)
        await asyncio.sleep(0.1)
        late = client_module._Stream(asyncio.StreamReader(), _Writer())
        sessions.give_back((a, "h"), late)
        gone = client_module._Stream(asyncio.StreamReader(), _Writer())
        sessions.give_back((b, "h"), gone)
        sessions.forget({b})
        assert gone.writer.closed and not early.writer.closed
        deadline = time.monotonic() + 10.0
        while not early.writer.closed:
            assert time.monotonic() < deadline, "the idle stream was never closed"
            await asyncio.sleep(0.01)
        assert not late.writer.closed  # idle for less than IDLE_S yet: kept
        while not late.writer.closed:
            assert time.monotonic() < deadline, "the second idle stream was never closed"
            await asyncio.sleep(0.01)
        assert sessions._timer is None and sessions.take((a, "h")) is None
        sessions.give_back((a, "h"), client_module._Stream(asyncio.StreamReader(), _Writer()))
        sessions.close()  # cancels the timer it armed
        assert sessions._timer is None

    asyncio.run(body())


def test_a_run_id_with_the_longest_name_fits_a_stage_request():
    """Any run id a spec accepts (a 64-character name and the fingerprint) travels in a
    stage request: the metadata's own caps must not refuse a run that ``run create``
    made."""
    key = Ed25519PrivateKey.generate()
    run_id = make_run_id("r" * 64, peer_id_of(key.public_key()))
    meta = StageMeta(run_id, 0, FORWARD, MAX_MICRO_BATCH_ID, True, False)
    assert StageMeta.decode(meta.encode()) == meta
