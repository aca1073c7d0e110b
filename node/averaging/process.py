"""hivemind's ``DecentralizedAverager`` as a stage uses it: one child process per stage.

``StageAveragerProcess`` decides; the hivemind internals it decides through (handler
names, the reducer, the round, the state download, the shutdown) are overridden in
``node.rpc.hivemind_compat.AveragerCompat``. What it decides:

- its handlers are served as ``StageAverager`` (``service_name``), whatever the subclass;
- the process dies with its parent (``prctl(PR_SET_PDEATHSIG, SIGKILL)``, as the node's
  DHT process does), ignores SIGINT (the node stops it with ``shutdown``), caps the
  frames hivemind reads (``cap_frames``), and decodes its ``compression``'s type with it
  (``use_compression``: a codec of ours, in this process only);
- a groupmate's part that is non-finite or wildly out of range, or comes with a bad
  weight, is refused, and the parts that pass are reduced by ``robust_mean`` (hivemind
  would average a NaN into everyone's result), then, if the ``compression`` has a
  ``snap_mean``, rounded by it;
- what a groupmate returns for the share it reduced is checked against our own parts of
  that share and our weight's share of the group (``protocol.averaging.check_returned``):
  a mean that cannot be one of parts that include ours (negated, scaled up) fails the
  round, is logged and emitted as ``averaging.part_rejected``; a non-finite or far-out
  mean refuses that groupmate (as a leader, a follower, a sender) for ``REJECTED_S`` at
  once, one refused for its direction (or a little beyond the radius) only once refused in
  ``STRIKES`` of its last rounds (``protocol.averaging.ReducerRecord``);
- the vector is split into equal shares among the groupmates that reduce
  (``protocol.averaging.reducer_shares``), whatever bandwidth they claim;
- in a private run, it averages with members only: it refuses to admit, aggregate for,
  or send its state to a peer whose DHT record shows no valid invite, downloads state
  from members only, and fails a round whose group includes a non-member (a non-member
  leader may have gathered members around it).
- a state download never asks a peer whose state the host refused lately
  (``refuse_source``: it did not fit the stage, or claimed an epoch no one else is near),
  nor a reducer it refused: hivemind would ask the peer that declares the highest
  priority first, every time, and the declared priority is anyone's to set.

It also lets the host key each round by its epoch and set the group size it expects
(``set_round``): peers at different epochs never average together, and a leader starts
the all-reduce as soon as the stage's peers are in, not at the end of the matchmaking
time. The host side answers state downloads through ``state_source``
(hivemind calls it on a background thread of the host process).
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Callable, Container, Sequence

# hivemind recognises stream handlers by typing.AsyncIterator, not collections.abc's.
from typing import AsyncIterator  # noqa: UP035

import torch
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2

from node import events, limits
from node.rpc.child_process import die_with_parent
from node.rpc.hivemind_compat import AveragerCompat, cap_frames, use_compression
from protocol.averaging import (
    MAX_ABS_CONTRIBUTION,
    REFUSED_S,
    ReducerRecord,
    ReturnedShare,
    check_returned,
    check_weight,
    max_abs,
    reducer_shares,
    robust_mean,
)
from protocol.membership import MembershipPolicy

logger = logging.getLogger(__name__)

MEMBERS_REFRESH_S = 2.0  # a peer we do not know yet is looked up at most this often
REJECTED_S = REFUSED_S  # how long a groupmate whose returned means we refused is refused
MAX_REDUCERS = 4096  # groupmates whose record as a reducer is kept (refused ones always)

EPOCH_BITS = 16  # epochs that differ by a multiple of 2**16 share a group key


def epoch_bits(epoch: int) -> str:
    """The group key bits of an epoch: peers at different epochs never meet."""
    return format(epoch % 2**EPOCH_BITS, f"0{EPOCH_BITS}b")


class StageAveragerProcess(AveragerCompat):
    """A ``DecentralizedAverager`` owned by its parent; see the module docstring."""

    service_name = "StageAverager"

    def __init__(
        self,
        averaged_tensors: Sequence[torch.Tensor],
        dht,
        *,
        state_source: Callable[[], tuple[object, Sequence[torch.Tensor]]],
        membership: MembershipPolicy | None = None,
        **kwargs,
    ) -> None:
        self._state_source = state_source
        self._membership = membership if membership is not None and membership.private else None
        self._members: set[PeerID] = set()
        self._members_read = -float("inf")
        self._reducers: dict[PeerID, ReducerRecord] = {}  # refusals of their means (monotonic)
        self._round = ""  # the group bits of the round we match for (``set_round``)
        self._bad_sources: dict[PeerID, float] = {}  # state source -> refused until
        self._compression = kwargs.get("compression")
        super().__init__(averaged_tensors, dht, **kwargs)

    def run(self) -> None:
        die_with_parent(self.parent_pid)
        cap_frames()
        # Forked from a parent whose OpenMP pool may be running: a parallel region here can
        # hang. Parts are small (512 KiB); one thread reduces them fast enough.
        torch.set_num_threads(1)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the node, which stops us
        limits.set_default_purpose(limits.AVERAGING)  # but state downloads: see below
        if self._compression is not None:  # our codec decodes its type here, and only here
            use_compression(self._compression)
        super().run()

    async def rpc_download_state(
        self, request: averaging_pb2.DownloadRequest, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.DownloadData]:
        """hivemind's, its bytes counted (and limited) as ``state``."""
        limits.PURPOSE.set(limits.STATE)  # the stream's task
        async for response in super().rpc_download_state(request, context):
            yield response

    async def _load_state_from_peers(
        self, future, timeout: float | None = None, only: list[str] | None = None
    ) -> None:
        limits.PURPOSE.set(limits.STATE)  # this download's task, and the tasks it starts
        return await super()._load_state_from_peers(future, timeout, only)

    def set_round(self, epoch: int, size: int | None) -> None:
        """Match only with peers at ``epoch`` (it becomes the group key's bits), and start
        the all-reduce as soon as ``size`` peers (us included) are in the group rather than
        at the end of the matchmaking time (None: wait for it). Takes effect for the next
        ``step``."""
        self.set_matchmaking(epoch_bits(epoch), size)

    async def _set_matchmaking(self, group_bits: str, target_group_size: int | None) -> None:
        self._round = group_bits  # refusals of one round's means count once
        await super()._set_matchmaking(group_bits, target_group_size)

    def get_current_state(self):
        metadata, tensors = self._state_source()
        return metadata, tensors, None

    def check_part(self, part: torch.Tensor, weight: float) -> str | None:
        """Refuses a part that is not finite or out of range, or a bad weight: hivemind's
        ``rpc_aggregate_part`` then bans that sender from the rest of the round's parts."""
        if not check_weight(weight) or not max_abs(part) <= MAX_ABS_CONTRIBUTION:  # NaN: refused
            return (
                f"a non-finite or out-of-range (> {MAX_ABS_CONTRIBUTION:g}) value, or a bad weight"
            )
        return None

    def reduce_parts(self, parts: list[torch.Tensor], weights: list[float]) -> torch.Tensor:
        """``robust_mean``: a groupmate sending finite but wrong values moves the result by
        a bounded amount (with three or more groupmates); rounded to the parts' grid where
        the ``compression`` says so (``BlockCodec.snap_mean``)."""
        mean = robust_mean(parts, weights)
        snap = getattr(self._compression, "snap_mean", None)
        return mean if snap is None else snap(mean, parts)

    def check_returned(
        self,
        own: ReturnedShare | None,
        shares: dict[PeerID, ReturnedShare],
        weight: float | None = None,
    ) -> dict[PeerID, str]:
        """``protocol.averaging.check_returned`` for each groupmate's share, ``weight``
        our weight's share of the group; each outcome goes to the reducer's
        ``ReducerRecord``, and a refused share is logged and emitted as
        ``averaging.part_rejected``."""
        refused = {}
        now = time.monotonic()
        for reducer, share in shares.items():
            refusal = check_returned(share, own, weight)
            record = self._reducers.setdefault(reducer, ReducerRecord())
            banned = record.reduced(self._round, refusal, now)
            if refusal is None:
                continue
            refused[reducer] = refusal.reason
            logger.warning(
                "discarded the share %s reduced (%s)%s",
                reducer,
                refusal.reason,
                f": it is refused for {REJECTED_S:.0f} s" if banned else "",
            )
            events.emit(
                "averaging.part_rejected",
                reducer=reducer.to_base58(),
                reason=refusal.reason,
                refused=banned,
            )
        for reducer, record in list(self._reducers.items()):  # groupmates of past rounds too
            if record.idle(now) or (
                len(self._reducers) > MAX_REDUCERS and not record.refuses(now)
            ):  # past the cap, the oldest records of a refusal or two go first
                del self._reducers[reducer]
        return refused

    def split_shares(self, clients: list[bool]) -> tuple[float, ...]:
        """Equal shares among the groupmates that reduce (``reducer_shares``)."""
        return reducer_shares(clients)

    async def admits(self, peer: PeerID) -> bool:
        """Whether to average with ``peer``: not a reducer we refused lately, and a member
        of the run (always, in a public run: its record in the DHT must show a valid
        invite). Unknown peers are looked up at most every ``MEMBERS_REFRESH_S``, so a
        flood of strangers costs one DHT read per period."""
        record = self._reducers.get(peer)
        if record is not None:
            now = time.monotonic()
            if record.refuses(now):
                return False
            if record.idle(now):
                del self._reducers[peer]
        if self._membership is None or peer in self._members or peer == self.peer_id:
            return True
        if time.monotonic() - self._members_read >= MEMBERS_REFRESH_S:
            await self._read_members()
        if peer not in self._members:
            logger.warning("refused averaging with %s: not a member of the private run", peer)
            return False
        return True

    async def state_sources(self) -> Container[PeerID] | None:
        """In a private run, the members as the DHT shows them now; else any peer; never
        a reducer we refused lately (its own copy took what it returned), nor a peer whose
        state we refused lately (``refuse_source``)."""
        now = time.monotonic()
        refused = {peer for peer, until in self._bad_sources.items() if until > now}
        refused |= {peer for peer, record in self._reducers.items() if record.refuses(now)}
        if self._membership is None:
            return _AllBut(refused) if refused else None
        await self._read_members()
        return self._members - refused

    def refuse_source(self, peer: str, for_s: float) -> None:
        """Download no state from ``peer`` (base58) for the next ``for_s`` seconds (called
        in the host; taken in the averager's process, in order with the downloads)."""
        self._outer_pipe.send(("_refuse_source", [peer, for_s], {}))

    async def _refuse_source(self, peer: str, for_s: float) -> None:
        until = time.monotonic() + for_s
        self._bad_sources = {p: t for p, t in self._bad_sources.items() if t > time.monotonic()}
        key = PeerID.from_base58(peer)
        self._bad_sources[key] = max(until, self._bad_sources.get(key, until))

    async def _read_members(self) -> None:
        from node.rpc.dht import SwarmDHT  # the run's record reader, here with our policy

        self._members_read = time.monotonic()
        swarm = SwarmDHT(self.dht, self._membership.run)
        swarm.policy = self._membership
        await swarm.refresh_revocations()
        self._membership = swarm.policy
        self._members = {PeerID.from_base58(p.peer_id) for p in await swarm.peers()}


class _AllBut(Container[PeerID]):
    """Every peer but ``excluded``."""

    def __init__(self, excluded: set[PeerID]) -> None:
        self.excluded = excluded

    def __contains__(self, peer: object) -> bool:
        return peer not in self.excluded
