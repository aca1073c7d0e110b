"""A node as the README starts it, alone in its run: training on, default flags.

A lone node holds every stage (it takes the second stage too, being the swarm's only
peer), so its own trainer has nobody to call but itself. It must keep training (its
trainer calls its own stages in-process: libp2p does not dial itself) and keep serving
through its first heartbeat (a minute, with default flags); a Ctrl-C in its terminal
(SIGINT to the whole process group, ``p2pd`` and the averager processes included) must
stop it within seconds, leaving no process, and with its stages checkpointed: the model
exports (from the live node too) and samples, and the node restarted resumes where it
stopped. What the node did is read from its events, in the default place (beside its
identity).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from hivemind.utils import get_dht_time

from node.events import read_events
from node.rpc.dht import SwarmDHT
from protocol.averaging import decode_progress, progress_key
from tests.swarm import LOCAL, status, wait_until

# How long, at least, the node trains before it is stopped; it trains on until its first
# heartbeat (60 s by default after it started), which it must live through. A trainer that
# dials itself through libp2p fails every call: it steps not at all, whatever the duration,
# and each half of the run must step. Since the node pauses a failed trainer instead of
# dying with it, waiting out the trainer's 120 s give-up (``TrainerSettings.stage_wait_s``)
# would show nothing more.
RUN_FOR_S = 30.0


def _epochs(dht: SwarmDHT, run: str, stage: int) -> dict[str, int]:
    """Each peer's optimizer steps on ``stage``, as its progress record in the DHT says."""
    found = dht.dht.get(progress_key(run, stage), latest=True)
    if found is None or not isinstance(found.value, dict):
        return {}
    now = get_dht_time()
    records = (decode_progress(v.value, subkey=k, run=run, now=now) for k, v in found.value.items())
    return {p.peer_id: p.epoch for p in records}


def _events(home: Path, kind: str) -> list[dict]:
    """The node's events of ``kind`` (``HOME`` is ``home``; the run is named "alone")."""
    return [e for f in sorted((home / ".swarmtrain/alone/events").glob("*.jsonl"))
            for e in read_events(f, kind)]  # fmt: skip


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


def _start(tmp_path: Path, log: Path, maddrs: Path) -> subprocess.Popen:
    """The README's node, in its own session (a Ctrl-C there reaches only its group)."""
    env = dict(os.environ, HOME=str(tmp_path), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    command = [
        sys.executable, "-m", "node.cli", "node", "--run", "alone", "--preset", "tiny",
        "--stages", "2", "--host-maddrs", LOCAL, "--maddrs-file", str(maddrs),
        "--dashboard", "auto",  # the default port serves one node per machine
    ]  # fmt: skip
    maddrs.unlink(missing_ok=True)
    with log.open("w") as out:
        return subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )


def _serving_both(proc: subprocess.Popen, home: Path, log: Path, maddrs: Path) -> tuple[str, str]:
    """Wait until the node serves both stages; its run id and address."""

    def started() -> str | None:
        assert proc.poll() is None, log.read_text()[-3000:]
        words = maddrs.read_text().split() if maddrs.exists() else []
        return words[0] if words else None

    maddr = wait_until(started, 90, "the node to start")
    run = _events(home, "node.started")[-1]["run"]

    def holds_both() -> bool:
        assert proc.poll() is None, log.read_text()[-3000:]
        return {e["role"] for e in _events(home, "stage.held")} == {"first", "second"}

    wait_until(holds_both, 90, "the node to serve both stages", every=0.5)

    def announced() -> bool:  # its record says so too, as others read it
        peers = status(run, maddr, timeout=120)["peers"]
        return bool(peers) and bool(peers[0]["second_serving"])

    wait_until(announced, 60, "the node's record to list its second stage", every=1.0)
    return run, maddr


def _ctrl_c(proc: subprocess.Popen, home: Path, log: Path) -> None:
    """SIGINT to the node's process group, as Ctrl-C in its terminal: it must exit 0
    within 10 s, and every process of the group with it, having checkpointed both stages
    and closed."""
    pgid = os.getpgid(proc.pid)
    sent = time.time()
    os.killpg(pgid, signal.SIGINT)
    stopped = time.monotonic()
    assert proc.wait(timeout=10) == 0, log.read_text()[-3000:]
    left = 10 - (time.monotonic() - stopped)
    wait_until(lambda: not _group(pgid), left, "every process of the node to exit")
    assert [e for e in _events(home, "node.stopped") if e["t"] >= sent]
    assert {e["stage"] for e in _events(home, "checkpoint.written") if e["t"] >= sent} == {0, 1}


