"""The benchmark's trainer: trains through a swarm in timed phases, reporting as it goes.

Each phase runs ``wiring`` for ``seconds`` (micro-batches still in flight when it ends
are dropped), or, written ``Nmb``, until N micro-batches completed; wiring ``idle``
trains nothing for its seconds (another trainer has the machine: paired phases). Timed
phases in a row end on one schedule (each ``seconds`` after the previous one's planned
end), so two trainers started together stay in step. With ``--gate`` the trainer, once
open, says ``ready`` and waits for a line on stdin before its first phase. Stdout
carries one JSON object a line: ``spec`` (what the run moves per sample), ``ready``
(with ``--gate``), ``phase`` (a phase starts),
``mb`` (a micro-batch completed: time, route, samples, loss), ``val`` (with
``--validate``: the validation loss after the last phase), ``end``; ``phase`` and ``end``
carry ``traffic``: the bytes this trainer's stage calls moved so far, sent and received,
by purpose (``node.limits``: every activation and gradient of the pipeline crosses
between the trainer and a stage, so these are all of them); with
``--trace-picks`` also ``pick`` (routing chose a peer for a call). Times are
``time.time()``, comparable with the orchestrator's.

    python -m scripts.swarm_bench.worker --run RUN --initial-peers MADDR \
        --phases warmup:stochastic:5 fixed:fixed:15 measured:stochastic:200mb --validate
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import sys
import time

from node import limits
from node.cli.train import open_trainer
from node.pipeline.trainer import MicroBatchResult, TrainerSettings
from node.rpc.dht import SwarmDHT
from scripts.swarm_bench.wire import required_bytes


def _emit(**event) -> None:
    print(json.dumps(event), flush=True)


def _phase(text: str) -> tuple[str, str, float | int]:
    """``NAME:WIRING:SECONDS`` (a float) or ``NAME:WIRING:Nmb`` (an int: micro-batches)."""
    name, wiring, length = text.split(":")
    if wiring not in ("stochastic", "fixed", "idle"):
        raise argparse.ArgumentTypeError(
            f"wiring must be stochastic, fixed or idle, got {wiring!r}"
        )
    if wiring == "idle" and length.endswith("mb"):
        raise argparse.ArgumentTypeError("an idle phase lasts seconds, not micro-batches")
    return name, wiring, int(length[:-2]) if length.endswith("mb") else float(length)


def _trace_picks(trainer) -> None:
    """Report every peer routing picks for a call (``pick``: time, peer), retries included:
    the partition scenario times how long new calls still go to a cut-off peer. Wraps the
    trainer's peer choice, the one point every call passes through."""
    choose = trainer._choose

    def traced(candidates, banned):
        peer = choose(candidates, banned)
        _emit(event="pick", t=time.time(), peer=peer)
        return peer

    trainer._choose = traced


def _traffic() -> dict[str, int]:
    """Bytes this process's calls moved so far, both directions, by purpose."""
    moved = dict.fromkeys(limits.PURPOSES, 0)
    for (purpose, _), n in limits.traffic.counts().bytes.items():
        moved[purpose] += n
    return moved


async def _run(dht: SwarmDHT, args: argparse.Namespace) -> None:
    settings = TrainerSettings(in_flight=args.in_flight, call_timeout_s=10)
    trainer = await open_trainer(dht, settings)
    try:
        _emit(event="spec", **required_bytes(trainer.spec, args.peers_per_stage))

        if args.trace_picks:
            _trace_picks(trainer)

        def on_result(r: MicroBatchResult) -> None:
            _emit(
                event="mb",
                t=time.time(),
                route=r.route,
                samples=r.samples,
                loss=r.loss,
                calls=r.call_s,
            )

        loop = asyncio.get_running_loop()
        if args.gate:
            _emit(event="ready", t=time.time())
            await loop.run_in_executor(None, sys.stdin.readline)
        end: float | None = None  # the planned end of the previous timed phase
        for name, wiring, length in args.phases:
            _emit(event="phase", name=name, wiring=wiring, t=time.time(), traffic=_traffic())
            if isinstance(length, int):
                trainer.settings = dataclasses.replace(settings, wiring=wiring)
                await trainer.train(length, on_result)
                end = None
                continue
            end = (loop.time() if end is None else end) + length
            if wiring == "idle":
                await asyncio.sleep(max(0.0, end - loop.time()))
                continue
            trainer.settings = dataclasses.replace(settings, wiring=wiring)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout_at(end):
                    await trainer.train(10**9, on_result)
        _emit(event="end", t=time.time(), traffic=_traffic())
        if args.validate:
            _emit(event="val", loss=await trainer.evaluate(), samples=trainer.stats.samples)
    finally:
        await trainer.p2p.shutdown()


def main() -> None:
    import uvloop

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run", required=True)
    p.add_argument("--initial-peers", nargs="+", required=True)
    p.add_argument("--host-maddrs", default="/ip4/127.0.0.1/tcp/0")
    p.add_argument("--in-flight", type=int, default=4)
    p.add_argument("--peers-per-stage", type=int, required=True)
    p.add_argument("--trace-picks", action="store_true", help="report each routing pick")
    p.add_argument("--phases", type=_phase, nargs="+", required=True, metavar="NAME:WIRING:S")
    p.add_argument("--validate", action="store_true", help="report the validation loss at the end")
    p.add_argument("--gate", action="store_true", help="say ready, wait for a stdin line")
    args = p.parse_args()
    dht = SwarmDHT.start(args.run, initial_peers=args.initial_peers,
                         host_maddrs=[args.host_maddrs], client_mode=True)  # fmt: skip
    try:
        uvloop.run(_run(dht, args))
    finally:
        dht.shutdown()


if __name__ == "__main__":
    main()
