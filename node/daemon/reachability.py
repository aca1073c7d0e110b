"""Whether peers can dial this node, and the relay it serves through when they cannot.

``Reach`` holds the verdict (unknown until ``find`` asks peers, or takes the operator's
``--reachable``), the relay it announces and whether it serves stages at all. The node
owns its tasks: ``recheck`` (while nobody could tell) and ``keep_relay`` (while it serves
through a relay). Every change a peer should see goes through ``on_change``, which
re-announces the node's record.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Coroutine

from hivemind.p2p import P2P, PeerID

from node import events
from node.daemon.relay_keeper import CHOOSE_WAIT_S, RelayKeeper
from node.daemon.settings import NodeSettings
from node.rpc.dht import SwarmDHT
from node.rpc.reach import check_reachability, shuffled
from node.rpc.relay import connect_relayed
from protocol.reachability import Reachability, dial_target, relay_peer_id
from protocol.records import PeerInfo

logger = logging.getLogger(__name__)

RECHECK_S = 10.0  # while no peer could tell whether this node is reachable


class Reach:
    """This node's reachability and relay. ``reached(peer_id)`` says whether the node has
    reached that peer itself (likeliest to answer a dial-back); ``on_change`` is called
    whenever what the record says of it changes."""

    def __init__(
        self,
        dht: SwarmDHT,
        settings: NodeSettings,
        reached: Callable[[str], bool],
        on_change: Callable[[], None],
    ) -> None:
        self._dht = dht
        self._settings = settings
        self._reached = reached
        self._on_change = on_change
        # Unknown until asked. A node found unreachable serves through a relay, or else
        # trains only.
        self.reachability = Reachability(None)
        # Unreachable, with relaying on: the relay (one of the initial peers, on which
        # p2pd reserves a slot) it serves through, announced in its record.
        self.relay: str | None = None
        # Whether it holds stages: decided by the verdict at start (a later verdict leaves
        # it serving; routing then skips it by its record).
        self.serves = True
        self._keeper: RelayKeeper | None = None  # unreachable, with relaying on
        self._links: dict[str, str] = {}  # relayed peer -> how we are linked to it

    @property
    def peer_id(self) -> str:
        return self._dht.peer_id

    async def find(self, p2p: P2P) -> None:
        """Ask peers to dial this node back (it answers theirs through its ``DialBack``)
        and act on the verdict: a node they can dial, or that cannot tell, becomes a full
        DHT node; one they cannot stays a DHT client (peers never route DHT lookups to it)
        and serves through a relay (one of its initial peers, unless relaying is off), or
        else holds no stage. Emits ``node.reachability``."""
        if self._settings.reachable == "auto":
            self.reachability = await self._ask(p2p)
        else:
            self.reachability = Reachability.declare(
                self._settings.reachable == "yes", self._dht.visible_maddrs()
            )
        if not self.reachability.serves and self._settings.relay.use:
            self._keeper = RelayKeeper(p2p, self._settings.initial_peers, self._views)
            self.relay = await self._keeper.choose(wait_s=CHOOSE_WAIT_S)
        self.serves = self.reachability.serves or self.relay is not None
        if self.reachability.serves:
            await self._dht.become_server()
        elif self.relay is not None:
            self._dht.serve_averaging()  # peers reach its averagers through the relay
        self._report()

    def keep_relay(self) -> Coroutine[object, object, None] | None:
        """The task that keeps the chosen relay (``RelayKeeper.run``), for the node to own;
        None when it serves through no relay."""
        if self._keeper is None or self.relay is None:
            return None
        return self._keeper.run(self._relay_changed)

    async def recheck(self, p2p: P2P) -> None:
        """While nobody could tell (the first node of a run, or peers that disagreed), ask
        again every ``RECHECK_S``, and report the first definite verdict (in the record,
        an event and the log)."""
        while self.reachability.reachable is None:
            await asyncio.sleep(RECHECK_S)
            try:
                found = await self._ask(p2p)
            except Exception as e:  # a P2P hiccup: ask again later
                logger.debug("reachability re-check failed: %s", e)
                continue
            if found.reachable is not None:
                self.reachability = found
                self._report()
                self._on_change()

    async def link_relayed(self, p2p: P2P, peers: list[PeerInfo]) -> None:
        """Keep a connection to every peer that serves through a relay (``p2pd`` dials it
        only at addresses it holds, and never learns a relay's circuit address itself), if
        this node's ``p2pd`` can dial through one at all;
        emit ``relay.link`` when how we are linked to one changes."""
        try:
            dials = self._settings.relay.dials_circuits
            links = await connect_relayed(p2p, [p for p in peers if p.routable_by(dials)])
        except Exception as e:  # a daemon hiccup: the next check retries
            logger.debug("connecting to relayed peers failed: %s", e)
            return
        for peer, link in links.items():
            if self._links.get(peer) != link:
                events.emit("relay.link", peer=peer, link=link)
        self._links = links

    async def _views(self) -> dict[str, bool | None]:
        """Each peer's reachability, as the run's records say (for ``RelayKeeper``)."""
        return {p.peer_id: p.reachable for p in await self._dht.peers()}

    def _relay_changed(self, previous: str | None, relay: str | None) -> None:
        """``RelayKeeper``'s news: serve through ``relay`` now (None: through none, so
        routing skips this node until one holds its reservation again); re-announce."""
        self.relay = relay
        events.emit(
            "relay.changed",
            previous=previous and relay_peer_id(previous),
            relay=relay and relay_peer_id(relay),
            relays_tried=self._relays_tried(),
        )
        logger.warning("%s", self.line())
        self._on_change()

    async def _ask(self, p2p: P2P) -> Reachability:
        maddrs = self._dht.visible_maddrs()
        return await check_reachability(p2p, await self._askers(p2p), maddrs)

    def _report(self) -> None:
        r = self.reachability
        events.emit(
            "node.reachability",
            reachable=r.reachable,
            address=r.address,
            observed=r.observed,
            yes=r.yes,
            no=r.no,
            declared=r.declared,
            serves=self.serves,
            relay=self.relay and relay_peer_id(self.relay),
            relays_tried=self._relays_tried(),
        )
        (logger.info if r.reachable is not False else logger.warning)("%s", self.line())

    def _relays_tried(self) -> dict[str, str]:
        """Relay peer id -> why it held no reservation for us, at the last choice."""
        keeper = self._keeper
        tried = keeper.tried if keeper is not None else {}
        return {relay_peer_id(m): why for m, why in tried.items()}

    async def _askers(self, p2p: P2P) -> list[PeerID]:
        """Whom to ask for a dial-back, likeliest answerers first: the run's peers this
        node has reached (a live host holds their key; a record alone costs nothing to
        forge), those known to be reachable, those not known either way, other peers we
        are connected to (the initial peers), and last those known to be unreachable
        (they can dial out)."""
        try:
            records = [p for p in await self._dht.peers() if p.peer_id != self.peer_id]
        except Exception as e:  # a DHT hiccup: the connected peers still answer
            logger.debug("reading the run's peers failed: %s", e)
            records = []
        connected = [p.peer_id.to_base58() for p in await p2p.list_peers()]
        reached = self._reached
        groups = [
            [p.peer_id for p in records if reached(p.peer_id)],
            [p.peer_id for p in records if p.reachable is True],
            [p.peer_id for p in records if p.reachable is None],
            connected,
            [p.peer_id for p in records if p.reachable is False],
        ]
        ordered = [i for g in groups for i in shuffled(g, self.peer_id)]
        return [PeerID.from_base58(i) for i in dict.fromkeys(ordered) if i != self.peer_id]

    def line(self) -> str:
        """One line for the person running the node: whether peers can dial it, and if
        not, what to do about it."""
        r = self.reachability
        asked = r.yes + r.no
        if r.declared and r.reachable:
            return f"reachable directly at {r.address} (as --reachable yes says; not checked)"
        if r.declared and self.relay is None:
            return "not reachable (as --reachable no says): running as a trainer only"
        if r.reachable:
            return f"reachable directly at {r.address} (confirmed by {r.yes} of {asked} peers)"
        if r.reachable is None:
            why = "the peers asked disagreed" if asked else "no peer could be asked yet"
            return f"reachability unknown ({why}): serving as if reachable"
        if self.relay is not None:
            return (
                f"not reachable, serving through relay {relay_peer_id(self.relay)} "
                f"({r.no} of {asked} peers could not dial this node directly)"
            )
        if self._keeper is not None:
            tried = "; ".join(f"{p}: {why}" for p, why in self._relays_tried().items())
            what = (
                "peers will not route calls to its stages until one does"
                if self.serves
                else "running as a trainer only (it serves no stage)"
            )
            return (
                f"not reachable ({r.no} of {asked} peers could not dial this node), and no "
                f"initial peer holds a relay reservation for it ({tried or 'none to try'}): "
                f"{what}"
            )
        what = (
            "peers will not route calls to its stages"
            if self.serves
            else "it has no relay: running as a trainer only (it serves no stage)"
        )
        ports = []
        for m in self._dht.visible_maddrs():
            with contextlib.suppress(ValueError):
                ports.append(dial_target(m)[1])
        port = str(ports[0]) if ports else "PORT"
        public = r.observed if r.observed and ":" not in r.observed else "PUBLIC_IP"
        return (
            f"not reachable: {r.no} of {asked} peers could not dial this node at its "
            f"announced addresses, and {what}. To serve, forward TCP port {port} on your "
            "router to this machine "
            f"and pass --announce-maddrs /ip4/{public}/tcp/{port} (with --host-maddrs "
            f"/ip4/0.0.0.0/tcp/{port})"
        )
