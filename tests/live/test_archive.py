"""An archive node keeps a stage whose every peer died: 2 stages (one peer on stage 0,
two on stage 1) train while an archive node (``--archive DIR``) pulls every stage; both
peers of stage 1 are killed at once; a new node takes stage 1, loads it from the archive
(its ``stage.held`` event names the archive and the step), and the run goes on from there
instead of from the initial weights."""

from __future__ import annotations

import asyncio
import math
import signal

import psutil

from node.cli.export import newest_of_each_stage
from node.harness.local_swarm import NodeProcess, launch_node, stop_all, wait_until
from tests.live.test_resume import _train_and_validate

EVERY_S = 2.0  # the archive's --checkpoint-every
STEPS = 10  # of stage 1 that the archive holds before its peers die
FRESH = 5.5  # validation loss of the initial weights (bytes: about ln 256)


def _archived_step(archive: NodeProcess, stage: int, until: float = math.inf) -> int:
    """The newest step of ``stage`` the archive wrote (by time ``until``); -1: none."""
    written = archive.events("checkpoint.written")
    return max((e["step"] for e in written if e["stage"] == stage and e["t"] <= until), default=-1)


def test_a_stage_whose_peers_all_died_comes_back_from_the_archive(tmp_path):
    nodes: list[NodeProcess] = []
    try:
        first = launch_node(tmp_path, "s0", "archived", extra=["--stage", "0"], train=True)
        nodes.append(first)
        run, peers = first.run_id, [first.maddr]
        for name in ("s1a", "s1b"):  # started together: they wait on I/O at start
            nodes.append(launch_node(
                tmp_path, name, run, initial_peers=peers, extra=["--stage", "1"], train=True,
                wait=False,
            ))  # fmt: skip
        for n in nodes:
            n.wait_serving(120)
        directory = tmp_path / "archive"
        extra = ["--archive", str(directory), "--checkpoint-every", str(EVERY_S)]
        archive = launch_node(tmp_path, "archive", run, initial_peers=peers, extra=extra)
        nodes.append(archive)

        # The nodes train (as the README starts them); the archive pulls stage 1 as it goes.
        wait_until(lambda: _archived_step(archive, 1) >= STEPS, 120, "stage 1 trained")
        before, _ = asyncio.run(_train_and_validate(run, first.maddr, 0))
        assert before < FRESH - 1.0, before
        for n in nodes[1:3]:  # every peer of stage 1 at once
            n.proc.send_signal(signal.SIGKILL)
        for n in nodes[1:3]:
            n.proc.wait(30)

        joiner = launch_node(tmp_path, "s1new", run, initial_peers=peers, extra=["--stage", "1"])
        nodes.append(joiner)
        joiner.wait_serving(120)
        loaded = joiner.events("stage.held")[-1]
        assert loaded["loaded"] == "archive" and loaded["source"] == archive.peer_id, loaded
        archived = _archived_step(archive, 1, until=loaded["t"])
        assert loaded["step"] == archived >= STEPS, (loaded, archived)

        after, _ = asyncio.run(_train_and_validate(run, first.maddr, 0))
        print(f"validation {before:.3f} before the kill, {after:.3f} after; stage 1 "
              f"loaded at step {loaded['step']} from the archive")  # fmt: skip
        # Stage 0 trained on past the archive's last pull of stage 1 (at most a few seconds
        # of steps), so the loss may rise a little; from stage 1's initial weights it would
        # be back near FRESH.
        slack = 0.25 * (FRESH - before)
        assert after < before + slack, f"validation {before:.3f} before, {after:.3f} after"
        # What the archive keeps is a whole model: it exports like nodes' checkpoints.
        _, chosen = newest_of_each_stage([directory])
        assert [c.stage for c in chosen] == [0, 1] and chosen[1].metadata["step"] >= archived

        # An archive whose averager of a stage dies (the OOM killer) stops in one line, so
        # that its service manager restarts it, instead of keeping a stage no longer pulled.
        forked = sorted((c for c in psutil.Process(archive.proc.pid).children()
                         if c.name() not in ("p2pd", "torch_shm_manager")),
                        key=lambda c: c.create_time())  # fmt: skip
        assert len(forked) == 3, forked  # its DHT's, then one averager per stage
        forked[-1].kill()
        assert archive.proc.wait(60) == 2, archive.output()[-3000:]
        (line,) = [x for x in archive.output().splitlines() if x.startswith("swarmtrain node:")]
        assert (
            line == "swarmtrain node: error: this node's averager process of stage 1 exited "
            "(exit code -9)"
        )
    finally:
        stop_all(nodes)
