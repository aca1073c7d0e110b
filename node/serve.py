"""``swarmtrain node``: run a node daemon until SIGINT or SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from pathlib import Path

from node.daemon import Node, NodeSettings, write_maddrs
from node.membership import read_invite

logger = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--run",
        default="",
        help="the run's id (NAME@FINGERPRINT); a bare NAME with no --initial-peers starts a "
        "new public run owned by --owner-key",
    )
    p.add_argument("--spec", type=Path, help="the run's signed spec file (swarmtrain run create)")
    p.add_argument(
        "--invite", help="private runs: the invite token from the run's owner, or @FILE holding it"
    )
    p.add_argument(
        "--owner-key",
        type=Path,
        help="the run owner's key (default ~/.swarmtrain/owner.key): signs a new run's spec; "
        "the owner's own node needs no invite",
    )
    p.add_argument(
        "--initial-peers",
        nargs="*",
        default=[],
        metavar="MADDR",
        help="multiaddrs of nodes of the run",
    )
    p.add_argument(
        "--host-maddrs",
        nargs="*",
        default=["/ip4/0.0.0.0/tcp/0"],
        metavar="MADDR",
        help="where to listen (default: every interface, a free TCP port)",
    )
    p.add_argument(
        "--announce-maddrs",
        nargs="*",
        default=[],
        metavar="MADDR",
        help="addresses others should dial, e.g. behind port forwarding",
    )
    p.add_argument(
        "--identity", type=Path, help="key file (default ~/.swarmtrain/RUN/identity.key)"
    )
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda", "mps"])
    p.add_argument(
        "--stage", type=int, help="serve this stage instead of choosing one (and never move)"
    )
    p.add_argument(
        "--second-stage",
        type=int,
        help="with --stage: serve this stage as well (a two-stage node never moves)",
    )
    p.add_argument(
        "--one-stage",
        action="store_true",
        help="never take a second stage (a node that chooses its stage takes one when the "
        "swarm needs more two-stage peers: that needs memory for two stages)",
    )
    p.add_argument(
        "--rebalance-period",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="mean time between checks whether moving to another stage would raise the "
        "swarm's bottleneck (randomised around it)",
    )
    p.add_argument(
        "--no-rebalance", action="store_true", help="keep the stage taken at join; never move"
    )
    p.add_argument("--preset", default="tiny", help="new run only: model preset")
    p.add_argument("--stages", type=int, default=2, help="new run only: number of stages")
    p.add_argument(
        "--compression",
        default="none",
        choices=["none", "float16", "uint8"],
        help="new run only: compression of activations and gradients",
    )
    p.add_argument("--throughput", type=float, help="declare samples/s instead of measuring")
    p.add_argument("--remeasure", action="store_true", help="measure throughput again (not cached)")
    p.add_argument("--bandwidth-mbps", type=float, help="declare up/down bandwidth in Mbit/s")
    p.add_argument(
        "--update-period",
        type=float,
        default=5.0,
        help="seconds between record refreshes (records expire after 3)",
    )
    p.add_argument("--no-train", action="store_true", help="serve only; run no trainer loop")
    p.add_argument("--maddrs-file", type=Path, help="also write the join multiaddrs here")


def settings_from(args: argparse.Namespace) -> NodeSettings:
    if not args.run and args.spec is None:
        raise ValueError("say which run: --run RUN_ID (or NAME for a new run) or --spec FILE")
    if args.second_stage is not None and args.stage is None:
        raise ValueError("--second-stage needs --stage: a pinned node pins both")
    if not args.rebalance_period > 0:
        raise ValueError(f"--rebalance-period must be > 0 seconds, got {args.rebalance_period}")
    return NodeSettings(
        run=args.run,
        spec_file=args.spec,
        invite=read_invite(args.invite),
        owner_key=args.owner_key,
        initial_peers=tuple(args.initial_peers),
        host_maddrs=tuple(args.host_maddrs),
        announce_maddrs=tuple(args.announce_maddrs),
        identity=args.identity,
        device=args.device,
        stage=args.stage,
        second_stage=args.second_stage,
        two_stage=not args.one_stage,
        rebalance=not args.no_rebalance,
        rebalance_period_s=args.rebalance_period,
        preset=args.preset,
        n_stages=args.stages,
        compression=args.compression,
        throughput=args.throughput,
        remeasure=args.remeasure,
        bandwidth_mbps=args.bandwidth_mbps,
        update_period_s=args.update_period,
        train=not args.no_train,
    )


async def serve(node: Node, maddrs_file: Path | None) -> int:
    settings = node.settings
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal(sig: signal.Signals) -> None:
        logger.info("%s received: stopping", sig.name)
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)
    try:
        await node.prepare()
        maddrs = node.dht.visible_maddrs()
        print(f"node {node.peer_id} in run {settings.run!r}; others join with:", flush=True)
        for m in maddrs:
            print(f"  --initial-peers {m}", flush=True)
        if maddrs_file:  # after the printout: whoever waits for this file may read it
            write_maddrs(maddrs_file, maddrs)

        def on_ready() -> None:
            print(
                f"serving stage {node.stage} of {node.spec.n_stages} on {node.device.name}",
                flush=True,
            )

        await node.run(stop, on_ready)
    finally:
        await node.close()
    print("node stopped", flush=True)
    return 0


def run(args: argparse.Namespace) -> int:
    import uvloop

    node = Node.start(settings_from(args))
    return uvloop.run(serve(node, args.maddrs_file))
