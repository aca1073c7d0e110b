"""``swarmtrain node``: run a node daemon until SIGINT or SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
from dataclasses import replace
from pathlib import Path
from typing import NoReturn

from node import events
from node.cli.args import parse_memory
from node.cli.exit import exit_closed
from node.cli.maddrs import check_can_listen
from node.daemon.node import Node, write_maddrs
from node.daemon.settings import NodeSettings
from node.daemon.tasks import until_stopped
from node.dashboard.address import check_can_bind, parse_address
from node.logs import log_to_file
from node.measure.capacity import pick_device
from node.rpc.membership import read_invite
from node.rpc.relay import RelaySettings
from protocol.admission import AdmissionLimits
from protocol.records import RecordError
from protocol.run_spec import read_spec_file

logger = logging.getLogger(__name__)


def settings_from(args: argparse.Namespace) -> NodeSettings:
    if not args.run and args.spec is None:
        raise ValueError("say which run: --run RUN_ID (or NAME for a new run) or --spec FILE")
    if args.second_stage is not None and args.stage is None:
        raise ValueError("--second-stage needs --stage: a pinned node pins both")
    if args.second_stage is not None and args.second_stage == args.stage:
        raise ValueError(f"--second-stage {args.second_stage} is the node's --stage already")
    if args.max_requests_per_peer > args.max_requests:
        raise ValueError(
            f"--max-requests-per-peer ({args.max_requests_per_peer}) must not exceed "
            f"--max-requests ({args.max_requests})"
        )
    if args.archive is not None:
        pinned = "--stage" if args.stage is not None else None
        if pinned:
            raise ValueError(f"--archive serves no stage: drop {pinned}")
        if args.checkpoint_every <= 0:
            raise ValueError("--archive pulls every --checkpoint-every seconds: give more than 0")
    settings = NodeSettings(
        run=args.run,
        spec_file=args.spec,
        invite=read_invite(args.invite),
        pretrained=args.pretrained,
        data=args.data,
        owner_key=args.owner_key,
        initial_peers=tuple(args.initial_peers),
        host_maddrs=tuple(args.host_maddrs),
        announce_maddrs=tuple(args.announce_maddrs),
        reachable=args.reachable,
        relay=RelaySettings(
            serve=not args.no_relay,
            use=not args.no_relay,
            max_reservations=args.relay_max_reservations,
            max_circuits=args.relay_max_circuits,
            data_limit_bytes=args.relay_data_limit_mib << 20,
            time_limit_s=args.relay_time_limit,
        ),
        identity=args.identity,
        device=args.device,
        stage=args.stage,
        second_stage=args.second_stage,
        two_stage=not args.one_stage,
        rebalance=not args.no_rebalance,
        rebalance_period_s=args.rebalance_period,
        resume_hold_s=args.resume_hold,
        preset=args.preset,
        n_stages=args.stages,
        compression=args.compression,
        throughput=args.throughput,
        remeasure=args.remeasure,
        bandwidth_mbps=args.bandwidth_mbps,
        max_upload_mbps=args.max_upload_mbps,
        max_download_mbps=args.max_download_mbps,
        max_memory=None if args.max_memory is None else parse_memory(args.max_memory),
        update_period_s=args.update_period,
        train=not args.no_train,
        heartbeat_s=args.heartbeat,
        stuck_after_s=args.stuck_after,
        checkpoint_every_s=args.checkpoint_every,
        checkpoint_dir=args.checkpoint_dir,
        archive=args.archive,
        events=args.events,
        dashboard=args.dashboard,
        limits=AdmissionLimits(
            per_caller=args.max_requests_per_peer,
            total=args.max_requests,
            first_s=args.request_start_timeout,
        ),
    )
    # its trainer routes only to peers its p2pd can dial (``--no-relay``: no circuits)
    trainer = replace(settings.trainer, dials_relays=settings.relay.dials_circuits)
    return replace(settings, trainer=trainer)


async def serve(node: Node, maddrs_file: Path | None) -> int:
    settings = node.settings
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal(sig: signal.Signals) -> None:
        logger.info("%s received: stopping", sig.name)
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)
    loop.set_exception_handler(_quiet_when_p2pd_is_gone)
    try:
        if await until_stopped(stop, node.prepare()):  # a stop meanwhile: just close
            maddrs = node.dht.visible_maddrs()
            dashboard = node.dashboard
            print(f"node {node.peer_id} in run {settings.run!r}; others join with:", flush=True)
            for m in maddrs:
                print(f"  --initial-peers {m}", flush=True)
            print(node.reach.line(), flush=True)
            print(
                f"log: {settings.log_path(node.peer_id)}  "
                f"events: {settings.events_path(node.peer_id)}",
                flush=True,
            )
            if dashboard is not None:
                print(f"dashboard: {dashboard.url}  metrics: {dashboard.metrics_url}", flush=True)
            if maddrs_file:  # after the printout: whoever waits for this file may read it
                write_maddrs(maddrs_file, maddrs)
            # last: whoever waits for this event may read the printout and the file
            events.emit(
                "node.started",
                run=node.spec.run,
                peer=node.peer_id,
                maddrs=maddrs,
                dashboard=dashboard and dashboard.url,
                metrics=dashboard and dashboard.metrics_url,
                log=str(settings.log_path(node.peer_id)),
                events=str(settings.events_path(node.peer_id)),
            )

            def on_ready() -> None:
                if settings.archive is not None:
                    line = f"archiving the {node.spec.n_stages} stages in {settings.archive}"
                elif (stage := node.stages.stage) is None:
                    line = "training only: this node serves no stage (not reachable)"
                else:
                    line = f"serving stage {stage} of {node.spec.n_stages} on {node.device.name}"
                print(line, flush=True)

            await node.run(stop, on_ready)
    finally:
        await node.close()
    print("node stopped", flush=True)
    return 0


def _quiet_when_p2pd_is_gone(loop: asyncio.AbstractEventLoop, context: dict) -> None:
    """hivemind's readers of p2pd's control connection fail when p2pd stops first (a
    Ctrl-C reaches it too), and nobody awaits them: that is no error of ours."""
    error = context.get("exception")
    if isinstance(error, ConnectionError | asyncio.IncompleteReadError):
        logger.debug("%s: %r", context.get("message"), error)
        return
    loop.default_exception_handler(context)


def check_before_start(settings: NodeSettings) -> None:
    """What can be checked before anything starts (no key written, no daemon started,
    nothing published): the device, and the pinned stages against the run's stage count
    where it is known here (a spec file, or a new run by name; a run joined by its id is
    checked once its spec is found, before the node announces itself)."""
    pick_device(settings.device)
    for maddr in settings.host_maddrs:
        check_can_listen(maddr)
    dashboard = parse_address(settings.dashboard)
    if dashboard is not None:
        check_can_bind(dashboard)
    n_stages = None
    if settings.spec_file is not None:
        with contextlib.suppress(OSError, RecordError):  # if so, resolve_run says why
            n_stages = read_spec_file(settings.spec_file.read_text()).spec.n_stages
    elif settings.run and "@" not in settings.run and not settings.initial_peers:
        n_stages = settings.n_stages
    for flag, stage in (("--stage", settings.stage), ("--second-stage", settings.second_stage)):
        if stage is not None and n_stages is not None and stage >= n_stages:
            raise ValueError(f"{flag} {stage}: the run has stages 0..{n_stages - 1}")


def run(args: argparse.Namespace) -> NoReturn:
    import uvloop

    settings = settings_from(args)
    check_before_start(settings)
    node = Node.start(settings)  # opens the node's event log
    log_to_file(node.settings.log_path(node.peer_id), verbose=args.verbose)
    exit_closed(uvloop.run(serve(node, args.maddrs_file)))  # serve closed the node
