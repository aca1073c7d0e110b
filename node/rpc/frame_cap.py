"""A cap on the frames that hivemind's protobuf streams read from a peer.

hivemind reads each frame of a protobuf stream by trusting its 8-byte length header and
buffering that many bytes: a peer that declares a 2**62-byte frame and keeps sending
makes the reader hold all of it (the stage RPC measured +257 MiB before it got its own
reader, ``node/servicer.py``). The averager's handlers (join, aggregate, state download)
and their clients still read through hivemind, in the processes hivemind forks, so each of
those processes calls :func:`cap_hivemind_frames` first: a frame over the cap is refused
after its header, unread; the stream fails (hivemind logs it) and the process goes on.
"""

from __future__ import annotations

import asyncio

from hivemind.p2p import P2P

# Averaging sends tensor parts of 512 KiB (hivemind's DEFAULT_PART_SIZE_BYTES) and state
# in chunks of 64 KiB; matchmaking messages are a few hundred bytes.
MAX_FRAME_BYTES = 4 * 2**20


class FrameTooLarge(ValueError):
    """A peer declared a frame larger than the cap."""


def cap_hivemind_frames(max_bytes: int = MAX_FRAME_BYTES) -> None:
    """From now on, in this process, hivemind's stream reads refuse frames over
    ``max_bytes`` before reading them."""
    if max_bytes < 1:
        raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")

    async def receive_raw_data(reader: asyncio.StreamReader) -> bytes:
        header = await reader.readexactly(P2P.HEADER_LEN)
        length = int.from_bytes(header, P2P.BYTEORDER)
        if length > max_bytes:
            raise FrameTooLarge(f"a frame of {length} bytes exceeds the limit of {max_bytes}")
        return await reader.readexactly(length)

    P2P.receive_raw_data = staticmethod(receive_raw_data)
