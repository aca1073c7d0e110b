"""Pipeline training through a real local swarm: reroutes around killed peers, stateless
backward on another peer, and learning parity with the single-process baseline. The
trainer runs in the test's process and writes its events (``call.failed``,
``call.rerouted``) to a log the test opens."""

import asyncio
import os
import signal
import time
from contextlib import contextmanager

from models.config import preset
from models.training import train_baseline
from node import events
from node.cli.train import open_trainer
from node.harness.local_swarm import LOCAL, launch_node, stop_all
from node.pipeline import client as stage_client
from node.pipeline.trainer import StageCalls, Trainer, TrainerSettings
from node.rpc.dht import SwarmDHT


@contextmanager
def swarm(tmp_path, run, stages_of_peers, new_run: tuple[str, ...] = ()):
    """Nodes (no trainer loops) pinned to the given stages, and a DHT client for a trainer;
    ``new_run``: flags of the first node, which creates the run."""
    nodes, dht = [], None
    try:
        for i, stage in enumerate(stages_of_peers):
            peers = [nodes[0].maddr] if nodes else []
            extra, first = ["--stage", str(stage)], not nodes
            extra += list(new_run) if first else []
            # The joiners start together: they wait on I/O at start.
            node = launch_node(tmp_path, f"p{i}", run, initial_peers=peers, extra=extra, wait=first)
            nodes.append(node)
            run = nodes[0].run_id  # the others join the run by its id
        for n in nodes:
            n.wait_serving(120)
        dht = SwarmDHT.start(run, initial_peers=[nodes[0].maddr], host_maddrs=[LOCAL],
                             client_mode=True)  # fmt: skip
        yield nodes, dht
    finally:
        if dht is not None:
            dht.shutdown()
        stop_all(nodes)


async def _trainer(dht, calls: StageCalls | None = None, **settings) -> Trainer:
    base = await open_trainer(dht, TrainerSettings(call_timeout_s=10, **settings))
    if calls is None:
        return base
    return Trainer(base.dht, base.p2p, base.spec, base.corpus, base.settings, calls=calls)


def _wait_for_view(trainer: Trainer, per_stage: list[int]) -> None:
    async def ready():
        while True:
            await trainer.refresh()
            if [len(v) for v in trainer.view] == per_stage:
                return
            await asyncio.sleep(0.3)

    return asyncio.wait_for(ready(), 30)


def test_sigkill_during_training_is_rerouted(tmp_path, event_log):
    with swarm(tmp_path, "chaos", [0, 1, 0, 1]) as (nodes, dht):
        stage1 = [n for n in nodes if n.stage() == 1]

        async def main():
            trainer = await _trainer(dht, in_flight=4)
            try:
                await _wait_for_view(trainer, [2, 2])
                losses = []

                def on_result(r):
                    losses.append(r.loss)
                    if len(losses) == 20:
                        stage1[0].proc.send_signal(signal.SIGKILL)

                await trainer.train(200, on_result)
                return trainer, losses
            finally:
                await trainer.p2p.shutdown()

        trainer, losses = asyncio.run(main())
        assert stage1[0].proc.wait(10) == -signal.SIGKILL
        assert trainer.stats.micro_batches == 200, "every micro-batch completed"
        survivor, killed = stage1[1].peer_id, stage1[0].peer_id
        failed = events.read_events(event_log, "call.failed")
        assert (1, killed) in {(e["stage"], e["peer"]) for e in failed}, failed
        assert {e["stage"] for e in failed} == {1}, failed
        rerouted = events.read_events(event_log, "call.rerouted")
        assert len(rerouted) == len(failed), "each failed call was sent again"
        assert (1, survivor) in {(e["stage"], e["peer"]) for e in rerouted}, rerouted
        late_calls = trainer.stats.calls[(1, survivor)]
        assert late_calls > 180 / 2, "the surviving peer of stage 1 took over"
        assert sum(losses[-20:]) / 20 < sum(losses[:20]) / 20 - 0.3, "loss kept falling"


