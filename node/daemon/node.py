"""The node daemon's lifecycle: join -> measure -> announce -> take a stage -> serve -> leave.

``Node`` is the composition root: ``start`` loads the identity and starts the DHT,
``prepare`` joins the run and examines the machine (``start``) while peers say whether
they can dial it (``reachability``), ``run`` builds the parts that serve (placement,
``stages``, ``checkpointing``, ``training``) and owns every background task they run
(an ``asyncio.TaskGroup``, cancelled and awaited when ``stop`` is set), and ``close``
announces the departure and releases every resource in reverse order, so that nothing
outlives the node.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable, Coroutine
from dataclasses import replace
from pathlib import Path

from hivemind.p2p import P2P
from hivemind.utils import get_dht_time

from models.data import Corpus
from models.pretrained import Checkpoint
from node import events, limits
from node.averaging.averager import StageAverager
from node.averaging.progress_push import ProgressInbox
from node.daemon import checkpoint
from node.daemon.archive import Archive
from node.daemon.checkpointing import Checkpointer
from node.daemon.join import Joined, NodeError, join_run, owner_key_of
from node.daemon.offer import Offer
from node.daemon.publishing import (
    announce_peer,
    announce_run,
    follow_revocations,
    publish_peer,
    refresh_spec,
)
from node.daemon.reachability import Reach
from node.daemon.settings import NodeSettings
from node.daemon.stages import HeldStages, StageLifecycle
from node.daemon.start import (
    MachineFacts,
    Steps,
    check_pins,
    examine_machine,
    invite_for,
    resolve_run,
    since_process_start,
)
from node.daemon.tasks import LoopStallWatch, Owned, until_stopped
from node.daemon.training import Training
from node.daemon.watch import Heartbeat, RunPeers, watch_run
from node.dashboard.address import parse_address
from node.dashboard.server import Dashboard
from node.dashboard.snapshot import snapshot_of
from node.files import load_or_create_identity, write_atomic
from node.measure.bandwidth import BandwidthProbe
from node.measure.capacity import Device
from node.pipeline.trainer import Trainer
from node.placement.driver import Placement
from node.rpc.dht import SwarmDHT
from node.rpc.gossip import GossipUnavailable
from node.rpc.membership import MembershipGate
from node.rpc.reach import DialBack
from node.rpc.service import BAN_AFTER, BAN_S, BAN_WINDOW_S, p2pd_running
from protocol.admission import InFlight
from protocol.identity import peer_id_of
from protocol.records import PROTOCOL_VERSION, PeerInfo, PeerState
from protocol.routing import BanList
from protocol.run_spec import RunSpec, SignedSpec

logger = logging.getLogger(__name__)

P2PD_GONE_GRACE_S = 2.0  # a stop signal that also stopped p2pd arrives within this
CHILDREN_CHECK_S = 2.0  # how often the node checks that its DHT and averagers still run
CHILD_ASK_S = 10.0  # how often the node asks its children something that needs no network
# An ask of the DHT process unanswered for ``NodeSettings.stuck_after_s``: the child is
# alive but stuck. An averager gets this many times longer: a peer's joiner waits out a
# busy one (retrying its download) rather than see it restart.
AVERAGER_PATIENCE = 4.0
LOOP_STALL = 2.0  # the event loop not run for this many times stuck_after_s: stuck in a call


class Node:
    """One volunteer's membership in one run.

    The stages it announces and holds are in ``stages`` (``stages.HeldStages``). Every
    resource is registered on one ``AsyncExitStack`` as it is acquired (identity lock,
    DHT, dashboard, P2P replica, services, placement, the held stages), and ``close``
    releases them in reverse order after announcing the departure."""

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
        self.offer = Offer(settings)  # samples/s per stage and bandwidth, as announced
        self.corpus: Corpus | None = None
        self.checkpoints: Path | None = None  # where the held stages are checkpointed
        self.pretrained: Checkpoint | None = None  # verified: where stages start from
        self.stages = HeldStages()  # the stages it announces and those it holds
        self.state = PeerState.JOINING
        self._changed = asyncio.Event()
        self.p2p: P2P | None = None
        self.gate: MembershipGate | None = None
        self.placement: Placement | None = None
        self.started = get_dht_time()  # for the uptime in our record
        self.dashboard: Dashboard | None = None
        self.training: Training | None = None  # once it runs
        self.archive: Archive | None = None  # an archive node's stages, once opened
        self.run_peers = RunPeers()  # the run's peers, as ``watch_run`` last read them
        # Whether peers can dial us, and the relay it serves through if they cannot.
        self.reach = Reach(dht, settings, self._reached, self._changed.set)

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
        check_pins(s, spec)
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
            self.corpus = machine.corpus
            self.offer.fit(spec, machine.throughput)
        logger.info("ready to serve %s after the process started", steps.line())

    async def _open_dashboard(self) -> None:
        """Serve the dashboard (``--dashboard``) until the node closes."""
        address = parse_address(self.settings.dashboard)
        if address is not None:
            self.dashboard = await Dashboard.open(address, lambda: snapshot_of(self))
            self._resources.push_async_callback(self.dashboard.close)

    async def _find_reachability(self) -> None:
        """Start this node's P2P replica and its ``DialBack`` (it answers peers' dial-backs
        from now on), then ask peers whether they can dial it (``Reach.find``)."""
        add = self._resources.push_async_callback
        self.p2p = await self.dht.replicate_p2p()
        add(self.p2p.shutdown)
        dial_back = await DialBack.create(self.p2p, callers=self.callers)
        add(dial_back.shutdown)
        await self.reach.find(self.p2p)

    def _reached(self, peer: str) -> bool:
        """Whether this node has reached ``peer`` itself (its placement's connections)."""
        return self.placement is not None and self.placement.reached(peer)

    @property
    def movable(self) -> bool:
        """Whether it may move to another stage: not pinned, rebalancing, and every stage
        fits its memory (a move may go to a stage that nobody holds, whatever the mover's
        throughput there)."""
        s = self.settings
        return s.stage is None and s.rebalance and self.offer.fits_every_stage

    def info(self, state: PeerState | None = None) -> PeerInfo:
        """This node's record as of now."""
        assert self.spec is not None and self.device is not None
        up_down, stages = self.offer.advertised_bandwidth(), self.stages
        now = get_dht_time()
        return PeerInfo(
            peer_id=self.peer_id,
            run=self.settings.run,
            version=PROTOCOL_VERSION,
            device=self.device.description,
            throughput=self.offer.advertised_throughput(
                self.spec, self.reach.relay, self.run_peers.peers
            ),
            throughput_source="declared" if self.settings.throughput is not None else "measured",
            bandwidth_up_mbps=up_down[0] if up_down else 0.0,
            bandwidth_down_mbps=up_down[1] if up_down else 0.0,
            bandwidth_source=self.offer.bandwidth_source(),
            stage=stages.stage,
            state=state or self.state,
            load=stages.load(),
            timestamp=now,
            membership=self.membership,
            second_stage=stages.second if stages.stage is not None else None,
            second_serving=stages.serving_second is not None,
            samples_served=stages.micro_batches_served() * self.spec.optim.micro_batch_size,
            started=min(self.started, now),  # a clock stepped back: no start in the future
            ttl_s=self.settings.record_ttl_s,
            reachable=self.reach.reachability.reachable,
            relay=self.reach.relay,
        )

    @staticmethod
    def _stopped() -> None:
        events.emit("node.stopped")
        events.close_log()

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
        inbox = await ProgressInbox.create(self.p2p, callers=self.callers)
        add(inbox.shutdown)
        try:
            self.placement = await Placement.create(
                self.dht,
                self.p2p,
                self.key,
                self.spec,
                self.offer.throughput,
                update_period_s=self.settings.update_period_s,
                params=self.settings.placement_params,
            )
        except GossipUnavailable as e:
            raise NodeError(f"cannot use the run's gossip topic: {e}") from None
        add(self.placement.close)
        lifecycle = StageLifecycle(
            self.stages,
            self.settings,
            self.spec,
            self.dht,
            self.p2p,
            self.key,
            self.device,
            self.pretrained,
            self.checkpoints,
            self.offer,
            self.placement,
            self.gate,
            self.callers,
            self.in_flight,
            inbox,
            set_state=self.set_state,
            on_change=self._changed.set,
        )
        self.training = Training(
            self.settings,
            self.spec,
            self.dht,
            self.p2p,
            self.corpus,
            self.membership,
            self.checkpoints,
            self.run_peers,
            local=lambda stage: self.stages.server(stage, self.state),
        )
        data = self.training.data_position
        checkpointer = Checkpointer(self.stages, self.spec, self.checkpoints, data)

        async def checkpoint_and_release() -> None:
            """On close: let the rounds whose groups formed end (the groupmates wait on
            them), checkpoint every held stage (a clean stop loses nothing), then release
            them."""
            held = list(self.stages.held.values())
            await asyncio.gather(*(h.averager.finish_round() for h in held))
            await checkpointer.write_all()
            await lifecycle.release_all()

        add(checkpoint_and_release)
        try:
            await self._run_tasks(stop, on_ready, lifecycle, checkpointer)
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
        self.archive = archive
        try:
            async with asyncio.TaskGroup() as tasks:
                own = Owned(tasks)
                own(archive.run(), "archive")
                own(self._watch_children(stop), "children")
                own(self._refresh_spec(), "refresh-spec")
                own(self._follow_revocations(), "revocations")
                if on_ready is not None:
                    on_ready()
                await stop.wait()
                own.cancel()
        except* NodeError as group:  # a task's reason to stop, for the person running us
            raise group.exceptions[0] from None

    async def _run_tasks(
        self,
        stop: asyncio.Event,
        on_ready: Callable[[], None] | None,
        lifecycle: StageLifecycle,
        checkpointer: Checkpointer,
    ) -> None:
        s = self.settings
        async with asyncio.TaskGroup() as tasks:
            own = Owned(tasks)
            own(self._announce(), "announce")
            own(self._refresh_spec(), "refresh-spec")
            own(self._follow_revocations(), "revocations")
            own(self._watch_children(stop), "children")
            own(self._follow_gossip(stop), "gossip")
            own(self.placement.keep_connected(), "gossip-peers")
            own(self._watch(), "watch")
            own(self.reach.recheck(self.p2p), "reachability")
            if (keeper := self.reach.keep_relay()) is not None:
                own(keeper, "relay-keeper")
            serves = self.reach.serves  # if not, a trainer only: no stage to hold
            if serves and not await until_stopped(stop, lifecycle.join()):
                own.cancel()
                return
            if on_ready is not None:
                on_ready()
            if self.stages.second is not None:  # a two-stage node never moves
                own(lifecycle.load_second(), "second-stage")
            elif serves and self.movable:
                own(lifecycle.rebalance(), "rebalance")
            if serves and s.checkpoint_every_s > 0:
                own(checkpointer.every(s.checkpoint_every_s), "checkpoint")
            if s.bandwidth_mbps is None:
                own(self._measure_bandwidth(), "bandwidth")  # ends by itself
            if s.train:
                own(self.training.run(), "trainer")
            private = self.spec.private
            owner_key = None if private else owner_key_of(s.owner_key_path(), self.spec.run)
            if owner_key is not None:  # the owner's node of a public run announces it
                own(announce_run(self.dht, self.spec, owner_key), "directory")
            await stop.wait()
            own.cancel()

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
                # The DHT process's death takes its p2pd along: name the cause.
                raise self._child_exited() or NodeError(f"this node's p2pd stopped: {e}") from None

    async def _watch_children(self, stop: asyncio.Event) -> None:
        """Stop the node with a ``NodeError`` once its DHT process or the averager process
        of a stage it holds has exited (the OOM killer, say), or has left an ask that
        needs no network (the size of the DHT's routing table, the averager's group bits)
        unanswered for ``stuck_after_s`` (an averager: ``AVERAGER_PATIENCE`` times that;
        alive but stuck: stopped, or its event loop blocked). Every record, progress read and
        averaging round goes through them, so without one the node would live on, serving
        nothing or a copy no longer averaged; stopped, a service manager restarts it. A
        stop that follows within ``P2PD_GONE_GRACE_S`` (a Ctrl-C signals the whole process
        group) just ends this task. While it runs, a ``LoopStallWatch`` ends the process
        if the loop itself stops running."""
        loop = asyncio.get_running_loop()
        # (what, its pid) -> its ask, when asked: a stage released (moved from) takes its
        # ask along, unanswered for good, and one taken again has a new process.
        asks: dict[tuple[str, int | None], tuple[asyncio.Future, float]] = {}
        next_ask = loop.time()
        stuck_after = self.settings.stuck_after_s
        ask_every = min(CHILD_ASK_S, stuck_after / 3)
        stall = LoopStallWatch(LOOP_STALL * stuck_after)
        try:
            while (exited := self._child_exited()) is None:
                now = loop.time()
                stall.ticked()
                questions = self._questions()
                for key, (ask, asked) in list(asks.items()):
                    if key not in questions:
                        ask.cancel()
                        del asks[key]
                    elif ask.done():
                        if not ask.cancelled() and ask.exception() is not None:
                            logger.debug("asking the %s failed: %r", key[0], ask.exception())
                        del asks[key]
                    elif now - asked >= questions[key][1]:
                        exited = NodeError(
                            f"this node's {key[0]} has not answered for {now - asked:.0f} s "
                            "(it runs but is stuck)"
                        )
                if exited is not None:
                    break
                if now >= next_ask:
                    for key, (question, _) in questions.items():
                        if key not in asks:
                            asks[key] = (asyncio.ensure_future(question()), now)
                    next_ask = now + ask_every
                await asyncio.sleep(CHILDREN_CHECK_S)
        finally:
            stall.stop()
            for ask, _ in asks.values():
                ask.cancel()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(P2PD_GONE_GRACE_S):
                await stop.wait()
        if not stop.is_set():
            raise exited

    def _questions(self) -> dict[tuple[str, int | None], tuple[Callable[[], Coroutine], float]]:
        """What the watchdog asks each child process, and how long the answer may take, by
        the child's name and pid."""
        dht = ("DHT process", self.dht.dht.pid)
        patience = self.settings.stuck_after_s
        questions = {dht: (self.dht.known_peers, patience)}
        for stage, averager in self._averagers():
            process = averager.transport.process

            async def group_bits(process=process) -> str:
                return await process.get_group_bits(wait=False)

            key = (f"averager process of stage {stage}", process.pid)
            questions[key] = (group_bits, AVERAGER_PATIENCE * patience)
        return questions

    def _averagers(self) -> list[tuple[int, StageAverager]]:
        """The averagers of the stages held (or, on an archive node, kept), by stage."""
        averagers = [(stage, held.averager) for stage, held in self.stages.held.items()]
        if self.archive is not None:
            averagers += [(kept.stage, kept.averager) for kept in self.archive.stages]
        return averagers

    def _child_exited(self) -> NodeError | None:
        """The error to stop with if the DHT process or the averager process of a held
        (or, on an archive node, kept) stage has exited; None while they run."""
        process = self.dht.dht
        if not process.is_alive():
            return NodeError(f"this node's DHT process exited (exit code {process.exitcode})")
        for stage, averager in self._averagers():
            if (code := averager.transport.exited()) is not None:
                return NodeError(
                    f"this node's averager process of stage {stage} exited (exit code {code})"
                )
        return None

    async def _measure_bandwidth(self) -> None:
        """Measure up/down against a serving peer (``Offer.measure_bandwidth``) and
        re-announce with the measured figures; on failure it stays unknown."""
        try:
            records = await self.dht.peers()
            measured = await self.offer.measure_bandwidth(
                self.p2p, records, self.peer_id, self._reached
            )
        except Exception as e:  # a DHT hiccup, a peer's malformed answer: stays unknown
            logger.warning("measuring our bandwidth failed: %s: %s", type(e).__name__, e)
            return
        if measured:
            self._changed.set()

    async def _watch(self) -> None:
        """Follow who joins and leaves the run, keep linked to relayed peers, and log the
        node's heartbeat (``watch.watch_run``)."""

        async def link(peers: list[PeerInfo]) -> None:
            await self.reach.link_relayed(self.p2p, peers)

        s = self.settings
        await watch_run(
            self.dht, self.run_peers, self.peer_id, s.record_ttl_s, s.heartbeat_s, link,
            self._heartbeat,
        )  # fmt: skip

    @property
    def trainer(self) -> Trainer | None:
        """This node's trainer, once training."""
        return None if self.training is None else self.training.trainer

    def _heartbeat(self, peers: list[PeerInfo]) -> Heartbeat | None:
        """The node's heartbeat given a read of the run's ``peers``; None while it does not
        serve."""
        if self.state is not PeerState.SERVING:
            return None
        return Heartbeat.of(
            self.peer_id,
            peers,
            first=self.stages.stage,
            second=self.stages.serving_second,
            served=self.stages.micro_batches_served(),
            steps=self.stages.steps(),
        )

    def _announce(self) -> Coroutine[object, object, None]:
        """The task that keeps this node's record published (``publishing.announce_peer``)."""
        return announce_peer(
            self.dht, self.placement, self.key, self.info, self._changed,
            self.settings.update_period_s,
        )  # fmt: skip

    def _refresh_spec(self) -> Coroutine[object, object, None]:
        """The task that keeps the run's spec published (``publishing.refresh_spec``)."""
        return refresh_spec(self.dht, self.joined.signed)

    def _follow_revocations(self) -> Coroutine[object, object, None]:
        """The task that stops a private run's node once its membership ends
        (``publishing.follow_revocations``)."""
        return follow_revocations(self.dht, self.spec, self.membership)

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
                        await self.placement.announce(self.stages.stage, PeerState.LEAVING, 0)
                    await publish_peer(self.dht, leaving, self.key)
        except TimeoutError:
            logger.warning("could not announce our departure within %.0f s", grace_s)
        finally:
            await self._resources.aclose()


def write_maddrs(path: Path, maddrs: list[str]) -> None:
    write_atomic(path, ("\n".join(maddrs) + "\n").encode())
