"""Follow a run's gossip with py-libp2p: a third-party libp2p client, not hivemind's daemon.

Dials a node (noise or TLS, yamux), joins the run's GossipSub topic (/meshsub/1.1.0) and
prints every message it receives, decoded and checked with the same
``protocol.gossip.GossipView`` the nodes use. With ``--forge`` it also publishes, twice a
second, a join intent in a valid libp2p envelope (signed by its own libp2p key, which the
nodes' routers check) whose swarmtrain signature is garbage: the nodes must ignore it.

    python -m scripts.watch_gossip --run myrun --connect /ip4/127.0.0.1/tcp/31337/p2p/12D3KooW...

py-libp2p runs on trio and its protobuf descriptors collide with hivemind's (both register
``crypto.pb``), so this script imports neither hivemind nor ``node``: only ``protocol``.
Output is one line per event (``--json``: one JSON object per line, for tests).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import secrets
import sys
import time

import msgpack
import multiaddr
import trio
from libp2p import new_host
from libp2p.crypto.ed25519 import create_new_key_pair as create_ed25519_key_pair
from libp2p.crypto.x25519 import create_new_key_pair as create_x25519_key_pair
from libp2p.custom_types import TProtocol
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import info_from_p2p_addr
from libp2p.pubsub.gossipsub import GossipSub
from libp2p.pubsub.pubsub import Pubsub
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
from libp2p.security.noise.transport import Transport as NoiseTransport
from libp2p.security.tls.transport import PROTOCOL_ID as TLS_PROTOCOL_ID
from libp2p.security.tls.transport import TLSTransport
from libp2p.tools.anyio_service import background_trio_service

from protocol.gossip import GossipError, GossipView, JoinIntent, run_topic
from protocol.records import PROTOCOL_VERSION

MESHSUB_1_1 = TProtocol("/meshsub/1.1.0")  # the version go-libp2p-pubsub in p2pd speaks too
HEARTBEAT_S = 1  # py-libp2p's default is 120 s: the mesh would take minutes to form
FORGE_PERIOD_S = 0.5


def _emit(args: argparse.Namespace, event: str, **fields) -> None:
    if args.json:
        print(json.dumps({"event": event, **fields}), flush=True)
    else:
        details = " ".join(f"{k}={v}" for k, v in fields.items())
        print(f"{event:9} {details}", flush=True)


def forged_join(peer_id: str, run: str, seqno: int, now: float) -> bytes:
    """A well-formed join intent of ``peer_id`` with a random 64-byte "signature"."""
    message = JoinIntent(
        peer_id=peer_id,
        run=run,
        version=PROTOCOL_VERSION,
        seqno=seqno,
        timestamp=now,
        stage=0,
        throughput=1e6,  # an attractive lie: the nodes must not count it
    )
    return msgpack.packb(
        {"msg": message.model_dump_json().encode(), "sig": secrets.token_bytes(64)}
    )


def _security(choice: str, host_key_pair) -> dict:
    """Exactly one security transport, so that the one negotiated is the one chosen."""
    if choice == "noise":
        noise_key = create_x25519_key_pair().private_key
        return {NOISE_PROTOCOL_ID: NoiseTransport(host_key_pair, noise_privkey=noise_key)}
    return {TLS_PROTOCOL_ID: TLSTransport(host_key_pair)}


async def watch(args: argparse.Namespace) -> None:
    key_pair = create_ed25519_key_pair()
    security = _security(args.security, key_pair)
    host = new_host(key_pair=key_pair, sec_opt=security, muxer_preference="YAMUX")
    router = GossipSub(
        protocols=[MESHSUB_1_1],
        degree=6,
        degree_low=4,
        degree_high=12,
        heartbeat_interval=HEARTBEAT_S,
    )
    pubsub = Pubsub(host, router)
    topic = run_topic(args.run)
    view = GossipView(args.run)
    me = host.get_id().to_base58()
    listen = [multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]
    with trio.move_on_after(args.duration if args.duration > 0 else math.inf):
        async with (
            host.run(listen_addrs=listen),
            background_trio_service(pubsub),
            background_trio_service(router),
            trio.open_nursery() as nursery,
        ):
            await pubsub.wait_until_ready()
            subscription = await pubsub.subscribe(topic)
            for address in args.connect:
                info = info_from_p2p_addr(multiaddr.Multiaddr(address))
                await host.connect(info)
                negotiated = await _negotiated(host, router, info.peer_id)
                _emit(args, "connected", security=str(*security), **negotiated)
            _emit(args, "ready", peer_id=me, topic=topic)
            if args.forge:
                nursery.start_soon(_forge, args, pubsub, topic, me)
            while True:
                message = await subscription.get()
                sender = ID(message.from_id).to_base58()
                try:
                    accepted = view.receive(message.data, sender, time.time())
                except GossipError as e:
                    _emit(args, "ignored", sender=sender, reason=str(e.reason), detail=str(e))
                    continue
                _emit(args, "accepted", sender=sender, **accepted.model_dump(mode="json"))


async def _negotiated(host, router: GossipSub, peer: ID) -> dict:
    """What the connection to ``peer`` runs: its muxer and pubsub protocol (known once
    the router has opened its stream; waited for up to 5 s)."""
    with trio.move_on_after(5):
        while peer not in router.peer_protocol:
            await trio.sleep(0.05)
    conn = host.get_network().get_connection(peer)
    muxed = getattr(conn, "muxed_conn", None)
    return {
        "peer": peer.to_base58(),
        "muxer": type(muxed).__name__,
        "pubsub": router.peer_protocol.get(peer),
    }


async def _forge(args: argparse.Namespace, pubsub: Pubsub, topic: str, me: str) -> None:
    seqno = int(time.time() * 1_000_000)
    while True:
        seqno += 1
        await pubsub.publish(topic, forged_join(me, args.run, seqno, time.time()))
        _emit(args, "forged", peer_id=me, seqno=seqno)
        await trio.sleep(FORGE_PERIOD_S)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", required=True, help="the run whose topic to follow")
    parser.add_argument(
        "--connect", action="append", required=True, help="a node's /ip4/.../p2p/... address"
    )
    parser.add_argument("--security", choices=("noise", "tls"), default="noise")
    parser.add_argument("--duration", type=float, default=0.0, help="seconds; 0: until killed")
    parser.add_argument("--forge", action="store_true", help="publish forged join intents")
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    trio.run(watch, args)


if __name__ == "__main__":
    main()
