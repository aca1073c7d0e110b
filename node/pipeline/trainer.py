"""The trainer: reads the run's data and drives micro-batches through the swarm's stages.

Each micro-batch takes its own route (``protocol.routing``): forward through stages
0..n-2, the last stage computes the loss and its input gradient in one call, then the
backward runs back through the same stages, each on any peer of that stage (backward is
stateless: the saved stage input is re-sent). A call that fails because the peer is gone,
times out or errs on its side is retried on another peer of the same stage, and that peer
is banned for a while (events ``call.failed``, then ``call.rerouted``). The timeout
follows how long the stage's calls take (``protocol.routing.CallTimer``): a peer cut off
mid-call holds its micro-batches for a few typical calls, not for ``call_timeout_s``.
A training forward (and the last stage's training call) may wait at its stage for a step
(``node.pipeline.server.HOLD_ROUND_S`` at most) before it is computed: its timeout is that much
longer, so a held call is late, never failed and sent again.
A peer's record is only a claim: a peer gets probes until a call of ours succeeds there,
then a share of calls that grows as they keep succeeding (``protocol.routing.Probation``),
and a stage's view keeps at most ``max_unproven`` peers not proven yet, so that a flood
of records claiming to serve neither draws the calls nor sets the work.
Several micro-batches are in flight at once so that stages overlap.

The routing (view, bans, timeouts, retries) is ``StageRouter``'s, which ``Trainer``
extends with the data and the training loop; generation (``swarmtrain generate --run``)
uses the router alone: one inference forward through the stages per token.

The stage RPCs go through ``StageCalls`` (``node.pipeline.client``'s functions unless
given): a test puts its faults there, between the trainer and the swarm.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from functools import partial
from typing import Literal, TypeVar

import torch
from hivemind.p2p import P2P, PeerID

from models.data import Tokens, eval_batches, sample_batches, stream_seed
from node import events
from node.pipeline import client as stage_client
from node.pipeline.client import (
    StageBusy,
    StageCallError,
    StageRefused,
    StageTimeout,
    StageUnavailable,
)
from node.pipeline.server import HOLD_ROUND_S, StageServer
from node.pipeline.wire import Encoded
from node.rpc.dht import SwarmDHT
from node.rpc.membership import NOT_A_MEMBER, present
from node.rpc.relay import connect_relayed
from protocol.records import PeerInfo
from protocol.routing import (
    WINDOW,
    BanList,
    CallTimer,
    Candidate,
    Probation,
    candidates_by_stage,
    keep_unproven,
    out_of_reach,
    refresh_period,
    route,
)
from protocol.run_spec import RunSpec
from protocol.stage_messages import WRONG_STAGE

logger = logging.getLogger(__name__)
R = TypeVar("R")
# The micro-batch a trainer's task is driving, for fixed wiring: ``_call`` has no index.
_micro_batch_index: ContextVar[int] = ContextVar("micro_batch_index", default=0)


class TrainerError(RuntimeError):
    """Training (or generation) cannot go on (a stage stayed empty, or peers refuse our
    requests)."""


# Peers (of all stages) whose calls ``TrainerStats.calls`` counts one by one: past this
# many, the half that served fewest are counted together under ``OTHER_PEERS`` (a trainer
# of a public run meets peers without end).
MAX_COUNTED_PEERS = 4096
OTHER_PEERS = ""


@dataclass
class TrainerStats:
    micro_batches: int = 0
    samples: int = 0
    loss_sum: float = 0.0  # of the micro-batches' training losses (their mean: / micro_batches)
    calls: Counter = field(default_factory=Counter)  # (stage, peer_id) -> calls served
    rerouted: Counter = field(default_factory=Counter)  # stage -> failed calls retried elsewhere

    def called(self, stage: int, peer: str) -> None:
        """``peer`` of ``stage`` served a call; per-stage totals stay exact."""
        self.calls[(stage, peer)] += 1
        if len(self.calls) > MAX_COUNTED_PEERS:
            fewest = sorted(self.calls.items(), key=lambda kv: kv[1])[: MAX_COUNTED_PEERS // 2]
            for (s, p), n in fewest:
                if p != OTHER_PEERS:
                    del self.calls[(s, p)]
                    self.calls[(s, OTHER_PEERS)] += n


@dataclass(frozen=True)
class MicroBatchResult:
    index: int  # its id: its place in the data stream, unique over the trainer's life
    loss: float
    samples: int
    route: tuple[str, ...]  # the peer of each stage that served the forward
    # Seconds each call took, retries included, in the order made: the forward of each
    # stage but the last, the last stage's loss, then the backward of each stage from the
    # last but one down to stage 0.
    call_s: tuple[float, ...] = ()


@dataclass(frozen=True)
class StageCalls:
    """The stage RPCs a trainer makes, with ``node.pipeline.client``'s signatures (its
    functions by default, keeping what is encoded: hidden states and gradients in a lossy
    encoding go on to the next stage as they came, ``node.pipeline.wire.Encoded``)."""

    forward: Callable[..., Awaitable[torch.Tensor | Encoded]] = partial(
        stage_client.forward, keep_encoded=True
    )
    loss: Callable[..., Awaitable[tuple[torch.Tensor, torch.Tensor | Encoded | None]]] = partial(
        stage_client.loss, keep_encoded=True
    )
    backward: Callable[..., Awaitable[torch.Tensor | Encoded | None]] = partial(
        stage_client.backward, keep_encoded=True
    )
    logits: Callable[..., Awaitable[torch.Tensor]] = stage_client.logits


class MembershipRefused(Exception):
    """A peer did not take our invite (or could not be asked)."""


@dataclass(frozen=True)
class TrainerSettings:
    in_flight: int = WINDOW  # micro-batches in the pipeline at once
    call_timeout_s: float = 30.0  # the longest wait for a call (before a stage's first answer)
    min_call_timeout_s: float = 5.0  # the shortest, however fast the stage's calls have been
    refresh_s: float = 2.0  # how often the swarm view is re-read from the DHT
    # A peer missing from a read stays in the view this long after the last read that
    # had it: DHT stores can fail for a few seconds (seen when a partitioned peer comes
    # back), records then expire, and a view without them would starve the pipeline.
    view_grace_s: float = 6.0
    ban_s: float = 15.0
    busy_s: float = 1.0  # how long a peer that shed our call for load is left alone
    # Peers of a stage kept in the view before any call of ours succeeded there: a flood
    # of records claiming to serve is gone through this many at a time.
    max_unproven: int = 16
    # How often each stage's next unproven peer is probed, off the micro-batches' path:
    # one that never answers holds no training call.
    probe_s: float = 2.0
    stage_wait_s: float = 120.0  # how long a stage may stay empty before we give up
    stream: int = 0  # which data stream of the run this trainer reads
    start: int = 0  # the micro-batch of its stream it reads first (a resumed data position)
    seed: int = 0  # of the routing draws
    # False: this trainer's p2pd cannot dial through a circuit relay (``--no-relay``:
    # ``RelaySettings.dials_circuits``), so peers reachable only through one are never
    # routed to (``PeerInfo.routable_by``); the trainer says how many it leaves out, once
    # each time that number changes.
    dials_relays: bool = True
    # "fixed": micro-batch i always takes route i mod n (GPipe-like), the baseline that
    # benchmarks compare stochastic wiring against; a failed peer is still routed around.
    wiring: Literal["stochastic", "fixed"] = "stochastic"


class StageRouter:
    """Calls to the run's stages, each on a serving peer that ``protocol.routing`` picks,
    retried on another peer of the stage when one fails: the swarm view, bans, call
    timeouts and (in a private run) the presentation of our invite. ``Trainer`` drives
    micro-batches through it; ``logits`` is one inference forward through every stage
    (generation), which trains nothing."""

    def __init__(
        self,
        dht: SwarmDHT,
        p2p: P2P,
        spec: RunSpec,
        settings: TrainerSettings,
        *,
        membership: str | None = None,
        local: Callable[[int], StageServer | None] | None = None,
        calls: StageCalls | None = None,
    ) -> None:
        self.dht, self.p2p, self.spec, self.settings = dht, p2p, spec, settings
        # This node's own server of a stage, if it serves it: our calls to our own peer id
        # run in-process (libp2p does not dial itself).
        self._local = local or (lambda stage: None)
        self._own_id = p2p.peer_id.to_base58()
        self._calls = calls or StageCalls()
        self.membership = membership  # private runs: our proof, shown to each peer we call
        self._presented: set[str] = set()
        self.stats = TrainerStats()
        self._rng = random.Random(settings.seed)
        self._bans = BanList(settings.ban_s)
        # Calls probe unproven peers only where no peer is proven; elsewhere ``_probe`` does.
        self._probation = Probation(probe_share=0.0)
        self._probation.trust(self._own_id)
        # stage -> an input it took: the call's positional tensors and keyword tensors
        self._samples: dict[int, tuple[tuple[torch.Tensor | Encoded, ...], dict]] = {}
        self._probes: Counter = Counter()  # stage -> probes of unproven peers in flight
        self._connected: frozenset[str] = frozenset()  # peers our p2p daemon holds a link to
        self._timer = CallTimer(settings.min_call_timeout_s, settings.call_timeout_s)
        self._view: list[list[Candidate]] = [[] for _ in range(spec.n_stages)]
        self._seen: dict[str, tuple[PeerInfo, float]] = {}  # peer -> newest record, read when
        self._in_flight: Counter = Counter()  # peer_id -> our calls running there
        self._refreshed = -math.inf  # time.monotonic() of the last view read
        self._found = self._listed = 0  # peer ids the last read found (as it runs; once done)
        self._out_of_reach = 0  # relayed peers out of our reach, as last said

    async def refresh(self) -> None:
        """Re-read the swarm's peers from the DHT (keeping, for ``view_grace_s``, those a
        read missed). Of a read's records, only ours, those of proven peers and a bounded
        sample of the others are checked (``_select``): a flood of records costs a bounded
        part of each refresh."""
        try:
            self._connected = frozenset(p.peer_id.to_base58() for p in await self.p2p.list_peers())
        except Exception as e:  # the daemon went away: no peer is preferred for probes
            logger.debug("could not list connected peers: %s", e)
            self._connected = frozenset()
        try:
            peers = await self.dht.peers(select=self._select)
        except Exception as e:  # a DHT hiccup: keep the old view, retry next period
            logger.warning("could not refresh the swarm view: %s", e)
            return
        self._listed = self._found
        now = time.monotonic()
        self._seen.update((p.peer_id, (p, now)) for p in peers)
        grace = self.settings.view_grace_s
        gone = [PeerID.from_base58(k) for k, (_, t) in self._seen.items() if now - t > grace]
        self._seen = {k: (p, t) for k, (p, t) in self._seen.items() if now - t <= grace}
        self._presented &= self._seen.keys()  # one back later presents itself again
        stage_client.forget_peers(self.p2p, gone)  # their idle streams, if any, close now
        recent = self._kept([p for p, _ in self._seen.values()], now)
        dials = self.settings.dials_relays
        self._view = candidates_by_stage(recent, self.spec.n_stages, dials_relays=dials)
        self._refreshed = now
        self._say_out_of_reach(out_of_reach(recent, dials))
        try:  # peers behind NAT: p2pd can dial them only at their relay's circuit address
            await connect_relayed(self.p2p, [p for p in recent if p.routable_by(dials)])
        except Exception as e:  # a daemon hiccup: their calls fail and reroute; retry next period
            logger.debug("could not connect to relayed peers: %s", e)

    def _say_out_of_reach(self, peers: list[str]) -> None:
        """Log and emit ``route.out_of_reach`` when the number of ``peers`` (serving
        through a relay, which this trainer cannot dial: ``out_of_reach``) changes."""
        if len(peers) == self._out_of_reach:
            return
        self._out_of_reach = len(peers)
        why = "this node runs without circuit relays (--no-relay)"
        if peers:
            logger.warning(
                "%d peer(s) serving through a relay are out of reach: %s; no call goes "
                "to them (run without --no-relay to use them)",
                len(peers),
                why,
            )
        events.emit("route.out_of_reach", count=len(peers), peers=peers, reason=why)

    def _select(self, peer_ids: list[str]) -> set[str]:
        """Of the peer ids a read found, those whose records to check: ours, the proven
        ones, and ``max_unproven`` others per stage, twice over (their stages are not known
        before their records are read), as ``keep_unproven`` orders them."""
        self._found = len(peer_ids)
        proven = self._probation.proven
        sure = {p for p in peer_ids if p == self._own_id or proven(p)}
        limit = 2 * self.settings.max_unproven * self.spec.n_stages
        now, rng = time.monotonic(), self._rng
        others = keep_unproven(peer_ids, self._probation, now, limit, rng, self._connected)
        return sure | set(others)

    def _kept(self, records: list[PeerInfo], now: float) -> list[PeerInfo]:
        """``records`` less all but ``max_unproven`` unproven peers of each stage
        (``protocol.routing.keep_unproven``); our own peer counts as proven."""
        proven = self._probation.proven
        by_stage: dict[int | None, list[str]] = {}
        for p in records:
            if p.peer_id != self._own_id and not proven(p.peer_id):
                by_stage.setdefault(p.stage, []).append(p.peer_id)
        kept, limit = {self._own_id}, self.settings.max_unproven
        for ids in by_stage.values():
            kept.update(keep_unproven(ids, self._probation, now, limit, self._rng, self._connected))
        return [p for p in records if proven(p.peer_id) or p.peer_id in kept]

    @property
    def view(self) -> tuple[tuple[Candidate, ...], ...]:
        """The peers of each stage that calls may go to now, as the last ``refresh`` read
        them less those that failed since."""
        return tuple(tuple(stage) for stage in self._view)

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(refresh_period(self.settings.refresh_s, self._listed))
            await self.refresh()

    def _opts(self, stage: int, peer: str, timeout: float) -> dict:
        """The keyword arguments of a ``stage_client`` call to ``peer`` of ``stage``."""
        local = None
        if peer == self._own_id:
            local = self._local(stage)
            if local is None:  # our record is behind: we no longer serve it (a move)
                raise StageUnavailable(self.p2p.peer_id, f"this node does not serve stage {stage}")
        return {
            "run_id": self.spec.run,
            "compression": self.spec.compression,
            "timeout": timeout,
            "local": local,
        }

    def _tokens(self, stage: int, tokens: torch.Tensor) -> dict:
        """The ``tokens`` keyword of a call to ``stage`` about sequences ``tokens``: given
        to a stage that takes hidden states across a low-rank boundary, else none."""
        return {"tokens": tokens} if self.spec.model.boundary_rank and stage > 0 else {}

    async def _forward(
        self,
        stage: int,
        x: torch.Tensor | Encoded,
        index: int,
        tokens: torch.Tensor,
        train: bool = False,
        infer: bool = False,
    ) -> tuple[torch.Tensor | Encoded, str]:
        """Stage ``stage``'s forward of ``x``, the hidden states (or, at stage 0, the token
        ids) of the sequences ``tokens``. Hidden states of another width than the model's
        boundary are the peer's fault (``StageUnavailable``): sent on, the next stage
        would refuse them, and the refusal would fall on that stage."""
        with_tokens = self._tokens(stage, tokens)
        self._samples[stage] = ((x,), with_tokens)
        exact = {"compression": "none"} if infer else {}  # generation: deterministic logits
        width = self.spec.model.boundary_width

        async def forward(peer: PeerID, opts: dict) -> torch.Tensor | Encoded:
            hidden = await self._calls.forward(
                self.p2p,
                peer,
                x,
                stage=stage,
                micro_batch=index,
                train=train,
                infer=infer,
                **opts | exact | with_tokens,
            )
            if hidden.shape[-1] != width:
                raise StageUnavailable(
                    peer, f"malformed response: hidden states of width {hidden.shape[-1]}, "
                    f"the model's boundary carries {width}"
                )  # fmt: skip
            return hidden

        return await self._call(stage, forward, held=train)

    async def _loss(
        self,
        x: torch.Tensor | Encoded,
        y: torch.Tensor,
        index: int,
        tokens: torch.Tensor,
        train: bool,
    ):
        last = self.spec.n_stages - 1
        with_tokens = self._tokens(last, tokens)
        self._samples[last] = ((x, y), with_tokens)
        return await self._call(
            last,
            lambda peer, opts: self._calls.loss(
                self.p2p,
                peer,
                x,
                y,
                stage=last,
                train=train,
                micro_batch=index,
                **opts | with_tokens,
            ),
            held=train,
        )

    async def _call(
        self,
        stage: int,
        call: Callable[[PeerID, dict], Awaitable[R]],
        prefer: str = "",
        held: bool = False,
    ) -> tuple[R, str]:
        """``call(peer, opts)`` on a peer of ``stage`` (``prefer`` first, if it is there
        and not banned; ``opts``: ``_opts``'s keywords); on a peer failure, ban it and try
        another. Each failure is a ``call.failed`` event, each retry a ``call.rerouted``.
        ``held``: the stage may hold the call for a step first (a training call), so it
        gets ``HOLD_ROUND_S`` more than the stage's call timeout."""
        extra_s = HOLD_ROUND_S if held else 0.0
        deadline = time.monotonic() + self.settings.stage_wait_s
        retry = False
        while True:
            candidates = [
                Candidate(c.peer_id, c.throughput, c.load + self._in_flight[c.peer_id])
                for c in self._view[stage]
            ]
            if not candidates:
                if time.monotonic() > deadline:
                    raise TrainerError(
                        f"stage {stage} has had no serving peer for "
                        f"{self.settings.stage_wait_s:.0f} s"
                    )
                await asyncio.sleep(0.5)
                await self.refresh()
                continue
            banned = self._bans.banned(time.monotonic())
            there = prefer not in banned and any(c.peer_id == prefer for c in candidates)
            peer, probe = (prefer, False) if there else self._choose(stage, candidates, banned)
            prefer = ""  # a retry goes where the rule sends it
            if retry:
                events.emit("call.rerouted", stage=stage, peer=peer)
            self._in_flight[peer] += 1
            self._probes[stage] += probe
            try:
                await self._present(peer)
                started = time.monotonic()
                opts = self._opts(stage, peer, self._timer.timeout(stage) + extra_s)
                result = await call(PeerID.from_base58(peer), opts)
                self._timer.succeeded(stage, time.monotonic() - started)
                self._probation.succeeded(peer)
            except StageRefused as e:
                self._failed(stage, peer, e)
                if NOT_A_MEMBER in str(e):
                    self._presented.discard(peer)  # it forgot us (restarted?): present again
                elif WRONG_STAGE not in str(e):  # else: it moved to another stage since
                    raise TrainerError(f"stage {stage} peer {peer} refused our request: {e}") from e
                retry = True
                continue
            except StageBusy as e:  # it is full, not broken: back off briefly, reroute
                events.emit("call.failed", stage=stage, peer=peer, error=f"StageBusy: {e}")
                self._bans.ban(peer, time.monotonic(), self.settings.busy_s)
                self.stats.rerouted[stage] += 1
                proven = [c for c in candidates if self._probation.proven(c.peer_id)]
                banned = self._bans.banned(time.monotonic())
                if all(c.peer_id in banned for c in proven or candidates):
                    await asyncio.sleep(self.settings.busy_s)  # every peer we trust is busy
                retry = True
                continue
            except (StageUnavailable, MembershipRefused) as e:
                if isinstance(e, StageTimeout):
                    self._timer.timed_out(stage)
                logger.info("stage %d peer %s failed (%s); rerouting", stage, peer[-8:], e)
                self._failed(stage, peer, e)
                if peer != self._own_id:  # our own server failing is no sign of a sybil
                    self._probation.failed(peer, time.monotonic())
                self.stats.rerouted[stage] += 1
                retry = True
                continue
            finally:
                self._in_flight[peer] -= 1
                if not self._in_flight[peer]:
                    del self._in_flight[peer]  # a peer called once is not kept for good
                self._probes[stage] -= probe
            self.stats.called(stage, peer)
            return result, peer

    def _failed(self, stage: int, peer: str, error: Exception) -> None:
        """A call to ``peer`` of ``stage`` failed: ban the peer and leave it out of the view."""
        events.emit("call.failed", stage=stage, peer=peer, error=f"{type(error).__name__}: {error}")
        self._bans.ban(peer, time.monotonic())
        self._view[stage] = [c for c in self._view[stage] if c.peer_id != peer]

    async def _probe_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.probe_s)
            probes = [self._probe(s) for s in range(self.spec.n_stages)]
            for outcome in await asyncio.gather(*probes, return_exceptions=True):
                if isinstance(outcome, Exception):  # a probe's fault must not stop training
                    logger.warning("probing a peer failed: %s", outcome)

    async def _probe(self, stage: int) -> None:
        """Send one unproven peer of ``stage`` (``route`` picks it) an evaluation call on
        an input the stage took lately: it changes nothing on the peer, and its outcome
        proves the peer or makes it a suspect (``Probation``)."""
        sample, now = self._samples.get(stage), time.monotonic()  # (args, keywords)
        fresh = [
            c
            for c in self._view[stage]
            if not self._probation.proven(c.peer_id) and not self._probation.suspect(c.peer_id, now)
        ]
        if sample is None or not fresh:
            return
        peer, _ = route(fresh, self._rng, self._probation, now, preferred=self._connected)
        last = stage == self.spec.n_stages - 1
        try:
            await self._present(peer)
            opts, target = (
                self._opts(stage, peer, self._timer.timeout(stage)),
                PeerID.from_base58(peer),
            )
            args, keywords = sample
            if last:
                await self._calls.loss(
                    self.p2p, target, *args, stage=stage, train=False, **opts | keywords
                )
            else:
                await self._calls.forward(self.p2p, target, *args, stage=stage, **opts | keywords)
        except (StageCallError, MembershipRefused) as e:
            logger.debug("probe of stage %d peer %s failed: %s", stage, peer[-8:], e)
            self._probation.failed(peer, time.monotonic())
            return
        self._probation.succeeded(peer)

    async def _present(self, peer: str) -> None:
        """In a private run, show our invite to ``peer`` before our first call there."""
        if self.membership is None or peer in self._presented or peer == self._own_id:
            return
        try:
            await present(self.p2p, PeerID.from_base58(peer), self.membership)
        except Exception as e:  # refused, unreachable or timed out: try another peer
            raise MembershipRefused(f"{type(e).__name__}: {e}") from None
        self._presented.add(peer)

    def _choose(
        self, stage: int, candidates: list[Candidate], banned: frozenset[str]
    ) -> tuple[str, bool]:
        """The peer for a call of ``stage``, and whether the call probes an unproven peer
        (``protocol.routing.route``; our own peer, if it serves, is proven from the start)."""
        if self.settings.wiring == "fixed":
            pool = [c for c in candidates if c.peer_id not in banned] or candidates
            return pool[_micro_batch_index.get() % len(pool)].peer_id, False
        return route(
            candidates,
            self._rng,
            self._probation,
            time.monotonic(),
            banned=banned,
            probing=self._probes[stage] > 0,
            preferred=self._connected,
        )

    async def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """The vocabulary logits (B, vocab) of the last position of each sequence of
        ``tokens`` (B, T), from one inference forward through the stages (0 .. last), each
        on a peer routing picks, as the trainer's forwards go. Nothing is kept for a
        backward, no sample counts toward a step, no stage holds it back for one, and the
        hidden states travel uncompressed both ways (the logits are deterministic). The
        view is re-read first when it is older than ``refresh_s``. ``TrainerError`` when a
        stage has had no serving peer for ``stage_wait_s`` or refuses the request."""
        if time.monotonic() - self._refreshed >= self.settings.refresh_s:
            await self.refresh()
        last, x = self.spec.n_stages - 1, tokens
        for s in range(last):
            x, _ = await self._forward(s, x, index=0, tokens=tokens, infer=True)
        out, _ = await self._call(
            last,
            lambda peer, opts: self._calls.logits(
                self.p2p,
                peer,
                x,
                stage=last,
                vocab_size=self.spec.model.vocab_size,
                **opts | {"compression": "none"} | self._tokens(last, tokens),
            ),
        )
        return out


