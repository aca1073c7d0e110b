"""hivemind's ``DecentralizedAverager`` as a stage uses it: one child process per stage.

What the subclasses change in hivemind's behaviour:

- handlers are served under a fixed name (hivemind names them after the concrete class,
  so a subclass, e.g. one that injects faults, would not reach the others);
- the process dies with its parent (``prctl(PR_SET_PDEATHSIG, SIGKILL)``, as the node's
  DHT process does) and ignores SIGINT (the node stops it with ``shutdown``);
- it disowns the parent's P2P replica it inherits: hivemind's averager replaces
  ``dht._p2p_replica`` in the child, and when the child collects the inherited object, its
  ``__del__`` removes the *parent's* handler socket file, after which the parent's p2pd can
  no longer deliver incoming streams (the stage server's RPCs) to the parent. Measured:
  a child that drops and collects it removes the file; with this change it stays;
- a reducer drops a groupmate that sends a non-finite or wildly out-of-range part, or a
  bad weight, from the parts it averages (hivemind would average the NaN into everyone's
  result);
- in a private run, it averages with members only: it refuses to admit, aggregate for,
  or send its state to a peer whose DHT record shows no valid invite, and fails a round
  whose group includes one (a non-member leader may have gathered members around it);
- a round in which some part came back un-averaged (a groupmate died or timed out while
  reducing it) fails instead of returning a half-averaged result: hivemind fills such
  parts with the local values, and two survivors would then hold different results.

It also lets the host key each round by its epoch and set the group size it expects
(``set_round``): peers at different epochs never average together, and a leader starts
the all-reduce as soon as the stage's peers are in, not at the end of the matchmaking
time. The host side answers state downloads through ``state_source``
(hivemind calls it on a background thread of the host process).
"""

from __future__ import annotations

import asyncio
import logging
import math
import signal
import time
from collections.abc import Callable, Sequence

# hivemind recognises stream handlers by typing.AsyncIterator, not collections.abc's.
from typing import AsyncIterator  # noqa: UP035

import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.allreduce import AllReduceRunner, AveragingMode
from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.partition import AllreduceException, TensorPartReducer
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils.asyncio import as_aiter, azip

from node.rpc.child_process import die_with_parent
from node.rpc.frame_cap import cap_hivemind_frames
from node.rpc.service import DETACH_TIMEOUT_S, p2pd_running
from protocol.averaging import MAX_ABS_CONTRIBUTION, check_weight, robust_mean
from protocol.membership import MembershipPolicy

logger = logging.getLogger(__name__)

MEMBERS_REFRESH_S = 2.0  # a peer we do not know yet is looked up at most this often

EPOCH_BITS = 16  # epochs that differ by a multiple of 2**16 share a group key


def epoch_bits(epoch: int) -> str:
    """The group key bits of an epoch: peers at different epochs never meet."""
    return format(epoch % 2**EPOCH_BITS, f"0{EPOCH_BITS}b")


class _Collected:
    """Stands in for hivemind's running sum of one part: keeps each sender's part and
    weight, and where hivemind divides the sum by the summed weights, reduces them with
    ``robust_mean`` instead."""

    def __init__(self, shape: torch.Size) -> None:
        self.shape = shape
        self.parts: list[torch.Tensor] = []
        self.weights: list[float] = []

    def add_(self, tensor: torch.Tensor, alpha: float = 1.0) -> _Collected:
        self.parts.append(tensor)
        self.weights.append(alpha)
        return self

    def div_(self, denominator: float) -> torch.Tensor:
        if not denominator > 0:  # no sender, or all of weight 0: NaN, as hivemind's sum / 0
            return torch.full(self.shape, math.nan)  # would give; the round is then dropped
        return robust_mean(self.parts, self.weights)


