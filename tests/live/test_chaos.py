"""Chaos: random SIGKILLs of peers during a short training run on a real local swarm.

Peers are killed at seeded random moments, each one a peer of a stage that still has
another (killing a stage's sole peer stalls training by design), and a replacement joins
while training goes on. Training must complete every micro-batch with finite, falling
losses, each call that failed (``call.failed`` events of the trainer, which runs in the
test's process) retried, and afterwards no process the test started may be left, however deep it was
in the tree (a node's DHT and averager children, every ``p2pd``).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import random
import signal
import time
import uuid
from collections import Counter
from pathlib import Path

import psutil

from node import events
from node.cli.train import open_trainer
from node.harness.local_swarm import LOCAL, NodeProcess, launch_node, stop_all
from node.pipeline.trainer import MicroBatchResult, TrainerSettings
from node.rpc.dht import SwarmDHT
from protocol.routing import candidates_by_stage

SEED = 6  # first kills a stage-0 peer (a replacement joins), then a random one
STAGES_OF_PEERS = [0, 1, 0, 1, 1]
MICRO_BATCHES = 240
KILLS = 2
TAG_VAR = "SWARMTRAIN_CHAOS_TAG"
KEEP = {"torch_shm_manager"}  # exits with its last client; see tests/conftest.py


def _tagged(tag: str) -> list[str]:
    """Processes anywhere on the machine whose environment carries ``tag``: everything
    exec'd below this test inherits it, also after its parent died and it was re-parented."""
    needle = f"{TAG_VAR}={tag}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        with contextlib.suppress(OSError, psutil.Error):
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                found += _alive([psutil.Process(int(entry.name))])
    return found


def _alive(procs: list[psutil.Process]) -> list[str]:
    """``procs`` still running (not zombies, not ``KEEP``), as 'pid name' for a message."""
    result = []
    for p in procs:
        with contextlib.suppress(psutil.Error):
            if p.name() not in KEEP and p.status() != psutil.STATUS_ZOMBIE:
                result.append(f"{p.pid} {p.name()}")
    return result


def _wait_gone(find, what: str, timeout: float = 20) -> None:
    """Poll until ``find()`` is empty; fail listing what is still there."""
    deadline = time.monotonic() + timeout
    while left := find():
        assert time.monotonic() < deadline, f"{what} still running after {timeout:.0f} s: {left}"
        time.sleep(0.2)


class Chaos:
    """Kills seeded-random non-sole peers at seeded-random micro-batches, and starts one
    replacement after the first kill."""

    def __init__(self, workdir: Path, run: str, nodes: list[NodeProcess], stage_of: dict):
        self.rng = random.Random(SEED)
        self.workdir, self.run, self.nodes, self.stage_of = workdir, run, nodes, stage_of
        self.kill_at = sorted(self.rng.sample(range(20, MICRO_BATCHES * 2 // 3), KILLS))
        self.killed: list[NodeProcess] = []
        self.done = 0

    def on_result(self, r: MicroBatchResult) -> None:
        self.done += 1
        if self.kill_at and self.done >= self.kill_at[0]:
            self.kill_at.pop(0)
            self._kill()

    def _kill(self) -> None:
        serving = [n for n in self.nodes if n.alive() and n.stage() is not None]
        per_stage = Counter(self.stage_of[n.name] for n in serving)
        eligible = [n for n in serving if per_stage[self.stage_of[n.name]] > 1]
        victim = self.rng.choice(eligible)
        victim.proc.send_signal(signal.SIGKILL)
        self.killed.append(victim)
        if len(self.killed) == 1:  # not waited for: it joins while training goes on
            stage = self.stage_of[victim.name]
            name = f"{victim.name}-replacement"
            peers = [n.maddr for n in self.nodes if n.alive()][:1]
            extra = ["--stage", str(stage)]
            node = launch_node(self.workdir, name, self.run, initial_peers=peers, extra=extra,
                               wait=False)  # fmt: skip
            self.nodes.append(node)
            self.stage_of[name] = stage


async def _train(dht: SwarmDHT, chaos: Chaos, n_peers: list[int]):
    trainer = await open_trainer(dht, TrainerSettings(in_flight=4, call_timeout_s=10))
    try:

        async def view() -> list[int]:
            return [len(c) for c in candidates_by_stage(await dht.peers(), len(n_peers))]

        async with asyncio.timeout(30):
            while await view() != n_peers:
                await asyncio.sleep(0.3)
        losses: list[float] = []

        def on_result(r: MicroBatchResult) -> None:
            losses.append(r.loss)
            chaos.on_result(r)

        await trainer.train(MICRO_BATCHES, on_result)
        return trainer, losses
    finally:
        await trainer.p2p.shutdown()


def test_random_sigkills_during_training(tmp_path, monkeypatch, event_log):
    tag = uuid.uuid4().hex
    monkeypatch.setenv(TAG_VAR, tag)
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    nodes: list[NodeProcess] = []
    stage_of: dict[str, int] = {}
    dht = None
    try:
        first = launch_node(tmp_path, "p0", "chaos", extra=["--stage", str(STAGES_OF_PEERS[0])])
        nodes.append(first)
        stage_of["p0"] = STAGES_OF_PEERS[0]
        for i, stage in enumerate(STAGES_OF_PEERS[1:], start=1):
            extra = ["--stage", str(stage)]  # started together: they wait on I/O at start
            node = launch_node(tmp_path, f"p{i}", first.run_id, initial_peers=[first.maddr],
                               extra=extra, wait=False)  # fmt: skip
            nodes.append(node)
            stage_of[f"p{i}"] = stage
        for n in nodes:
            n.wait_serving(120)
        run = first.run_id
        dht = SwarmDHT.start(run, initial_peers=[first.maddr], host_maddrs=[LOCAL],
                             client_mode=True)  # fmt: skip
        chaos = Chaos(tmp_path, run, nodes, stage_of)
        n_peers = [STAGES_OF_PEERS.count(s) for s in sorted(set(STAGES_OF_PEERS))]
        trainer, losses = asyncio.run(_train(dht, chaos, n_peers))
    finally:
        if dht is not None:
            dht.shutdown()
        stop_all(nodes)

    assert len(chaos.killed) == KILLS, "every scheduled kill happened during training"
    assert all(n.proc.returncode == -signal.SIGKILL for n in chaos.killed)
    assert trainer.stats.micro_batches == MICRO_BATCHES, "every micro-batch completed"
    assert all(math.isfinite(x) for x in losses), "no NaN or inf loss"
    # The tiny model's loss falls from 5.58 to a plateau near 5.0 in this many samples.
    first, last = sum(losses[:20]) / 20, sum(losses[-40:]) / 40
    assert last < first - 0.2, f"loss fell: {first:.3f} -> {last:.3f}"
    failed = events.read_events(event_log, "call.failed")
    killed = {n.peer_id for n in chaos.killed}
    assert killed & {e["peer"] for e in failed}, "calls to the killed peers failed"
    assert len(events.read_events(event_log, "call.rerouted")) == len(failed), "and were retried"

    children = psutil.Process().children
    _wait_gone(lambda: _alive([p for p in children(recursive=True) if p.pid not in before]),
               "children of the test")  # fmt: skip
    _wait_gone(lambda: _tagged(tag), "processes started by the test (re-parented p2pd too)")
