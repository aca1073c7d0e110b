"""A whole swarm stopped at once resumes from its checkpoints: 2 stages x 2 peers train,
every node process is stopped at once (stage 0's peers by SIGKILL, so that stage has only
the checkpoints written while it ran; stage 1's by SIGTERM, a clean stop that checkpoints
first), the same nodes (same identities, same checkpoint folders, stages no longer pinned)
start again, each takes the stage it kept, and the run goes on from where the checkpoints
left it instead of from the initial weights. One swarm shows both stops: each stage's
peers were stopped alike, so neither stage can borrow the other kind's checkpoint."""

from __future__ import annotations

import asyncio
import signal
import time

from node.cli.train import open_trainer
from node.harness.local_swarm import LOCAL, NodeProcess, launch_node, stop_all, wait_until
from node.pipeline.trainer import TrainerSettings
from node.rpc.dht import SwarmDHT

STAGES = [0, 1, 0, 1]
EVERY_S = 2.0  # --checkpoint-every
STOP = {0: signal.SIGKILL, 1: signal.SIGTERM}  # how each stage's peers are stopped


def _launch(tmp_path, run: str, pin: bool) -> list[NodeProcess]:
    """The 2 x 2 swarm checkpointing every ``EVERY_S``, pinned to its stages with
    ``pin``; started again under the same names, each node finds its identity and its
    checkpoints (and, not pinned, takes the stage of its checkpoints by itself)."""
    nodes: list[NodeProcess] = []
    for i, stage in enumerate(STAGES):
        extra = ["--checkpoint-every", str(EVERY_S)] + (["--stage", str(stage)] if pin else [])
        initial = [nodes[0].maddr] if nodes else []
        # Pinned, the joiners start together (they wait on I/O at start). Unpinned, one
        # after another, as before the stop: a node alone for long may move to an empty
        # stage, and the test is about each resuming its checkpoint's stage.
        together = pin and bool(nodes)
        nodes.append(
            launch_node(
                tmp_path, f"r{i}", run, initial_peers=initial, extra=extra, wait=not together
            )
        )
        run = nodes[0].run_id
    for n in nodes:
        n.wait_serving(120)
    return nodes


async def _train_and_validate(run: str, maddr: str, micro_batches: int) -> tuple[float, int]:
    dht = SwarmDHT.start(run, initial_peers=[maddr], host_maddrs=[LOCAL], client_mode=True)
    try:
        trainer = await open_trainer(dht, TrainerSettings(in_flight=2, call_timeout_s=10))
        try:
            if micro_batches:
                await trainer.train(micro_batches)
            return await trainer.evaluate(), trainer.stats.samples
        finally:
            await trainer.p2p.shutdown()
    finally:
        dht.shutdown()


async def _train_until_checkpointed(
    run: str, nodes: list[NodeProcess], micro_batches: int
) -> tuple[float, int, float, float]:
    """One trainer for the run before the stop (a DHT client and a trainer each cost a
    process start): the validation loss at the initial weights, the samples of
    ``micro_batches`` trained, when training ended, and the validation loss once every
    node has checkpointed what it holds at least once since then."""
    dht = SwarmDHT.start(run, initial_peers=[nodes[0].maddr], host_maddrs=[LOCAL],
                         client_mode=True)  # fmt: skip
    try:
        trainer = await open_trainer(dht, TrainerSettings(in_flight=2, call_timeout_s=10))
        try:
            initial = await trainer.evaluate()
            await trainer.train(micro_batches)
            trained = time.time()
            await asyncio.to_thread(wait_until, lambda: all(
                any(e["t"] > trained for e in n.events("checkpoint.written")) for n in nodes
            ), 30, "a checkpoint of every node after training")  # fmt: skip
            return initial, trainer.stats.samples, trained, await trainer.evaluate()
        finally:
            await trainer.p2p.shutdown()
    finally:
        dht.shutdown()


def _checkpointed_steps(nodes: list[NodeProcess], after: float) -> dict[int, int]:
    """The most steps of each stage in a checkpoint written after ``after``."""
    steps: dict[int, int] = {}
    for n in nodes:
        for e in n.events("checkpoint.written"):
            if e["t"] > after:
                steps[e["stage"]] = max(steps.get(e["stage"], 0), e["step"])
    return steps


def test_a_whole_swarm_killed_and_stopped_at_once_resumes_from_its_checkpoints(tmp_path):
    nodes: list[NodeProcess] = []
    try:
        nodes = _launch(tmp_path, "resume", pin=True)
        run = nodes[0].run_id
        initial, samples, trained, before = asyncio.run(_train_until_checkpointed(run, nodes, 120))
        assert samples >= 120 * 8
        assert before < initial - 0.5, (initial, before)
        steps = _checkpointed_steps(nodes, trained)
        assert set(steps) == {0, 1} and min(steps.values()) > 0, steps
        own = {n.name: _checkpointed_steps([n], trained) for n in nodes}

        stopped = time.time()
        for n, stage in zip(nodes, STAGES, strict=True):  # the whole swarm at once
            n.proc.send_signal(STOP[stage])
        for n, stage in zip(nodes, STAGES, strict=True):
            code = n.proc.wait(60)  # a stopped node exits within 60 s (the README's promise)
            if STOP[stage] == signal.SIGTERM:  # a clean stop: exit 0, its stage checkpointed
                at_stop = [e for e in n.events("checkpoint.written") if e["t"] >= stopped]
                assert code == 0 and at_stop, (n.name, code, n.output()[-2000:])

        nodes = _launch(tmp_path, "resume", pin=False)  # as the README starts a node
        resumed = {}
        for n, stage in zip(nodes, STAGES, strict=True):
            held = n.events("stage.held")
            assert held and held[-1]["stage"] == stage, (n.name, held, "its checkpoint's stage")
            assert held[-1]["loaded"] in ("checkpoint", "peers"), held
            # Its own checkpoint, or a peer's newer state (``protocol.archive.start_from``).
            assert held[-1]["step"] >= own[n.name][stage], (n.name, held[-1], own)
            resumed[n.name] = (stage, held[-1]["loaded"], held[-1]["step"])
        for stage in (0, 1):  # the stage's newest checkpoint is where its peers go on
            assert max(s for st, _, s in resumed.values() if st == stage) >= steps[stage]
        after, _ = asyncio.run(_train_and_validate(nodes[0].run_id, nodes[0].maddr, 0))
        print(f"validation {initial:.3f} at start, {before:.3f} before the stop, {after:.3f} "
              f"after; steps checkpointed {steps}; resumed {resumed}")  # fmt: skip
        assert abs(after - before) < 0.05, f"validation {before:.3f} before, {after:.3f} after"
    finally:
        stop_all(nodes)


