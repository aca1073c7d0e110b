"""GossipSub through the node's own ``p2pd``: one libp2p host, one peer identity.

The ``p2pd`` that hivemind ships runs a GossipSub router (signed messages, strict
verification) when started with ``-pubsub``, and its control socket takes ``PSRequest``s
(``p2pd.proto``). hivemind 1.1.12 neither passes that flag (``P2P.create`` has no option
for it) nor speaks those requests: ``SwarmDHT.start(pubsub=True)`` starts the DHT's daemon
with ``PUBSUB_FLAGS`` (through ``hivemind_compat.p2pd_options``), and :class:`Gossip` talks
to the daemon's control socket.

Known behaviour of that daemon, measured on loopback, and what follows from it:

- delivery between two daemons takes about 0.5 ms (median; a few ms at worst);
- a subscription lives only while its control connection is open, so each
  :class:`Subscription` holds one connection, and closing it unsubscribes;
- a message published before the mesh forms (about one 1 s heartbeat after peers
  connect) can be lost: :meth:`Gossip.wait_for_peers` waits for topic peers, and callers
  re-announce periodically anyway;
- hundreds of concurrent publishes overflow its queue: :meth:`Gossip.publish` sends one
  request at a time on one connection and waits for the daemon's answer (500 calls at
  once, so serialised, all arrive: about 1 ms each);
- a message over 1 MiB (the whole RPC frame, envelope included) is dropped silently:
  :meth:`Gossip.publish` refuses data over ``MAX_PUBLISH_BYTES``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import NamedTuple

import hivemind
from hivemind.p2p import PeerID
from hivemind.p2p.p2p_daemon_bindings.control import DaemonConnector
from hivemind.p2p.p2p_daemon_bindings.utils import read_pbmsg_safe, write_pbmsg
from hivemind.proto import p2pd_pb2 as pb
from hivemind.utils.multiaddr import Multiaddr

from protocol.gossip import GossipError, GossipMessage, GossipView, Ignored

logger = logging.getLogger(__name__)

# The daemon's flags: GossipSub, messages signed by the origin and checked on receipt (so
# the sender a message names is authenticated), a 1 s heartbeat (the mesh forms within it).
PUBSUB_FLAGS = (
    "-pubsub",
    "-pubsubRouter=gossipsub",
    "-pubsubSign=true",
    "-pubsubSignStrict=true",
    "-gossipsubHeartbeatInterval=1s",
)
DAEMON_MAX_FRAME = 1 << 20  # go-libp2p-pubsub's cap on one RPC frame; larger ones are dropped
MAX_PUBLISH_BYTES = DAEMON_MAX_FRAME - 4096  # room for the envelope (ids, key, signature)
MAX_TOPIC_CHARS = 256
SELF_TEST_TIMEOUT_S = 10.0
MAX_TOLD = 10_000  # (sender, reason) pairs already logged at info level


class GossipUnavailable(RuntimeError):
    """The daemon does not run pubsub, or its control socket is gone."""


class Delivery(NamedTuple):
    """One message as the daemon delivered it. ``sender`` is the libp2p peer that
    published it (authenticated by the router's signature check, whoever relayed it);
    ``seqno`` is the router's own sequence number, not the application's."""

    sender: str
    data: bytes
    seqno: int


def _check_topic(topic: str) -> str:
    if not isinstance(topic, str) or not 0 < len(topic) <= MAX_TOPIC_CHARS:
        raise ValueError(f"topic must be 1-{MAX_TOPIC_CHARS} characters, got {topic!r:.80}")
    return topic


class _Control:
    """One connection to the daemon's control socket: requests, one at a time."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, maddr: Multiaddr) -> _Control:
        try:
            return cls(*await DaemonConnector(maddr).open_connection())
        except OSError as e:
            raise GossipUnavailable(f"cannot reach the p2pd control socket {maddr}: {e}") from e

    async def request(self, request: pb.Request) -> pb.Response:
        response = pb.Response()
        try:
            await write_pbmsg(self.writer, request)
            await read_pbmsg_safe(self.reader, response)
        except (OSError, asyncio.IncompleteReadError) as e:
            raise GossipUnavailable(f"the p2pd control connection broke: {e!r}") from e
        return response

    def abort(self) -> None:
        """Close without waiting (safe while being cancelled)."""
        self.writer.close()

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(OSError):
            await self.writer.wait_closed()


def _pubsub(kind: int, topic: str | None = None, data: bytes | None = None) -> pb.Request:
    return pb.Request(
        type=pb.Request.PUBSUB, pubsub=pb.PSRequest(type=kind, topic=topic, data=data)
    )


def _failure(response: pb.Response, what: str) -> str | None:
    if response.type == pb.Response.OK:
        return None
    return f"p2pd refused {what}: {response.error.msg or 'no reason given'}"


class Subscription:
    """Messages on one topic, as an async iterator of :class:`Delivery`. Holds its own
    control connection (the daemon unsubscribes when it closes). Iteration ends after
    :meth:`close`; it raises ``GossipUnavailable`` if the daemon goes away."""

    def __init__(self, topic: str, control: _Control, on_close: Callable[[Subscription], None]):
        self.topic = topic
        self._control = control
        self._on_close = on_close
        self._closed = False

    def __aiter__(self) -> AsyncIterator[Delivery]:
        return self._deliveries()

    async def _deliveries(self) -> AsyncIterator[Delivery]:
        while True:
            message = pb.PSMessage()
            try:
                await read_pbmsg_safe(self._control.reader, message)
            except (OSError, asyncio.IncompleteReadError) as e:
                if self._closed:
                    return
                raise GossipUnavailable(
                    f"p2pd closed the subscription to {self.topic!r}: {e!r}"
                ) from e
            if self._closed:
                return
            try:
                sender = PeerID(getattr(message, "from")).to_base58()
            except Exception:  # the daemon checked it; skip what we still cannot read
                logger.warning("skipped a pubsub message with an unreadable sender")
                continue
            yield Delivery(sender, message.data, int.from_bytes(message.seqno, "big"))

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._on_close(self)
            await self._control.close()

    async def __aenter__(self) -> Subscription:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


class Gossip:
    """Publish and subscribe through a running ``p2pd`` (started with ``PUBSUB_FLAGS``),
    over its control socket. Owns its connections and no tasks:
    a subscription is read by whoever iterates it. ``close`` closes everything."""

    def __init__(self, control_maddr: Multiaddr, control: _Control, peer_id: str) -> None:
        self.control_maddr = control_maddr
        self.peer_id = peer_id
        self._control: _Control | None = control  # None after a request was cut short
        self._lock = asyncio.Lock()  # one request at a time: the daemon answers in order
        self._subscriptions: set[Subscription] = set()
        self._closed = False

    @classmethod
    async def create(
        cls,
        control_maddr: Multiaddr | str,
        *,
        self_test: bool = True,
        timeout_s: float = SELF_TEST_TIMEOUT_S,
    ) -> Gossip:
        """Connect to the daemon at ``control_maddr`` (``P2P.daemon_listen_maddr``), and
        unless ``self_test`` is False, check that it runs pubsub: that it answers
        GET_TOPICS, and that a message published to a private topic comes back."""
        maddr = Multiaddr(str(control_maddr))
        control = await _Control.open(maddr)
        try:
            response = await control.request(pb.Request(type=pb.Request.IDENTIFY))
            if (error := _failure(response, "IDENTIFY")) is not None:
                raise GossipUnavailable(error)
            self = cls(maddr, control, PeerID(response.identify.id).to_base58())
        except BaseException:
            await control.close()
            raise
        try:
            if self_test:
                async with asyncio.timeout(timeout_s):
                    await self._self_test()
        except TimeoutError:
            await self.close()
            raise GossipUnavailable(
                f"p2pd (hivemind {hivemind.__version__}) answers pubsub requests but did not "
                f"deliver a message to itself within {timeout_s:.0f} s"
            ) from None
        except BaseException:
            await self.close()
            raise
        return self

    async def _self_test(self) -> None:
        response = await self._request(_pubsub(pb.PSRequest.GET_TOPICS))
        if (error := _failure(response, "GET_TOPICS")) is not None:
            raise GossipUnavailable(
                f"the p2pd of hivemind {hivemind.__version__} at {self.control_maddr} does not "
                f"run pubsub ({error}); start it with node.rpc.gossip.PUBSUB_FLAGS "
                "(SwarmDHT.start(pubsub=True) does)"
            )
        topic = f"swarmtrain/self-test/{self.peer_id}/{secrets.token_hex(8)}"
        async with await self.subscribe(topic) as subscription:
            probe = secrets.token_bytes(16)
            await self.publish(topic, probe)
            async for delivery in subscription:
                if delivery.data == probe and delivery.sender == self.peer_id:
                    return

    async def _request(self, request: pb.Request) -> pb.Response:
        if self._closed:
            raise GossipUnavailable("this Gossip is closed")
        async with self._lock:
            if self._control is None:
                self._control = await _Control.open(self.control_maddr)
            try:
                return await self._control.request(request)
            except BaseException:
                # A request cut short (cancelled, timed out) may leave its answer unread on
                # the connection, and the next request would read it: never reuse it.
                self._control.abort()
                self._control = None
                raise

    async def publish(self, topic: str, data: bytes) -> None:
        """Publish ``data`` to ``topic``; returns once the daemon has taken it (not once
        anyone received it: gossip is best effort). ``ValueError`` for data the daemon
        would drop silently."""
        _check_topic(topic)
        if not isinstance(data, bytes):
            raise TypeError(f"gossip data must be bytes, got {type(data).__name__}")
        if len(data) > MAX_PUBLISH_BYTES:
            raise ValueError(
                f"refusing to publish {len(data)} bytes to {topic!r}: p2pd silently drops "
                f"messages over {DAEMON_MAX_FRAME} bytes with their envelope (limit "
                f"{MAX_PUBLISH_BYTES} bytes of data)"
            )
        response = await self._request(_pubsub(pb.PSRequest.PUBLISH, topic, data))
        if (error := _failure(response, f"to publish to {topic!r}")) is not None:
            raise GossipUnavailable(error)

    async def subscribe(self, topic: str) -> Subscription:
        """Subscribe to ``topic`` on a connection of its own, until the subscription is
        closed (or this Gossip is)."""
        _check_topic(topic)
        if self._closed:
            raise GossipUnavailable("this Gossip is closed")
        control = await _Control.open(self.control_maddr)
        try:
            response = await control.request(_pubsub(pb.PSRequest.SUBSCRIBE, topic))
            if (error := _failure(response, f"to subscribe to {topic!r}")) is not None:
                raise GossipUnavailable(error)
        except BaseException:
            await control.close()
            raise
        subscription = Subscription(topic, control, self._subscriptions.discard)
        self._subscriptions.add(subscription)
        return subscription

    async def topics(self) -> list[str]:
        """The topics this daemon is subscribed to."""
        response = await self._request(_pubsub(pb.PSRequest.GET_TOPICS))
        if (error := _failure(response, "GET_TOPICS")) is not None:
            raise GossipUnavailable(error)
        return list(response.pubsub.topics)

    async def topic_peers(self, topic: str) -> list[str]:
        """The connected peers that the daemon knows to be subscribed to ``topic``."""
        response = await self._request(_pubsub(pb.PSRequest.LIST_PEERS, _check_topic(topic)))
        if (error := _failure(response, "LIST_PEERS")) is not None:
            raise GossipUnavailable(error)
        return [PeerID(p).to_base58() for p in response.pubsub.peerIDs]

    async def connect(
        self, peer_id: str, maddrs: Sequence[str] = (), timeout_s: float = 10.0
    ) -> None:
        """Dial ``peer_id`` at ``maddrs``, or where the daemon's peerstore has it (the DHT
        fills it): GossipSub reaches only peers it is connected to, and the DHT connects
        lazily. On a connection of its own, so that a slow dial holds up no publish;
        ``ConnectionError`` if the daemon cannot reach the peer."""
        if self._closed:
            raise GossipUnavailable("this Gossip is closed")
        request = pb.Request(
            type=pb.Request.CONNECT,
            connect=pb.ConnectRequest(
                peer=PeerID.from_base58(peer_id).to_bytes(),
                addrs=[Multiaddr(m).to_bytes() for m in maddrs],
                timeout=max(1, round(timeout_s)),
            ),
        )
        control = await _Control.open(self.control_maddr)
        try:
            async with asyncio.timeout(timeout_s + 5.0):
                response = await control.request(request)
        finally:
            await control.close()
        if (error := _failure(response, f"to connect to {peer_id}")) is not None:
            raise ConnectionError(error)

    async def wait_for_peers(
        self, topic: str, count: int = 1, timeout_s: float = 10.0, poll_s: float = 0.1
    ) -> list[str]:
        """Wait until at least ``count`` peers are known on ``topic`` (the mesh forms on
        the next heartbeat after that); the peers, or ``TimeoutError``."""
        deadline = time.monotonic() + timeout_s
        while len(peers := await self.topic_peers(topic)) < count:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{len(peers)} of {count} peers on {topic!r} after {timeout_s:.0f} s"
                )
            await asyncio.sleep(poll_s)
        return peers

    async def close(self) -> None:
        """Close every subscription and the control connection (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for subscription in list(self._subscriptions):
            await subscription.close()
        if self._control is not None:
            await self._control.close()

    async def __aenter__(self) -> Gossip:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


async def receive_run(
    subscription: Subscription, view: GossipView, clock: Callable[[], float]
) -> AsyncIterator[GossipMessage]:
    """The messages of a run's topic that ``view`` accepts, as they arrive; the others
    are counted in ``view.ignored`` and logged: at info level the first time a sender
    earns a reason, at debug level after that and for replays (re-announcements make
    those common), so that a flood of bad messages cannot flood the log."""
    told: set[tuple[str, Ignored]] = set()
    async for delivery in subscription:
        try:
            message = view.receive(delivery.data, delivery.sender, clock())
        except GossipError as e:
            first = e.reason is not Ignored.REPLAYED and (delivery.sender, e.reason) not in told
            if first and len(told) < MAX_TOLD:
                told.add((delivery.sender, e.reason))
            level = logging.INFO if first else logging.DEBUG
            logger.log(level, "ignored gossip from %s: %s", delivery.sender, e)
            continue
        yield message
