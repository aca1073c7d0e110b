"""Where this node sits in the pipeline: its stage at join, and its moves while it serves.

The decisions are ``protocol.assignment``'s (pure); this module feeds them a view of the
swarm and carries their messages on the run's GossipSub topic (``protocol.gossip``):

- The view is the DHT's peer records, the source of truth a newcomer reads, overridden by
  a peer's gossip where that is newer than its record (an intent to join or move, that it
  serves, that it leaves). A peer with no record counts through its gossip only while
  that is younger than a record would live, so a killed peer's last word does not outlive
  its record and an emptied stage shows as empty.
- At join, the node listens for a settle period (peers re-announce within it), takes
  ``choose_stage`` seeded by its peer id (so a wave of joiners spreads out), announces the
  intent, listens again and reconsiders once (``decide_move`` with ``serving=False``).
- While serving, it evaluates ``decide_move`` every ``check_delay`` seconds, and sooner
  when the view, looked at every update period, raises an ``alarm`` (a stage lost a
  fifth of its total since the last check, or nobody holds it): a mass departure is
  answered in seconds whatever the period. A move is announced first and carried out
  only if, a settle period later, the live view still shows another peer serving the
  stage it leaves: two peers that decide at once to leave a stage both back off rather
  than empty it. It counts the peers that arrive (new peer ids in the records) over the
  last ``ARRIVALS_S`` seconds, and tells the rule their rate: where few join, a gap
  would wait for joiners in vain, so moves that close it are made sooner.

Gossip reaches only peers the daemon is connected to, and the DHT connects lazily, so the
node dials the peers its records name. In a private run, gossip counts only from peers
whose DHT record passed the run's membership policy.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import random
import time
from collections.abc import Callable, Iterable, Mapping

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hivemind.p2p import P2P
from hivemind.utils import get_dht_time

from node.rpc.dht import SwarmDHT
from node.rpc.gossip import Gossip, GossipUnavailable, Subscription, receive_run
from protocol.assignment import (
    Claim,
    Move,
    Params,
    SwarmView,
    alarm,
    check_delay,
    choose_stage,
    decide_move,
    second_stage,
    view_from_peers,
)
from protocol.gossip import GossipMessage, GossipSigner, GossipView, Leaving, run_topic
from protocol.records import PeerInfo, PeerState
from protocol.run_spec import RunSpec

logger = logging.getLogger(__name__)

MIN_SETTLE_S = 2.0  # two GossipSub heartbeats: the mesh forms and others' intents arrive
CONNECT_TIMEOUT_S = 3.0
TOPIC_PEERS = 8  # GossipSub's mesh keeps 6 (4 to 12) neighbours per topic
ARRIVALS_S = 600.0  # arrivals are counted over this window (and only once watched this long)


class ArrivalCount:
    """Peers that arrived per peer-hour over the last ``window_s`` seconds, from the sets
    of peer ids this node reads (times are the caller's clock). The peers of the first
    read were there before us; a peer gone and first seen before the window is forgotten
    (if it comes back, it counts again)."""

    def __init__(self, window_s: float = ARRIVALS_S) -> None:
        self.window_s = window_s
        self._first_seen: dict[str, float] = {}
        self._since: float | None = None
        self._present = 0

    def saw(self, present: frozenset[str], now: float) -> None:
        self._present = len(present)
        if self._since is None:
            self._since = now
            self._first_seen = dict.fromkeys(present, -math.inf)
            return
        for peer in present - self._first_seen.keys():
            self._first_seen[peer] = now
        cutoff = now - self.window_s
        seen = self._first_seen.items()
        self._first_seen = {p: t for p, t in seen if p in present or t >= cutoff}

    def rate(self, now: float) -> float | None:
        """None until watched for a whole window (or while nobody is present)."""
        if self._since is None or now - self._since < self.window_s or not self._present:
            return None
        new = sum(t >= now - self.window_s for t in self._first_seen.values())
        return new * 3600.0 / self.window_s / self._present


def merge_gossip(
    records: Iterable[PeerInfo],
    latest: Mapping[str, GossipMessage],
    *,
    me: str,
    now: float,
    max_silence_s: float,
) -> tuple[list[PeerInfo], list[Claim]]:
    """The records to count and the gossip claims that override them (for
    ``view_from_peers(records, intents=claims)``), both without ``me``.

    A message counts when it is at least as new as the peer's record, or, for a peer
    without a record, when it is younger than ``max_silence_s`` (a record's lifetime). A
    peer whose counted message says it leaves is dropped, record and all."""
    by_peer = {p.peer_id: p for p in records if p.peer_id != me}
    claims = []
    for peer, message in sorted(latest.items()):
        record = by_peer.get(peer)
        if peer == me or (record is not None and message.timestamp < record.timestamp):
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
    the swarm view, and the join and rebalance decisions. Owns no tasks: the node runs
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
        self.settle_s = max(MIN_SETTLE_S, update_period_s)  # everyone re-announced within it
        validators = [self._member] if spec.private else []
        self.view_of_gossip = GossipView(spec.run, num_stages=spec.n_stages, validators=validators)
        self._members: frozenset[str] = frozenset()  # peers whose record passed the policy
        self._records: list[PeerInfo] = []  # the last read, for the alarm's looks
        self._arrivals = ArrivalCount()
        self._checks = 0
        self._rng = random.Random(self.peer_id)  # whom to dial
        self._announced: tuple[int | None, PeerState] | None = None
        self._pending: Move | None = None  # a move announced and not yet carried out
        self._alarmed: int | None = None  # the stage of the last alarm, until a periodic check
        self._reference: SwarmView | None = None  # the view at the last check, for alarms
        self._ignored_logged: dict[str, int] = {}

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
        self._arrivals.saw(self._members, time.monotonic())
        return records

    async def _connect(self, records: list[PeerInfo]) -> None:
        """Dial a few of the peers the records name, until ``TOPIC_PEERS`` are on the
        topic with us: the mesh needs a handful of neighbours, not the whole swarm."""
        on_topic = set(await self.gossip.topic_peers(self.topic))
        others = sorted(
            p.peer_id
            for p in records
            if p.peer_id != self.peer_id
            and p.peer_id not in on_topic
            and p.state is not PeerState.LEAVING
        )
        wanted = max(0, TOPIC_PEERS - len(on_topic))
        for peer in self._rng.sample(others, min(wanted, len(others))):
            try:
                await self.gossip.connect(peer, timeout_s=CONNECT_TIMEOUT_S)
            except (ConnectionError, TimeoutError) as e:
                logger.debug("could not dial %s for gossip: %s", peer, e)

    # -- the view ------------------------------------------------------------------------

    def view(self, records: Iterable[PeerInfo], own: Claim | None = None) -> SwarmView:
        """The swarm as the rule sees it: the others' records and fresher gossip, priced
        with every present peer's throughput (ours included), plus ``own`` if given."""
        kept, claims = merge_gossip(
            records,
            self.view_of_gossip.latest,
            me=self.peer_id,
            now=get_dht_time(),
            max_silence_s=self.record_ttl_s,
        )
        view = view_from_peers(kept, self.n_stages, intents=claims, own=self.throughput)
        return view if own is None else view.add(own)

    def _claim(self, stage: int, serving: bool) -> Claim:
        return Claim(self.peer_id, stage, self.throughput[stage], serving)

    # -- decisions -----------------------------------------------------------------------

    async def join(self, on_choice: Callable[[int], None]) -> int:
        """Choose a stage, tell ``on_choice`` (which announces it), reconsider once the
        others' intents had a settle period to arrive; the stage to load."""
        await self._connect(await self.records())
        await self._settle("listen")  # others re-announce where they are within it
        view = self.view(await self.records())
        stage = choose_stage(view, self.throughput, self.peer_id, self.params)
        logger.info("chose stage %d; stage totals seen: %s", stage, _totals(view))
        on_choice(stage)
        await self.publish(self.signer.join(stage, self.throughput[stage], get_dht_time()))
        await self._settle("reconsider")
        view = self.view(await self.records(), own=self._claim(stage, serving=False))
        move = decide_move(
            view, stage, self.throughput, f"{self.peer_id}/join", self.params, serving=False
        )
        if move is not None:
            logger.info(
                "reconsidered: stage %d instead of %d (%s); stage totals seen: %s",
                move.to_stage,
                stage,
                move.reason,
                _totals(view),
            )
            stage = move.to_stage
            on_choice(stage)
            await self.publish(self.signer.join(stage, self.throughput[stage], get_dht_time()))
        return stage

    async def second_stage(self, stage: int) -> int | None:
        """The second stage to take as well, now that ``stage`` serves (or None)."""
        view = self.view(await self.records(), own=self._claim(stage, serving=True))
        second = second_stage(view, stage, self.throughput, self.params)
        if second is not None:
            logger.info(
                "taking stage %d as a second stage (two-stage peers hold %.1f samples/s); "
                "stage totals seen: %s",
                second,
                view.two_stage,
                _totals(view),
            )
        return second

    async def _settle(self, label: str) -> None:
        """Wait about a settle period, drawn in 0.5-1.5 of it from our peer id: joiners of
        a wave that decide at different moments see each other's intents, where deciding
        together they would all make the same choice (seen: two joiners that both
        reconsidered onto the same stage)."""
        spread = Params(mean_period_s=self.settle_s, period_jitter=0.5)
        await asyncio.sleep(check_delay(f"{self.peer_id}/{label}", spread))

    async def next_move(self, stage: Callable[[], int]) -> Move:
        """Wait for a check that decides to move: every ``check_delay`` seconds, or sooner
        on an alarm; ``stage()`` says where this node serves at each check."""
        self._reference = None  # the first look after this sets it
        while True:
            self._checks += 1
            seed = f"{self.peer_id}/{self._checks}"
            await self._until_check(seed, stage)
            here = stage()
            try:
                view = self.view(await self.records(), own=self._claim(here, serving=True))
            except Exception as e:  # a DHT hiccup: check again next period
                logger.warning("rebalancing check skipped: %s", e)
                continue
            self._reference = view
            arrivals = self._arrivals.rate(time.monotonic())
            move = decide_move(view, here, self.throughput, seed, self.params, arrivals=arrivals)
            if move is not None:
                logger.info(
                    "rebalancing: move from stage %d to %d (%s, gain %.2f, drawn with p=%.2f); "
                    "stage totals seen: %s",
                    move.from_stage,
                    move.to_stage,
                    move.reason,
                    move.gain,
                    move.probability,
                    _totals(view),
                )
                return move

    async def _until_check(self, seed: str, stage: Callable[[], int]) -> None:
        """Sleep until the next periodic check, or until the view, looked at every update
        period, raises an alarm against the view at the last check; then a draw of up to
        two settle periods more, so that the peers alarmed by the same loss check one
        after another, each seeing the moves announced before it."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + check_delay(seed, self.params)
        while (left := deadline - loop.time()) > 0:
            await asyncio.sleep(min(left, self.update_period_s))
            try:
                now = self.view(self._records, own=self._claim(stage(), serving=True))
            except Exception as e:  # the periodic check will say it at warning level
                logger.debug("alarm look skipped: %s", e)
                continue
            before = self._reference
            if before is None:
                self._reference = now
                continue
            short = alarm(before, now, self.params)
            if short is None or loop.time() >= deadline:
                continue
            log = logger.info if short != self._alarmed else logger.debug
            self._alarmed = short  # a stage nobody holds alarms at every look: log it once
            log(
                "alarm: stage %d holds %.0f (was %.0f at the last check); checking now "
                "(stage totals seen: %s)",
                short,
                now.totals[short],
                before.totals[short],
                _totals(now),
            )
            spread = Params(mean_period_s=self.settle_s, period_jitter=1.0)
            await asyncio.sleep(check_delay(f"{seed}/alarm", spread))
            return
        self._alarmed = None

    async def confirm_move(self, move: Move) -> bool:
        """Announce ``move``, wait a settle period, and say whether it may go ahead:
        another peer still serves ``move.from_stage`` and announced no move away."""
        self._pending = move  # re-announced, instead of our load, until we move or stay
        await self.publish(self._move_intent(move))
        await asyncio.sleep(self.settle_s)
        view = self.view(await self.records())
        if view.serving[move.from_stage] >= 1:
            return True
        self._pending = None
        logger.info(
            "not moving: nobody else would serve stage %d (stage totals seen: %s)",
            move.from_stage,
            _totals(view),
        )
        return False

    # -- announcements -------------------------------------------------------------------

    async def announce(self, stage: int | None, state: PeerState, load: int) -> None:
        """Re-announce where this node is (the announce loop calls it with every record):
        an intent while joining or loading, ``serving`` once it serves, then load updates;
        a pending move's intent while it is being confirmed (sent after the record, so
        that it is the newer word)."""
        now = get_dht_time()
        previous, self._announced = self._announced, (stage, state)
        pending = self._pending
        if pending is not None and (stage, state) != (pending.from_stage, PeerState.SERVING):
            pending = self._pending = None  # carried out (or abandoned)
        if pending is not None:
            raw = self._move_intent(pending)
        elif state is PeerState.LEAVING:
            raw = self.signer.leaving(stage, now)
        elif stage is None:
            return
        elif state is not PeerState.SERVING:
            raw = self.signer.join(stage, self.throughput[stage], now)
        elif previous != (stage, state):
            raw = self.signer.serving(stage, self.throughput[stage], now)
        else:
            raw = self.signer.load(stage, self.throughput[stage], load, now)
        await self.publish(raw)

    def _move_intent(self, move: Move) -> bytes:
        to = move.to_stage
        return self.signer.move(move.from_stage, to, self.throughput[to], get_dht_time())

    async def publish(self, raw: bytes) -> None:
        """Best effort: gossip is re-announced, and the DHT record says the same."""
        try:
            await self.gossip.publish(self.topic, raw)
        except (GossipUnavailable, ValueError) as e:
            logger.warning("could not publish on the run's gossip topic: %s", e)

    async def close(self) -> None:
        await self.gossip.close()


def _totals(view: SwarmView) -> str:
    return "[" + ", ".join(f"{t:.0f}" for t in view.totals) + "]"
