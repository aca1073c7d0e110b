"""Helpers to run real local swarms in tests: node processes on 127.0.0.1 with their own
``p2pd`` daemons, the ``swarmtrain status`` client, and waiting with deadlines."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

LOCAL = "/ip4/127.0.0.1/tcp/0"
T = TypeVar("T")


def wait_until(check: Callable[[], T], timeout: float, what: str, every: float = 0.2) -> T:
    """Poll ``check`` until it returns something truthy; fail naming ``what`` at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(every)


@dataclass
class NodeProcess:
    name: str
    proc: subprocess.Popen
    log: Path
    maddrs_file: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    @property
    def maddr(self) -> str:
        return self.maddrs_file.read_text().split()[0]

    @property
    def peer_id(self) -> str:
        return self.maddr.rsplit("/p2p/", 1)[1]

    def stage(self) -> int | None:
        m = re.search(r"serving stage (\d+)", self.output())
        return int(m.group(1)) if m else None

    def wait_serving(self, timeout: float = 60) -> int:
        def serving():
            if self.proc.poll() is not None:
                raise AssertionError(f"node {self.name} exited early:\n{self.output()}")
            return self.stage() is not None

        wait_until(serving, timeout, f"node {self.name} to serve")
        return self.stage()

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout)


def launch_node(
    tmp: Path,
    name: str,
    run: str,
    *,
    initial_peers: list[str] = (),
    extra: list[str] = (),
    train: bool = False,
) -> NodeProcess:
    """Start ``swarmtrain node`` in its own process; returns once it has written its maddrs."""
    log = tmp / f"{name}.log"
    maddrs = tmp / f"{name}.maddrs"
    args = [
        sys.executable,
        "-m",
        "node.cli",
        "node",
        "--run",
        run,
        "--host-maddrs",
        LOCAL,
        "--identity",
        str(tmp / f"{name}.key"),
        "--maddrs-file",
        str(maddrs),
        "--update-period",
        "1",
        "--throughput",
        "100",
    ]
    if initial_peers:
        args += ["--initial-peers", *initial_peers]
    if not train:
        args.append("--no-train")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [*args, *extra], stdout=log.open("w"), stderr=subprocess.STDOUT, env=env
    )
    node = NodeProcess(name, proc, log, maddrs)

    def started():
        if proc.poll() is not None:
            raise AssertionError(f"node {name} exited with {proc.returncode}:\n{node.output()}")
        return maddrs.exists() and maddrs.read_text().strip()

    wait_until(started, 60, f"node {name} to start")
    return node


def status(run: str, maddr: str, timeout: float = 60) -> dict:
    """``swarmtrain status --json`` as a dict."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "node.cli",
            "status",
            "--run",
            run,
            "--initial-peers",
            maddr,
            "--host-maddrs",
            LOCAL,
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def stop_all(nodes: list[NodeProcess]) -> None:
    for n in nodes:
        if n.proc.poll() is None:
            n.proc.kill()
    for n in nodes:
        n.proc.wait(10)
