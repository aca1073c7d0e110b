"""Relay upkeep for a node that no peer can dial: which relay it announces, and keeping
that one a relay that holds its reservation for as long as the node runs.

``RelayKeeper.choose`` tries the candidate relays (``protocol.reachability``:
``relay_candidates``, in ``relay_order``) with ``node.rpc.relay.reservation_holds`` and
returns the first that holds a reservation for the node. ``RelayKeeper.run`` (a task the
node owns) then looks every ``tick_s`` whether the node is still connected to that relay,
checks its reservation when ``RelayWatch`` says so, chooses again when the checks fail,
and tells the node through ``on_change`` (which re-announces it).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING

from node.rpc.relay import reservation_holds
from protocol.reachability import (
    RelayWatch,
    offers_no_relay,
    relay_candidates,
    relay_order,
    relay_peer_id,
)

if TYPE_CHECKING:
    from hivemind.p2p import P2P

logger = logging.getLogger(__name__)

TICK_S = 5.0  # how often the keeper looks at its connection to the relay
CHECK_EVERY_S = 120.0  # a reservation check while all looks well
RETRY_AFTER_S = 10.0  # a check after the connection went or a check failed
CHOOSE_WAIT_S = 90.0  # at start: how long to wait for a reservation (autorelay takes time)

Probe = Callable[[str, str], Awaitable[str | None]]  # (relay, peer id) -> None, or why not
Views = Callable[[], Awaitable[dict[str, bool | None]]]  # peer id -> reachable, per record


class RelayKeeper:
    """Chooses and keeps this node's relay among ``trusted`` (its initial peers). ``views``
    returns what the run's records say of each peer's reachability (for the order of
    candidates; a failure reads as nothing known); ``probe`` checks one relay (the seam
    for tests: ``reservation_holds`` by default)."""

    def __init__(
        self,
        p2p: P2P,
        trusted: Sequence[str],
        views: Views,
        *,
        probe: Probe = reservation_holds,
        tick_s: float = TICK_S,
        check_every_s: float = CHECK_EVERY_S,
        retry_after_s: float = RETRY_AFTER_S,
    ):
        self.p2p = p2p
        self.peer_id = p2p.peer_id.to_base58()
        self.trusted = tuple(trusted)
        self.views = views
        self.probe = probe
        self.tick_s = tick_s
        self.watch = RelayWatch(check_every_s, retry_after_s)
        self.tried: dict[str, str] = {}  # relay -> why it failed, at the last choice

    @property
    def relay(self) -> str | None:
        """The relay chosen last (None: none held a reservation)."""
        return self.watch.relay

    async def choose(self, *, wait_s: float = 0.0) -> str | None:
        """The first candidate (in ``relay_order`` after the current relay) that holds a
        reservation for this node; tries them all again every ``retry_after_s`` until one
        does or ``wait_s`` has passed, or every candidate tried runs no relay service
        (``offers_no_relay``: none ever will); None if none did. Remembered as the current
        relay."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while True:
            found = await self._first_holding()
            if found is not None or loop.time() + self.watch.retry_after_s > deadline:
                break
            if self.tried and all(offers_no_relay(why) for why in self.tried.values()):
                logger.info("no candidate relay offers a relay service: not waiting for one")
                break
            await asyncio.sleep(self.watch.retry_after_s)
        self.watch.chose(loop.time(), found)
        return found

    async def _first_holding(self) -> str | None:
        try:
            views = await self.views()
        except Exception as e:  # a DHT hiccup: the initial peers' order, blind
            logger.debug("reading the run's peers failed: %s", e)
            views = {}
        self.tried = {}
        for relay in relay_order(relay_candidates(self.trusted, views), self.watch.relay):
            why = await self.probe(relay, self.peer_id)
            if why is None:
                return relay
            self.tried[relay] = why
            logger.info("relay %s holds no reservation for us: %s", relay_peer_id(relay), why)
        return None

    async def run(self, on_change: Callable[[str | None, str | None], None]) -> None:
        """Until cancelled: keep the relay one that holds our reservation, and call
        ``on_change(previous, relay)`` when it changes (``relay`` None: none holds one now;
        looked for again every ``check_every_s``)."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.tick_s)
            previous = self.watch.relay
            if not self.watch.tick(loop.time(), await self._connected(previous)):
                continue
            if previous is not None:
                why = await self.probe(previous, self.peer_id)
                if why is not None:
                    logger.info(
                        "relay %s failed a check of our reservation: %s",
                        relay_peer_id(previous),
                        why,
                    )
                if not self.watch.checked(loop.time(), why is None):
                    continue
            relay = await self.choose()
            if relay != previous:
                on_change(previous, relay)

    async def _connected(self, relay: str | None) -> bool:
        """Whether our daemon holds a connection to ``relay`` (a reservation lives on one)."""
        if relay is None:
            return False
        try:
            peers = await self.p2p.list_peers()
        except Exception as e:  # the daemon is going away: the next look tells
            logger.debug("listing connections failed: %s", e)
            return True
        return any(p.peer_id.to_base58() == relay_peer_id(relay) for p in peers)
