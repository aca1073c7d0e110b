"""``node.rpc.hivemind_compat``'s process-wide patches on real ``p2pd`` daemons (loopback):
the options reach the daemon, and hivemind's own stream handlers read capped frames."""

from __future__ import annotations

import asyncio
import shutil
import tempfile

from hivemind.p2p import P2P
from hivemind.proto import runtime_pb2

from node.rpc import hivemind_compat as compat
from node.rpc.gossip import PUBSUB_FLAGS, Gossip

LOOPBACK = "/ip4/127.0.0.1/tcp/0"


def test_p2pd_options_start_a_daemon_with_pubsub_and_its_sockets_in_our_directory():
    directory = tempfile.mkdtemp(prefix="compat-", dir="/tmp")  # short: a socket path

    async def main() -> None:
        with compat.p2pd_options(extra_args=PUBSUB_FLAGS, socket_dir=directory):
            p2p = await P2P.create(host_maddrs=[LOOPBACK])
        try:
            assert p2p.daemon_listen_maddr["unix"].startswith(f"{directory}/p2pd-")
            gossip = await Gossip.create(p2p.daemon_listen_maddr)  # self-tests pubsub
            await gossip.close()
        finally:
            await p2p.shutdown()

    try:
        asyncio.run(asyncio.wait_for(main(), 60))
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def test_hiveminds_stream_handler_drops_a_frame_over_the_cap_without_reading_it():
    received: list[runtime_pb2.ExpertRequest] = []

    async def echo(requests, context):
        async for request in requests:
            received.append(request)
            yield runtime_pb2.ExpertResponse()

    async def main() -> None:
        server = await P2P.create(host_maddrs=[LOOPBACK])
        client = await P2P.create(
            host_maddrs=[LOOPBACK], initial_peers=await server.get_visible_maddrs()
        )
        try:
            await server.add_protobuf_handler(
                "echo", echo, runtime_pb2.ExpertRequest, stream_input=True, stream_output=True
            )
            _, reader, writer = await client.call_binary_stream_handler(server.peer_id, "echo")
            header = P2P.MESSAGE_MARKER + (2**62).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER)
            async with asyncio.timeout(10):  # uncapped, the server would wait for 2**62 bytes
                try:
                    writer.write(header + b"\0" * 2**20)
                    await writer.drain()
                    assert await reader.read() == b""  # the server dropped the stream
                except (ConnectionResetError, BrokenPipeError):
                    pass  # or reset or closed it while we were still sending
            assert received == []
            writer.close()
        finally:
            await client.shutdown()
            await server.shutdown()

    compat.cap_frames(4096)
    try:
        asyncio.run(asyncio.wait_for(main(), 60))
    finally:
        compat.cap_frames(None)
