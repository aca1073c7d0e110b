"""The node daemon's lifecycle: join -> measure -> announce -> take a stage -> serve -> leave.

``Node`` owns every background task it starts (an ``asyncio.TaskGroup``); ``run`` returns
only after they are all cancelled and awaited, and ``close`` announces the departure and
stops the DHT (and its ``p2pd``) so that nothing outlives the node.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import time
import zlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

import psutil
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hivemind.p2p import P2P, PeerID
from hivemind.utils import get_dht_time

from models.data import Corpus
from models.pretrained import Checkpoint, load_into, load_stage_state, verify_files
from models.stages import Stage
from models.training import StageOptimizer
from node import events, limits
from node.averaging.averager import AveragedStageServer, StageAverager
from node.cli.args import DEFAULT_OWNER_KEY
from node.daemon import checkpoint
from node.daemon.archive import Archive
from node.daemon.join import (
    Joined,
    NodeError,
    join_run,
    member_invite,
    owned_spec,
    owner_key_of,
)
from node.daemon.relay_keeper import CHOOSE_WAIT_S, RelayKeeper
from node.daemon.watch import Heartbeat, Members
from node.dashboard.address import DEFAULT as DEFAULT_DASHBOARD
from node.dashboard.address import parse_address
from node.dashboard.server import Dashboard
from node.dashboard.snapshot import snapshot_of
from node.data import token_stream, training_data
from node.files import (
    default_identity_path,
    load_or_create_identity,
    load_or_create_key,
    write_atomic,
)
from node.measure.bandwidth import (
    BandwidthError,
    BandwidthProbe,
    advertised,
    measure_bandwidth,
    partners,
)
from node.measure.capacity import Device, free_memory, pick_device, stage_memory, stage_throughputs
from node.pipeline.server import StageServer
from node.pipeline.trainer import MicroBatchResult, Trainer, TrainerError, TrainerSettings
from node.placement.driver import Placement
from node.rpc.dht import SwarmDHT
from node.rpc.gossip import GossipUnavailable
from node.rpc.membership import MembershipGate
from node.rpc.reach import DialBack, check_reachability, shuffled
from node.rpc.relay import RelaySettings, connect_relayed
from node.rpc.service import BAN_AFTER, BAN_S, BAN_WINDOW_S, p2pd_running
from protocol.admission import AdmissionLimits, InFlight
from protocol.announce import ANNOUNCE_PERIOD_S, announcement_of
from protocol.assignment import Params
from protocol.data_split import TokenRange, share_of
from protocol.identity import peer_id_of
from protocol.membership import MembershipError
from protocol.ownership import check_run_id
from protocol.reachability import (
    Reachability,
    dial_target,
    relay_peer_id,
    relayed_throughput,
)
from protocol.records import PROTOCOL_VERSION, PeerInfo, PeerState, RecordError
from protocol.routing import BanList
from protocol.run_spec import RunSpec, SignedSpec, make_run_spec, read_spec_file
from protocol.stage_messages import StageContract

logger = logging.getLogger(__name__)

SPEC_REFRESH_S = 300.0
REVOCATIONS_REFRESH_S = 10.0
TRAIN_PAUSE_S = 10.0  # a node's trainer that cannot go on waits this long to try again
HEARTBEAT_S = 60.0  # a serving node logs that it is alive, and what it did, this often
P2PD_GONE_GRACE_S = 2.0  # a stop signal that also stopped p2pd arrives within this
REACHABILITY_RECHECK_S = 10.0  # while no peer could tell whether this node is reachable
MEMBERS_CHECK_S = 5.0  # how often the node reads the run's peers to log who joined or left
TRAIN_EVENT_EVERY = 10  # micro-batches between two ``train.progress`` events


@dataclass(frozen=True)
class NodeSettings:
    run: str  # a run id (NAME@FINGERPRINT), or a new public run's NAME
    initial_peers: tuple[str, ...] = ()
    host_maddrs: tuple[str, ...] = ("/ip4/0.0.0.0/tcp/0",)
    announce_maddrs: tuple[str, ...] = ()
    # Whether peers can dial this node: "auto" asks them; "yes" and "no" take the
    # operator's word (a forwarded port known to work; a host behind a local proxy, where
    # peers see every connection come from the proxy).
    reachable: Literal["auto", "yes", "no"] = "auto"
    # The relay this node offers, and whether it serves through one when not reachable.
    relay: RelaySettings = RelaySettings()
    identity: Path | None = None  # default: ~/.swarmtrain/<run>/identity.key
    device: str = "auto"
    stage: int | None = None  # pin a stage instead of choosing one (a pinned node never moves)
    second_stage: int | None = None  # with ``stage``: pin a second stage it serves as well
    # A node that chooses its stage also takes a second one when the run's rule asks for
    # more two-stage peers (protocol.assignment.second_stage); False: never (it needs the
    # memory of two stages, and trains and averages both).
    two_stage: bool = True
    rebalance: bool = True  # move to another stage when that raises the swarm's bottleneck
    rebalance_period_s: float = 60.0  # mean time between rebalancing checks
    spec_file: Path | None = None  # the run's signed spec (``swarmtrain run create``)
    invite: str | None = None  # private runs: the invite token from the run's owner
    # Runs started from a Hugging Face checkpoint: this machine's copy of it.
    pretrained: Path | None = None
    # Runs with sharded data (``RunSpec.dataset``): this machine's copy of the shards.
    data: Path | None = None
    owner_key: Path | None = None  # default: ~/.swarmtrain/owner.key
    # Used only by the node that starts a new public run by name: the run's spec.
    preset: str = "tiny"
    n_stages: int = 2
    compression: str = "none"
    update_period_s: float = 5.0  # records expire after 3 periods without a refresh
    throughput: float | None = None  # declared samples/s for every stage (skips measuring)
    remeasure: bool = False  # measure throughput again instead of using the cached figures
    bandwidth_mbps: float | None = None  # declared up and down
    # What the volunteer lets the node take (None: no limit): Mbit/s sent and received
    # (``node.limits``; the record advertises no more), and bytes of memory for its stages.
    max_upload_mbps: float | None = None
    max_download_mbps: float | None = None
    max_memory: int | None = None
    cache_dir: Path | None = field(default_factory=lambda: Path("~/.cache/swarmtrain").expanduser())
    spec_timeout_s: float = 30.0
    train: bool = True  # run a trainer loop alongside the stage
    # Where the held stages are checkpointed (default: beside the identity key, per peer
    # id), and how often; 0: never (a clean stop still writes one).
    checkpoint_dir: Path | None = None
    checkpoint_every_s: float = 300.0
    archive: Path | None = None  # an archive node: serves no stage, keeps all of them here
    events: Path | None = None  # the structured event log (default: in the run's folder)
    dashboard: str = DEFAULT_DASHBOARD  # HOST:PORT, PORT, "auto" or "off" (node.dashboard)
    heartbeat_s: float = HEARTBEAT_S
    trainer: TrainerSettings = field(default_factory=lambda: TrainerSettings(in_flight=2))
    # Caps on stage requests in flight and how fast they must arrive (protocol.admission).
    limits: AdmissionLimits = field(default_factory=AdmissionLimits)

    @property
    def record_ttl_s(self) -> float:
        return 3 * self.update_period_s

    def identity_path(self) -> Path:
        return self.identity or default_identity_path(self.run)

    def checkpoint_root(self, peer_id: str) -> Path:
        """Beside the run's default identity, a folder per peer id (nodes that share a
        home keep their checkpoints apart)."""
        root = default_identity_path(self.run).parent / "checkpoints" / peer_id
        return self.checkpoint_dir or root

    def events_path(self, peer_id: str) -> Path:
        """The node's JSON-lines event log (``node.events``): ``--events``, or beside the
        run's default identity, one file per peer id."""
        root = default_identity_path(self.run).parent / "events"
        return self.events or root / f"{peer_id}.jsonl"

    def log_path(self, peer_id: str) -> Path:
        """The node's rotating log file (``node.logs``): beside ``--events`` when that is
        given, else in the run's folder, one file per peer id."""
        if self.events is not None:
            return self.events.with_suffix(".log")
        return default_identity_path(self.run).parent / "logs" / f"{peer_id}.log"

    def owner_key_path(self) -> Path:
        return (self.owner_key or DEFAULT_OWNER_KEY).expanduser()


