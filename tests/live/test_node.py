"""Node daemons on a real local swarm: discovery, status, departure, identity."""

import contextlib
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.swarm import StatusWatch, launch_node, stop_all, wait_until


def _present(view: dict) -> dict[str, int]:
    return {p["peer_id"]: p["stage"] for p in view["peers"]}


def test_three_nodes_discover_and_leave(tmp_path):
    run = "discovery"
    nodes = []
    watch = None
    try:
        a = launch_node(tmp_path, "a", run, extra=["--stage", "0"])
        nodes.append(a)
        run = a.run_id  # NAME@FINGERPRINT: how the others join
        for name in ("b", "c"):  # started together: they wait on I/O at start
            nodes.append(launch_node(tmp_path, name, run, initial_peers=[a.maddr], wait=False))
        a.wait_serving(120)  # the run's spec is out: status may read it
        watch = StatusWatch(run, a.maddr)
        served = [n.wait_serving(120) for n in nodes]  # then each has its maddrs
        stages = {n.peer_id: stage for n, stage in zip(nodes, served, strict=True)}
        assert stages[a.peer_id] == 0

        view = watch.wait(
            lambda v: _present(v) == stages and v,
            60,
            "status to list all three nodes with their stages",
        )
        assert all(p["state"] == "serving" for p in view["peers"])
        # the joiners measured their bandwidth against a serving peer and re-announced
        watch.wait(
            lambda v: sum(p["bandwidth_source"] == "measured" for p in v["peers"]) >= 2,
            30,
            "joiners to advertise measured bandwidth",
        )
        assert sum(s["peers"] for s in view["stages"]) == 3
        assert view["bottleneck_stage"] in (0, 1)

        b, c = nodes[1], nodes[2]
        started = time.monotonic()
        assert b.stop(signal.SIGTERM) == 0
        assert time.monotonic() - started < 10, "SIGTERM must stop a node within seconds"
        assert b.events("node.stopped"), "it closed cleanly"
        # Its log file, named when it started, holds its own lines (not its children's).
        log = b.events("node.started")[-1]["log"]
        text = Path(log).read_text()
        assert "took stage" in text and "received: stopping" in text, text[-2000:]
        assert b.peer_id not in _present(watch.view()), "SIGTERM: gone at once"

        c.stop(signal.SIGKILL)
        killed = time.monotonic()
        watch.wait(
            lambda v: c.peer_id not in _present(v),
            30,
            "a SIGKILLed node's record to expire",
        )
        assert time.monotonic() - killed >= 1.0  # it vanished by expiry, not by leaving
        assert _present(watch.view()) == {a.peer_id: 0}
    finally:
        if watch is not None:
            watch.close()
        stop_all(nodes)


def test_identity_is_stable_across_restarts(tmp_path):
    first = launch_node(tmp_path, "a", "identity")
    try:
        peer_id = first.peer_id
        assert first.stop() == 0
        assert oct((tmp_path / "a.key").stat().st_mode & 0o777) == "0o600"
        (tmp_path / "a.maddrs").unlink()
        second = launch_node(tmp_path, "a", "identity")
        assert second.peer_id == peer_id
        assert second.stop() == 0
    finally:
        stop_all([first])


def test_a_stopped_node_exits_with_nothing_lost(tmp_path):
    """SIGTERM: exit status 0 at once after the node closed (it skips the interpreter's
    teardown), with its stage checkpointed, ``node.stopped`` its last event, its log's
    last line written, and every child process (DHT, averager, p2pd) gone."""
    node = launch_node(tmp_path, "a", "exit", extra=["--stage", "0"])
    try:
        node.wait_serving(120)
        named = {c: c.name() for c in psutil.Process(node.proc.pid).children(recursive=True)}
        assert set(named.values()) >= {"p2pd", "python"}, named
        sent = time.time()
        assert node.stop(signal.SIGTERM, timeout=60) == 0
        assert node.events()[-1]["event"] == "node.stopped"
        assert any(e["t"] >= sent for e in node.events("checkpoint.written"))
        log = Path(node.events("node.started")[-1]["log"]).read_text().splitlines()
        assert "leaving the run" in "\n".join(log[-20:]), log[-20:]
        # Reaped by the node, not by an orphan's reparenting: none outlives it for long.
        _, alive = psutil.wait_procs(
            [c for c, name in named.items() if name != "torch_shm_manager"], timeout=10
        )
        assert not alive, f"children left: {alive}"
    finally:
        stop_all([node])


