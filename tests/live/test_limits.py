"""The limits a volunteer sets, on real nodes.

``--max-upload-mbps 2.5`` on a node whose link (``scripts.netem``: a network namespace
with a 100 Mbit/s veth) could carry far more: it counts at most 2.5 Mbit/s sent, and the
link carries little more, while it serves, trains and averages; its sends wait for the
limit, and its record advertises at most 2.5 Mbit/s up, and only the samples/s that the
limit carries for its stage. Skipped, saying why, where network namespaces, veth
pairs, bridges or ``tbf`` cannot be used (``NetemUnavailable``).

``--max-memory`` smaller than any stage of the run: the node refuses the stage, with a
``stage.refused`` event and a one-line error, before it announces anything.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from node.harness.local_swarm import NodeProcess
from protocol.run_spec import read_spec_file
from scripts.bench_swarm import CONFIGS, write_spec
from scripts.netem.network import ROOT, Host, NetemUnavailable, Network
from scripts.netem.profiles import Profile
from tests.swarm import cli_error, launch_node, status, stop_all, wait_until

ANY = "/ip4/0.0.0.0/tcp/0"
LINK = Profile("link100", up_mbit=100, down_mbit=100, delay_ms=0)
# Below what b sends unlimited even on a loaded machine (3.3 Mbit/s in a CI run of three
# test workers on two cores; about 9 idle), so that the limit binds either way.
LIMIT_MBPS = 2.5
DOWN_LIMIT_MBPS = 20.0  # above what the node receives here: only its record is checked
WINDOW_S = 20.0  # the link is read over this long, once the node serves and averages
# What the link carries over the limit: TCP/IP headers (about 5 % of full segments) and
# libp2p's framing and encryption, in proportion; and what is not limited (DHT, gossip,
# pings: about 0.5 Mbit/s among these three nodes).
OVERHEAD, UNLIMITED_MBPS = 1.1, 0.75


@pytest.fixture
def net() -> Iterator[Network]:
    try:
        with Network([LINK, LINK]) as n:
            yield n
    except NetemUnavailable as e:
        pytest.skip(f"cannot build the emulated network here: {e}")


def _link_bytes(host: Host) -> tuple[int, int]:
    """Bytes ``host`` has sent onto its link and received from it (its veth's bridge end
    counts them the other way round)."""
    stats = Path(f"/sys/class/net/{host.veth_bridge}/statistics")
    return int((stats / "rx_bytes").read_text()), int((stats / "tx_bytes").read_text())


def _api(host: Host, url: str) -> dict:
    """The node's JSON API, read from inside its namespace (where its dashboard listens)."""
    code = (
        "import sys, urllib.request; "
        "print(urllib.request.urlopen(sys.argv[1], timeout=10).read().decode())"
    )
    out = subprocess.run(host.exec([sys.executable, "-c", code, url + "api/state"]),
                         capture_output=True, text=True, timeout=30, cwd=ROOT)  # fmt: skip
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def _maddr_at(node: NodeProcess, address: str) -> str:
    return next(m for m in node.maddrs_file.read_text().split() if f"/{address}/" in m)


def _averaged(node: NodeProcess) -> int:
    return sum(e["how"] == "averaged" for e in node.events("averaging.round"))


