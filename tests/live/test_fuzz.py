"""Hostile streams against real stage servers over real ``p2pd`` daemons: malformed
streams are refused and the server keeps serving; a frame declaring 2**62 bytes is
refused unread."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import math
import random
import struct
import time

import psutil
import torch
from hivemind.p2p import P2P
from hivemind.proto import runtime_pb2

from node.pipeline import client as stage_client
from node.pipeline.server import StageServer, stage_namespace
from node.pipeline.wire import (
    MAX_CHUNK_BYTES,
    REFUSED,
    serialize,
    split_message,
)
from protocol.admission import BUSY
from protocol.stage_messages import (
    BACKWARD,
    FORWARD,
    UNIFORM_8BIT_BINS,
    StageMeta,
)
from tests.stage_rig import (
    CFG,
    RUN,
    TWO,
    _patient,
    _swarm,
)
from tests.streams import flood
from tests.unit.test_fuzz import (
    _ERROR,
    _MESSAGE,
    END,
    B,
    C,
    T,
    _assert_unchanged,
    _frame,
    _snapshot,
)


class _QuickServer(StageServer):
    """Gives up on a request that stops arriving after 1 s, not 60, and bans nobody: the
    hostile streams all come from one caller."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, receive_timeout=1.0, callers=_patient(), **kwargs)


def _stream(metadata: bytes, tensors: list, *, end: bool = True) -> bytes:
    messages = split_message(runtime_pb2.ExpertRequest, metadata, tensors)
    return b"".join(_frame(m) for m in messages) + (END if end else b"")


def _handle(stage: int, kind: str) -> str:
    return StageServer.handle_name(stage_namespace(stage), f"rpc_{kind}")


async def _exchange(client: P2P, peer, stage: int, kind: str, raw: bytes, timeout: float = 10.0):
    """Send ``raw`` on a stream to ``peer``'s ``rpc_<kind>`` of ``stage``; return how the
    server answered: ("refused", reason), ("closed", "") or ("answered", "")."""
    _, reader, writer = await client.call_binary_stream_handler(peer, _handle(stage, kind))
    try:
        async with asyncio.timeout(timeout):
            writer.write(raw)
            with contextlib.suppress(ConnectionError):
                await writer.drain()
            try:
                response, error = await P2P.receive_protobuf(runtime_pb2.ExpertResponse, reader)
            except (asyncio.IncompleteReadError, ConnectionError):
                return "closed", ""
            if error is not None:
                # Not FAILED (no crash); a stalled request is BUSY (it may only be slow)
                prefix = BUSY if error.message.startswith(BUSY) else REFUSED
                assert prefix in error.message, error.message
                assert len(error.message) < 400, error.message[:400]  # it is logged, too
                return "refused", error.message.split(prefix, 1)[1]
            assert response is not None
            return "answered", ""
    finally:
        writer.close()