def resolve_run(settings: NodeSettings) -> tuple[str, SignedSpec | None]:
    """The run's id, and its signed spec when this node brings it (a spec file, or a new
    public run by name, signed with this machine's owner key). A run started by name
    keeps the spec it was created with (``join.owned_spec``): restarting it with
    other settings is refused, since a run's spec never changes."""
    if settings.spec_file is not None:
        try:
            signed = read_spec_file(settings.spec_file.read_text())
        except (OSError, RecordError) as e:
            raise NodeError(f"cannot use spec file {settings.spec_file}: {e}") from None
        if settings.run not in ("", signed.spec.run):
            raise NodeError(f"--run {settings.run} but the spec file is for {signed.spec.run}")
        return signed.spec.run, signed
    if "@" in settings.run:
        return settings.run, None  # the spec comes from the DHT
    if settings.initial_peers:
        check_run_id(settings.run)  # joining: the run's id, not a name
    owner_key = load_or_create_key(settings.owner_key_path())
    owner = peer_id_of(owner_key.public_key())
    spec = make_run_spec(
        settings.run,
        settings.preset,
        settings.n_stages,
        owner=owner,
        compression=settings.compression,
    )
    try:
        return spec.run, owned_spec(settings.owner_key_path(), owner_key, spec)
    except ValueError as e:
        raise NodeError(str(e)) from None


def pretrained_copy(spec: RunSpec, directory: Path | None) -> Checkpoint | None:
    """This machine's copy of the checkpoint ``spec`` starts from, its files checked
    against the spec's hashes; None for a run that starts from seeded weights. ``NodeError``
    naming the flag to give, or the file that is missing or differs."""
    pinned = spec.pretrained
    if pinned is None:
        if directory is not None:
            logger.warning("--pretrained %s: run %s starts from no checkpoint", directory, spec.run)
        return None
    if directory is None:
        raise NodeError(
            f"run {spec.run} starts from a {pinned.architecture} checkpoint: give this "
            f"machine's copy of it with --pretrained DIR ({', '.join(sorted(pinned.files))})"
        )
    directory = directory.expanduser()
    logger.info("checking the checkpoint in %s against the run's hashes", directory)
    try:
        verify_files(directory, pinned.files)
    except ValueError as e:
        raise NodeError(f"--pretrained: {e}") from None
    return Checkpoint(directory, pinned.architecture, spec.model, pinned.tied, dict(pinned.files))


@dataclass(frozen=True)
class MachineFacts:
    """What a node finds out about its machine at start, without asking any peer."""

    pretrained: Checkpoint | None  # this machine's copy of the run's checkpoint, checked
    device: Device
    throughput: tuple[float, ...]  # samples/s per stage: declared, cached or measured
    corpus: Corpus | None  # the training data (None: the node does not train)
    seconds: float  # how long finding all this out took


def examine_machine(settings: NodeSettings, spec: RunSpec) -> MachineFacts:
    """Check this machine's copy of the run's checkpoint (``pretrained_copy``), pick the
    device, take its throughput per stage (``--throughput``, else the cache or a
    measurement: ``stage_throughputs``) and read the training data (with ``train``).
    Blocking, and one step after another: a measurement beside the data being read would
    measure the reading too. ``NodeError`` or ``ValueError`` naming what to fix."""
    started = time.monotonic()
    pretrained = pretrained_copy(spec, settings.pretrained)
    device = pick_device(settings.device)
    if settings.throughput is not None:
        throughput = (float(settings.throughput),) * spec.n_stages
    else:
        throughput = tuple(
            stage_throughputs(spec, device, settings.cache_dir, remeasure=settings.remeasure)
        )
    corpus = training_data(spec, settings.data) if settings.train else None
    return MachineFacts(pretrained, device, throughput, corpus, time.monotonic() - started)


class Steps:
    """How long each step of a sequence took (a node's start, the loading of a stage), for
    one log line. Steps end one after another (``done``), or ran beside the others
    (``done(name, seconds)``: shown, not added to the total)."""

    def __init__(self, before: tuple[str, float] | None = None) -> None:
        """``before``: a first step, (name, seconds), that ended just now."""
        self._last = time.monotonic()
        self._steps: list[tuple[str, float]] = [before] if before else []
        self.total = before[1] if before else 0.0

    def done(self, name: str, seconds: float | None = None) -> None:
        """Step ``name`` ended now (or, with ``seconds``, took that long beside others)."""
        if seconds is None:
            now = time.monotonic()
            seconds, self._last = now - self._last, now
            self.total += seconds
        self._steps.append((name, seconds))

    def line(self) -> str:
        """``"T s (STEP S s, ...)"``."""
        steps = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in self._steps)
        return f"{self.total:.1f} s ({steps})"


def since_process_start() -> float:
    """Seconds since this process started (its imports included)."""
    return max(0.0, time.time() - psutil.Process().create_time())


