"""A swarm of node processes on this machine (127.0.0.1): for the demo, tests and benchmarks.

Each node is a real ``swarmtrain node`` process with its own ``p2pd``; nothing is mocked.
``LocalSwarm`` owns the processes it starts and kills whatever is left on ``close``.
"""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from node.events import read_events

LOCAL = "/ip4/127.0.0.1/tcp/0"
# How long a node may take to write its maddrs: imports, p2pd, the DHT and, for a joiner,
# its reachability check; a minute and more when other swarms load the machine.
START_TIMEOUT_S = 120.0
T = TypeVar("T")


def wait_until(check: Callable[[], T], timeout: float, what: str, every: float = 0.2) -> T:
    """Poll ``check`` until it returns something truthy; fail naming ``what`` at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(every)


def shifted_clock(shift_s: float) -> Callable[[list[str]], list[str]] | None:
    """A ``wrap`` for ``launch_node`` that runs the node with its clock ``shift_s`` seconds
    off (libfaketime, preloaded through ``env``, which execs: the node is the launched
    process itself, so stopping it leaves nothing behind, where the ``faketime`` command
    forks the node and leaves it running when it is killed); None if libfaketime is not
    installed (Debian: ``faketime``). Its ``p2pd``, a Go binary, keeps the true clock."""
    found = sorted(glob.glob("/usr/lib/*/faketime/libfaketime.so.1"))
    if not found:
        return None
    preload = [f"LD_PRELOAD={found[0]}", f"FAKETIME={shift_s:+g}s"]
    return lambda command: ["env", *preload, *command]


@dataclass
class NodeProcess:
    name: str
    proc: subprocess.Popen
    log: Path
    maddrs_file: Path
    events_file: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def events(self, event: str | None = None) -> list[dict]:
        """The node's structured events (``node.events``), all or of one kind."""
        return read_events(self.events_file, event)

    @property
    def maddr(self) -> str:
        return self.maddrs_file.read_text().split()[0]

    @property
    def peer_id(self) -> str:
        return self.maddr.rsplit("/p2p/", 1)[1]

    @property
    def run_id(self) -> str:
        """The id of the run this node is in, as others must name it to join."""
        started = self.events("node.started")
        if not started:
            raise RuntimeError(f"node {self.name} has not said which run it is in yet")
        return started[-1]["run"]

    @property
    def dashboard(self) -> str | None:
        """The URL of the node's dashboard (``node.started``); None when it serves none."""
        started = self.events("node.started")
        if not started:
            raise RuntimeError(f"node {self.name} has not said where it serves yet")
        return started[-1].get("dashboard")

    def stage(self) -> int | None:
        """The first stage the node holds now (None before it holds one)."""
        stage = None
        for e in self.events():
            if e["event"] == "stage.held" and e["role"] == "first":
                stage = e["stage"]
            elif e["event"] == "stage.released" and e["stage"] == stage:
                stage = None
        return stage

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait_serving(self, timeout: float = 60) -> int:
        def serving() -> bool:
            if not self.alive():
                raise RuntimeError(f"node {self.name} exited early:\n{self.output()[-2000:]}")
            return self.stage() is not None

        wait_until(serving, timeout, f"node {self.name} to serve")
        return self.stage()

    def wait_started(self, timeout: float = START_TIMEOUT_S) -> str:
        """Wait until the node has said ``node.started``, which it says after writing its
        maddrs (``launch_node`` with ``wait`` does); return the first. Fails, with the node's
        output, if it exits first."""

        def started() -> bool:
            if not self.alive():
                raise RuntimeError(
                    f"node {self.name} exited with {self.proc.returncode}:\n{self.output()}"
                )
            return bool(self.events("node.started")) and bool(self.maddrs_file.read_text().strip())

        wait_until(started, timeout, f"node {self.name} to start")
        return self.maddr

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        if self.alive():
            self.proc.send_signal(sig)
        return self.proc.wait(timeout)


def launch_node(
    workdir: Path,
    name: str,
    run: str,
    *,
    initial_peers: Sequence[str] = (),
    extra: Sequence[str] = (),
    train: bool = False,
    update_period: float = 1.0,
    wait: bool = True,
    host_maddr: str = LOCAL,
    wrap: Callable[[list[str]], list[str]] | None = None,
    two_stage: bool = False,
    dashboard: str = "off",
) -> NodeProcess:
    """Start ``swarmtrain node`` in its own process; with ``wait``, return once it has
    written its maddrs. ``wrap`` turns the command into the one to run (e.g. inside a
    network namespace). Unless ``two_stage``, the node never takes a second stage by
    itself (``--one-stage``): several nodes share this machine, and a test of anything
    else wants one stage and one averager per node. ``dashboard``: its ``--dashboard``
    (off by default: the default port serves one node per machine; ``auto`` picks a free
    one, and the node's ``node.started`` event says where)."""
    workdir.mkdir(parents=True, exist_ok=True)
    log, maddrs = workdir / f"{name}.log", workdir / f"{name}.maddrs"
    events = workdir / f"{name}.events.jsonl"
    maddrs.unlink(missing_ok=True)
    events.unlink(missing_ok=True)
    args = [
        sys.executable, "-m", "node.cli", "node", "--run", run, "--host-maddrs", host_maddr,
        "--identity", str(workdir / f"{name}.key"), "--maddrs-file", str(maddrs),
        "--checkpoint-dir", str(workdir / f"{name}.checkpoints"), "--events", str(events),
        "--update-period", str(update_period), "--throughput", "100", "--dashboard", dashboard,
    ]  # fmt: skip
    if initial_peers:
        args += ["--initial-peers", *initial_peers]
    elif "@" not in run:  # starts a new run: its owner key stays in the work directory
        args += ["--owner-key", str(workdir / "owner.key")]
    if not train:
        args.append("--no-train")
    if not two_stage:
        args.append("--one-stage")
    # One torch thread per node: several nodes share this machine's cores.
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    command = [*args, *extra]
    with log.open("w") as out:
        proc = subprocess.Popen(
            wrap(command) if wrap else command, stdout=out, stderr=subprocess.STDOUT, env=env
        )
    node = NodeProcess(name, proc, log, maddrs, events)
    if not wait:
        return node
    try:
        node.wait_started()
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return node


def stop_all(nodes: Sequence[NodeProcess], timeout: float = 10) -> None:
    """Kill every node still running and reap it."""
    for n in nodes:
        if n.alive():
            n.proc.kill()
    for n in nodes:
        n.proc.wait(timeout)