def _alive(proc: subprocess.Popen, log: Path) -> None:
    assert proc.poll() is None, f"the node died:\n{log.read_text()[-3000:]}"


def _alive_until(proc: subprocess.Popen, log: Path, when: float) -> None:
    """Wait until ``time.monotonic()`` passes ``when``; the node must live meanwhile."""

    def passed() -> bool:
        _alive(proc, log)
        return time.monotonic() >= when

    wait_until(passed, max(0.0, when - time.monotonic()) + 5, "the run's time", every=1.0)


def _cli(tmp_path: Path, *args: str) -> str:
    env = dict(os.environ, HOME=str(tmp_path), OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "node.cli", *args], capture_output=True, text=True, env=env,
        timeout=240,  # a loaded machine: imports, a DHT, the download
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.timeout(600)  # training to the first heartbeat, a stop, an export, a restart
def test_a_lone_default_node_trains_stops_on_ctrl_c_and_resumes(tmp_path: Path):
    log, maddrs = tmp_path / "node.log", tmp_path / "maddrs"
    proc = _start(tmp_path, log, maddrs)
    dht = None
    try:
        run, maddr = _serving_both(proc, tmp_path, log, maddrs)
        began = time.monotonic()
        dht = SwarmDHT.start(run, initial_peers=[maddr], host_maddrs=[LOCAL], client_mode=True)
        first = [_epochs(dht, run, s) for s in range(2)]
        # Meanwhile, the model as the live swarm holds it exports, stage by stage.
        out = _cli(tmp_path, "export", "--run", run, "--initial-peers", maddr,
                   "--host-maddrs", LOCAL, "--out", str(tmp_path / "live"))  # fmt: skip
        assert out.count("from peer") == 2, out
        assert _cli(tmp_path, "generate", "--model", str(tmp_path / "live"), "--prompt", "x")
        _alive_until(proc, log, began + RUN_FOR_S / 2)
        middle = [_epochs(dht, run, s) for s in range(2)]
        _alive_until(proc, log, max(began + RUN_FOR_S, time.monotonic() + RUN_FOR_S / 3))

        def heartbeat() -> list[dict]:
            _alive(proc, log)
            return _events(tmp_path, "node.heartbeat")

        beat = wait_until(heartbeat, 90, "the node's first heartbeat", every=1.0)[-1]
        assert beat["steps"] > 0 and {beat["stage"], beat["second_stage"]} == {0, 1}, beat
        last = [_epochs(dht, run, s) for s in range(2)]
        for stage in range(2):
            (peer,) = last[stage]
            steps = [first[stage].get(peer, 0), middle[stage].get(peer, 0), last[stage][peer]]
            # A tiny step takes ~0.1 s here; a stalled trainer adds none in either half.
            assert steps[0] < steps[1] < steps[2] and steps[2] > steps[0] + 50, (stage, steps)
        dht.shutdown()
        dht = None
        _ctrl_c(proc, tmp_path, log)

        # The stop checkpointed both stages: the model exports and samples deterministically.
        name = run.partition("@")[0]
        _cli(tmp_path, "export", "--checkpoint", str(tmp_path / ".swarmtrain" / name),
             "--out", str(tmp_path / "model"))  # fmt: skip
        sample = ["generate", "--model", str(tmp_path / "model"), "--prompt", "def ",
                  "--max-new-tokens", "24", "--temperature", "0"]  # fmt: skip
        text = _cli(tmp_path, *sample)
        assert text.startswith("def ") and len(text.encode()) >= 4 + 24
        assert _cli(tmp_path, *sample) == text

        # Restarted with the same identity, it resumes where it stopped, not from scratch.
        proc = _start(tmp_path, log, maddrs)
        run, maddr = _serving_both(proc, tmp_path, log, maddrs)
        dht = SwarmDHT.start(run, initial_peers=[maddr], host_maddrs=[LOCAL], client_mode=True)
        for stage in range(2):
            (stopped_at,) = last[stage].values()
            resumed = wait_until(lambda s=stage: _epochs(dht, run, s), 30, "progress records")
            assert min(resumed.values()) >= stopped_at, (stage, stopped_at, resumed)
        dht.shutdown()
        dht = None
        _ctrl_c(proc, tmp_path, log)
    finally:
        if dht is not None:
            dht.shutdown()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