class Trainer(StageRouter):
    """Trains micro-batches of the run's data stream ``settings.stream`` through the
    swarm's stages (see the module docstring)."""

    def __init__(
        self,
        dht: SwarmDHT,
        p2p: P2P,
        spec: RunSpec,
        corpus,
        settings: TrainerSettings,
        *,
        membership: str | None = None,
        local: Callable[[int], StageServer | None] | None = None,
        calls: StageCalls | None = None,
    ) -> None:
        super().__init__(dht, p2p, spec, settings, membership=membership, local=local, calls=calls)
        self.corpus = corpus
        self._drawn = 0  # micro-batches read from the stream
        self._data: Iterator = self._batches(corpus.train)

    def _batches(self, train: Tokens) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return sample_batches(
            train,
            self.spec.model.block_size,
            self.spec.optim.micro_batch_size,
            stream_seed(self.spec.seed, self.settings.stream),
            start=self.data_position,
        )

    def read_from(self, train: Tokens) -> None:
        """Draw the next micro-batches from ``train`` instead (this trainer's share of the
        run's shards changed: ``protocol.data_split``), going on at ``data_position``."""
        self._data = self._batches(train)

    @property
    def data_position(self) -> int:
        """The next micro-batch of the stream this trainer reads (``settings.start`` plus
        those read): where a trainer restarted on this stream goes on."""
        return self.settings.start + self._drawn

    async def train(
        self, n_micro_batches: int, on_result: Callable[[MicroBatchResult], None] | None = None
    ) -> None:
        """Run ``n_micro_batches`` through the swarm, ``in_flight`` at a time. Raises
        ``TrainerError`` (not a group of them) when training cannot go on."""
        try:
            await self._train(n_micro_batches, on_result)
        except* TrainerError as group:  # nested: the workers' group is in the refresher's
            error: BaseException = group
            while isinstance(error, BaseExceptionGroup):
                error = error.exceptions[0]
            raise error from None

    async def _train(
        self, n_micro_batches: int, on_result: Callable[[MicroBatchResult], None] | None
    ) -> None:
        await self.refresh()
        counter = iter(range(n_micro_batches))

        async def worker() -> None:
            for _ in counter:
                # Its id is its place in the data stream: unique and increasing over the
                # trainer's life (every ``train`` call goes on from the last), and over a
                # restart that resumes the stream; the stage servers key by it per caller.
                index = self.data_position
                x, y = next(self._data)
                self._drawn += 1
                result = await self._micro_batch(index, x, y)
                self.stats.micro_batches += 1
                self.stats.samples += result.samples
                self.stats.loss_sum += result.loss
                if on_result:
                    on_result(result)

        async with asyncio.TaskGroup() as tasks:
            refresher = tasks.create_task(self._refresh_loop(), name="refresh-view")
            prober = tasks.create_task(self._probe_loop(), name="probe-peers")
            async with asyncio.TaskGroup() as workers:
                for _ in range(self.settings.in_flight):
                    workers.create_task(worker())
            refresher.cancel()
            prober.cancel()

    async def _micro_batch(self, index: int, x: torch.Tensor, y: torch.Tensor) -> MicroBatchResult:
        _micro_batch_index.set(index)  # this task's calls below read it (fixed wiring)
        last = self.spec.n_stages - 1
        inputs, route, call_s = [x], [], []
        clock = time.perf_counter()

        def lap() -> None:
            nonlocal clock
            now = time.perf_counter()
            call_s.append(now - clock)
            clock = now

        for s in range(last):
            hidden, peer = await self._forward(s, inputs[s], index, tokens=x, train=True)
            lap()
            inputs.append(hidden)
            route.append(peer)
        (loss, grad), peer = await self._loss(inputs[last], y, index, tokens=x, train=True)
        lap()
        route.append(peer)
        for s in reversed(range(last)):
            grad, _ = await self._call(
                s,
                lambda peer, opts, s=s, g=grad: self._calls.backward(
                    self.p2p,
                    peer,
                    inputs[s],
                    g,
                    stage=s,
                    micro_batch=index,
                    **opts | self._tokens(s, x),
                ),
                prefer=route[s],  # it kept the forward's graph: no recompute there
            )
            lap()
        return MicroBatchResult(index, float(loss), len(x), tuple(route), tuple(call_s))

    async def evaluate(self, n_batches: int = 8) -> float:
        """Mean validation loss over the run's fixed validation windows (no gradients)."""
        model, optim = self.spec.model, self.spec.optim
        windows = eval_batches(self.corpus.val, model.block_size, optim.micro_batch_size, n_batches)
        losses = []
        for tokens, y in windows:
            x = tokens
            for s in range(self.spec.n_stages - 1):
                x, _ = await self._forward(s, x, index=0, tokens=tokens)
            (loss, _), _ = await self._loss(x, y, index=0, tokens=tokens, train=False)
            losses.append(float(loss))
        return sum(losses) / len(losses)