class _FiniteReducer(TensorPartReducer):
    """Refuses a groupmate's part that is not finite (or comes with a bad weight): the
    caller, hivemind's ``rpc_aggregate_part``, then bans that sender from the rest of this
    reducer's parts. Our own parts (``local``) were checked before the round. The parts
    that pass are reduced by ``robust_mean``: a groupmate sending finite but wrong values
    moves the result by a bounded amount (with three or more groupmates)."""

    def __init__(self, part_shapes, num_senders: int, local: int | None) -> None:
        super().__init__(part_shapes, num_senders)
        self.local = local

    def reset_accumulators(self) -> None:
        super().reset_accumulators()
        if not self.finished.is_set():
            self.accumulator = _Collected(self.part_shapes[self.current_part_index])

    async def accumulate_part(
        self, sender_index: int, part_index: int, tensor_part: torch.Tensor, weight: float = 1.0
    ) -> torch.Tensor:
        if sender_index != self.local and (
            not check_weight(weight)
            or not bool(torch.isfinite(tensor_part).all())
            or (tensor_part.numel() and float(tensor_part.abs().max()) > MAX_ABS_CONTRIBUTION)
        ):
            raise AllreduceException(
                f"sender {sender_index} sent part {part_index} with a non-finite or "
                f"out-of-range (> {MAX_ABS_CONTRIBUTION:g}) value, or a bad weight"
            )
        return await super().accumulate_part(sender_index, part_index, tensor_part, weight)


class _CheckedAllReduceRunner(AllReduceRunner):
    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        plain = self.tensor_part_reducer
        local = self.sender_peer_ids.index(self.peer_id) if self.peer_id in self else None
        self.tensor_part_reducer = _FiniteReducer(plain.part_shapes, plain.num_senders, local)
        plain.finished.set()  # unused: keeps it from warning about missing parts when collected