def test_an_upload_limit_holds_at_the_link_and_is_advertised(net: Network, tmp_path) -> None:
    """Three nodes of a tiny 2-stage run, all training: ``a`` (stage 0) and ``c`` (stage
    1) share one host, ``b`` (stage 1, ``--max-upload-mbps 2.5``) is alone on the other, so
    everything it sends crosses its link: its trainer's calls to stage 0, its replies to
    the others' trainers, and its averaging rounds with ``c``."""
    there, here = net.hosts
    nodes: list[NodeProcess] = []
    try:
        # Uncompressed (boundaries and rounds): compressed, b would not reach its limit.
        spec = write_spec(tmp_path, "tiny", 2, CONFIGS["none"])
        a = launch_node(tmp_path, "a", read_spec_file(spec.read_text()).spec.run,
                        host_maddr=ANY, wrap=there.exec, train=True,
                        extra=["--stage", "0", "--spec", str(spec)], wait=False)  # fmt: skip
        nodes.append(a)
        wait_until(lambda: a.events("node.started"), 90, "the first node to start")
        run, seed = a.run_id, [_maddr_at(a, there.address)]
        c = launch_node(tmp_path, "c", run, initial_peers=seed, host_maddr=ANY, wrap=there.exec,
                        train=True, extra=["--stage", "1"], wait=False)  # fmt: skip
        nodes.append(c)
        limit = ["--stage", "1", "--max-upload-mbps", str(LIMIT_MBPS),
                 "--max-download-mbps", str(DOWN_LIMIT_MBPS)]  # fmt: skip
        b = launch_node(tmp_path, "b", run, initial_peers=seed, host_maddr=ANY, wrap=here.exec,
                        train=True, extra=limit, dashboard="auto", wait=False)  # fmt: skip
        nodes.append(b)
        for node in nodes:
            node.wait_serving(120)
        wait_until(lambda: _averaged(b) >= 1, 120, "b to average with c")
        url = wait_until(lambda: b.events("node.started"), 30, "b's dashboard")[0]["dashboard"]

        # The window: the link's bytes and the node's own counters, at both ends of it.
        before_state, before_link, started = _api(here, url), _link_bytes(here), time.monotonic()
        rounds = _averaged(b)
        wait_until(
            lambda: time.monotonic() - started >= WINDOW_S and _averaged(b) > rounds,
            WINDOW_S + 120,
            "a window with an averaging round in it",
        )
        after_link, elapsed = _link_bytes(here), time.monotonic() - started
        after_state = _api(here, url)
        mbps, down_mbps = (
            (a - b) * 8 / elapsed / 1e6 for a, b in zip(after_link, before_link, strict=True)
        )
        was, now = before_state["node"]["network"], after_state["node"]["network"]
        waited = now["waited_s"]["sent"] - was["waited_s"]["sent"]
        sent = {p: now["bytes_sent"][p] - was["bytes_sent"][p] for p in now["bytes_sent"]}
        print(f"b sent {mbps:.2f} Mbit/s at its link over {elapsed:.0f} s (limit {LIMIT_MBPS}) "
              f"and received {down_mbps:.2f}; its sends waited {waited:.1f} s; bytes sent by "
              f"purpose: {sent}")  # fmt: skip
        assert mbps <= LIMIT_MBPS * OVERHEAD + UNLIMITED_MBPS, f"{mbps:.2f} Mbit/s at the link"
        counted = sum(sent.values()) * 8 / elapsed / 1e6  # what the limit applies to
        assert counted <= LIMIT_MBPS * 1.1, f"{counted:.2f} Mbit/s counted"
        # The limit held it back: its sends waited for it, and the node was busy. (How
        # busy varies with the machine's load, and routing sends fewer calls to a peer
        # whose queue grows: these bounds are loose on purpose.)
        assert waited >= 1.0, f"sends waited {waited:.1f} s of {elapsed:.0f} s"
        assert mbps >= 0.25 * LIMIT_MBPS, f"only {mbps:.2f} Mbit/s: the node was not busy"
        for purpose in ("activations", "gradients", "averaging"):
            assert sent[purpose] > 0, sent
        assert now["limit_mbps"] == {"sent": LIMIT_MBPS, "received": DOWN_LIMIT_MBPS}

        # What the others plan with: the record says at most the limits (the measured
        # figures, over a link of 100 Mbit/s, are above them on an idle machine).
        view = status(run, seed[0], host_maddr=ANY, wrap=there.exec)
        record = next(p for p in view["peers"] if p["peer_id"] == b.peer_id)
        assert record["bandwidth_source"] == "measured", record
        up, down = record["bandwidth_up_mbps"], record["bandwidth_down_mbps"]
        assert 0 < up <= LIMIT_MBPS and 0 < down <= DOWN_LIMIT_MBPS, record
        assert now["advertised_mbps"] == {"up": up, "down": down}
        # and its stage's samples/s no more than the limit carries (it declared 100: the
        # harness's --throughput)
        assert 0 < record["throughput"] < 100, record
    finally:
        stop_all(nodes)


def test_a_stage_that_does_not_fit_in_max_memory_is_refused(tmp_path) -> None:
    """The tiny preset's stages need a few MiB each: with 1 MiB the node refuses the stage
    it was told to take, says so in one line and an event, and exits."""
    node = launch_node(tmp_path, "small", "mem", extra=["--stage", "0", "--max-memory", "1M"],
                       wait=False)  # fmt: skip
    try:
        assert node.proc.wait(120) != 0
        refused = node.events("stage.refused")
        assert len(refused) == 1 and refused[0]["stage"] == 0, refused
        assert refused[0]["max_memory"] == 2**20 < refused[0]["need"], refused
        command, message = cli_error(node.output())
        assert command == "node" and message.startswith("refusing stage 0 of run mem@"), message
        assert "more than --max-memory allows (1 MiB)" in message, message
        assert not node.events("stage.held")
    finally:
        stop_all([node])