def test_exit_closed_runs_exit_handlers_and_flushes(tmp_path):
    """``exit_closed`` keeps what a normal exit keeps: the atexit handlers run and
    buffered output reaches a pipe; the status is the one given."""
    mark = tmp_path / "handler-ran"
    code = (
        "import atexit, pathlib, sys\n"
        "from node.cli.exit import exit_closed\n"
        f"atexit.register(pathlib.Path({str(mark)!r}).write_text, 'yes')\n"
        "print('buffered', end='')\n"
        "sys.stderr.write('and stderr')\n"
        "exit_closed(3)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout, done.stderr) == (3, "buffered", "and stderr")
    assert mark.read_text() == "yes"


def _forked(node) -> list[psutil.Process]:
    """The processes a one-stage node forked, oldest first: its DHT's, then its stage's
    averager's."""
    forked = sorted((c for c in psutil.Process(node.proc.pid).children()
                     if c.name() not in ("p2pd", "torch_shm_manager")),
                    key=lambda c: c.create_time())  # fmt: skip
    assert len(forked) == 2, [(c.pid, c.name(), c.cmdline()[:3]) for c in forked]
    return forked


def test_a_joiner_whose_stage_peer_hands_over_no_state_waits_for_it(tmp_path):
    """A joiner of a stage whose only peer answers no state download (its averager frozen,
    as a peer busy or on a slow link can be, while its progress records stay fresh) stays
    up, says so, and loads the stage from that peer once it answers again."""
    nodes = []
    frozen = None
    try:
        a = launch_node(tmp_path, "a", "stalled", extra=["--stage", "0"])
        nodes.append(a)
        a.wait_serving(120)
        frozen = _forked(a)[-1]
        frozen.suspend()
        b = launch_node(tmp_path, "b", a.run_id, initial_peers=[a.maddr], extra=["--stage", "0"])
        nodes.append(b)

        def failed() -> list[dict]:
            assert b.alive(), b.output()[-3000:]
            return b.events("stage.load_failed")

        (first, *_) = wait_until(failed, 150, "the joiner to fail its first load", every=0.5)
        assert first["stage"] == 0 and first["retry_s"] > 0, first
        assert b.stage() is None and b.alive()
        frozen.resume()
        frozen = None
        assert b.wait_serving(120) == 0
        (held,) = b.events("stage.held")
        assert (held["loaded"], held["source"]) == ("peers", a.peer_id), held
    finally:
        if frozen is not None:
            frozen.resume()
        stop_all(nodes)


def test_a_node_whose_averager_is_stuck_stops_with_one_line(tmp_path):
    """The averager process stuck (stopped here) while its stage averages with a peer:
    the node does not live on stepping alone, its copy no longer averaged, nor with its
    event loop blocked for good in a round's call into the process (hivemind's ``step``
    waits for it with no timeout): it stops with one line and exit status 2."""
    nodes, frozen = [], None
    try:
        # Stuck after 10 s (not 30): the averager's ask waits 40 s, not 120, the loop 20 s.
        a = launch_node(tmp_path, "a", "stuck", extra=["--stage", "0", "--stuck-after", "10"],
                        train=True)  # fmt: skip
        nodes.append(a)
        for name, stage in (("b", "0"), ("c", "1")):
            nodes.append(launch_node(tmp_path, name, a.run_id, initial_peers=[a.maddr],
                                     extra=["--stage", stage], train=True, wait=False))  # fmt: skip
        for n in nodes:
            n.wait_serving(120)
        averaged = lambda: [e for e in a.events("averaging.round") if e["how"] == "averaged"]  # noqa: E731
        wait_until(averaged, 120, "a round of a averaged with b")
        frozen = _forked(a)[-1]
        frozen.suspend()
        assert a.proc.wait(180) == 2, a.output()[-3000:]
        (line,) = [x for x in a.output().splitlines() if x.startswith("swarmtrain node:")]
        # Which comes first depends on when the next round starts: a round's step into the
        # process, which blocks the loop until the thread that watches it ends the node
        # (twice --stuck-after), or the watchdog's ask unanswered (4x); or the DHT
        # process's (1x), when the averager stopped holding the lock that hivemind's
        # MPFuture shares among all processes to send results (the DHT then blocks on it).
        assert re.fullmatch(
            r"swarmtrain node: error: this node's (averager process of stage 0 has not "
            r"answered for \d+ s \(it runs but is stuck\)|event loop has not run for \d+ s "
            r"\(a call into a stuck process\?\): stopping|DHT process has not answered for "
            r"\d+ s \(it runs but is stuck\))",
            line,
        ), line
        psutil.wait_procs([frozen], timeout=10)  # it dies with the node
        assert not frozen.is_running() or frozen.status() == psutil.STATUS_ZOMBIE
        frozen = None
    finally:
        if frozen is not None:
            with contextlib.suppress(psutil.NoSuchProcess):
                frozen.kill()
        stop_all(nodes)


@pytest.mark.parametrize("child", ["DHT", "averager", "DHT stuck"])
def test_a_node_whose_dht_or_averager_process_dies_stops_with_one_line(tmp_path, child):
    """A child process killed under a training node (the OOM killer can pick one), or its
    DHT process alive but stuck (stopped here): the node does not live on unseen, serving
    nothing or a copy no longer averaged; it checkpoints and exits 2 within a minute,
    naming the process in one line, and leaves no process behind."""
    stuck_after = ["--stuck-after", "10"] if child == "DHT stuck" else []
    node = launch_node(tmp_path, "a", "orphaned", extra=["--stage", "0", *stuck_after], train=True)
    try:
        node.wait_serving(120)
        dht, averager = _forked(node)
        killed = time.time()
        if child == "DHT stuck":
            dht.suspend()
        else:
            (dht if child == "DHT" else averager).kill()
        assert node.proc.wait(75) == 2, node.output()[-3000:]
        (line,) = [x for x in node.output().splitlines() if x.startswith("swarmtrain node:")]
        if child == "DHT stuck":
            said = re.fullmatch(
                r"swarmtrain node: error: this node's DHT process has not answered for "
                r"(\d+) s \(it runs but is stuck\)",
                line,
            )
            assert said and int(said[1]) < 30, line  # --stuck-after 10, not the default 30
            assert not dht.is_running() or dht.status() == psutil.STATUS_ZOMBIE
        else:
            what = "DHT process" if child == "DHT" else "averager process of stage 0"
            assert line == f"swarmtrain node: error: this node's {what} exited (exit code -9)"
        assert [e for e in node.events("checkpoint.written") if e["t"] >= killed]
    finally:
        stop_all([node])