def _losses(node: NodeProcess) -> list[float]:
    """The training losses its trainer reported (every 10 micro-batches)."""
    return [e["loss"] for e in node.events("train.progress")]


def test_a_whole_swarm_restarted_node_by_node_keeps_each_stages_training(tmp_path):
    """2 stages, 2 nodes with default flags (trainers on, second stages allowed): the
    first holds both stages, the second joins one. Both stop; the node that kept one
    stage comes back first and alone, the other later. Alone, the first must not start
    the stage it kept no state of from scratch (the other's checkpoint is that stage's
    only copy): at the end both stages serve from their resumed states, and training
    goes on at the loss it had, not the initial one."""
    extra = ["--checkpoint-every", str(EVERY_S)]
    nodes: list[NodeProcess] = []
    try:
        first = launch_node(tmp_path, "w0", "restart", extra=extra, train=True, two_stage=True)
        nodes = [first]
        first.wait_serving(120)
        joiner = launch_node(tmp_path, "w1", first.run_id, initial_peers=[first.maddr],
                             extra=extra, train=True, two_stage=True)  # fmt: skip
        nodes.append(joiner)
        joiner.wait_serving(120)
        run = first.run_id

        def trained() -> bool:  # each node has trained a while with the other
            steps = _checkpointed_steps(nodes, 0)
            enough = set(steps) == {0, 1} and min(steps.values()) >= 20
            return enough and all(len(_losses(n)) >= 4 for n in nodes)

        wait_until(trained, 180, "both nodes training and both stages checkpointed", every=1.0)
        initial = _losses(first)[0]  # near the initial weights (the joiner came later)
        stopped = time.time()
        for n in nodes:
            n.proc.send_signal(signal.SIGTERM)
        for n in nodes:  # a clean stop checkpoints what it holds
            assert n.proc.wait(60) == 0, n.output()[-2000:]
        before = [loss for n in nodes for loss in _losses(n)[-3:]]
        steps = _checkpointed_steps(nodes, 0)
        kept = {n.name: {e["stage"] for e in n.events("checkpoint.written")} for n in nodes}
        assert all(e["t"] >= stopped for n in nodes for e in n.events("checkpoint.written")[-1:])

        # The node that kept fewer stages comes back first, alone: started from its
        # checkpoints' copy of the run's spec, as no peer is up to give it.
        names = sorted(kept, key=lambda name: len(kept[name]))
        assert kept[names[0]] != {0, 1} and kept[names[1]] == {0, 1}, kept
        spec = tmp_path / f"{names[0]}.checkpoints" / "spec.json"
        alone = launch_node(tmp_path, names[0], run, extra=[*extra, "--spec", str(spec)],
                            train=True, two_stage=True)  # fmt: skip
        nodes = [alone]
        alone.wait_serving(120)

        def decided() -> list[dict]:  # on a second stage: to wait, or (wrongly) to take it
            second = [e for e in alone.events("stage.held") if e["role"] == "second"]
            return alone.events("placement.waiting") + second

        wait_until(decided, 60, "the lone node's decision on a second stage")
        later = launch_node(tmp_path, names[1], run, initial_peers=[alone.maddr], extra=extra,
                            train=True, two_stage=True)  # fmt: skip
        nodes.append(later)
        later.wait_serving(120)
        wait_until(lambda: all(len(_losses(n)) >= 2 for n in nodes), 120,
                   "both nodes training again", every=1.0)  # fmt: skip

        held = [e for n in nodes for e in n.events("stage.held")]
        after = {n.name: _losses(n)[:2] for n in nodes}
        print(f"kept {kept}; checkpointed steps {steps}; held after the restart "
              f"{[(e['stage'], e['role'], e['loaded'], e['step']) for e in held]}; loss at "
              f"start {initial:.2f}, before the stop {before}, after {after}")  # fmt: skip
        assert alone.events("placement.waiting"), "the lone node took a stage from scratch"
        assert not [e for e in held if e["loaded"] == "initial"], held
        for stage in (0, 1):  # served from the newest state checkpointed before the stop
            assert max(e["step"] for e in held if e["stage"] == stage) >= steps[stage], held
        mid = (initial + sum(before) / len(before)) / 2
        for n in nodes:  # its trainer goes on at the loss it had, far from the initial one
            assert max(after[n.name]) < mid, (n.name, initial, before, after)
    finally:
        stop_all(nodes)
