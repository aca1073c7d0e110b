"""A node as the README starts it, alone in its run: training on, default flags.

A lone node holds every stage (it takes the second stage too, being the swarm's only
peer), so its own trainer has nobody to call but itself. It must keep training (its
trainer calls its own stages in-process: libp2p does not dial itself) and keep serving
for minutes, and a Ctrl-C in its terminal (SIGINT to the whole process group, ``p2pd``
and the averager processes included) must stop it within seconds, leaving no process.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from node.dht import SwarmDHT
from protocol.averaging import decode_progress, progress_key
from tests.swarm import LOCAL, status, wait_until

RUN_FOR_S = 180.0  # a trainer that could not reach a stage gave up after 120 s


def _epochs(dht: SwarmDHT, run: str, stage: int) -> dict[str, int]:
    """Each peer's optimizer steps on ``stage``, as its progress record in the DHT says."""
    found = dht.dht.get(progress_key(run, stage), latest=True)
    if found is None or not isinstance(found.value, dict):
        return {}
    records = (decode_progress(k, v.value) for k, v in found.value.items())
    return {p.peer_id: p.epoch for p in records}


def _group(pgid: int) -> list[psutil.Process]:
    """The processes still alive in process group ``pgid`` (zombies count: not reaped)."""
    result = []
    for p in psutil.process_iter(["pid"]):
        try:
            if os.getpgid(p.pid) == pgid:
                result.append(p)
        except (ProcessLookupError, psutil.NoSuchProcess):
            continue
    return result


def test_a_lone_default_node_trains_for_minutes_and_stops_on_ctrl_c(tmp_path: Path):
    maddrs = tmp_path / "maddrs"
    env = dict(os.environ, HOME=str(tmp_path), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    command = [
        sys.executable, "-m", "node.cli", "node", "--run", "alone", "--preset", "tiny",
        "--stages", "2", "--host-maddrs", LOCAL, "--maddrs-file", str(maddrs),
    ]  # fmt: skip
    log = tmp_path / "node.log"
    with log.open("w") as out:  # its own session: a Ctrl-C there reaches only its group
        proc = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    dht = None
    try:

        def started() -> str | None:
            assert proc.poll() is None, log.read_text()[-3000:]
            words = maddrs.read_text().split() if maddrs.exists() else []
            return words[0] if words else None

        maddr = wait_until(started, 90, "the node to start")
        run = next(
            line.split("'")[1] for line in log.read_text().splitlines() if "in run '" in line
        )

        def both_stages_served() -> bool:
            assert proc.poll() is None, log.read_text()[-3000:]
            peers = status(run, maddr)["peers"]
            return bool(peers) and bool(peers[0]["second_serving"])

        wait_until(both_stages_served, 90, "the node to serve both stages", every=1.0)
        began = time.monotonic()
        dht = SwarmDHT.start(run, initial_peers=[maddr], host_maddrs=[LOCAL], client_mode=True)
        first = [_epochs(dht, run, s) for s in range(2)]
        while time.monotonic() - began < RUN_FOR_S:
            assert proc.poll() is None, f"the node died:\n{log.read_text()[-3000:]}"
            time.sleep(5)
        last = [_epochs(dht, run, s) for s in range(2)]
        for stage in range(2):
            (peer,) = last[stage]
            before = first[stage].get(peer, 0)
            # a tiny step takes ~0.1 s here; a stalled trainer adds none
            assert last[stage][peer] > before + 50, (stage, first, last)

        proc_pgid = os.getpgid(proc.pid)
        os.killpg(proc_pgid, signal.SIGINT)  # what Ctrl-C in its terminal does
        stopped = time.monotonic()
        assert proc.wait(timeout=10) == 0, log.read_text()[-3000:]
        wait_until(lambda: not _group(proc_pgid), 10 - (time.monotonic() - stopped),
                   "every process of the node to exit")  # fmt: skip
    finally:
        if dht is not None:
            dht.shutdown()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