def _live_cases() -> list[tuple[str, int, str, bytes, str]]:
    """(name, stage, handler, raw stream, the refusal's words, or "closed" or "any")."""
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, CFG.vocab_size, (B, T), generator=g)
    hidden = torch.randn(B, T, C, generator=g)
    s, F, BW = serialize, FORWARD, BACKWARD
    x, h = s(tokens), s(hidden)

    def meta(stage: int, kind: str = FORWARD, **over) -> bytes:
        return StageMeta(over.pop("run", RUN), stage, kind, 1, **over).encode()

    def to(stage: int, *tensors, kind: str = FORWARD, **over) -> bytes:
        """A framed request, its tensors cut into chunks as the client cuts them."""
        return _stream(meta(stage, kind, **over), list(tensors))

    def one(metadata: bytes, *tensors) -> bytes:
        """A framed request in one message, whatever its size."""
        return _frame(runtime_pb2.ExpertRequest(metadata=metadata, tensors=tensors)) + END

    def planted(value: float) -> runtime_pb2.Tensor:
        t = hidden.clone()
        t[1, 2, 3] = value
        return s(t)

    def wire(dtype, size, buffer=b"", compression=0) -> runtime_pb2.Tensor:
        return runtime_pb2.Tensor(dtype=dtype, size=size, buffer=buffer, compression=compression)

    eight_bit = s(hidden, "uint8")  # int64 codebook size, 256 float32 entries, indices
    bad_bins = copy.deepcopy(eight_bit)
    bad_bins.buffer = struct.pack("<q", 2**40) + eight_bit.buffer[8:]
    nan_entries = struct.pack("<f", math.nan) * UNIFORM_8BIT_BINS
    nan_codebook = copy.deepcopy(eight_bit)
    nan_codebook.buffer = eight_bit.buffer[:8] + nan_entries + eight_bit.buffer[1032:]
    half = copy.deepcopy(h)
    half.buffer = h.buffer[: len(h.buffer) // 2]
    longer = copy.deepcopy(x)
    longer.buffer += b"\0" * 8
    huge_tokens = wire("int64", [2**32 - 1] * 2)
    huge_hidden = wire("float32", [2**32 - 1] * 3)
    many_dims = wire("float32", [2**32 - 1] * 4000)
    oversized = wire("float32", [B, T, C], b"\0" * (MAX_CHUNK_BYTES + 1))
    headless = wire("", [], b"\0" * 8)
    meanstd_tokens = wire("int64", [B, T], b"\0" * 64, runtime_pb2.CompressionType.MEANSTD_16BIT)
    unknown = wire("float32", [B, T, C], b"", 99)
    first = _frame(runtime_pb2.ExpertRequest(metadata=meta(0), tensors=[x]))
    late_meta = first + _frame(runtime_pb2.ExpertRequest(metadata=meta(0))) + END
    no_meta = _frame(runtime_pb2.ExpertRequest(tensors=[x])) + END
    empties = _frame(runtime_pb2.ExpertRequest()) * 50 + END
    mid_frame = first[: len(first) // 2]
    huge_frame = _MESSAGE + (2**62).to_bytes(P2P.HEADER_LEN, "big") + b"\0" * 64
    garbage_body = _MESSAGE + (6).to_bytes(P2P.HEADER_LEN, "big") + b"\xff" * 6 + END
    garbage_end = _ERROR + (4).to_bytes(P2P.HEADER_LEN, "big") + b"\xff" * 4
    cases = [
        ("wrong shape", 1, F, to(1, s(hidden[..., :8]), x), "(B, T, 32)"),
        ("wrong dtype", 1, F, to(1, s(hidden.double()), x), "dtype float32"),
        ("float token ids", 0, F, to(0, s(tokens.float())), "dtype int64"),
        ("NaN", 1, F, to(1, planted(math.nan), x), "non-finite"),
        ("Inf", 1, F, to(1, planted(math.inf), x, train=True), "non-finite"),
        ("Inf grad_outputs", 0, BW, to(0, x, planted(-math.inf), kind=BW), "non-finite"),
        ("huge finite inputs", 1, F, to(1, s(hidden * 1e37), x, train=True), "non-finite"),
        ("huge finite, no train", 1, F, to(1, s(hidden * 1e37), x), "non-finite"),
        ("overflowing grads", 0, BW, to(0, x, s(hidden * 1e38), kind=BW), "non-finite"),
        ("token id 256", 0, F, to(0, s(tokens + 256)), "out of range"),
        ("negative target", 1, F, to(1, h, s(tokens - 300)), "out of range"),
        ("wrong stage", 0, F, to(1, x), "request for stage 1"),
        ("largest stage index", 0, F, to(2**16 - 1, x), "request for stage 65535"),
        ("wrong run", 0, F, to(0, x, run="other"), "run 'other'"),
        ("kind mismatch", 0, BW, to(0, x), "forward request sent"),
        ("backward at the last stage", 1, BW, to(1, h, h, kind=BW), "last stage"),
        ("targets with infer", 1, F, to(1, h, x, infer=True), "got more"),
        ("Inf with infer", 1, F, to(1, planted(math.inf), infer=True), "non-finite"),
        ("huge declared shape", 0, F, one(meta(0), huge_tokens), "exceeds the block size"),
        ("huge declared dims", 1, F, one(meta(1), huge_hidden), "(B, T, 32)"),
        ("4000 dims", 1, F, one(meta(1), many_dims), "4000 dimensions"),
        ("truncated tensor", 1, F, to(1, half, x), "its header declares"),
        ("longer tensor", 0, F, to(0, longer), "more than"),
        ("oversized chunk", 1, F, one(meta(1), oversized), "exceeds 1048576"),
        ("headless chunk", 0, F, one(meta(0), headless), "without a tensor header"),
        ("late metadata", 0, F, late_meta, "first message"),
        ("no metadata", 0, F, no_meta, "carry metadata"),
        ("garbage metadata", 0, F, _stream(b"\xc1\xff\x00garbage", [x]), "malformed metadata"),
        ("oversized metadata", 0, F, _stream(b"\xa0" * 4096, [x]), "exceeds the limit"),
        ("8-bit codebook size", 1, F, to(1, bad_bins, x), "codebook"),
        ("8-bit NaN codebook", 1, F, to(1, nan_codebook, x), "non-finite"),
        ("compressed token ids", 0, F, one(meta(0), meanstd_tokens), "compression"),
        ("unknown compression", 1, F, one(meta(1), unknown, x), "compression"),
        ("extra tensor", 0, F, to(0, x, x), "got more"),
        ("no tensors", 0, F, to(0), "got 0"),
        ("empty stream", 0, F, END, "empty request"),
        ("empty messages", 0, F, empties, "carry metadata"),
        ("stalled mid-tensor", 1, F, to(1, half)[: -len(END)], "not received within"),
        ("stalled mid-frame", 0, F, mid_frame, "not received within"),
        ("frame of 2**62 bytes", 0, F, huge_frame, "a frame of 4611686018427387904 bytes"),
        ("garbage frame marker", 0, F, b"\x07" + b"garbage" * 10, "closed"),
        ("garbage protobuf", 0, F, garbage_body, "closed"),
        ("garbage end of stream", 1, F, garbage_end, "closed"),
    ]
    # Seeded bit flips inside the protobuf bodies of a valid last-stage evaluation
    # forward (stateless even if it is accepted): refused, closed or answered.
    rng = random.Random(11)
    valid = [_frame(m) for m in split_message(runtime_pb2.ExpertRequest, meta(1), [h, x])]
    for n in range(12):
        frames = [bytearray(f) for f in valid]
        f = frames[rng.randrange(len(frames))]
        for _ in range(rng.randint(1, 3)):
            at = 1 + P2P.HEADER_LEN + rng.randrange(len(f) - 1 - P2P.HEADER_LEN)
            f[at] ^= 1 << rng.randrange(8)
        cases.append((f"bit flips {n}", 1, F, b"".join(frames) + END, "any"))
    return cases


async def _train_one(client: P2P, s0: StageServer, s1: StageServer, x, y) -> None:
    """A forward and backward through ``TWO``'s two stages."""
    kw = {"run_id": RUN, "timeout": 10}
    a = await stage_client.forward(client, s0.peer_id, x, stage=0, **kw)
    _, grad = await stage_client.loss(client, s1.peer_id, a, y, stage=1, train=True, **kw)
    await stage_client.backward(client, s0.peer_id, x, grad, stage=0, **kw)


def test_live_server_refuses_malformed_streams_and_keeps_serving():
    cases = _live_cases()
    g = torch.Generator().manual_seed(9)
    # Micro-batches of 4: two make OPT.target_batch_size (one AdamW step), the third
    # leaves gradients in .grad, so parameters, moments and gradients all exist.
    batches = [
        tuple(torch.randint(0, CFG.vocab_size, (4, T), generator=g) for _ in range(2))
        for _ in range(4)
    ]

    async def body():
        async with _swarm(TWO, [0, 1], server_cls=_QuickServer) as (client, (s0, s1)):
            for x, y in batches[:3]:
                await _train_one(client, s0, s1, x, y)
            servers = {0: s0, 1: s1}
            assert all(s.optimizer.optimizer.state for s in servers.values())
            assert all(s.optimizer.samples == 4 for s in servers.values())
            before = {i: _snapshot(s) for i, s in servers.items()}

            started = time.monotonic()
            outcomes = []
            for name, i, kind, raw, expect in cases:
                how, reason = await _exchange(client, servers[i].peer_id, i, kind, raw)
                outcomes.append((name, how))
                if expect == "closed":
                    assert how in ("closed", "refused"), (name, how, reason)
                elif expect != "any":
                    assert how == "refused" and expect in reason, (name, how, reason)
            elapsed = time.monotonic() - started
            assert elapsed < 30, elapsed

            for i, server in servers.items():
                _assert_unchanged(server, before[i])
            deadline = time.monotonic() + 5
            while (s0.load or s1.load) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert s0.load == 0 and s1.load == 0
            assert s0.counters.rejected + s1.counters.rejected >= len(
                [c for c in cases if c[4] not in ("any", "closed")]
            )
            # Still serving, and the valid micro-batch counts (8 samples: a step).
            await _train_one(client, s0, s1, *batches[3])
            assert all(s.counters.steps == 2 and s.optimizer.samples == 0 for s in (s0, s1))
            return outcomes

    outcomes = asyncio.run(asyncio.wait_for(body(), 120))
    assert len(outcomes) == len(cases) >= 30


def test_a_frame_declaring_2_62_bytes_is_refused_unread():
    # hivemind reads a frame of any declared length whole; the server refuses this one
    # after its 9-byte header. Served by hivemind's own reader, a flood of 256 MiB grew
    # the server's process by 257 MiB, with no answer within 8 s.
    x, y = (torch.randint(0, CFG.vocab_size, (4, T)) for _ in range(2))
    header = _MESSAGE + (2**62).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER)

    async def body():
        async with _swarm(TWO, [0, 1]) as (client, (s0, s1)):
            process = psutil.Process()
            rss = process.memory_info().rss
            handle = _handle(0, FORWARD)
            answer, after, sent = await flood(
                client, s0.peer_id, handle, header, 64 * 2**20, runtime_pb2.ExpertResponse
            )
            grew = process.memory_info().rss - rss
            assert answer == "closed" or "a frame of 4611686018427387904 bytes" in answer, answer
            # Refused at once, the stream cut after the server dropped at most 1 MiB more.
            assert after < 2 and grew < 8 * 2**20 and sent < 8 * 2**20, (after, grew, sent)
            assert s0.counters.rejected == 1
            await _train_one(client, s0, s1, x, y)  # one refusal bans nobody
            assert s0.counters.backward == 1

    asyncio.run(asyncio.wait_for(body(), 60))
