"""A Llama-preset run (``llama-tiny``: rotary positions, RMSNorm, SwiGLU, grouped-query
attention) trains through 2 stages x 2 peers: four nodes started as the README starts
them (the first creates the run with ``--preset llama-tiny --stages 2``, the others join
by its id, stages not pinned, each node training), and the run's validation loss falls."""

from __future__ import annotations

import asyncio
from collections import Counter

from node.harness.local_swarm import NodeProcess, launch_node, stop_all, wait_until
from tests.live.test_resume import _train_and_validate

TRAINED = 200  # micro-batches the four nodes' trainers run together before validating


def _trained(nodes: list[NodeProcess]) -> int:
    """Micro-batches trained by all the nodes' trainers, as their last ``train.progress``
    events say."""
    return sum(max((e["micro_batches"] for e in n.events("train.progress")), default=0)
               for n in nodes)  # fmt: skip


def test_a_llama_run_trains_through_two_stages_of_two_peers(tmp_path):
    nodes: list[NodeProcess] = []
    try:
        first = launch_node(tmp_path, "l0", "llama", train=True,
                            extra=["--preset", "llama-tiny", "--stages", "2"])  # fmt: skip
        nodes.append(first)
        first.wait_serving(90)
        run = first.run_id
        for i in range(1, 4):  # the three joiners at once
            nodes.append(launch_node(tmp_path, f"l{i}", run, initial_peers=[first.maddr],
                                     train=True, wait=False))  # fmt: skip
        wait_until(lambda: Counter(n.wait_serving(180) for n in nodes) == {0: 2, 1: 2}, 180,
                   "two peers on each of the two stages")  # fmt: skip
        initial, _ = asyncio.run(_train_and_validate(run, first.maddr, 0))
        start = _trained(nodes)
        wait_until(lambda: _trained(nodes) >= start + TRAINED, 300,
                   f"{TRAINED} micro-batches trained by the nodes")  # fmt: skip
        after, _ = asyncio.run(_train_and_validate(run, first.maddr, 0))
        rounds = [e for n in nodes for e in n.events("averaging.round")]
        steps = {s: max((e["epoch"] for e in rounds if e["stage"] == s), default=0)
                 for s in (0, 1)}  # fmt: skip
        print(f"llama-tiny 2 x 2: validation {initial:.3f} -> {after:.3f} after "
              f"{_trained(nodes)} micro-batches; optimizer steps per stage {steps}")  # fmt: skip
        assert all(n.alive() for n in nodes), [n.name for n in nodes if not n.alive()]
        assert min(steps.values()) > 0, steps
        # Each stage's two copies averaged: a round with both peers on each stage.
        for s in (0, 1):
            assert any(e["how"] == "averaged" and e["peers"] == 2 and e["stage"] == s
                       for e in rounds), s  # fmt: skip
        assert after < initial - 0.3, (initial, after)
    finally:
        stop_all(nodes)
