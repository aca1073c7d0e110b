"""Every patch or override of hivemind's internals, written for hivemind 1.1.12 only.

Nothing else in swarmtrain replaces a hivemind function, sets a private attribute of a
hivemind object, or overrides one of its private methods: it goes through this module.
:func:`install` checks the version (``HivemindVersionError`` otherwise) and applies the
process-wide patches, once; the base classes below call it when built. Each entry has a
test in ``tests/unit/test_hivemind_compat.py`` (or ``tests/live/``, where it needs a
daemon) that fails when hivemind's side of it changes.

What is patched or overridden, and why:

- ``P2P.receive_raw_data`` (replaced by ``install``): reads a frame as hivemind does but,
  after :func:`cap_frames`, refuses one whose header declares more than the cap before
  reading its body. hivemind buffers whatever length a peer declares (a 2**62-byte frame
  would grow the reader until it dies); the averager's and the DHT's processes still read
  their streams through hivemind, so they cap them.
- ``P2P._make_process_args`` (wrapped by ``install``): appends the arguments set by
  :func:`p2pd_options` to every ``p2pd`` command line. hivemind has no option to start
  ``p2pd`` with pubsub (``node.rpc.gossip.PUBSUB_FLAGS``).
- ``P2P._UNIX_SOCKET_PREFIX`` (set inside :func:`p2pd_options`): puts the daemon's and the
  client's sockets in a directory of ours, so that they can be removed whatever happens to
  the daemon (one that fails to start leaves its socket in ``/tmp``).
- ``ServicerBase._get_handle_name`` (overridden by :class:`PinnedHandleNames`): names
  handlers after a fixed ``service_name``, not after the concrete class, so that a subclass
  (one that injects faults) serves where its peers call; :meth:`PinnedHandleNames.handle_name`
  is the public form of the rule, for callers that open streams by name.
- ``ServicerBase._collect_rpc_handlers`` and ``_rpc_handlers`` (read by
  :meth:`PinnedHandleNames.rpc_handlers`): the node's services register their own stream
  handlers (with capped frames) from hivemind's list of a service's ``rpc_*`` methods.
- ``DHT._shutdown`` (overridden by :class:`DHTCompat`): within ``DETACH_TIMEOUT_S``, and
  with only our socket removed when ``p2pd`` is already gone (a Ctrl-C reaches the whole
  process group), where hivemind's would wait forever unregistering handlers.
- ``P2P._client.connect`` (called by :func:`connect`): dials a peer at given addresses (a
  relay's ``/p2p-circuit`` address); hivemind's ``P2P`` has no call for it.
- ``DHTNode.protocol.routing_table.uid_to_peer_id`` (read by :func:`routing_table_size`):
  whether a node has reached any peer yet; hivemind has no call for it.
- ``DHTProtocol.client_mode``, ``node_info`` and its handlers, and ``DHT._client_mode``
  (:func:`become_dht_server`): a node joins as a DHT client and turns into a full DHT node
  once peers confirm they can dial it; hivemind fixes the mode at start. In client mode
  ``node_info`` is empty, so peers never add the node to their routing tables.
- ``DHT._client_mode`` (set by :func:`serve_averaging`, also once a client DHT node became
  a full one): averagers read their mode from it when built; a node served through a
  relay keeps a client DHT node but averages as a full peer (others call it through the
  relay).
- ``DHT._parent_pid`` and ``DecentralizedAverager._parent_pid`` (read by ``parent_pid``):
  the child process asks to die with the process that started it.
- ``DecentralizedAverager.run`` (:class:`AveragerCompat`): the child disowns the parent's
  P2P replica it inherits as ``dht._p2p_replica``: hivemind replaces it in the child, and
  when the child collects the inherited object its ``__del__`` removes the *parent's*
  handler socket, after which the parent's ``p2pd`` cannot deliver streams to the parent.
- ``DecentralizedAverager._shutdown`` (:class:`AveragerCompat`): as ``DHT._shutdown``.
- ``Matchmaking.group_key_manager.group_bits``, ``Matchmaking.target_group_size`` and
  ``PotentialLeaders.target_group_size``, through the averager's control pipe
  (``_outer_pipe``; :meth:`AveragerCompat.set_matchmaking`): the group key and the group
  size change between rounds; hivemind sets the size only at construction.
- ``DecentralizedAverager.rpc_join_group``, ``rpc_aggregate_part``, ``rpc_download_state``
  (:class:`AveragerCompat`): refused to a peer that :meth:`AveragerCompat.admits` refuses.
- ``DecentralizedAverager._load_state_from_peers`` and, for one download, this instance's
  ``get_stub`` (:class:`AveragerCompat`): a state download tries only the peers that
  :meth:`AveragerCompat.state_sources` allows, and of those only the ones
  :meth:`AveragerCompat.load_state` names (hivemind tries every peer that declared one,
  highest declared priority first), and its result is (metadata, tensors, source): the
  peer it came from, as the transport knows it (hivemind returns only what the peer sent).
- ``DecentralizedAverager._run_allreduce_inplace_`` (:class:`AveragerCompat`): hivemind's,
  except that a group holding a peer ``admits`` refuses fails, the reducer is
  :class:`ScreenedReducer`, an auxiliary role fails, and a round in which some part came
  back un-averaged (``TensorPartContainer.failed_size``: a groupmate died or timed out while
  reducing it) fails instead of returning a half-averaged result: hivemind fills such
  parts with the local values, and two survivors would then hold different results. It
  also notes when it began (``AveragerCompat.allreduce_began``: where matchmaking ended).
- ``AllReduceRunner.tensor_part_reducer`` (replaced) and ``TensorPartReducer.accumulator``
  (:class:`ScreenedReducer`): a groupmate's part that ``check_part`` refuses is refused
  (``rpc_aggregate_part`` then drops that sender from the rest of the reducer's parts), and
  the parts that pass are reduced by ``reduce_parts``, where hivemind sums them weighted.
- ``TensorPartContainer.register_processed_part`` and ``register_failed_reducer`` (wrapped
  per round by ``_ScreenedRunner``), reading ``_input_parts_by_peer``: the means each
  groupmate returned for its share are summed up against our own parts of it, and once
  all are in, ``check_returned`` may refuse some: the round then fails (our tensors, which
  took the means in place, are written afresh by the next round), given our weight's share
  of the group (``protocol.averaging.weight_share`` of our weight and those the groupmates
  declared to the share we reduced). hivemind applies whatever a reducer returns.
- The ``peer_fractions`` hivemind's ``_aggregate_with_group`` passes to
  ``_run_allreduce_inplace_`` (replaced there by ``split_shares``, from the modes the
  groupmates declared): hivemind splits the vector by the bandwidth each groupmate claims.
- ``Matchmaking._request_join_group`` (wrapped per averager in ``_set_matchmaking``): a
  leader that ``admits`` refuses is skipped, as one that rejected us.
- ``hivemind.compression.serialization._BASE_COMPRESSION_TYPES`` (an entry set by
  :func:`use_compression`, in the averager process): hivemind decodes a received tensor
  by its compression type's entry; a codec of ours takes a type's slot. A part whose shape
  is not the one the reducer expects is refused (:class:`ScreenedReducer`), as a part
  ``check_part`` refuses.
- ``DecentralizedAverager._state_sharing_priority`` (set by
  :meth:`AveragerCompat.set_state_priority_quietly`): the priority the next periodic
  state declaration carries, set without the DHT store that hivemind's setter makes at
  every change (``HivemindTransport.sharing_epoch`` declares at once at most every
  ``DECLARE_EPOCH_S``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import time
from collections.abc import Callable, Collection, Container, Iterator, Sequence
from pathlib import Path

# hivemind recognises stream handlers by typing.AsyncIterator, not collections.abc's.
from typing import AsyncIterator, ClassVar  # noqa: UP035

import hivemind
import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.allreduce import AllReduceRunner, AveragingMode
from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.partition import AllreduceException, TensorPartReducer
from hivemind.compression import CompressionBase
from hivemind.compression import serialization as hivemind_serialization
from hivemind.p2p import P2P, P2PContext, PeerID, ServicerBase
from hivemind.p2p.servicer import RPCHandler
from hivemind.proto import averaging_pb2, dht_pb2, runtime_pb2
from hivemind.utils.asyncio import as_aiter, azip
from hivemind.utils.auth import AuthRole, AuthRPCWrapper
from hivemind.utils.mpfuture import MPFuture
from multiaddr import Multiaddr

from protocol.averaging import ReturnedShare, weight_share

logger = logging.getLogger(__name__)

WRITTEN_FOR = "1.1.12"  # the hivemind version every patch here was checked against
MAX_FRAME_BYTES = 4 * 2**20  # averaging parts are 512 KiB, state chunks 64 KiB
DETACH_TIMEOUT_S = 2.0  # to remove a service's handlers from p2pd on shutdown


class HivemindVersionError(RuntimeError):
    """The installed hivemind is not the version these patches were written for."""


class FrameTooLarge(ValueError):
    """A peer declared a frame larger than the cap set by :func:`cap_frames`."""


def check_version(version: str | None = None) -> None:
    """Raise ``HivemindVersionError`` unless ``version`` (default: the installed
    hivemind's) is ``WRITTEN_FOR``."""
    version = hivemind.__version__ if version is None else version
    if version != WRITTEN_FOR:
        raise HivemindVersionError(
            f"swarmtrain patches hivemind {WRITTEN_FOR}'s internals "
            f"(node/rpc/hivemind_compat.py) but hivemind {version} is installed: install "
            f"hivemind=={WRITTEN_FOR}, or check every patch listed in that module against "
            f"hivemind {version} and its tests (tests/*/test_hivemind_compat.py)"
        )


# The process-wide settings the installed patches read (a forked process inherits them).
_max_frame_bytes: int | None = None
_extra_daemon_args: tuple[str, ...] = ()
_hivemind_make_process_args = P2P.__dict__["_make_process_args"]  # hivemind's, kept


async def _receive_raw_data(reader: asyncio.StreamReader) -> bytes:
    header = await reader.readexactly(P2P.HEADER_LEN)
    length = int.from_bytes(header, P2P.BYTEORDER)
    if _max_frame_bytes is not None and length > _max_frame_bytes:
        raise FrameTooLarge(f"a frame of {length} bytes exceeds the limit of {_max_frame_bytes}")
    return await reader.readexactly(length)


def _make_process_args(*args: object, **kwargs: object) -> list[str]:
    return _hivemind_make_process_args.__func__(*args, **kwargs) + list(_extra_daemon_args)


def install() -> None:
    """Check hivemind's version and apply the process-wide patches (idempotent). Until
    :func:`cap_frames` or :func:`p2pd_options` set something, the patched functions behave
    as hivemind's."""
    check_version()
    P2P.receive_raw_data = staticmethod(_receive_raw_data)
    P2P._make_process_args = staticmethod(_make_process_args)


def use_compression(compression: CompressionBase) -> None:
    """Make ``compression`` the decoder of its ``compression_type`` in this process (and in
    those it forks from now on), in place of hivemind's."""
    name = runtime_pb2.CompressionType.Name(compression.compression_type)
    hivemind_serialization._BASE_COMPRESSION_TYPES[name] = compression


def cap_frames(max_bytes: int | None = MAX_FRAME_BYTES) -> None:
    """From now on, in this process (and those it forks), hivemind's stream reads refuse a
    frame over ``max_bytes`` after its header, unread: the stream fails (hivemind logs it)
    and the process goes on. None reads any frame, as hivemind does."""
    global _max_frame_bytes
    if max_bytes is not None and max_bytes < 1:
        raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
    install()
    _max_frame_bytes = max_bytes


@contextlib.contextmanager
def p2pd_options(
    *, extra_args: Sequence[str] = (), socket_dir: str | None = None
) -> Iterator[None]:
    """Inside, every ``p2pd`` that ``P2P.create`` starts in this process (or in a process
    forked from it, such as hivemind's DHT) gets ``extra_args`` on its command line and,
    if ``socket_dir`` is given, puts its control sockets there. Undone on exit."""
    global _extra_daemon_args
    install()
    args, prefix = _extra_daemon_args, P2P.__dict__["_UNIX_SOCKET_PREFIX"]
    _extra_daemon_args = args + tuple(extra_args)
    if socket_dir is not None:
        P2P._UNIX_SOCKET_PREFIX = f"/unix{socket_dir.rstrip('/')}/"
    try:
        yield
    finally:
        _extra_daemon_args = args
        P2P._UNIX_SOCKET_PREFIX = prefix


def p2pd_running(p2p: P2P) -> bool:
    """Whether the ``p2pd`` that ``p2p`` talks to still listens on its control socket (a
    Ctrl-C in a terminal signals the whole process group, p2pd too: then nothing can be
    announced or unregistered, and waiting for it would hang shutdown)."""
    return Path(p2p.daemon_listen_maddr["unix"]).exists()


async def connect(p2p: P2P, peer: PeerID, maddrs: Sequence[Multiaddr]) -> None:
    """Have ``p2p``'s daemon connect to ``peer`` at ``maddrs`` (and keep them in its
    peerstore); ``P2PDaemonError`` if it could not."""
    await p2p._client.connect(peer, maddrs)


class PinnedHandleNames(ServicerBase):
    """A hivemind servicer whose handlers are named after ``service_name``: hivemind names
    them after the concrete class, so a subclass would serve where no client calls."""

    service_name: ClassVar[str]

    @classmethod
    def handle_name(cls, namespace: str | None, method_name: str) -> str:
        """The name this service's ``method_name`` is served and called under, in
        ``namespace``: ``namespace::service_name.method_name``, hivemind's format."""
        name = f"{cls.service_name}.{method_name}"
        return name if namespace is None else f"{namespace}::{name}"

    @classmethod
    def _get_handle_name(cls, namespace: str | None, method_name: str) -> str:
        return cls.handle_name(namespace, method_name)

    @classmethod
    def rpc_handlers(cls) -> list[RPCHandler]:
        """The service's ``rpc_*`` methods, with their message types and stream sides, as
        hivemind reads them from the type hints (``ServicerBase._collect_rpc_handlers``)."""
        cls._collect_rpc_handlers()
        return list(cls._rpc_handlers)


class _ForkedByHivemind:
    """A hivemind object that runs in a process it forks (``DHT``, ``DecentralizedAverager``):
    installs the patches when built, so that the forked process inherits them."""

    def __init__(self, *args, **kwargs) -> None:
        install()
        super().__init__(*args, **kwargs)

    @property
    def parent_pid(self) -> int:
        """The process that built this object (and forks its process)."""
        return self._parent_pid


class DHTCompat(_ForkedByHivemind, hivemind.DHT):
    """hivemind's DHT process, with a shutdown that cannot hang on a daemon already gone."""

    async def _shutdown(self) -> None:
        p2p = self._node.p2p
        with contextlib.suppress(Exception):
            async with asyncio.timeout(DETACH_TIMEOUT_S):
                await (super()._shutdown() if p2pd_running(p2p) else p2p.shutdown())


async def become_dht_server(_dht: hivemind.DHT, node: hivemind.DHTNode) -> int:
    """Run in the DHT process (``DHT.run_coroutine``): turn a client-mode DHT node into a
    full one, as ``DHTProtocol.create`` builds one (its handlers, and a ``node_info`` that
    carries its id, so that peers it talks to add it to their routing tables), then ping
    the peers it knows so they add it now. Returns how many it pinged (0 if it was a full
    node already)."""
    protocol = node.protocol
    if not protocol.client_mode:
        return 0
    servicer = AuthRPCWrapper(protocol, AuthRole.SERVICER, protocol.authorizer)
    await protocol.add_p2p_handlers(protocol.p2p, servicer)
    protocol.node_info = dht_pb2.NodeInfo(node_id=node.node_id.to_bytes())
    protocol.client_mode = False
    known = list(protocol.routing_table.peer_id_to_uid)
    await asyncio.gather(*(protocol.call_ping(peer) for peer in known))
    return len(known)


def serve_averaging(dht: hivemind.DHT) -> None:
    """In the process that built ``dht``: averagers built from now on accept requests from
    peers (they are not in client mode), whatever the DHT node's own mode."""
    dht._client_mode = False


async def routing_table_size(_dht: hivemind.DHT, node: hivemind.DHTNode) -> int:
    """Run in the DHT process (``DHT.run_coroutine``): how many peers its routing table
    holds."""
    return len(node.protocol.routing_table.uid_to_peer_id)


class _Collected:
    """Stands in for hivemind's running sum of one part (``TensorPartReducer.accumulator``):
    keeps each sender's part and weight, and where hivemind divides the sum by the summed
    weights, returns ``reduce`` of them instead."""

    def __init__(
        self, shape: torch.Size, reduce: Callable[[list[torch.Tensor], list[float]], torch.Tensor]
    ) -> None:
        self.shape = shape
        self.reduce = reduce
        self.parts: list[torch.Tensor] = []
        self.weights: list[float] = []

    def add_(self, tensor: torch.Tensor, alpha: float = 1.0) -> _Collected:
        self.parts.append(tensor)
        self.weights.append(alpha)
        return self

    def div_(self, denominator: float) -> torch.Tensor:
        if not denominator > 0:  # no sender, or all of weight 0: NaN, as hivemind's sum / 0
            return torch.full(self.shape, float("nan"))  # would give; the round then fails
        return self.reduce(self.parts, self.weights)


class ScreenedReducer(TensorPartReducer):
    """hivemind's reducer of one peer's share of the parts, with the averager's screen:
    ``check_part`` may refuse a groupmate's part (not ``local``'s, our own), and the parts
    that pass are reduced by ``reduce_parts``."""

    def __init__(
        self,
        part_shapes: Sequence[torch.Size],
        num_senders: int,
        local: int | None,
        screen: AveragerCompat,
    ) -> None:
        self.local = local
        self.screen = screen
        self.declared: dict[int, float] = {}  # sender -> the weight it declared (accepted)
        super().__init__(part_shapes, num_senders)

    def reset_accumulators(self) -> None:
        super().reset_accumulators()
        if not self.finished.is_set():
            shape = self.part_shapes[self.current_part_index]
            self.accumulator = _Collected(shape, self.screen.reduce_parts)

    async def accumulate_part(
        self, sender_index: int, part_index: int, tensor_part: torch.Tensor, weight: float = 1.0
    ) -> torch.Tensor:
        expected = self.part_shapes[part_index] if 0 <= part_index < len(self.part_shapes) else None
        if tensor_part.shape != expected:
            raise AllreduceException(
                f"sender {sender_index}, part {part_index}: shape {tuple(tensor_part.shape)}, "
                f"expected {None if expected is None else tuple(expected)}"
            )
        if sender_index != self.local:
            refused = self.screen.check_part(tensor_part, weight)
            if refused is not None:
                raise AllreduceException(f"sender {sender_index}, part {part_index}: {refused}")
            self.declared.setdefault(sender_index, weight)
        return await super().accumulate_part(sender_index, part_index, tensor_part, weight)


class _ScreenedRunner(AllReduceRunner):
    def __init__(self, *, screen: AveragerCompat, **kwargs) -> None:
        super().__init__(**kwargs)
        plain = self.tensor_part_reducer
        local = self.sender_peer_ids.index(self.peer_id) if self.peer_id in self else None
        self.tensor_part_reducer = ScreenedReducer(
            plain.part_shapes, plain.num_senders, local, screen
        )
        plain.finished.set()  # unused: keeps it from warning about missing parts when collected
        self.returned: dict[PeerID, ReturnedShare] = {}  # what each reducer returned
        self._failed: set[int] = set()
        container = self.tensor_part_container
        self._register_part = container.register_processed_part
        self._register_failed = container.register_failed_reducer
        container.register_processed_part = self._sum_returned_part
        container.register_failed_reducer = self._reducer_failed

    def _sum_returned_part(self, peer_index: int, part_index: int, delta: torch.Tensor) -> None:
        """Add a part a groupmate (or we) reduced to its share's sums: our part (intact:
        our tensor takes its average in place only once all its parts are in) and the
        mean (ours plus the delta it sent)."""
        if peer_index not in self._failed:
            mine = self.tensor_part_container._input_parts_by_peer[peer_index][part_index][0]
            reducer = self.ordered_peer_ids[peer_index]
            share = self.returned.setdefault(reducer, ReturnedShare())
            share.add(mine, mine.float() + delta.float())
        self._register_part(peer_index, part_index, delta)

    def our_weight_share(self) -> float | None:
        """Our weight's share of the group, from the weights the other senders declared to
        the share we reduced (None: we reduced none, or no part carries weight)."""
        reducer = self.tensor_part_reducer
        if reducer.local is None or not reducer.declared:
            return None
        return weight_share(self.weight, list(reducer.declared.values()))

    def _reducer_failed(self, peer_index: int) -> None:
        self._failed.add(peer_index)  # the rest of its share is ours, unaveraged
        self.returned.pop(self.ordered_peer_ids[peer_index], None)
        self._register_failed(peer_index)


class _Downloaded:
    """What hivemind's ``_load_state_from_peers`` hands its future: (metadata, tensors) of
    the last peer it asked, or None."""

    def __init__(self) -> None:
        self.result: tuple[object, object] | None = None
        self._done = False

    def set_result(self, result: tuple[object, object] | None) -> None:
        self.result, self._done = result, True

    def done(self) -> bool:
        return self._done


class AveragerCompat(_ForkedByHivemind, PinnedHandleNames, DecentralizedAverager):
    """hivemind's ``DecentralizedAverager`` with the overrides listed in the module
    docstring. A subclass decides through ``admits``, ``state_sources``, ``check_part``,
    ``reduce_parts``, ``check_returned`` and ``split_shares`` (which run in the averager's
    process); the defaults behave as hivemind."""

    def __init__(self, *args, **kwargs) -> None:
        # Shared with the forked process, which writes it (``allreduce_began``).
        self._allreduce_began = multiprocessing.Value("d", 0.0, lock=False)
        super().__init__(*args, **kwargs)

    @property
    def allreduce_began(self) -> float:
        """When the latest all-reduce of this averager began (its group was formed), in
        ``time.monotonic`` seconds (one clock for every process of the machine); 0 before
        the first. Read from any process."""
        return self._allreduce_began.value

    def set_state_priority_quietly(self, value: float) -> None:
        """Set the priority that this averager's next periodic state declaration carries
        (every ``declare_state_period``), without declaring it now: hivemind's
        ``state_sharing_priority`` setter stores a declaration in the DHT at every change.
        Any process may call it."""
        self._state_sharing_priority.value = value

    async def admits(self, peer: PeerID) -> bool:
        """Whether to join, aggregate and share state with ``peer``."""
        return True

    async def state_sources(self) -> Container[PeerID] | None:
        """The peers a state download may use (None: any that declared a state)."""
        return None

    def check_part(self, part: torch.Tensor, weight: float) -> str | None:
        """Why a groupmate's part (with its weight) is refused, or None to accept it."""
        return None

    def reduce_parts(self, parts: list[torch.Tensor], weights: list[float]) -> torch.Tensor:
        """The average of one part from the parts accepted and their weights (> 0 in sum)."""
        total = sum(weights)
        return sum(p * (w / total) for p, w in zip(parts, weights, strict=True))

    def check_returned(
        self,
        own: ReturnedShare | None,
        shares: dict[PeerID, ReturnedShare],
        weight: float | None = None,
    ) -> dict[PeerID, str]:
        """The groupmates whose returned means (``shares``: sums over each one's share;
        ``own``: over the share we reduced, if any) are refused, and why; ``weight``: our
        weight's share of the group (None: unknown)."""
        return {}

    def split_shares(self, clients: list[bool]) -> Sequence[float] | None:
        """Each groupmate's share of the vector to reduce (``clients``: those that declared
        client mode), or None for hivemind's split by the bandwidths the groupmates claim."""
        return None

    def set_matchmaking(self, group_bits: str, target_group_size: int | None) -> None:
        """From the next ``step`` on, match under ``group_bits`` and start the all-reduce
        as soon as ``target_group_size`` peers (us included) are in the group (None: at the
        end of the matchmaking time). Control messages are handled in order."""
        if not all(bit in "01" for bit in group_bits):
            raise ValueError(f"group bits must be 0s and 1s, got {group_bits!r}")
        self._outer_pipe.send(("_set_matchmaking", [group_bits, target_group_size], {}))

    async def _set_matchmaking(self, group_bits: str, target_group_size: int | None) -> None:
        matchmaking = self._matchmaking
        if "_request_join_group" not in vars(matchmaking):  # once: leaders we refuse are skipped
            plain_request = matchmaking._request_join_group

            async def screened_request(leader: PeerID) -> GroupInfo | None:
                if not await self.admits(leader):
                    return None  # as a leader that rejected us: try the next one
                return await plain_request(leader)

            matchmaking._request_join_group = screened_request
        self._matchmaking.group_key_manager.group_bits = group_bits
        self._matchmaking.target_group_size = target_group_size
        self._matchmaking.potential_leaders.target_group_size = target_group_size

    def run(self) -> None:
        inherited = getattr(self.dht, "_p2p_replica", None)
        if inherited is not None:
            inherited._client_listen_maddr = None  # the parent's socket file: not ours to remove
        super().run()

    async def _shutdown(self, timeout: float | None) -> None:
        if p2pd_running(self._p2p):
            try:
                async with asyncio.timeout(DETACH_TIMEOUT_S):
                    await super()._shutdown(timeout)
            except Exception as e:  # the process must exit all the same
                logger.debug("averager shutdown: %r", e)
        await self._p2p.shutdown()  # removes our own handler socket file

    async def rpc_join_group(
        self, request: averaging_pb2.JoinRequest, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.MessageFromLeader]:
        if not await self.admits(context.remote_id):
            yield averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        async for response in super().rpc_join_group(request, context):
            yield response

    async def rpc_aggregate_part(
        self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        if not await self.admits(context.remote_id):
            yield averaging_pb2.AveragingData(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        async for response in super().rpc_aggregate_part(stream, context):
            yield response

    async def rpc_download_state(
        self, request: averaging_pb2.DownloadRequest, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.DownloadData]:
        if not await self.admits(context.remote_id):
            return
        async for response in super().rpc_download_state(request, context):
            yield response

    def load_state(self, timeout_s: float, *, only: Collection[str] | None = None) -> MPFuture:
        """hivemind's ``load_state_from_peers(wait=False)``, asking only the peers in
        ``only`` (base58) if given; the future's result is (metadata, tensors, source)."""
        future = MPFuture()
        peers = None if only is None else list(only)
        self._outer_pipe.send(
            ("_load_state_from_peers", [], dict(timeout=timeout_s, future=future, only=peers))
        )
        return future

    async def _load_state_from_peers(
        self, future, timeout: float | None = None, only: list[str] | None = None
    ) -> None:
        sources = await self.state_sources()
        wanted = None if only is None else {PeerID.from_base58(p) for p in only}
        plain_stub = self.get_stub
        asked: list[PeerID] = []

        def screened_stub(p2p: P2P, peer: PeerID, *, namespace: str | None = None):
            # hivemind logs what this raises and tries the next peer
            if (sources is not None and peer not in sources) or (
                wanted is not None and peer not in wanted
            ):
                raise PermissionError(f"{peer} is not a state source of this download")
            asked.append(peer)
            return plain_stub(p2p, peer, namespace=namespace)

        got = _Downloaded()
        self.get_stub = screened_stub  # this instance only, for this download
        try:
            await super()._load_state_from_peers(got, timeout)
        finally:
            del self.get_stub
            if not future.done():
                found = got.result if asked else None
                future.set_result(None if found is None else (*found, asked[-1].to_base58()))

    async def _run_allreduce_inplace_(
        self,
        tensors: Sequence[torch.Tensor],
        group_info: GroupInfo,
        group_id: bytes | None = None,
        **kwargs,
    ) -> None:
        self._allreduce_began.value = time.monotonic()
        group_id = group_info.group_id if group_id is None else group_id
        for peer in group_info.peer_ids:
            if not await self.admits(peer):
                raise AllreduceException(f"the group includes {peer}, which this averager refuses")
        modes = [AveragingMode(self.serializer.loads(g)[1]) for g in group_info.gathered]
        shares = self.split_shares([m == AveragingMode.CLIENT for m in modes])
        if shares is not None:
            kwargs["peer_fractions"] = tuple(shares)
        runner = _ScreenedRunner(
            screen=self,
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
            raise AllreduceException("this averager never runs as an auxiliary peer")
        async for tensor, update in azip(as_aiter(*tensors), runner):
            tensor.add_(update)  # averaging_alpha is 1
        own = runner.returned.pop(self.peer_id, None)
        refused = self.check_returned(own, runner.returned, runner.our_weight_share())
        if refused:
            reducers = ", ".join(f"{peer} ({why})" for peer, why in refused.items())
            raise AllreduceException(f"refused the means returned by {reducers}")
        failed = runner.tensor_part_container.failed_size
        if failed:
            total = runner.tensor_part_container.total_size
            raise AllreduceException(
                f"{failed} of {total} values came back un-averaged (a groupmate failed)"
            )
