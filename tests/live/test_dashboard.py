"""The node's dashboard over real sockets: the server alone (its routes, the Host guard,
stuck clients, a port in use), the node's refusal of a port in use, and a real swarm
whose nodes serve it: the JSON API lists every peer, ``/metrics`` counts training as it
goes, the page draws in headless Chromium, and the API answers after a peer is killed."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from node.dashboard.address import Address
from node.dashboard.server import SHUTDOWN_S, Dashboard
from node.dashboard.snapshot import NodeSnapshot
from tests.swarm import LOCAL, cli_error, launch_node, stop_all, swarmtrain, wait_until

HTTP_TIMEOUT_S = 5.0


def _get(url: str, host: str | None = None) -> tuple[int, dict[str, str], bytes]:
    request = urllib.request.Request(url, headers={"Host": host} if host else {})
    try:
        with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_S) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def _state(url: str) -> dict:
    status, _, body = _get(url + "api/state")
    assert status == 200, body
    return json.loads(body)


def _metric(url: str, name: str, **labels: str) -> float | None:
    status, headers, body = _get(url + "metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain"), headers
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            if sample.name == name and labels.items() <= sample.labels.items():
                return sample.value
    return None


# -- the server alone, in this process ---------------------------------------------------


def _snapshot() -> NodeSnapshot:
    now = time.time()
    return NodeSnapshot(time=now, run="solo", peer_id="12D3KooWSolo", state="joining", started=now)


async def _raw(port: int, data: bytes) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    await writer.drain()
    return reader, writer


def test_the_server_alone_routes_guards_and_stuck_clients() -> None:
    async def scenario() -> None:
        dashboard = await Dashboard.open(Address("127.0.0.1", 0), _snapshot, period_s=0.05)
        url = dashboard.url
        port = int(url.rsplit(":", 1)[1].strip("/"))
        stuck: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        try:
            get = lambda path, host=None: asyncio.to_thread(_get, url + path, host)  # noqa: E731
            status, headers, body = await get("")
            assert status == 200 and b"stage-table" in body
            assert headers["Content-Security-Policy"] == "default-src 'self'"
            assert (await get("static/dashboard.js"))[0] == 200
            assert (await get("static/secret.txt"))[0] == 404
            status, _, body = await get("api/state")
            assert status == 200 and json.loads(body)["node"]["state"] == "joining"
            status, headers, body = await get("metrics")
            assert b'swarmtrain_node_state{state="joining"} 1.0' in body, body
            # A page elsewhere whose DNS name now points here (DNS rebinding): refused.
            status, _, body = await get("api/state", host="evil.example")
            assert status == 403 and b"localhost" in body
            assert (await get("api/state", host=f"localhost:{port}"))[0] == 200

            # Clients that send half a request, or ask and never read: the loop goes on,
            # and others are answered at once.
            half = b"GET /api/state HTTP/1.1\r\nHost: 127.0.0.1"
            unread = b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n" * 50
            stuck += [await _raw(port, half) for _ in range(20)]
            stuck += [await _raw(port, unread) for _ in range(5)]
            started = time.monotonic()
            assert (await get("api/state"))[0] == 200
            assert time.monotonic() - started < 1.0
            points = len(dashboard.history.points())
            await asyncio.sleep(0.3)  # the history sampler (every 0.05 s) still runs
            assert len(dashboard.history.points()) > points

            # Another dashboard on the same port: refused, naming the port.
            with pytest.raises(ValueError, match=f"dashboard port {port} is in use"):
                await Dashboard.open(Address("127.0.0.1", port), _snapshot)
        finally:
            started = time.monotonic()
            await dashboard.close()
            closing_s = time.monotonic() - started
        assert closing_s < SHUTDOWN_S + 2, "stuck clients held the close"
        for _, writer in stuck:
            writer.close()
        with pytest.raises(OSError):  # nothing listens there any more
            socket.create_connection(("127.0.0.1", port), timeout=1).close()

    asyncio.run(scenario())


def test_a_node_refuses_a_dashboard_port_in_use_before_it_starts(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = swarmtrain("node", "--run", "lab", "--throughput", "5", "--host-maddrs", LOCAL,
                          "--dashboard", f"127.0.0.1:{port}", home=str(tmp_path))  # fmt: skip
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert cli_error(err)[0] == "node" and f"dashboard port {port} is in use" in err
    assert not (tmp_path / ".swarmtrain").exists(), "refused before any key was written"


# -- a real swarm -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    """Four nodes as the README starts them (training on; the local-swarm harness's
    flags), each serving its dashboard on a free port: two peers per stage."""
    workdir = tmp_path_factory.mktemp("dashboard")
    nodes = []
    try:
        first = launch_node(workdir, "a", "dash", train=True, dashboard="auto")
        nodes.append(first)
        for name in ("b", "c", "d"):  # started together: they join while the first loads
            nodes.append(
                launch_node(workdir, name, first.run_id, initial_peers=[first.maddr],
                            train=True, dashboard="auto", wait=False)
            )  # fmt: skip
        for node in nodes:
            node.wait_serving(timeout=90)
        yield nodes
    finally:
        stop_all(nodes)


def test_the_api_lists_every_peer_and_metrics_count_training(swarm) -> None:
    a = swarm[0]
    url = a.dashboard
    assert url.startswith("http://127.0.0.1:") and a.events("node.started")[0]["metrics"] == (
        url + "metrics"
    )
    stages = {n.peer_id: n.stage() for n in swarm}

    def listed() -> dict | None:
        state = _state(url)
        peers = {p["peer_id"]: (p["stage"], p["state"]) for p in state["swarm"]["peers"]}
        return state if peers == {p: (s, "serving") for p, s in stages.items()} else None

    state = wait_until(listed, 30, "the API to list every peer serving its stage")
    assert state["run"]["id"] == a.run_id and state["run"]["model"]["preset"] == "tiny"
    assert state["node"]["peer_id"] == a.peer_id and state["node"]["state"] == "serving"
    assert [s["serving"] for s in state["swarm"]["stages"]] == [
        sum(stage == s for stage in stages.values()) for s in range(2)
    ]
    assert _metric(url, "swarmtrain_swarm_peers") == 4

    first = wait_until(
        lambda: _metric(url, "swarmtrain_samples_trained_total"), 60, "the node to train"
    )
    wait_until(
        lambda: _metric(url, "swarmtrain_samples_trained_total") > first,
        30,
        "the trained-samples counter to grow between two scrapes",
    )
    assert _metric(url, "swarmtrain_samples_served_total") > 0

    # Bytes by purpose grow as the node trains and serves (4 peers over 2 stages: every
    # node calls, or is called by, a peer of the other stage).
    def moved() -> dict[tuple[str, str], float]:
        return {
            (purpose, direction): _metric(
                url, "swarmtrain_network_bytes_total", purpose=purpose, direction=direction
            )
            for purpose in ("activations", "gradients")
            for direction in ("sent", "received")
        }

    def all_moved() -> dict[tuple[str, str], float] | None:
        m = moved()
        return m if all(m.values()) else None

    before = wait_until(all_moved, 60, "activations and gradients sent and received")
    wait_until(
        lambda: all(moved()[k] > n for k, n in before.items()),
        60,
        "the bytes-by-purpose counters to grow between two scrapes",
    )
    network = _state(url)["node"]["network"]
    assert network["bytes_sent"]["activations"] > 0 and network["limit_mbps"] == {
        "sent": None,
        "received": None,
    }
    # A node that loaded its stage's state from a peer counts those bytes as state (they
    # travel through its averager process, which shares the counters).
    downloaded = [n for n in swarm if n.events("stage.held")[0]["loaded"] == "peers"]
    for node in downloaded:
        got = _metric(node.dashboard, "swarmtrain_network_bytes_total", purpose="state",
                      direction="received")  # fmt: skip
        assert got and got > 10_000, (node.name, got)
    stage = str(stages[a.peer_id])
    assert _metric(url, "swarmtrain_stage_held", stage=stage, role="first") == 1
    wait_until(
        lambda: any(x is not None for x in _state(url)["history"]["loss"]),
        30,
        "the loss history to have a point",
    )


CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")


@pytest.mark.skipif(
    not (CHROMIUM and CHROMEDRIVER),
    reason="headless Chromium needs chromium and chromedriver on PATH (Debian: apt-get "
    "install chromium chromium-driver)",
)
def test_the_page_in_headless_chromium(swarm, tmp_path: Path) -> None:
    """The page shows every peer in its table and points on the loss chart; its
    screenshot goes to $SWARMTRAIN_DASHBOARD_PNG if set (docs/dashboard.png is one)."""
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--window-size=1200,1500"):  # fmt: skip
        options.add_argument(flag)
    browser = webdriver.Chrome(options=options, service=Service(executable_path=CHROMEDRIVER))
    try:
        browser.set_page_load_timeout(30)
        browser.get(swarm[0].dashboard)
        peers = {n.peer_id for n in swarm if n.alive()}

        def drawn() -> bool:
            # Read in one script: the page replaces its rows at every poll, so an element
            # found by one call may be gone by the next.
            shown, points = browser.execute_script(
                "return [[...document.querySelectorAll('#peer-table tbody tr')]"
                ".map(row => row.dataset.peer), document.getElementById('loss-chart')"
                ".dataset.points]"
            )
            return peers <= set(shown) and int(points or 0) >= 3

        wait_until(drawn, 30, "the page to list every peer and draw the loss chart")
        assert browser.find_element("id", "run-id").text == swarm[0].run_id
        path = Path(os.environ.get("SWARMTRAIN_DASHBOARD_PNG", tmp_path / "dashboard.png"))
        assert browser.save_screenshot(str(path)) and path.stat().st_size > 10_000
    finally:
        browser.quit()


def test_the_api_answers_after_a_peer_is_killed(swarm) -> None:
    a = swarm[0]
    url = a.dashboard
    # The victim shares its stage with another peer: the pipeline keeps a peer per stage.
    stage_of = {n.name: n.stage() for n in swarm}
    victim = next(n for n in swarm[1:] if sum(s == stage_of[n.name] for s in stage_of.values()) > 1)

    def listed() -> bool:
        return victim.peer_id in {p["peer_id"] for p in _state(url)["swarm"]["peers"]}

    wait_until(listed, 30, "the victim in the stage table before it is killed")
    victim.stop(signal.SIGKILL)
    killed = time.monotonic()

    wait_until(lambda: not listed(), 30, "the killed peer's record to expire from the stage table")
    assert time.monotonic() - killed >= 1.0  # it went by expiry: it could not announce
    trained = _metric(url, "swarmtrain_samples_trained_total")
    wait_until(
        lambda: _metric(url, "swarmtrain_samples_trained_total") > trained,
        30,
        "training to go on without the killed peer",
    )
    status, _, body = _get(url)
    assert status == 200 and b"peer-table" in body