def test_a_peer_cut_off_mid_call_holds_training_for_seconds_not_the_timeout(tmp_path, event_log):
    """SIGSTOP one of stage 1's two peers: like a machine that lost its link, it neither
    answers nor closes its connections. The calls stuck there end after the stage's
    adaptive timeout (a few typical calls, at least 5 s), not after the 60 s ceiling, and
    the other peer of stage 1 takes over."""
    with swarm(tmp_path, "cutoff", [0, 1, 1]) as (nodes, dht):
        victim = next(n for n in nodes if n.stage() == 1)

        async def main():
            trainer = await open_trainer(dht, TrainerSettings(in_flight=4, call_timeout_s=60))
            try:
                await _wait_for_view(trainer, [1, 2])
                await trainer.train(20)  # the trainer learns how long the stages' calls take
                victim.proc.send_signal(signal.SIGSTOP)
                stopped = time.monotonic()
                await asyncio.wait_for(trainer.train(40), 50)
                return trainer, time.monotonic() - stopped
            finally:
                victim.proc.send_signal(signal.SIGCONT)
                await trainer.p2p.shutdown()

        trainer, took = asyncio.run(main())
        print(
            f"40 micro-batches in {took:.1f} s after stage 1's peer was stopped "
            f"({trainer.stats.rerouted[1]} calls rerouted; timeout ceiling 60 s)"
        )
        assert trainer.stats.micro_batches == 60
        failed = events.read_events(event_log, "call.failed")
        assert failed and {(e["stage"], e["peer"]) for e in failed} == {(1, victim.peer_id)}
        assert all(e["error"].startswith("StageTimeout") for e in failed), failed
        assert took < 30, f"training was held {took:.0f} s: stuck calls waited the ceiling"


def test_backward_runs_on_another_peer_after_forward_peer_dies(tmp_path, event_log):
    """Fault: SIGKILL the stage-0 peer that served the forward of the first micro-batch,
    before that micro-batch's backward is sent (to that peer first: it kept the graph)."""
    with swarm(tmp_path, "stateless", [0, 1, 0]) as (nodes, dht):
        pids = {n.peer_id: n.proc.pid for n in nodes}
        killed: list[str] = []

        async def forward_then_kill(p2p, peer, x, **kw):
            result = await stage_client.forward(p2p, peer, x, **kw)
            if kw["stage"] == 0 and not killed:
                killed.append(peer.to_base58())
                os.kill(pids[killed[0]], signal.SIGKILL)
            return result

        async def main():
            calls = StageCalls(forward=forward_then_kill)
            trainer = await _trainer(dht, calls, in_flight=1)
            try:
                await _wait_for_view(trainer, [2, 1])
                await trainer.train(3)
                return trainer
            finally:
                await trainer.p2p.shutdown()

        trainer = asyncio.run(main())
        assert killed and trainer.stats.micro_batches == 3
        (failed,) = events.read_events(event_log, "call.failed")
        (rerouted,) = events.read_events(event_log, "call.rerouted")
        (other,) = set(pids) - {killed[0]} - {nodes[1].peer_id}
        assert (failed["stage"], failed["peer"]) == (0, killed[0]), "the backward went there"
        assert (rerouted["stage"], rerouted["peer"]) == (0, other), "and then to the other"


def test_swarm_matches_baseline_loss_curve(tmp_path, corpus):
    """One peer per stage, one micro-batch in flight, the same seed, data and optimizer:
    the swarm computes what the baseline computes (uncompressed boundaries: int4's
    stochastic rounding would move each step's loss by about 1e-3)."""
    steps = 6
    model, optim = preset("tiny")
    micro_per_step = optim.target_batch_size // optim.micro_batch_size
    base = train_baseline(model, optim, corpus, steps=steps, n_stages=2, eval_every=10**6)
    with swarm(tmp_path, "parity", [0, 1], ("--compression", "none")) as (nodes, dht):

        async def main():
            trainer = await _trainer(dht, in_flight=1, stream=0)
            try:
                await _wait_for_view(trainer, [1, 1])
                losses = []
                await trainer.train(steps * micro_per_step, lambda r: losses.append(r.loss))
                return losses
            finally:
                await trainer.p2p.shutdown()

        losses = asyncio.run(main())
    swarm_steps = [
        sum(losses[i : i + micro_per_step]) / micro_per_step
        for i in range(0, len(losses), micro_per_step)
    ]
    diffs = [abs(a - b.train_loss) for a, b in zip(swarm_steps, base.steps, strict=True)]
    assert max(diffs) < 1e-3, diffs
    assert swarm_steps[-1] < swarm_steps[0] - 0.1  # and both learned
