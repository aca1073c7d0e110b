"""Hostile streams for tests: a frame header that declares more than any reader should
take, followed by as much junk as the stream accepts."""

from __future__ import annotations

import asyncio
import contextlib
import time

from google.protobuf.message import Message
from hivemind.p2p import P2P, PeerID


async def flood(
    client: P2P, peer: PeerID, handle: str, header: bytes, nbytes: int, response: type[Message]
) -> tuple[str, float, int]:
    """Open a raw stream to ``peer``'s ``handle``, send ``header`` and then zeros, up to
    ``nbytes`` of them, for as long as the stream takes them. Returns how the server
    answered (its error, or "closed"), after how many seconds, and the bytes sent."""
    _, reader, writer = await client.call_binary_stream_handler(peer, handle)
    sent = 0

    async def send() -> None:
        nonlocal sent
        chunk = bytes(2**16)
        writer.write(header)
        with contextlib.suppress(ConnectionError):
            while sent < nbytes:
                writer.write(chunk)
                await writer.drain()
                sent += len(chunk)

    started = time.monotonic()
    sending = asyncio.create_task(send())
    try:
        async with asyncio.timeout(5):
            try:
                _, error = await P2P.receive_protobuf(response, reader)
                answer = error.message if error is not None else "answered"
            except (asyncio.IncompleteReadError, ConnectionError):
                answer = "closed"  # reset while we were still sending: no time to read it
            answered_after = time.monotonic() - started
            await sending
    finally:
        sending.cancel()
        writer.close()
    return answer, answered_after, sent
