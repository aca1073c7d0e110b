"""What a person running the commands sees, on real local swarms whose nodes run in their
default configuration (training on): fast, uniform failures for a run that does not
exist; ``train``'s exit status, startup and CSV; ``status`` of a node holding two stages,
and ``--watch``; a node's events of who joins and leaves and its heartbeat, and no
parameter digests in its log at INFO."""

from __future__ import annotations

import csv
import json
import signal
import time
from pathlib import Path

from protocol.identity import resolve_peer_prefix
from tests.swarm import cli_error, launch_node, stop_all, swarmtrain, wait_until


def _error(stderr: str) -> tuple[str, str]:
    error = cli_error(stderr)
    assert error, stderr[-3000:]
    return error


def _finish(proc, timeout: float) -> tuple[int, str, str, float]:
    """Wait for ``proc`` (killing it past ``timeout``): exit code, stdout, stderr, and the
    seconds since this call (``swarmtrain`` just started: about its whole run)."""
    started = time.monotonic()
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException:
        proc.kill()
        proc.communicate()
        raise
    return proc.returncode, out, err, time.monotonic() - started


def test_a_run_that_does_not_exist_fails_fast_with_one_message(tmp_path):
    """``node``, ``train`` and ``status`` named a run id the reachable peers do not know:
    each exits 2 within seconds (not after 30-60 s of retries), saying the same thing."""
    owner = launch_node(tmp_path, "owner", "real", train=True)
    procs = {}
    try:
        fingerprint = owner.run_id.partition("@")[2]
        wrong = f"nosuch@{fingerprint}"
        peers = ["--initial-peers", owner.maddr]
        home = str(tmp_path / "home")
        commands = {
            "node": ["node", "--run", wrong, *peers, "--host-maddrs", "/ip4/127.0.0.1/tcp/0"],
            "train": ["train", "--run", wrong, *peers, "--host-maddrs", "/ip4/127.0.0.1/tcp/0"],
            "status": ["status", "--run", wrong, *peers, "--host-maddrs", "/ip4/127.0.0.1/tcp/0"],
        }
        # What any command costs before and after its lookups (imports, the DHT's start
        # and stop): a status of the run that exists. Seconds, more on a loaded machine.
        # All four start at once, so that each pays what the others cost the machine.
        real = [*commands["status"][:2], owner.run_id, *commands["status"][3:]]
        # Each has a HOME of its own: no two processes share an identity.
        procs = {name: swarmtrain(*args, home=f"{home}-{name}") for name, args in commands.items()}
        code, _, err, overhead = _finish(swarmtrain(*real, home=home), timeout=90)
        assert code == 0, err[-3000:]
        messages = {}
        for name, proc in procs.items():
            code, _, err, took = _finish(proc, timeout=90)
            assert code == 2, err[-3000:]
            assert took < 15, (
                f"{name} took {took:.0f} s more than status to fail ({overhead:.0f} s)"
            )
            command, messages[name] = _error(err)
            assert command == name
        assert len(set(messages.values())) == 1, messages
        assert wrong in messages["node"]
        assert owner.alive()
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        stop_all([owner])


def _csv_rows(path: Path) -> list[dict]:
    text = path.read_text()
    assert text.endswith("\n"), "a partial line"
    rows = list(csv.DictReader(text.splitlines()))
    for r in rows:
        assert r["samples"].isdigit() and (r["train_loss"] or r["val_loss"]), r
        float(r["train_loss"] or r["val_loss"])
    return rows


