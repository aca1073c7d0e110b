"""Home nodes behind NAT (``scripts.netem`` homes behind masquerading routers), as root.

Skipped, saying why, where network namespaces, veth pairs, bridges, ``tbf`` or nftables
cannot be used (``scripts.netem.network.NetemUnavailable``)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator

import pytest

from scripts.netem.network import ROOT, Home, Host, NetemUnavailable, Network
from scripts.netem.profiles import profile

PROBE_PORT = 5000


@pytest.fixture
def net() -> Iterator[Network]:
    """Two public hosts, and two homes behind one router (a home LAN)."""
    try:
        with Network([profile("datacenter")] * 2, [profile("home")] * 2, shared_router=True) as n:
            yield n
    except NetemUnavailable as e:
        pytest.skip(f"cannot build the emulated network here: {e}")


def _listen(host: Host | Home) -> subprocess.Popen:
    args = [sys.executable, "-m", "scripts.netem.probe", "serve", "--host", "0.0.0.0",
            "--port", str(PROBE_PORT)]  # fmt: skip
    proc = subprocess.Popen(host.exec(args), stdout=subprocess.PIPE, text=True, cwd=ROOT)
    assert "listening" in proc.stdout.readline()
    return proc


def _connect(src: Host | Home, address: str) -> dict:
    args = [sys.executable, "-m", "scripts.netem.probe", "connect",
            "--to", f"{address}:{PROBE_PORT}", "--timeout", "2"]  # fmt: skip
    out = subprocess.run(src.exec(args), capture_output=True, text=True, cwd=ROOT, timeout=30)
    return json.loads(out.stdout)


def test_home_dials_out_and_nothing_dials_in(net: Network) -> None:
    public, home, neighbour = net.hosts[0], net.homes[0], net.homes[1]
    router = home.router
    servers = [_listen(h) for h in (public, home, neighbour)]
    try:
        assert _connect(home, public.address) == {"ok": True}, "a home dials out"
        assert _connect(home, neighbour.address) == {"ok": True}, "homes on one LAN talk"
        assert not _connect(public, home.address)["ok"], "no route to a home's LAN"
        assert not _connect(public, router.address)["ok"], "no port is forwarded"
        # Even with a route to the LAN (as an ISP could add one), the router drops
        # connections that start on its public side.
        route = ["route", "add", f"{home.address}/32", "via", router.address]
        subprocess.run(public.exec(["ip", *route]), check=True)
        blocked = _connect(public, home.address)
        assert not blocked["ok"] and "TimeoutError" in blocked["error"], blocked
    finally:
        for s in servers:
            s.kill()
            s.wait()