def invite_for(settings: NodeSettings, peer_id: str) -> Callable[[RunSpec], str | None]:
    """The invite a node shows to join a run: ``--invite``, or in a private run one its
    owner's node makes for itself when it finds the run's owner key (``--owner-key``, by
    default ``~/.swarmtrain/owner.key``): the run's owner needs no invite."""
    return member_invite(settings.invite, settings.owner_key_path(), peer_id)


@dataclass
class HeldStage:
    """A stage this node holds: its index, whether it is the node's first stage (which it
    may move) or a second one (fixed once taken), its averager and its server."""

    stage: int
    role: str  # "first" or "second"
    averager: StageAverager
    server: StageServer


class Node:
    """One volunteer's membership in one run.

    The stages it holds are records in ``held`` (keyed by stage): one stage or two take the
    same code path. Every resource is registered on one ``AsyncExitStack`` as it is
    acquired (identity lock, DHT, dashboard, P2P replica, services, placement, the held
    stages), and ``close`` releases them in reverse order after announcing the departure."""

    def __init__(
        self,
        settings: NodeSettings,
        dht: SwarmDHT,
        key,
        lock_fd: int,
        signed_spec: SignedSpec | None = None,
    ) -> None:
        self.settings = settings
        self.dht = dht
        self.key = key
        self._resources = contextlib.AsyncExitStack()
        self._resources.callback(self._stopped)  # released last: the event log, opened first
        self._resources.callback(os.close, lock_fd)
        self._resources.push_async_callback(asyncio.to_thread, dht.shutdown)
        self._brought_spec = signed_spec  # a spec this node publishes (a new run, a file)
        self.joined: Joined | None = None
        # One for every service of this node: a peer refused by one is refused by all.
        self.callers = BanList(BAN_S, BAN_AFTER, BAN_WINDOW_S)
        # Stage requests in flight, capped per caller and in total over all held stages.
        self.in_flight = InFlight(settings.limits)
        self.device: Device | None = None
        self.throughput: tuple[float, ...] = ()
        self.corpus: Corpus | None = None
        self.checkpoints: Path | None = None  # where the held stages are checkpointed
        self.pretrained: Checkpoint | None = None  # verified: where stages start from
        # The stages this node announces (its first may be chosen but not yet loaded; its
        # second is fixed once taken: a two-stage node never moves), and those it holds.
        self.stage: int | None = None
        self.second: int | None = None
        self.held: dict[int, HeldStage] = {}
        self.state = PeerState.JOINING
        self._changed = asyncio.Event()
        self.p2p: P2P | None = None
        self.gate: MembershipGate | None = None
        self.placement: Placement | None = None
        self.bandwidth: tuple[float, float] | None = None  # measured (up, down), Mbit/s
        self.stage_needs: list[int] = []  # bytes each stage needs (with --max-memory)
        self.fits_every_stage = True  # else it never moves (--max-memory)
        self.started = get_dht_time()  # for the uptime in our record
        self.dashboard: Dashboard | None = None
        self.trainer: Trainer | None = None  # once training
        self.peers: list[PeerInfo] = []  # the run's peers, as ``_watch_loop`` last read them
        self.peers_read_at: float | None = None  # Unix seconds
        self._served_before = 0  # micro-batches served by stage servers since unloaded
        # Whether peers can dial us (``_find_reachability``, in ``prepare``): unknown until
        # asked. A node found unreachable serves through a relay, or else trains only.
        self.reachability = Reachability(None)
        # Unreachable, with relaying on: the relay (one of the initial peers, on which
        # p2pd reserves a slot) it serves through, announced in its record.
        self.relay: str | None = None
        self._relay_links: dict[str, str] = {}  # relayed peer -> how we are linked to it
        self._relay_keeper: RelayKeeper | None = None  # unreachable, with relaying on
        # Whether it holds stages: decided by the verdict at start (a later verdict leaves
        # it serving; routing then skips it by its record).
        self.serves = True

    @classmethod
    def start(cls, settings: NodeSettings) -> Node:
        """Load (or create) the identity and start the DHT. Call before any event loop runs:
        hivemind forks the DHT's process, and forking a process with a running loop is
        fragile."""
        run, signed = resolve_run(settings)
        settings = replace(settings, run=run)
        key, lock_fd = load_or_create_identity(settings.identity_path())
        events.open_log(settings.events_path(peer_id_of(key.public_key())))  # before the fork
        limits.install(settings.max_upload_mbps, settings.max_download_mbps)
        try:
            dht = SwarmDHT.start(
                run,
                initial_peers=settings.initial_peers,
                host_maddrs=settings.host_maddrs,
                announce_maddrs=settings.announce_maddrs,
                identity_path=settings.identity_path(),
                pubsub=True,  # the run's gossip topic (node.placement.driver)
                # A joiner stays out of others' DHT routing tables until peers confirm
                # they can dial it (``_find_reachability``); the first node is dialled by
                # every joiner, so it is a full DHT node from the start.
                client_mode=bool(settings.initial_peers),
                peer_routing=True,
                relay=settings.relay,
            )
        except BaseException:
            os.close(lock_fd)
            events.close_log()
            raise
        return cls(settings, dht, key, lock_fd, signed)

    @property
    def peer_id(self) -> str:
        return self.dht.peer_id

    @property
    def spec(self) -> RunSpec | None:
        return None if self.joined is None else self.joined.spec

    @property
    def membership(self) -> str | None:
        return None if self.joined is None else self.joined.membership

    async def prepare(self) -> None:
        """Serve the dashboard, join the run (publishing the spec this node brings), and
        find out what this machine can do. What needs no peer (``examine_machine``: the
        checkpoint's files checked, the throughput measured, the training data read) runs
        on a thread while peers check whether they can dial this node. Logs how long each
        step of the start took."""
        s = self.settings
        steps = Steps(("process and DHT", since_process_start()))
        await self._open_dashboard()
        if self._brought_spec is not None:
            spec = self._brought_spec.spec
            private = ", private" if spec.private else ""
            logger.info(
                "publishing the spec of run %s: %d stages%s", spec.run, spec.n_stages, private
            )
        self.joined = await join_run(
            self.dht,
            invite_for(s, self.peer_id),
            signed=self._brought_spec,
            spec_timeout_s=s.spec_timeout_s,
        )
        steps.done("run joined")
        spec = self.joined.spec
        for flag, stage in (("--stage", s.stage), ("--second-stage", s.second_stage)):
            if stage is not None and not 0 <= stage < spec.n_stages:
                raise NodeError(f"{flag} {stage}: run {s.run!r} has stages 0..{spec.n_stages - 1}")
        if s.second_stage is not None and s.second_stage == s.stage:
            raise NodeError(f"--second-stage {s.second_stage} is the node's --stage already")
        self.checkpoints = s.archive or s.checkpoint_root(self.peer_id)
        examined: asyncio.Task[MachineFacts] | None = None
        try:
            async with asyncio.TaskGroup() as tasks:
                if s.archive is None:  # an archive serves no stage: nothing to measure or read
                    examined = tasks.create_task(asyncio.to_thread(examine_machine, s, spec))
                await self._find_reachability()
                steps.done("reachability")
                await asyncio.to_thread(checkpoint.write_spec, self.checkpoints, self.joined.signed)
        except* Exception as group:  # the first failure, in the one line the person sees
            raise group.exceptions[0] from None
        if examined is not None:
            machine = examined.result()
            steps.done("waited for the machine")  # what its examination took past the rest
            steps.done("machine examined on a thread", machine.seconds)
            self.pretrained, self.device = machine.pretrained, machine.device
            self.throughput, self.corpus = machine.throughput, machine.corpus
            logger.info("throughput per stage (samples/s): %s", self.throughput)
            self._fit_bandwidth()
            self._fit_memory()
        logger.info("ready to serve %s after the process started", steps.line())

    async def _open_dashboard(self) -> None:
        """Serve the dashboard (``--dashboard``) until the node closes."""
        address = parse_address(self.settings.dashboard)
        if address is not None:
            self.dashboard = await Dashboard.open(address, lambda: snapshot_of(self))
            self._resources.push_async_callback(self.dashboard.close)

    async def _find_reachability(self) -> None:
        """Ask peers to dial this node back (``node.rpc.reach``; it answers theirs from now
        on) and act on the verdict: a node they can dial, or that cannot tell, becomes a
        full DHT node; one they cannot stays a DHT client (peers never route DHT lookups
        to it) and serves through a relay (one of its initial peers, unless relaying is
        off), or else holds no stage. Emits ``node.reachability``."""
        add = self._resources.push_async_callback
        self.p2p = await self.dht.replicate_p2p()
        add(self.p2p.shutdown)
        dial_back = await DialBack.create(self.p2p, callers=self.callers)
        add(dial_back.shutdown)
        if self.settings.reachable == "auto":
            self.reachability = await self._ask_reachability()
        else:
            self.reachability = Reachability.declare(
                self.settings.reachable == "yes", self.dht.visible_maddrs()
            )
        if not self.reachability.serves and self.settings.relay.use:
            self._relay_keeper = RelayKeeper(self.p2p, self.settings.initial_peers, self._views)
            self.relay = await self._relay_keeper.choose(wait_s=CHOOSE_WAIT_S)
        self.serves = self.reachability.serves or self.relay is not None
        if self.reachability.serves:
            await self.dht.become_server()
        elif self.relay is not None:
            self.dht.serve_averaging()  # peers reach its averagers through the relay
        self._report_reachability()

    async def _views(self) -> dict[str, bool | None]:
        """Each peer's reachability, as the run's records say (for ``RelayKeeper``)."""
        return {p.peer_id: p.reachable for p in await self.dht.peers()}

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
        logger.warning("%s", self.reachability_line())
        self._changed.set()

    async def _ask_reachability(self) -> Reachability:
        maddrs = self.dht.visible_maddrs()
        return await check_reachability(self.p2p, await self._askers(), maddrs)

    def _report_reachability(self) -> None:
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
        (logger.info if r.reachable is not False else logger.warning)(
            "%s", self.reachability_line()
        )

    def _relays_tried(self) -> dict[str, str]:
        """Relay peer id -> why it held no reservation for us, at the last choice."""
        keeper = self._relay_keeper
        tried = keeper.tried if keeper is not None else {}
        return {relay_peer_id(m): why for m, why in tried.items()}

    async def _recheck_reachability(self) -> None:
        """While nobody could tell (the first node of a run, or peers that disagreed), ask
        again every ``REACHABILITY_RECHECK_S``, and report the first definite verdict (in
        the record, an event and the log)."""
        while self.reachability.reachable is None:
            await asyncio.sleep(REACHABILITY_RECHECK_S)
            try:
                found = await self._ask_reachability()
            except Exception as e:  # a P2P hiccup: ask again later
                logger.debug("reachability re-check failed: %s", e)
                continue
            if found.reachable is not None:
                self.reachability = found
                self._report_reachability()
                self._changed.set()

    async def _askers(self) -> list[PeerID]:
        """Whom to ask for a dial-back, likeliest answerers first: the run's peers this
        node has reached (a live host holds their key; a record alone costs nothing to
        forge), those known to be reachable, those not known either way, other peers we
        are connected to (the initial peers), and last those known to be unreachable
        (they can dial out)."""
        try:
            records = [p for p in await self.dht.peers() if p.peer_id != self.peer_id]
        except Exception as e:  # a DHT hiccup: the connected peers still answer
            logger.debug("reading the run's peers failed: %s", e)
            records = []
        connected = [p.peer_id.to_base58() for p in await self.p2p.list_peers()]
        reached = self.placement.reached if self.placement is not None else lambda p: False
        groups = [
            [p.peer_id for p in records if reached(p.peer_id)],
            [p.peer_id for p in records if p.reachable is True],
            [p.peer_id for p in records if p.reachable is None],
            connected,
            [p.peer_id for p in records if p.reachable is False],
        ]
        ordered = [i for g in groups for i in shuffled(g, self.peer_id)]
        return [PeerID.from_base58(i) for i in dict.fromkeys(ordered) if i != self.peer_id]

    def reachability_line(self) -> str:
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
        if self._relay_keeper is not None:
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
        for m in self.dht.visible_maddrs():
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

    def _fit_bandwidth(self) -> None:
        """``--max-upload-mbps`` / ``--max-download-mbps``: announce no more samples/s per
        stage than the limits let the stage move (``limits.throughput_within``), so that
        routing sends it no more calls, and assignment counts no more, than it can serve."""
        up, down = self.settings.max_upload_mbps, self.settings.max_download_mbps
        if up is None and down is None:
            return
        self.throughput = tuple(
            limits.throughput_within(self.spec, stage, t, up, down)
            for stage, t in enumerate(self.throughput)
        )
        logger.info("within the bandwidth limits, throughput per stage: %s", self.throughput)

    def _fit_memory(self) -> None:
        """``--max-memory``: refuse (``NodeError``, after a ``stage.refused`` event) pinned
        stages that do not fit, and a run none of whose stages does; announce no
        throughput for the stages that do not fit, so that assignment leaves them to
        others; and where some do not fit, never move (``movable``)."""
        s, budget = self.settings, self.settings.max_memory
        if budget is None:
            return
        needs = [stage_memory(self.spec, stage) for stage in range(self.spec.n_stages)]
        self.stage_needs = needs
        pinned = [stage for stage in (s.stage, s.second_stage) if stage is not None]
        if refusal := limits.memory_refusal(needs, budget, pinned):
            self._refuse_stage(*refusal)
        fits = limits.stages_within(needs, budget)
        if not fits:
            smallest = min(range(len(needs)), key=needs.__getitem__)
            self._refuse_stage(*limits.memory_refusal(needs, budget, [smallest]))
        self.throughput = tuple(t if i in fits else 0.0 for i, t in enumerate(self.throughput))
        self.fits_every_stage = len(fits) == len(needs)
        logger.info("--max-memory: stages %s fit", fits)

    def _refuse_stage(self, stage: int, why: str) -> None:
        events.emit(
            "stage.refused",
            stage=stage,
            need=self.stage_needs[stage],
            max_memory=self.settings.max_memory,
            reason=why,
        )
        raise NodeError(f"refusing stage {stage} of run {self.settings.run}: {why}")

    @property
    def movable(self) -> bool:
        """Whether it may move to another stage: not pinned, rebalancing, and every stage
        fits its memory (a move may go to a stage that nobody holds, whatever the mover's
        throughput there)."""
        s = self.settings
        return s.stage is None and s.rebalance and self.fits_every_stage

    def advertised_bandwidth(self) -> tuple[float, float] | None:
        """(up, down) Mbit/s as our record says them: measured, else declared, capped by
        ``--max-upload-mbps`` / ``--max-download-mbps``; None: unknown."""
        s = self.settings
        figure = self.bandwidth or s.bandwidth_mbps
        return advertised(figure, s.max_upload_mbps, s.max_download_mbps)

    def info(self, state: PeerState | None = None) -> PeerInfo:
        """This node's record as of now."""
        assert self.spec is not None and self.device is not None
        up_down = self.advertised_bandwidth()
        return PeerInfo(
            peer_id=self.peer_id,
            run=self.settings.run,
            version=PROTOCOL_VERSION,
            device=self.device.description,
            throughput=self._advertised_throughput(),
            throughput_source="declared" if self.settings.throughput is not None else "measured",
            bandwidth_up_mbps=up_down[0] if up_down else 0.0,
            bandwidth_down_mbps=up_down[1] if up_down else 0.0,
            bandwidth_source=(
                "measured"
                if self.bandwidth
                else "declared"
                if up_down  # declared, or the limits where nothing was measured
                else "unknown"
            ),
            stage=self.stage,
            state=state or self.state,
            load=sum(h.server.load for h in self.held.values()),
            timestamp=get_dht_time(),
            membership=self.membership,
            second_stage=self.second if self.stage is not None else None,
            second_serving=self.serving_second is not None,
            samples_served=self.micro_batches_served() * self.spec.optim.micro_batch_size,
            started=self.started,
            ttl_s=self.settings.record_ttl_s,
            reachable=self.reachability.reachable,
            relay=self.relay,
        )

    def _advertised_throughput(self) -> tuple[float, ...]:
        """Our throughput per stage, capped by the relay path when we serve through one
        (``relayed_throughput``; the relay's rate from its record, as last read)."""
        if self.relay is None:
            return self.throughput
        relay = relay_peer_id(self.relay)
        rates = [min(p.bandwidth_up_mbps, p.bandwidth_down_mbps)
                 for p in self.peers if p.peer_id == relay]  # fmt: skip
        model = self.spec.model
        per_sample = 2 * model.block_size * model.n_embd * 4  # activations and grads, fp32
        return relayed_throughput(self.throughput, rates[0] if rates else 0.0, per_sample)

    @property
    def serving_second(self) -> int | None:
        """The second stage, once it is held (a second stage is announced before)."""
        return self.second if self.second is not None and self.second in self.held else None

    @staticmethod
    def _stopped() -> None:
        events.emit("node.stopped")
        events.close_log()

    def micro_batches_served(self) -> int:
        """Forward passes (train and validation) our stage servers computed, since start."""
        return self._served_before + sum(h.server.counters.forward for h in self.held.values())

    def set_state(self, state: PeerState) -> None:
        """Change state and re-announce at once."""
        self.state = state
        events.emit("node.state", state=state.name)
        self._changed.set()

    async def run(self, stop: asyncio.Event, on_ready: Callable[[], None] | None = None) -> None:
        """Announce, take a stage, serve, until ``stop`` is set; then cancel every task.
        An archive node (``settings.archive``) keeps every stage instead."""
        if self.settings.archive is not None:
            await self._run_archive(stop, on_ready)
            return
        add = self._resources.push_async_callback
        probe = await BandwidthProbe.create(self.p2p, callers=self.callers)
        add(probe.shutdown)
        self.gate = await MembershipGate.create(self.p2p, lambda: self.dht.policy, self.callers)
        add(self.gate.shutdown)
        try:
            self.placement = await Placement.create(
                self.dht,
                self.p2p,
                self.key,
                self.spec,
                self.throughput,
                update_period_s=self.settings.update_period_s,
                params=Params(mean_period_s=self.settings.rebalance_period_s),
            )
        except GossipUnavailable as e:
            raise NodeError(f"cannot use the run's gossip topic: {e}") from None
        add(self.placement.close)
        add(self._release_stages)
        try:
            await self._run_tasks(stop, on_ready)
        except* NodeError as group:  # a task's reason to stop, for the person running us
            raise group.exceptions[0] from None

    async def _run_archive(self, stop: asyncio.Event, on_ready: Callable[[], None] | None) -> None:
        archive = await Archive.open(
            self.dht,
            self.joined,
            self.settings.archive,
            self.key,
            period_s=self.settings.checkpoint_every_s,
            record_ttl_s=self.settings.record_ttl_s,
        )
        self._resources.push_async_callback(archive.close)
        async with asyncio.TaskGroup() as tasks:
            background = [
                tasks.create_task(archive.run(), name="archive"),
                tasks.create_task(self._spec_loop(), name="refresh-spec"),
                tasks.create_task(self._revocations_loop(), name="revocations"),
            ]
            if on_ready is not None:
                on_ready()
            await stop.wait()
            for task in background:
                task.cancel()

    async def _run_tasks(self, stop: asyncio.Event, on_ready: Callable[[], None] | None) -> None:
        async with asyncio.TaskGroup() as tasks:
            background = [
                tasks.create_task(self._announce_loop(), name="announce"),
                tasks.create_task(self._spec_loop(), name="refresh-spec"),
                tasks.create_task(self._revocations_loop(), name="revocations"),
                tasks.create_task(self._follow_gossip(stop), name="gossip"),
                tasks.create_task(self.placement.keep_connected(), name="gossip-peers"),
                tasks.create_task(self._watch_loop(), name="watch"),
            ]
            background.append(tasks.create_task(self._recheck_reachability(), name="reachability"))
            if self._relay_keeper is not None and self.relay is not None:
                keeper = self._relay_keeper.run(self._relay_changed)
                background.append(tasks.create_task(keeper, name="relay-keeper"))
            serves = self.serves  # if not, a trainer only: no stage to hold
            if serves and not await until_stopped(stop, self._join()):
                for task in background:
                    task.cancel()
                return
            if on_ready is not None:
                on_ready()
            if self.second is not None:  # a two-stage node never moves
                background.append(tasks.create_task(self._load_second(), name="second-stage"))
            elif serves and self.movable:
                background.append(tasks.create_task(self._rebalance_loop(), name="rebalance"))
            if serves and self.settings.checkpoint_every_s > 0:
                background.append(tasks.create_task(self._checkpoint_loop(), name="checkpoint"))
            if self.settings.bandwidth_mbps is None:
                tasks.create_task(self._measure_bandwidth(), name="bandwidth")  # ends by itself
            if self.settings.train:
                background.append(tasks.create_task(self._train_loop(), name="trainer"))
            owner_key = (
                None
                if self.spec.private
                else owner_key_of(self.settings.owner_key_path(), self.spec.run)
            )
            if owner_key is not None:  # the owner's node of a public run announces it
                background.append(
                    tasks.create_task(self._directory_loop(owner_key), name="directory")
                )
            await stop.wait()
            for task in background:
                task.cancel()

    async def _follow_gossip(self, stop: asyncio.Event) -> None:
        """Follow the run's gossip topic. When ``p2pd`` goes away, a Ctrl-C in a terminal
        (which signals ``p2pd`` too) is the usual reason: if a stop follows within
        ``P2PD_GONE_GRACE_S`` this task just ends, else the node stops with a
        ``NodeError``."""
        try:
            await self.placement.follow()
        except GossipUnavailable as e:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(P2PD_GONE_GRACE_S):
                    await stop.wait()
            if not stop.is_set():
                raise NodeError(f"this node's p2pd stopped: {e}") from None

    async def _join(self) -> None:
        """Take a stage, load it, and decide on a second one."""
        await self._take_stage()
        self.second = await self._second_choice()

    async def _take_stage(self) -> None:
        """Choose a stage (``--stage`` pins it; a node that kept a checkpoint takes that
        checkpoint's stage again) and load it."""
        assert self.spec is not None and self.placement is not None
        if self.settings.stage is not None:
            self.stage = self.settings.stage
        else:

            def on_choice(stage: int) -> None:
                self.stage = stage
                self.set_state(PeerState.JOINING)  # the record and the gossip carry the intent

            kept = await asyncio.to_thread(checkpoint.kept_stages, self.checkpoints, self.spec)
            await self.placement.join(on_choice, kept)
        self.set_state(PeerState.LOADING)
        await self._hold(self.stage, "first")
        self.set_state(PeerState.SERVING)

    async def _second_choice(self) -> int | None:
        """The second stage this node takes as well, if any: pinned, or (for a node that
        chose its first) what the rule says once the first serves."""
        s = self.settings
        if s.second_stage is not None or s.stage is not None or not s.two_stage:
            return s.second_stage
        try:
            second = await self.placement.second_stage(self.stage)
        except Exception as e:  # a DHT hiccup: one stage is what every node can do
            logger.warning("could not decide on a second stage: %s", e)
            return None
        if second is None:
            return None
        if refusal := limits.memory_refusal(self.stage_needs, s.max_memory, [self.stage, second]):
            logger.info("not taking stage %d as a second stage: %s", second, refusal[1])
            return None
        need, free = stage_memory(self.spec, second), free_memory(self.device)
        if need > free:
            logger.info(
                "not taking stage %d as a second stage: it needs about %.0f MiB, %.0f MiB free",
                second,
                need / 2**20,
                free / 2**20,
            )
            return None
        self._changed.set()  # announce it at once: others count it in the reserve
        return second

    async def _load_second(self) -> None:
        """Load and serve the second stage too; its time goes where routing sends calls.
        If that fails the node goes on with one stage (it does not move either)."""
        try:
            await self._hold(self.second, "second")
        except Exception as e:
            logger.warning("could not load stage %d as a second stage: %s", self.second, e)
            self.second = None
        self._changed.set()

    async def _rebalance_loop(self) -> None:
        """Move when a check says so and the stage we leave keeps a serving peer."""
        while True:
            move = await self.placement.next_move(lambda: self.stage)
            started = asyncio.get_running_loop().time()
            if not await self.placement.confirm_move(move):
                self._changed.set()  # re-announce that we stay
                continue
            self.stage = move.to_stage
            self.set_state(PeerState.LOADING)
            await self._release(move.from_stage)
            await self._hold(move.to_stage, "first")
            self.set_state(PeerState.SERVING)
            logger.info(
                "moved from stage %d to %d in %.1f s (announced, confirmed, loaded)",
                move.from_stage,
                move.to_stage,
                asyncio.get_running_loop().time() - started,
            )

    async def _hold(self, stage: int, role: str) -> None:
        """Build ``stage`` (its state from a peer of it, else from our newest checkpoint of
        it, else initial), and serve it."""
        together = [self.stage, stage] if role == "second" else [stage]
        if refusal := limits.memory_refusal(self.stage_needs, self.settings.max_memory, together):
            self._refuse_stage(*refusal)
        if role == "first":
            logger.info("took stage %d of %d", stage, self.spec.n_stages)
        steps = Steps()
        model = self.spec.model
        module = Stage(model, self.spec.stage_range(stage))
        if self.pretrained is not None:  # the initial state; a peer's or a checkpoint's wins
            r = module.range
            state = await asyncio.to_thread(
                load_stage_state, self.pretrained, range(r.start, r.end)
            )
            load_into(module, state, str(self.pretrained.directory))
        module = module.to(self.device.torch)
        optimizer = StageOptimizer(module, self.spec.optim)
        steps.done("built")
        averager = await StageAverager.create(
            self.dht, self.spec, stage, module, optimizer, key=self.key
        )
        steps.done("averager started")
        try:
            kept = await asyncio.to_thread(checkpoint.newest, self.checkpoints, self.spec, stage)
            saved = None if kept is None else (kept.metadata, kept.tensors, str(kept.path))
            loaded = await averager.load_state(
                saved=saved, archived=functools.partial(self._archived, stage)
            )
            steps.done("state loaded")
            logger.info("stage %d state: %s", stage, loaded)
            server = await AveragedStageServer.create(
                self.p2p,
                module,
                optimizer,
                StageContract.for_stage(model, module.range, stage),
                self.spec.run,
                compression=self.spec.compression,
                averager=averager,
                admission=self.gate.refusal if self.spec.private else None,
                callers=self.callers,
                in_flight=self.in_flight,
                download_mbps=self.download_mbps,
            )
        except BaseException:
            await averager.shutdown()
            raise
        steps.done("serving")
        self.held[stage] = HeldStage(stage, role, averager, server)
        logger.info("stage %d held in %s", stage, steps.line())
        if role == "second":
            logger.info("serving stage %d as well (a second stage)", stage)
        events.emit(
            "stage.held",
            stage=stage,
            role=role,
            loaded=str(loaded.origin),
            source=loaded.source,
            step=loaded.step,
        )

    async def _archived(self, stage: int) -> dict[str, int]:
        """The archive nodes that hold ``stage``, and the epoch of their newest copy."""
        held = {}
        for record in await self.dht.archives():
            epoch = record.epoch_of(stage)
            if epoch is not None and record.peer_id != self.peer_id:
                held[record.peer_id] = epoch
        return held

    async def _release(self, stage: int) -> None:
        """Stop serving and averaging ``stage`` (before taking another, or on close)."""
        held = self.held.pop(stage, None)
        if held is None:
            return
        await held.server.shutdown()
        self._served_before += held.server.counters.forward
        await held.averager.shutdown()
        events.emit("stage.released", stage=stage)

    async def _release_stages(self) -> None:
        """On close: checkpoint every held stage (a clean stop loses nothing), release them."""
        await self._checkpoint()
        for stage in reversed(list(self.held)):
            await self._release(stage)

    def _checkpointable(self) -> list[HeldStage]:
        return [h for h in self.held.values() if h.averager.running]

    async def _checkpoint(self) -> None:
        """Write a checkpoint of every stage held (the copy holds the stage's lock for as
        long as copying its tensors takes; the write runs off the event loop)."""
        for held in self._checkpointable():
            started = time.monotonic()
            try:
                metadata, tensors = await asyncio.to_thread(held.averager.snapshot)
                path = await asyncio.to_thread(
                    checkpoint.write,
                    self.checkpoints,
                    self.spec,
                    held.stage,
                    metadata,
                    tensors,
                    data=self._data_position(),
                )
            except Exception as e:  # a full disk must not stop the node
                logger.warning("could not checkpoint stage %d: %s", held.stage, e)
                continue
            events.emit(
                "checkpoint.written", stage=held.stage, step=metadata["step"], path=str(path)
            )
            logger.info(
                "checkpointed stage %d at step %d in %.1f s: %s",
                held.stage,
                metadata["step"],
                time.monotonic() - started,
                path,
            )

    def _data_position(self) -> checkpoint.DataPosition | None:
        if self.trainer is None:
            return None
        return checkpoint.DataPosition(self.trainer.settings.stream, self.trainer.data_position)

    async def _checkpoint_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.checkpoint_every_s)
            await self._checkpoint()

    async def _measure_bandwidth(self) -> None:
        """Up/down against a serving peer (up to 3 tried, those reached first:
        ``bandwidth.partners``); on failure it stays 'unknown'."""
        records = await self.dht.peers()
        reached = self.placement.reached if self.placement is not None else lambda p: False
        for peer in partners(records, self.peer_id, reached, self.peer_id):
            try:
                self.bandwidth = await measure_bandwidth(self.p2p, PeerID.from_base58(peer))
            except BandwidthError as e:
                logger.warning("could not measure bandwidth: %s", e)
                continue
            logger.info("bandwidth against %s: %.0f up / %.0f down Mbit/s", peer,
                        *self.bandwidth)  # fmt: skip
            self._changed.set()  # re-announce with the measured figures
            return

    def download_mbps(self) -> float | None:
        """This node's download bandwidth, measured or declared (None: unknown)."""
        return self.bandwidth[1] if self.bandwidth else self.settings.bandwidth_mbps

    def _serving(self, stage: int) -> StageServer | None:
        """This node's server of ``stage``, if it serves it now (its own trainer calls it
        in-process)."""
        held = self.held.get(stage)
        if held is None or (held.role == "first" and self.state is not PeerState.SERVING):
            return None
        return held.server

    async def _train_loop(self) -> None:
        """Drive micro-batches through the swarm for as long as the node runs."""
        assert self.spec is not None and self.p2p is not None
        stream = zlib.crc32(self.peer_id.encode())
        start = await asyncio.to_thread(
            checkpoint.data_position, self.checkpoints, self.spec, stream
        )
        if start:
            logger.info("training resumes its data stream at micro-batch %d", start)
        settings = replace(self.settings.trainer, stream=stream, start=start)
        self.trainer = trainer = Trainer(
            self.dht,
            self.p2p,
            self.spec,
            self.corpus,
            settings,
            membership=self.membership,
            local=self._serving,
        )
        losses: list[float] = []

        def on_result(r: MicroBatchResult) -> None:
            losses.append(r.loss)
            if trainer.stats.micro_batches % TRAIN_EVENT_EVERY == 0:
                events.emit(
                    "train.progress", micro_batches=trainer.stats.micro_batches, loss=r.loss
                )
            if len(losses) == 50:
                logger.info(
                    "trained %d micro-batches; mean loss of the last 50: %.3f",
                    trainer.stats.micro_batches,
                    sum(losses) / len(losses),
                )
                losses.clear()

        share: tuple[TokenRange, ...] = ()
        if self.spec.dataset is not None and self.peers_read_at is None:
            with contextlib.suppress(Exception):  # else the share waits for the watch loop
                self.peers, self.peers_read_at = await self.dht.peers(), time.time()
        while True:  # whatever stops the trainer pauses it: the node goes on serving
            share = self._read_share(trainer, share)
            try:
                await trainer.train(100, on_result)
            except TrainerError as e:
                logger.warning("training paused for %.0f s: %s", TRAIN_PAUSE_S, e)
                await asyncio.sleep(TRAIN_PAUSE_S)
            except Exception:
                logger.exception("the trainer failed; trying again in %.0f s", TRAIN_PAUSE_S)
                await asyncio.sleep(TRAIN_PAUSE_S)

    def _read_share(
        self, trainer: Trainer, share: tuple[TokenRange, ...]
    ) -> tuple[TokenRange, ...]:
        """In a run with shards, point ``trainer`` at this node's share of them among the
        run's live peers (``protocol.data_split``, from the peers ``_watch_loop`` last read;
        every peer counts as a trainer, so a ``--no-train`` peer's share goes unread rather
        than read twice) when it differs from ``share``; the share it reads now."""
        dataset, directory = self.spec.dataset, self.settings.data
        if dataset is None or directory is None:
            return share
        trainers = {p.peer_id for p in self.peers} | {self.peer_id}
        new = share_of([(s.name, s.tokens) for s in dataset.train], trainers, self.peer_id)
        if new != share:
            tokens = token_stream(dataset, directory.expanduser(), new)
            trainer.read_from(tokens)
            share_ranges = [[r.shard, r.start, r.end] for r in new]
            events.emit("data.share", trainers=len(trainers), ranges=len(new), tokens=len(tokens),
                        share=share_ranges)  # fmt: skip
            logger.info("reading %d of the run's %d training tokens (%d trainers)", len(tokens),
                        sum(s.tokens for s in dataset.train), len(trainers))  # fmt: skip
        return new

    async def _watch_loop(self) -> None:
        """Log and emit who joins and leaves the run (``watch.Members``) and, every
        ``heartbeat_s`` while serving, the node's ``watch.Heartbeat``."""
        loop = asyncio.get_running_loop()
        members = Members(self.peer_id, self.settings.record_ttl_s + MEMBERS_CHECK_S)
        peers: list[PeerInfo] = []
        next_beat = loop.time() + self.settings.heartbeat_s
        while True:
            try:
                peers = await self.dht.peers()
            except Exception as e:  # a DHT hiccup: the next check retries
                logger.debug("reading the run's peers failed: %s", e)
            else:
                self.peers, self.peers_read_at = peers, time.time()
                await self._reach_relayed(peers)
                first = members.seen is None
                members.update(peers, loop.time())
                members.report(first)
            if loop.time() >= next_beat and self.state is PeerState.SERVING:
                next_beat = loop.time() + self.settings.heartbeat_s
                self._heartbeat(peers).report()
            await asyncio.sleep(min(MEMBERS_CHECK_S, self.settings.heartbeat_s))

    async def _reach_relayed(self, peers: list[PeerInfo]) -> None:
        """Keep a connection to every peer that serves through a relay (``p2pd`` dials it
        only at addresses it holds, and never learns a relay's circuit address itself);
        emit ``relay.link`` when how we are linked to one changes."""
        try:
            links = await connect_relayed(self.p2p, [p for p in peers if p.routable])
        except Exception as e:  # a daemon hiccup: the next check retries
            logger.debug("connecting to relayed peers failed: %s", e)
            return
        for peer, link in links.items():
            if self._relay_links.get(peer) != link:
                events.emit("relay.link", peer=peer, link=link)
        self._relay_links = links

    def _heartbeat(self, peers: list[PeerInfo]) -> Heartbeat:
        return Heartbeat.of(
            self.peer_id,
            peers,
            first=self.stage,
            second=self.serving_second,
            served=self.micro_batches_served(),
            steps=sum(h.server.counters.steps for h in self.held.values()),
        )

    async def _announce_loop(self) -> None:
        while True:
            self._changed.clear()
            info = self.info()
            await self._publish(info)
            await self.placement.announce(info.stage, info.state, info.load)
            # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow a cancellation
            # that lands as the event fires (seen: a node that ignored SIGTERM).
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.settings.update_period_s):
                    await self._changed.wait()

    async def _directory_loop(self, owner_key: Ed25519PrivateKey) -> None:
        """Announce this public run in the run directory (``protocol.announce``) every
        ``ANNOUNCE_PERIOD_S``, with the figures of its live peer records. Only the owner's
        node can (it holds the owner key); while it is down the run drops off the list."""
        logger.info("announcing public run %s in the run directory", self.spec.run)
        while True:
            try:
                record = announcement_of(self.spec, await self.dht.peers(), now=get_dht_time())
                if not await self.dht.publish_announcement(record, owner_key):
                    logger.warning("the DHT did not store the run's announcement")
            except Exception as e:  # a DHT hiccup: the next period retries
                logger.warning("announcing the run failed: %s", e)
            await asyncio.sleep(ANNOUNCE_PERIOD_S)

    async def _publish(self, info: PeerInfo) -> None:
        try:
            if not await self.dht.publish_peer(info, self.key):
                logger.warning("the DHT did not store our record (no reachable peer?)")
        except Exception as e:  # a DHT hiccup must not stop the node; the next period retries
            logger.warning("publishing our record failed: %s", e)

    async def _spec_loop(self) -> None:
        while True:
            await asyncio.sleep(SPEC_REFRESH_S)
            await self.dht.publish_spec(self.joined.signed)

    async def _revocations_loop(self) -> None:
        """Follow the owner's revocations; stop the node if they (or time) end our invite."""
        while self.spec.private:
            await asyncio.sleep(REVOCATIONS_REFRESH_S)
            try:
                await self.dht.refresh_revocations(restore=True)
            except Exception as e:  # a DHT hiccup: the next period retries
                logger.warning("reading the run's revocations failed: %s", e)
            try:
                self.dht.policy.check(self.peer_id, self.membership, get_dht_time())
            except MembershipError as e:
                raise NodeError(f"this node is no longer a member of the run: {e}") from None

    async def close(self, grace_s: float = 5.0) -> None:
        """Announce ``leaving`` (best effort, within ``grace_s``), then release every
        resource in reverse order of acquisition: the held stages (checkpointed first),
        placement, services, P2P, the DHT (and its ``p2pd``), the identity lock."""
        logger.info("leaving the run")
        p2pd_up = self.p2p is None or p2pd_running(self.p2p)
        if not p2pd_up:  # Ctrl-C in a terminal signals the whole process group, p2pd too
            logger.warning("p2pd has stopped already: leaving without announcing it")
        try:
            if self.spec is not None and self.device is not None and p2pd_up:
                leaving = self.info(PeerState.LEAVING)
                async with asyncio.timeout(grace_s):
                    if self.placement is not None:  # gossip first: it arrives in milliseconds
                        await self.placement.announce(self.stage, PeerState.LEAVING, 0)
                    await self._publish(leaving)
        except TimeoutError:
            logger.warning("could not announce our departure within %.0f s", grace_s)
        finally:
            await self._resources.aclose()


async def until_stopped(stop: asyncio.Event, work: Awaitable[object]) -> bool:
    """Await ``work`` unless ``stop`` is set first (then cancel it and wait for it to
    unwind). True if the work finished; its exception, if it raised one, propagates."""
    task = asyncio.ensure_future(work)
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if task.cancelled():
        return False
    task.result()
    return True


def write_maddrs(path: Path, maddrs: list[str]) -> None:
    write_atomic(path, ("\n".join(maddrs) + "\n").encode())