def test_train_exits_0_when_done_and_writes_its_csv_as_it_goes(tmp_path):
    """A few micro-batches cannot be expected to lower the loss: done is exit 0. The CSV
    holds every row as soon as it is known, so Ctrl-C keeps the rows so far."""
    owner = launch_node(tmp_path, "owner", "trainrun", train=True, extra=["--stages", "1"])
    try:
        run = owner.run_id
        common = ["--run", run, "--initial-peers", owner.maddr, "--host-maddrs",
                  "/ip4/127.0.0.1/tcp/0", "--in-flight", "1"]  # fmt: skip
        home = str(tmp_path / "home")

        short = tmp_path / "short.csv"
        code, out, err, _ = _finish(
            swarmtrain("train", *common, "--micro-batches", "3", "--csv", str(short), home=home),
            timeout=180,
        )
        assert code == 0, err[-3000:]
        rows = _csv_rows(short)
        assert [bool(r["val_loss"]) for r in rows] == [True, False, False, False, True]
        assert [int(r["samples"]) for r in rows] == sorted(int(r["samples"]) for r in rows)
        assert "| 3/3 [" in err  # the progress line, once all are done

        # Interrupted part way: the rows so far are there, whole.
        long = tmp_path / "long.csv"
        proc = swarmtrain("train", *common, "--micro-batches", "100000", "--csv", str(long),
                          home=home)  # fmt: skip
        try:
            wait_until(
                lambda: long.exists() and long.read_text().count("\n") >= 6,
                120,
                "train to write 5 rows",
            )
            proc.send_signal(signal.SIGINT)
            code, _, err, _ = _finish(proc, timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        assert code == 130, err[-3000:]
        assert len(_csv_rows(long)) >= 5
        # It said what it was doing before training began (connecting, reading the spec,
        # loading data, validating): the lines before the first progress line.
        assert len(err.split("training [")[0].strip().splitlines()) >= 3, err[:2000]
    finally:
        stop_all([owner])


def test_status_of_a_two_stage_node_and_watch(tmp_path):
    """A node holding stage 1, and stage 0 as its second: ``status`` shows both stages
    served, with the node's samples served and uptime and an id prefix that resolves to
    it; ``--watch`` refreshes on one connection and stops on Ctrl-C with exit 0."""
    node = launch_node(tmp_path, "a", "watched", train=True, two_stage=True,
                       extra=["--stage", "1", "--second-stage", "0"])  # fmt: skip
    try:
        node.wait_serving()
        args = ["--run", node.run_id, "--initial-peers", node.maddr, "--host-maddrs",
                "/ip4/127.0.0.1/tcp/0", "--json"]  # fmt: skip
        home = str(tmp_path / "home")

        def both_served() -> dict | None:
            code, out, err, _ = _finish(swarmtrain("status", *args, home=home), timeout=60)
            assert code == 0, err[-3000:]
            view = json.loads(out)
            stages = view["stages"]
            return view if all(s["serving"] == 1 and s["throughput"] > 0 for s in stages) else None

        view = wait_until(both_served, 60, "status to show both stages served", every=1)
        (peer,) = view["peers"]
        assert view["stages"][0]["also_served_by"] == 1
        assert resolve_peer_prefix(peer["short_id"], [node.peer_id]) == node.peer_id
        assert peer["uptime_s"] > 0 and peer["samples_served"] >= 0

        watch = swarmtrain("status", *args, "--watch", "0.5", home=home)
        try:
            times = []
            for _ in range(3):
                line = watch.stdout.readline()
                assert line, watch.stderr.read()[-3000:]
                times.append(time.monotonic())
                assert json.loads(line)["stages"][0]["serving"] == 1
            assert times[2] - times[1] < 5, "a refresh re-reads the DHT, it does not restart it"
            watch.send_signal(signal.SIGINT)
            code, _, err, _ = _finish(watch, timeout=30)
            assert code == 0, err[-3000:]
        finally:
            if watch.poll() is None:
                watch.kill()
                watch.communicate()
    finally:
        stop_all([node])


def test_a_node_reports_joins_departures_and_a_heartbeat_but_logs_no_digests(tmp_path):
    """The owner's node reports a member joining and leaving (events ``peer.joined``,
    ``peer.left``), and a ``node.heartbeat`` every --heartbeat seconds; the per-epoch
    parameter digests are not in its log for people (they are DEBUG)."""
    extra = ["--stage", "0", "--heartbeat", "5"]  # 60 s by default
    owner = launch_node(tmp_path, "owner", "logged", train=True, extra=extra)
    nodes = [owner]
    try:
        owner.wait_serving()
        member = launch_node(tmp_path, "member", owner.run_id, initial_peers=[owner.maddr],
                             train=True, extra=["--stage", "1"])  # fmt: skip
        nodes.append(member)
        member.wait_serving()

        def seen(kind: str) -> dict | None:
            return next((e for e in owner.events(kind) if e["peer"] == member.peer_id), None)

        joined = wait_until(lambda: seen("peer.joined"), 30, "the owner to see the join")
        assert joined["stage"] in (None, 1)
        assert member.stop(signal.SIGTERM) == 0
        left = wait_until(lambda: seen("peer.left"), 30, "the owner to see the departure")
        assert isinstance(left["announced"], bool)  # seen leaving, or missing too long

        beats = wait_until(lambda: owner.events("node.heartbeat"), 30, "a heartbeat", every=1)
        assert beats[0]["stage"] == 0 and beats[0]["second_stage"] is None
        assert beats[0]["run_peers"] >= 1 and beats[0]["stage_peers"] >= 1
        assert beats[0]["served"] >= 0 and beats[0]["steps"] >= 0
        rounds = owner.events("averaging.round") + member.events("averaging.round")
        assert not any("digest" in r for r in rounds), "digests are off by default"
    finally:
        stop_all(nodes)
