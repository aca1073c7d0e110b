"""Where this node sits in the pipeline: the run's gossip topic, the swarm view, and the
node-facing calls that run ``protocol.placement``'s machine (``runner.PlacementRunner``).

- The view is the DHT's peer records, the source of truth a newcomer reads, overridden by
  a peer's gossip where that is newer than its record (an intent to join or move, that it
  serves, that it leaves). A peer with no record counts through its gossip only while
  that is younger than a record would live, so a killed peer's last word does not outlive
  its record and an emptied stage shows as empty.
- Arrivals (new peer ids in the records) are counted for the rule
  (``protocol.placement.ArrivalCount``).

Gossip reaches only peers the daemon is connected to, and the DHT connects lazily, so the
node dials the peers its records name. In a private run, gossip counts only from peers
whose DHT record passed the run's membership policy.

A record or a gossip claim costs nothing to forge from a fresh key: a flood claiming
1e9 samples/s on a stage would make it look oversupplied, lure its peers away and
confirm their moves ("another peer still serves it"). So the view counts only peers
this node has *reached*: on the run's topic with it (a live libp2p host holding the
peer's key), or dialed successfully. Peers not reached yet are dialed a few per update
period (``protocol.routing.keep_unproven`` picks which; one that fails is not dialed
again for a while).
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
from collections.abc import Callable, Iterable, Mapping, Sequence

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hivemind.p2p import P2P
from hivemind.utils import get_dht_time

from node.placement.runner import LoopClock, PlacementRunner
from node.rpc.dht import SwarmDHT
from node.rpc.gossip import Gossip, GossipUnavailable, Subscription, receive_run
from protocol.assignment import Claim, Move, Params, SwarmView, view_from_peers
from protocol.gossip import GossipMessage, GossipSigner, GossipView, Leaving, run_topic
from protocol.placement import Announce, ArrivalCount, PeerPlacement, settle_period
from protocol.records import PeerInfo, PeerState
from protocol.routing import Probation, keep_unproven
from protocol.run_spec import RunSpec

logger = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 3.0
TOPIC_PEERS = 8  # GossipSub's mesh keeps 6 (4 to 12) neighbours per topic
DIALS_PER_PERIOD = 8  # peers not reached yet that are dialed (at once) every update period


def merge_gossip(
    records: Iterable[PeerInfo],
    latest: Mapping[str, GossipMessage],
    *,
    me: str,
    now: float,
    max_silence_s: float,
    reached: Callable[[str], bool] | None = None,
) -> tuple[list[PeerInfo], list[Claim]]:
    """The records to count and the gossip claims that override them (for
    ``view_from_peers(records, intents=claims)``), both without ``me``, and (given
    ``reached``) only of peers it says this node has reached.

    A message counts when it is at least as new as the peer's record, or, for a peer
    without a record, when it is younger than ``max_silence_s`` (a record's lifetime). A
    peer whose counted message says it leaves is dropped, record and all."""
    counted = reached or (lambda peer: True)
    by_peer = {p.peer_id: p for p in records if p.peer_id != me and counted(p.peer_id)}
    claims = []
    for peer, message in sorted(latest.items()):
        record = by_peer.get(peer)
        if peer == me or not counted(peer):
            continue
        if record is not None and message.timestamp < record.timestamp:
            continue
        if record is None and message.timestamp < now - max_silence_s:
            continue
        if isinstance(message, Leaving):
            by_peer.pop(peer, None)
        elif message.claimed_stage is not None:
            claims.append(Claim(peer, message.claimed_stage, message.throughput, message.serving))
    return sorted(by_peer.values(), key=lambda p: p.peer_id), claims


class Placement:
    """One node's assignment: the run's gossip topic (subscribed while this object lives),
    the swarm view, and the placement machine's runner. Owns no tasks: the node runs
    :meth:`follow` and :meth:`keep_connected` in its TaskGroup. Build with
    ``await create(...)``; ``close`` unsubscribes."""

    def __init__(
        self,
        dht: SwarmDHT,
        gossip: Gossip,
        subscription: Subscription,
        signer: GossipSigner,
        spec: RunSpec,
        throughput: tuple[float, ...],
        *,
        update_period_s: float,
        params: Params,
    ) -> None:
        self.dht = dht
        self.gossip = gossip
        self.subscription = subscription
        self.signer = signer
        self.peer_id = signer.peer_id
        self.topic = subscription.topic
        self.n_stages = spec.n_stages
        self.throughput = throughput
        self.params = params
        self.update_period_s = update_period_s
        self.record_ttl_s = 3 * update_period_s  # as the node's own records
        validators = [self._member] if spec.private else []
        self.view_of_gossip = GossipView(spec.run, num_stages=spec.n_stages, validators=validators)
        self._members: frozenset[str] = frozenset()  # peers whose record passed the policy
        self._records: list[PeerInfo] = []  # the last read, for the alarm's looks
        self._arrivals = ArrivalCount()
        self._reach = Probation()  # peers reached: on the topic with us, or dialed
        self._clock = LoopClock()
        self._rng = random.Random(self.peer_id)  # whom to dial
        self._load = 0
        self._ignored_logged: dict[str, int] = {}
        machine = PeerPlacement(
            self.peer_id, throughput, params, settle_s=settle_period(update_period_s)
        )
        self.runner = PlacementRunner(
            machine, self._clock, self, self._send, update_period_s=update_period_s
        )

    @classmethod
    async def create(
        cls,
        dht: SwarmDHT,
        p2p: P2P,
        key: Ed25519PrivateKey,
        spec: RunSpec,
        throughput: tuple[float, ...],
        *,
        update_period_s: float,
        params: Params,
    ) -> Placement:
        """Connect to the node's ``p2pd`` (started with pubsub; its self-test runs here)
        and subscribe to the run's topic. ``GossipUnavailable`` if the daemon has no pubsub."""
        gossip = await Gossip.create(p2p.daemon_listen_maddr)
        try:
            subscription = await gossip.subscribe(run_topic(spec.run))
        except BaseException:
            await gossip.close()
            raise
        signer = GossipSigner(key, spec.run)
        return cls(
            dht,
            gossip,
            subscription,
            signer,
            spec,
            throughput,
            update_period_s=update_period_s,
            params=params,
        )

    def _member(self, message: GossipMessage) -> None:
        if message.peer_id != self.peer_id and message.peer_id not in self._members:
            raise ValueError(f"peer {message.peer_id} has no DHT record that shows an invite")

    # -- tasks the node owns -------------------------------------------------------------

    async def follow(self) -> None:
        """Read the topic into the gossip view until cancelled (or the daemon goes away)."""
        async for message in receive_run(self.subscription, self.view_of_gossip, get_dht_time):
            logger.debug("gossip from %s: %s", message.peer_id[-8:], message.kind)

    async def keep_connected(self) -> None:
        """Every update period: dial the peers the records name that are not on the topic
        yet, forget silent peers, and log what gossip was ignored (if that changed)."""
        while True:
            try:
                await self._connect(await self.records())
            except (GossipUnavailable, ConnectionError, TimeoutError) as e:
                logger.warning("could not connect to the run's gossip peers: %s", e)
            except Exception as e:  # a DHT hiccup: the next period retries
                logger.warning("reading the run's peers failed: %s", e)
            self.view_of_gossip.expire(get_dht_time())
            self._log_ignored()
            await asyncio.sleep(self.update_period_s)

    def _log_ignored(self) -> None:
        ignored = {str(k): v for k, v in self.view_of_gossip.ignored.items()}
        if ignored != self._ignored_logged:
            self._ignored_logged = ignored
            logger.info("ignored gossip so far: %s", json.dumps(ignored, sort_keys=True))

    async def records(self) -> list[PeerInfo]:
        """The run's valid peer records (the DHT applies the membership policy); also the
        members whose gossip a private run accepts."""
        records = await self.dht.peers()
        self._members = frozenset(p.peer_id for p in records)
        self._records = records
        reached = {p.peer_id for p in records if self.reached(p.peer_id)}
        self._arrivals.saw(reached, self._clock.now())
        return records

    def reached(self, peer: str) -> bool:
        """Whether this node has reached ``peer`` (the view counts only such peers)."""
        return self._reach.proven(peer)

    async def _connect(self, records: list[PeerInfo]) -> None:
        """Dial a few of the peers the records name, until ``TOPIC_PEERS`` are on the
        topic with us (the mesh needs a handful of neighbours, not the whole swarm), and
        ``DIALS_PER_PERIOD`` of those not reached yet."""
        on_topic = set(await self.gossip.topic_peers(self.topic))
        for peer in on_topic:
            if not self._reach.proven(peer):
                self._reach.succeeded(peer)
        others = sorted(
            p.peer_id
            for p in records
            if p.peer_id != self.peer_id
            and p.peer_id not in on_topic
            and p.state is not PeerState.LEAVING
        )
        known = [p for p in others if self._reach.proven(p)]
        wanted = max(0, TOPIC_PEERS - len(on_topic))
        dials = self._rng.sample(known, min(wanted, len(known)))
        now = self._clock.now()
        dials += keep_unproven(others, self._reach, now, DIALS_PER_PERIOD, self._rng)
        await asyncio.gather(*(self._dial(peer) for peer in dials))

    async def _dial(self, peer: str) -> None:
        try:
            await self.gossip.connect(peer, timeout_s=CONNECT_TIMEOUT_S)
        except (ConnectionError, TimeoutError) as e:
            logger.debug("could not dial %s for gossip: %s", peer, e)
            self._reach.failed(peer, self._clock.now())
            return
        self._reach.succeeded(peer)

    # -- the view (the runner's ViewSource) ----------------------------------------------

    def view(self, records: Iterable[PeerInfo]) -> SwarmView:
        """The others as the rule sees them: their records and fresher gossip, priced with
        every present peer's throughput (ours included)."""
        kept, claims = merge_gossip(
            records,
            self.view_of_gossip.latest,
            me=self.peer_id,
            now=get_dht_time(),
            max_silence_s=self.record_ttl_s,
            reached=self.reached,
        )
        return view_from_peers(kept, self.n_stages, intents=claims, own=self.throughput)

    async def read(self) -> SwarmView:
        return self.view(await self.records())

    def cached(self) -> SwarmView:
        return self.view(self._records)

    def arrivals(self) -> float | None:
        return self._arrivals.rate(self._clock.now())

    # -- decisions (the node's calls) ----------------------------------------------------

    async def join(self, on_choice: Callable[[int], None], kept: Sequence[int] = ()) -> int:
        """Choose a stage, tell ``on_choice`` (which announces it), reconsider once the
        others' intents had a settle period to arrive; the stage to load. With ``kept``
        (the stages of this node's own checkpoints, most recent first) one of those is
        taken at once (``protocol.assignment.resume_stage``)."""
        await self._connect(await self.records())
        return await self.runner.join(on_choice, kept)

    async def second_stage(self, stage: int) -> int | None:
        """``stage`` serves now: the second stage to take as well (or None). A node
        restarted with checkpoints may wait here, up to ``Params.resume_hold_s``, for a
        peer holding the state of the stage the rule asks it to take."""
        return await self.runner.loaded(second=True)

    async def next_move(self, stage: Callable[[], int]) -> Move:
        """Wait for a check that decides to move: every ``check_delay`` seconds, or sooner
        on an alarm. (``stage``, where the node serves, is the machine's own stage.)"""
        return await self.runner.next_move()

    async def confirm_move(self, move: Move) -> bool:
        """``move`` was announced by :meth:`next_move`; a settle period later, whether it
        may go ahead: another peer still serves ``move.from_stage``."""
        return await self.runner.confirm_move()

    # -- announcements -------------------------------------------------------------------

    async def announce(self, stage: int | None, state: PeerState, load: int) -> None:
        """Re-announce where this node is (the announce loop calls it with every record):
        what ``PeerPlacement.announcement`` says for ``stage`` and ``state``."""
        self._load = load
        said = self.runner.machine.announcement(stage, state)
        if said is not None:
            await self._send(said)

    async def _send(self, said: Announce) -> None:
        now, signer, stage = get_dht_time(), self.signer, said.stage
        if said.kind == "leaving":
            raw = signer.leaving(stage, now)
        elif stage is None:
            return
        elif said.kind == "move" and said.to_stage is not None:
            raw = signer.move(stage, said.to_stage, self.throughput[said.to_stage], now)
        elif said.kind == "join":
            raw = signer.join(stage, self.throughput[stage], now)
        elif said.kind == "serving":
            raw = signer.serving(stage, self.throughput[stage], now)
        else:
            raw = signer.load(stage, self.throughput[stage], self._load, now)
        await self.publish(raw)

    async def publish(self, raw: bytes) -> None:
        """Best effort: gossip is re-announced, and the DHT record says the same."""
        try:
            await self.gossip.publish(self.topic, raw)
        except (GossipUnavailable, ValueError) as e:
            logger.warning("could not publish on the run's gossip topic: %s", e)

    async def close(self) -> None:
        await self.gossip.close()
