"""Node daemons on a real local swarm: discovery, status, departure, identity."""

import signal
import time
from pathlib import Path

from tests.swarm import StatusWatch, launch_node, stop_all


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