class StageAveragerProcess(DecentralizedAverager):
    """A ``DecentralizedAverager`` owned by its parent; see the module docstring."""

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
        super().__init__(averaged_tensors, dht, **kwargs)

    @classmethod
    def _get_handle_name(cls, namespace: str | None, method_name: str) -> str:
        # hivemind names handlers after the concrete class: pin the name, so that a subclass
        # (one that injects faults) speaks to the others. The wire format is hivemind's.
        name = f"StageAverager.{method_name}"
        return name if namespace is None else f"{namespace}::{name}"

    def run(self) -> None:
        die_with_parent(self._parent_pid)
        cap_hivemind_frames()
        # Forked from a parent whose OpenMP pool may be running: a parallel region here can
        # hang. Parts are small (512 KiB); one thread reduces them fast enough.
        torch.set_num_threads(1)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the node, which stops us
        inherited = getattr(self.dht, "_p2p_replica", None)
        if inherited is not None:
            inherited._client_listen_maddr = None  # the parent's socket file: not ours to remove
        super().run()

    async def _shutdown(self, timeout: float | None) -> None:
        # p2pd may be gone already (Ctrl-C reaches the whole process group): removing our
        # handlers then fails or never returns, and the process must still exit.
        if p2pd_running(self._p2p):
            try:
                async with asyncio.timeout(DETACH_TIMEOUT_S):
                    await super()._shutdown(timeout)
            except Exception as e:
                logger.debug("averager shutdown: %s", e)
        await self._p2p.shutdown()  # removes our own handler socket file

    def set_round(self, epoch: int, size: int | None) -> None:
        """Match only with peers at ``epoch`` (it becomes the group key's bits), and start
        the all-reduce as soon as ``size`` peers (us included) are in the group rather than
        at the end of the matchmaking time (None: wait for it). Takes effect for the next
        ``step``: messages on the control pipe are handled in order."""
        self._outer_pipe.send(("_set_round", [epoch_bits(epoch), size], {}))

    async def _set_round(self, bits: str, size: int | None) -> None:
        self._matchmaking.group_key_manager.group_bits = bits
        self._matchmaking.target_group_size = size
        self._matchmaking.potential_leaders.target_group_size = size

    def get_current_state(self):
        metadata, tensors = self._state_source()
        return metadata, tensors, None

    async def _admits(self, peer: PeerID) -> bool:
        """Whether ``peer`` is a member of the run (always, in a public run): its record in
        the DHT must show a valid invite. Unknown peers are looked up at most every
        ``MEMBERS_REFRESH_S``, so a flood of strangers costs one DHT read per period."""
        if self._membership is None or peer in self._members or peer == self.peer_id:
            return True
        if time.monotonic() - self._members_read >= MEMBERS_REFRESH_S:
            await self._read_members()
        if peer not in self._members:
            logger.warning("refused averaging with %s: not a member of the private run", peer)
            return False
        return True

    async def _read_members(self) -> None:
        from node.rpc.dht import SwarmDHT  # the run's record reader, here with our policy

        self._members_read = time.monotonic()
        swarm = SwarmDHT(self.dht, self._membership.run)
        swarm.policy = self._membership
        await swarm.refresh_revocations()
        self._membership = swarm.policy
        self._members = {PeerID.from_base58(p.peer_id) for p in await swarm.peers()}

    async def _load_state_from_peers(self, future, timeout: float | None = None):
        """hivemind's download, from members only: it tries the peers that declared a
        state one by one and moves on from any whose stub raises."""
        if self._membership is None:
            return await super()._load_state_from_peers(future, timeout)
        await self._read_members()
        members, plain_stub = set(self._members), self.get_stub

        def members_only_stub(p2p, peer, *, namespace=None):
            if peer not in members:
                raise PermissionError(f"{peer} is not a member of the private run")
            return plain_stub(p2p, peer, namespace=namespace)

        self.get_stub = members_only_stub  # this instance only, for this download
        try:
            return await super()._load_state_from_peers(future, timeout)
        finally:
            del self.get_stub

    async def rpc_join_group(
        self, request: averaging_pb2.JoinRequest, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.MessageFromLeader]:
        if not await self._admits(context.remote_id):
            yield averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        async for response in super().rpc_join_group(request, context):
            yield response

    async def rpc_aggregate_part(
        self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        if not await self._admits(context.remote_id):
            yield averaging_pb2.AveragingData(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        async for response in super().rpc_aggregate_part(stream, context):
            yield response

    async def rpc_download_state(
        self, request: averaging_pb2.DownloadRequest, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.DownloadData]:
        if not await self._admits(context.remote_id):
            return  # the stage's state is the run's: members only
        async for response in super().rpc_download_state(request, context):
            yield response

    async def _run_allreduce_inplace_(
        self,
        tensors: Sequence[torch.Tensor],
        group_info: GroupInfo,
        group_id: bytes | None = None,
        **kwargs,
    ) -> None:
        # hivemind's own, with the checked runner and the failed-part check (no auxiliary
        # peers here, and averaging_alpha is 1).
        group_id = group_info.group_id if group_id is None else group_id
        for peer in group_info.peer_ids:
            if not await self._admits(peer):
                raise AllreduceException(f"the group includes {peer}, not a member of the run")
        runner = _CheckedAllReduceRunner(
            p2p=self._p2p,
            servicer_type=type(self),
            prefix=self.prefix,
            tensors=tensors,
            group_id=group_id,
            ordered_peer_ids=group_info.peer_ids,
            **kwargs,
        )
        self._running_groups[group_id].set_result(runner)
        if runner.modes[group_info.peer_ids.index(self.peer_id)] == AveragingMode.AUX:
            raise AllreduceException("a stage averager never runs as an auxiliary peer")
        async for tensor, update in azip(as_aiter(*tensors), runner):
            tensor.add_(update)
        failed = runner.tensor_part_container.failed_size
        if failed:
            total = runner.tensor_part_container.total_size
            raise AllreduceException(
                f"{failed} of {total} values came back un-averaged (a groupmate failed)"
            )
