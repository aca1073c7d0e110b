"""What a node keeps published in the DHT, each a loop the node owns as a task: its peer
record (``announce_peer``: on every change, else every update period, and on the run's
gossip topic), the run's signed spec (``refresh_spec``), a public run's entry in the run
directory (``announce_run``, on the owner's node), and, in a private run, its own
membership against the owner's revocations (``follow_revocations``). A DHT hiccup is
logged and retried at the next period; it never stops the node."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hivemind.utils import get_dht_time

from node.daemon.join import NodeError
from node.placement.driver import Placement
from node.rpc.dht import SwarmDHT
from protocol.announce import ANNOUNCE_PERIOD_S, announcement_of
from protocol.membership import MembershipError
from protocol.records import PeerInfo
from protocol.run_spec import RunSpec, SignedSpec

logger = logging.getLogger(__name__)

SPEC_REFRESH_S = 300.0
REVOCATIONS_REFRESH_S = 10.0


async def publish_peer(dht: SwarmDHT, info: PeerInfo, key: Ed25519PrivateKey) -> None:
    """Store ``info`` signed with ``key``; a failure is logged (the next period retries)."""
    try:
        if not await dht.publish_peer(info, key):
            logger.warning("the DHT did not store our record (no reachable peer?)")
    except Exception as e:  # a DHT hiccup must not stop the node; the next period retries
        logger.warning("publishing our record failed: %s", e)


async def announce_peer(
    dht: SwarmDHT,
    placement: Placement,
    key: Ed25519PrivateKey,
    record: Callable[[], PeerInfo],
    changed: asyncio.Event,
    period_s: float,
) -> None:
    """Publish the node's ``record`` and announce its stage on the gossip topic, again as
    soon as ``changed`` is set or ``period_s`` has passed, until cancelled."""
    while True:
        changed.clear()
        try:
            info = record()
        except ValueError as e:  # e.g. a figure out of a record's bounds: the next try may fit
            logger.warning("could not build our record: %s", e)
        else:
            await publish_peer(dht, info, key)
            await placement.announce(info.stage, info.state, info.load)
        # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow a cancellation
        # that lands as the event fires (seen: a node that ignored SIGTERM).
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(period_s):
                await changed.wait()


async def announce_run(dht: SwarmDHT, spec: RunSpec, owner_key: Ed25519PrivateKey) -> None:
    """Announce this public run in the run directory (``protocol.announce``) every
    ``ANNOUNCE_PERIOD_S``, with the figures of its live peer records. Only the owner's
    node can (it holds the owner key); while it is down the run drops off the list."""
    logger.info("announcing public run %s in the run directory", spec.run)
    while True:
        try:
            record = announcement_of(spec, await dht.peers(), now=get_dht_time())
            if not await dht.publish_announcement(record, owner_key):
                logger.warning("the DHT did not store the run's announcement")
        except Exception as e:  # a DHT hiccup: the next period retries
            logger.warning("announcing the run failed: %s", e)
        await asyncio.sleep(ANNOUNCE_PERIOD_S)


async def refresh_spec(dht: SwarmDHT, signed: SignedSpec) -> None:
    """Publish the run's signed spec again every ``SPEC_REFRESH_S``."""
    while True:
        await asyncio.sleep(SPEC_REFRESH_S)
        try:
            await dht.publish_spec(signed)
        except Exception as e:  # a DHT hiccup: the next period retries
            logger.warning("publishing the run's spec failed: %s", e)


async def follow_revocations(dht: SwarmDHT, spec: RunSpec, membership: str | None) -> None:
    """In a private run, follow the owner's revocations every ``REVOCATIONS_REFRESH_S``;
    ``NodeError`` once they (or time) end this node's ``membership``. Returns at once in
    a public run."""
    latest = get_dht_time()
    while spec.private:
        await asyncio.sleep(REVOCATIONS_REFRESH_S)
        try:
            await dht.refresh_revocations(restore=True)
        except Exception as e:  # a DHT hiccup: the next period retries
            logger.warning("reading the run's revocations failed: %s", e)
        # The latest time seen: a clock stepped back must not put our own claim in the future.
        latest = max(latest, get_dht_time())
        try:
            dht.policy.check(dht.peer_id, membership, latest)
        except MembershipError as e:
            raise NodeError(f"this node is no longer a member of the run: {e}") from None
