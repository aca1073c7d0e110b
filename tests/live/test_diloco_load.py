"""DiLoCo stages whose outer rounds run long (a slow link): real ``AveragedStageServer``s
on real hivemind DHTs and averagers (loopback), fed training calls through real sessions.

Without ``overlap`` a stage holds new micro-batches while its outer round runs, each at
most ``HOLD_S``. A round longer than that (here every round: the averagers' all-reduce
waits ``SLOW_S`` first, a fault named ``_SlowLink``) must not cut the pipeline down to one
micro-batch per hold, a trainer must never give up on a held call, every micro-batch must
be computed and counted once, and a call whose caller left while it was held must not be
computed at all."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import uvloop
from hivemind.p2p import P2P

from node import events
from node.averaging.averager import AveragedStageServer
from node.averaging.process import StageAveragerProcess
from node.pipeline import client as stage_client
from node.pipeline.client import StageTimeout
from node.pipeline.server import HOLD_ROUND_S, HOLD_S
from node.pipeline.trainer import TrainerSettings
from protocol.stage_messages import StageContract
from tests.averaging_peer import CFG, LOOPBACK, STAGE, batch, make_spec, start_pair, stop_serving

SLOW_S = 8.0  # how long each all-reduce waits before it starts: rounds of 2-3 holds
FEEDERS = 4  # training calls in flight at once (a trainer's ``in_flight``)
# A trainer's timeout for a training call: its floor (``min_call_timeout_s``) plus a hold.
TRAINER_TIMEOUT_S = TrainerSettings().min_call_timeout_s + HOLD_ROUND_S
IMPATIENT_S = 1.0  # a caller that gives up on a call long before its hold ends
LONG_ROUNDS = 2  # per peer, fed throughout


class _SlowLink(StageAveragerProcess):
    """Fault: every all-reduce starts ``SLOW_S`` late (a slow link), then runs as usual."""

    async def _run_allreduce_inplace_(self, *args, **kwargs):
        await asyncio.sleep(SLOW_S)
        return await super()._run_allreduce_inplace_(*args, **kwargs)


async def _until(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:.0f} s: {what}")
        await asyncio.sleep(0.02)


def test_a_long_outer_round_holds_micro_batches_once_and_counts_each_once(tmp_path):
    """Fed by ``FEEDERS`` callers with a trainer's timeout through ``LONG_ROUNDS`` rounds of
    each peer: no call times out; the stages keep training during the rounds (after the
    first hold of a round it goes on overlapped: far more answers per round than one per
    hold per caller, and inner steps); the samples the stages computed are those
    answered. Then a
    caller that gives up on a held call: the stage drops it uncomputed (``abandoned``, a
    ``stage.abandoned`` event naming it)."""
    spec = make_spec(
        "diloco-load",
        mode="diloco",
        inner_steps=1,
        round_timeout_s=3 * SLOW_S,
        allreduce_timeout_s=2 * SLOW_S,
    )
    own, peers = start_pair(str(tmp_path), spec, "l")
    contract = StageContract.for_stage(CFG, spec.stage_range(STAGE), STAGE)
    servers: list[AveragedStageServer] = []
    seen: list[dict] = []
    stop_listening = events.listen(
        lambda e: seen.append(e) if e["event"] in ("averaging.round", "stage.abandoned") else None
    )
    client = None
    answered: list[float] = []  # when each training call was answered
    timed_out = 0

    async def call(index: int, timeout: float, server: AveragedStageServer) -> None:
        x, y = batch(index)
        await stage_client.loss(client, server.peer_id, x, y, run_id=spec.run, stage=STAGE,
                                train=True, micro_batch=index, timeout=timeout)  # fmt: skip

    async def feed(k: int, stop: asyncio.Event) -> None:
        """Micro-batches 1000 k + 1, ...: each to the next server; one that times out is
        sent again to the other, as a trainer reroutes it."""
        nonlocal timed_out
        index, turn = 1000 * k, k
        while not stop.is_set():
            index += 1
            while True:
                turn += 1
                try:
                    await call(index, TRAINER_TIMEOUT_S, servers[turn % 2])
                except StageTimeout:
                    timed_out += 1
                    continue
                answered.append(time.time())
                break

    async def body():
        nonlocal client
        for peer in peers:
            await peer.start(process_class=_SlowLink)
            await peer.averager.load_state()
            p2p = await peer.dht.replicate_p2p()
            servers.append(
                await AveragedStageServer.create(
                    p2p, peer.stage, peer.optimizer, contract, spec.run, averager=peer.averager
                )
            )
        try:
            await _until(lambda: all(p.averager.peers == 1 for p in peers), 20, "peers see each")
            maddrs = [m for peer in peers for m in peer.dht.visible_maddrs()]
            client = await P2P.create(host_maddrs=[LOOPBACK], initial_peers=maddrs)

            stop = asyncio.Event()
            async with asyncio.TaskGroup() as feeders:
                for k in range(FEEDERS):
                    feeders.create_task(feed(k + 1, stop))
                try:
                    await _until(
                        lambda: all(p.averager.stats.rounds + p.averager.stats.fallbacks
                                    >= LONG_ROUNDS for p in peers),
                        LONG_ROUNDS * 4 * SLOW_S + 30,
                        f"{LONG_ROUNDS} rounds of each peer",
                    )  # fmt: skip
                finally:
                    stop.set()
            assert timed_out == 0, "a held call outlasted a trainer's timeout"
            rounds = [
                e for e in seen
                if e["event"] == "averaging.round" and e["how"] in ("averaged", "fallback")
            ]  # fmt: skip
            assert rounds and all(e["seconds"] >= SLOW_S for e in rounds), rounds
            assert all(e["inner_steps"] >= 1 for e in rounds), rounds
            # Answers during each round, after its first hold: the stage kept serving.
            for e in rounds:
                start, end = e["t"] - e["seconds"] + HOLD_S + 0.5, e["t"] - 0.5
                during = [t for t in answered if start <= t <= end]
                per_hold = (end - start) / HOLD_S
                assert len(during) >= 2 * FEEDERS * per_hold, (len(during), e)
            # Every micro-batch the stages computed was answered, once.
            computed = sum(s.counters.backward for s in servers)
            assert computed == len(answered), (computed, len(answered))
            assert sum(s.counters.abandoned for s in servers) == 0

            # A caller that gives up while its call is held: it is dropped uncomputed.
            await _until(lambda: all(s.counters.waiting == 0 for s in servers), 30, "idle")
            await _until(lambda: all(not p.averager.busy for p in peers), 60, "rounds end")
            before = [s.counters.backward for s in servers]
            index = 10**6
            while not any(p.averager.strategy.holding for p in peers):
                index += 1
                await call(index, TRAINER_TIMEOUT_S, servers[index % 2])
                answered.append(time.time())
                await asyncio.sleep(0.05)
            holding = next(
                s for s, p in zip(servers, peers, strict=True) if p.averager.strategy.holding
            )
            held_before = holding.counters.held
            try:
                await call(10**7, IMPATIENT_S, holding)
                raise AssertionError("a call held for a round was answered within 1 s")
            except StageTimeout:
                pass
            await _until(lambda: holding.counters.abandoned == 1, 2 * HOLD_S, "the drop")
            assert holding.counters.held == held_before + 1
            gone = [e for e in seen if e["event"] == "stage.abandoned"]
            assert [e["micro_batch"] for e in gone] == [10**7], gone
            after = [s.counters.backward for s in servers]
            assert sum(after) - sum(before) == index - 10**6, (before, after)
        finally:
            stop_listening()
            await stop_serving(servers, client, peers)

    try:
        uvloop.run(asyncio.wait_for(body(), 240))
    finally:
        for dht in own:
            dht.shutdown()
