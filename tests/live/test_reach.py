"""Reachability on real ``p2pd`` daemons (loopback): the dial-back service, and a DHT that
joins as a client and becomes a full node (``node.rpc.reach``, ``SwarmDHT.become_server``).
Behind real NAT: ``test_nat.py``."""

from __future__ import annotations

import asyncio
import socket

import pytest
from hivemind.p2p import P2P, P2PHandlerError
from hivemind.proto import runtime_pb2

from node.rpc.dht import SwarmDHT
from node.rpc.reach import DialBack, ask_dial_back, check_reachability
from protocol.routing import BanList
from tests.swarm import LOCAL, wait_until


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_dial_back_reaches_a_libp2p_listener_and_nothing_else():
    async def not_libp2p(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"SSH-2.0-OpenSSH_9.2\r\n")  # an open port, but not a libp2p listener
        await writer.drain()
        writer.close()

    async def main() -> None:
        server = await P2P.create(host_maddrs=[LOCAL])
        client = await P2P.create(
            host_maddrs=[LOCAL], initial_peers=await server.get_visible_maddrs()
        )
        other = await asyncio.start_server(not_libp2p, "127.0.0.1", 0)
        service = await DialBack.create(server, callers=BanList(60, 5, 60))
        try:
            own = [str(m) for m in await client.get_visible_maddrs()]
            closed = f"/ip4/127.0.0.1/tcp/{_closed_port()}"
            foreign = f"/ip4/127.0.0.1/tcp/{other.sockets[0].getsockname()[1]}"
            stranger = "/ip4/10.9.9.9/tcp/4001"  # not where the asker connects from
            answer = await ask_dial_back(
                client, server.peer_id, [*own, closed, foreign, stranger], 10
            )
            assert answer.reachable_at == own[0]
            assert any(o.startswith("/ip4/127.0.0.1/tcp/") for o in answer.observed)
            by = {r.maddr: r for r in answer.results}
            assert "ConnectionRefusedError" in by[closed].error
            assert "other than a libp2p listener" in by[foreign].error
            assert by[stranger].error.startswith("not dialled: your connections come from")
            assert not any(by[m].ok for m in (closed, foreign, stranger))

            said = await check_reachability(client, [server.peer_id], own)
            assert (said.reachable, said.address, said.yes, said.no) == (True, own[0], 1, 0)
            said = await check_reachability(client, [server.peer_id], [closed])
            assert (said.reachable, said.yes, said.no) == (False, 0, 1)

            stub = DialBack.get_stub(client, server.peer_id)
            with pytest.raises(P2PHandlerError, match="malformed DialBackRequest"):
                await stub.rpc_dial_back(runtime_pb2.ExpertRequest(metadata=b"{}"))
        finally:
            await service.shutdown()
            other.close()
            await client.shutdown()
            await server.shutdown()

    asyncio.run(asyncio.wait_for(main(), 60))


def test_a_client_dht_enters_routing_tables_only_once_it_becomes_a_server():
    first = SwarmDHT.start("reach", host_maddrs=[LOCAL])
    try:
        joiner = SwarmDHT.start(
            "reach", initial_peers=first.visible_maddrs(), host_maddrs=[LOCAL], client_mode=True
        )
        try:
            assert asyncio.run(joiner.known_peers()) >= 1, "the client knows the first node"
            assert asyncio.run(first.known_peers()) == 0, "but is in no routing table"
            assert joiner.dht.client_mode
            assert asyncio.run(joiner.become_server()) >= 1
            assert not joiner.dht.client_mode
            wait_until(
                lambda: asyncio.run(first.known_peers()) >= 1, 10, "the first node to add it"
            )
            assert asyncio.run(joiner.become_server()) == 0, "a full node stays one"
        finally:
            joiner.shutdown()
    finally:
        first.shutdown()
