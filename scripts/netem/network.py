"""Hosts as network namespaces on one bridge, each behind its own shaped veth pair.

Host ``i`` is the namespace ``stn<tag>h<i>`` with address ``10.77.0.<i+2>/24`` on its end
of a veth pair; the other end is a port of the bridge ``stn<tag>br``, which has no
address: nothing is reachable from, or added to, the machine's own network. Upload is
shaped with ``tbf`` on the host's end, download on the bridge's end. Every name starts
with ``PREFIX``, so ``cleanup()`` finds whatever a crashed run left.

Home hosts sit behind NAT, as behind a home router: router ``j`` is a namespace
``stn<tag>r<j>`` on the bridge (an address after the public hosts', shaped by the home's
profile, so homes behind one router share its link), and each home ``stn<tag>n<i>`` sits
on the router's LAN ``10.78.<j>.0/24`` (the router is ``.1``, homes ``.2`` on). The router
forwards and masquerades (nftables) what its homes send out, keeping their source ports,
and silently drops every connection that starts on its public side (no reset): a home
dials out to the bridge; nothing dials in.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from scripts.netem.profiles import Profile

ROOT = Path(__file__).resolve().parents[2]  # the repository: ``scripts.netem`` imports from it
PREFIX = "stn"
SUBNET = "10.77.0"
LAN_SUBNET = "10.78"  # router j's LAN is 10.78.<j>.0/24
NODE_PORT = 4001  # the node's p2pd, on the namespace's 127.0.0.1
RELAY_PORT = 4000  # the relay, on the namespace's address: what the node announces


class NetemUnavailable(RuntimeError):
    """This machine cannot build the emulated network; the message says what is missing."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def _tbf(mbit: float) -> list[str]:
    """A ``tbf`` that holds ``mbit`` Mbit/s; the bucket covers 5 ms of traffic (at least
    64 KiB) so that the kernel's timer granularity does not cap high rates."""
    burst = max(64 * 1024, int(mbit * 1e6 / 8 * 0.005))
    return ["tbf", "rate", f"{mbit}mbit", "burst", str(burst), "latency", "100ms"]


@dataclass(frozen=True)
class Host:
    index: int
    ns: str
    address: str
    profile: Profile
    veth_host: str  # in the namespace
    veth_bridge: str  # a port of the bridge

    @property
    def relay_maddr(self) -> str:
        return f"/ip4/{self.address}/tcp/{RELAY_PORT}"

    def exec(self, args: Sequence[str]) -> list[str]:
        """``args`` run inside this host's namespace."""
        return ["ip", "netns", "exec", self.ns, *args]


@dataclass(frozen=True)
class Home:
    """A host behind ``router`` (NAT): it dials out to the bridge, nothing dials in. Its
    ``address`` is on the router's LAN; peers see its connections come from the router's."""

    index: int
    ns: str
    address: str
    router: Host  # on the bridge; its profile is the home's access link

    @property
    def profile(self) -> Profile:
        return self.router.profile

    def exec(self, args: Sequence[str]) -> list[str]:
        """``args`` run inside this home's namespace."""
        return ["ip", "netns", "exec", self.ns, *args]


class Network:
    """Builds the hosts on ``__enter__`` and removes everything on ``__exit__`` (also after
    an exception or Ctrl-C; SIGTERM is turned into the same exit while it is open).

    ``hosts`` are public: one per profile in ``profiles``. ``homes`` sit behind NAT, one per
    profile in ``home_profiles``, each behind a router of its own, or all behind one router
    (with the first home's profile) when ``shared_router``. ``subnet`` (three octets) is
    the bridge's: a non-private one (only inside these namespaces) lets libp2p treat the
    hosts as on the public internet, which its AutoNAT, relay addresses and hole punching
    require; the homes' LANs stay private."""

    def __init__(
        self,
        profiles: Sequence[Profile],
        home_profiles: Sequence[Profile] = (),
        *,
        shared_router: bool = False,
        subnet: str = SUBNET,
    ) -> None:
        routers = min(len(home_profiles), 1) if shared_router else len(home_profiles)
        if not 1 <= len(profiles) + routers <= 200 or len(home_profiles) > 200:
            raise ValueError(
                f"1..200 hosts and routers and at most 200 homes, got {len(profiles)} hosts, "
                f"{routers} routers and {len(home_profiles)} homes"
            )
        self.tag = uuid.uuid4().hex[:4]
        self.bridge = f"{PREFIX}{self.tag}br"
        self.hosts = [
            Host(
                i,
                f"{PREFIX}{self.tag}h{i}",
                f"{subnet}.{i + 2}",
                p,
                f"{PREFIX}{self.tag}h{i}a",
                f"{PREFIX}{self.tag}h{i}b",
            )  # fmt: skip
            for i, p in enumerate(profiles)
        ]
        first = len(profiles)
        self.routers = [
            Host(
                first + j,
                f"{PREFIX}{self.tag}r{j}",
                f"{subnet}.{first + j + 2}",
                home_profiles[j],
                f"{PREFIX}{self.tag}r{j}a",
                f"{PREFIX}{self.tag}r{j}b",
            )  # fmt: skip
            for j in range(routers)
        ]
        self.homes = [
            Home(
                i,
                f"{PREFIX}{self.tag}n{i}",
                f"{LAN_SUBNET}.{0 if shared_router else i}.{i + 2 if shared_router else 2}",
                self.routers[0 if shared_router else i],
            )  # fmt: skip
            for i in range(len(home_profiles))
        ]
        self._old_sigterm = None

    def __enter__(self) -> Network:
        check()
        self._old_sigterm = signal.signal(signal.SIGTERM, _exit_on_sigterm)
        try:
            self._build()
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        remove(self.tag_prefix)
        if self._old_sigterm is not None:
            signal.signal(signal.SIGTERM, self._old_sigterm)
            self._old_sigterm = None

    @property
    def tag_prefix(self) -> str:
        return f"{PREFIX}{self.tag}"

    def _build(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("link", "set", self.bridge, "up")
        for h in [*self.hosts, *self.routers]:
            _ip("netns", "add", h.ns)
            _ip("link", "add", h.veth_bridge, "type", "veth", "peer", "name", h.veth_host)
            _ip("link", "set", h.veth_host, "netns", h.ns)
            _ip("link", "set", h.veth_bridge, "master", self.bridge, "up")
            _ip("-n", h.ns, "addr", "add", f"{h.address}/24", "dev", h.veth_host)
            _ip("-n", h.ns, "link", "set", h.veth_host, "up")
            _ip("-n", h.ns, "link", "set", "lo", "up")
            _tc(h.ns, h.veth_host, h.profile.up_mbit)
            _tc(None, h.veth_bridge, h.profile.down_mbit)
        for r in self.routers:
            self._build_router(r)
        for home in self.homes:
            self._build_home(home)

    def _lan(self, router: Host) -> str:
        """``router``'s LAN prefix (three octets)."""
        return f"{LAN_SUBNET}.{self.routers.index(router)}"

    def _build_router(self, router: Host) -> None:
        """Forwarding on, and NAT as most home routers do it: masquerade what leaves by the
        bridge, keeping the home's source port where it is free (Linux NAT changes it only
        on a clash, so a home's mapping is the same whoever it dials: endpoint-independent),
        and silently drop what arrives there unless it belongs to a connection a home
        started, whether bound for a home or for the router itself (no reset: a reset
        would end a hole punch whose other side's SYN arrives first)."""
        lan, wan = f"{self._lan(router)}.0/24", router.veth_host
        r = subprocess.run(router.exec(["sysctl", "-qw", "net.ipv4.ip_forward=1"]),
                           capture_output=True, text=True)  # fmt: skip
        if r.returncode:
            raise NetemUnavailable(f"cannot enable forwarding in a namespace: {r.stderr.strip()}")
        rules = f"""
            table ip {PREFIX}nat {{
                chain postrouting {{
                    type nat hook postrouting priority srcnat; policy accept;
                    oifname "{wan}" ip saddr {lan} masquerade
                }}
                chain forward {{
                    type filter hook forward priority filter; policy drop;
                    ct state established,related accept
                    iifname != "{wan}" oifname "{wan}" accept
                    ip saddr {lan} ip daddr {lan} accept
                }}
                chain input {{
                    type filter hook input priority filter; policy accept;
                    iifname "{wan}" ct state != established,related drop
                }}
            }}
        """
        if shutil.which("nft") is None:
            raise NetemUnavailable("'nft' not found (install nftables): home hosts need NAT")
        r = subprocess.run(router.exec(["nft", "-f", "-"]), input=rules, capture_output=True,
                           text=True)  # fmt: skip
        if r.returncode:
            raise NetemUnavailable(f"nftables masquerade is unavailable: {r.stderr.strip()}")

    def _build_home(self, home: Home) -> None:
        router, lan = home.router, self._lan(home.router)
        inside, outside = f"{home.ns}a", f"{home.ns}b"  # in the home, in the router
        _ip("netns", "add", home.ns)
        _ip("link", "add", outside, "type", "veth", "peer", "name", inside)
        _ip("link", "set", inside, "netns", home.ns)
        _ip("link", "set", outside, "netns", router.ns)
        if _ip("-n", router.ns, "-o", "addr", "show", "to", f"{lan}.1", check=False).stdout:
            # a router shared by several homes: one LAN bridge holds its side of each
            _ip("-n", router.ns, "link", "set", outside, "master", "lan", "up")
        else:
            _ip("-n", router.ns, "link", "add", "lan", "type", "bridge")
            _ip("-n", router.ns, "addr", "add", f"{lan}.1/24", "dev", "lan")
            _ip("-n", router.ns, "link", "set", "lan", "up")
            _ip("-n", router.ns, "link", "set", outside, "master", "lan", "up")
        _ip("-n", home.ns, "addr", "add", f"{home.address}/24", "dev", inside)
        _ip("-n", home.ns, "link", "set", inside, "up")
        _ip("-n", home.ns, "link", "set", "lo", "up")
        _ip("-n", home.ns, "route", "add", "default", "via", f"{lan}.1")

    def tx_bytes(self) -> int:
        """Bytes all hosts have sent onto the bridge so far (what crossed the 'wire')."""
        total = 0
        for h in [*self.hosts, *self.routers]:
            with contextlib.suppress(OSError):
                stats = Path(f"/sys/class/net/{h.veth_bridge}/statistics")
                total += int((stats / "rx_bytes").read_text())
        return total

    def start_relay(self, host: Host) -> subprocess.Popen:
        """``host``'s relay (killed with its namespace on exit), once it listens."""
        table = [f"{h.address}={h.profile.name}" for h in self.hosts]
        args = [sys.executable, "-m", "scripts.netem.relay", "--listen",
                f"{host.address}:{RELAY_PORT}", "--target", f"127.0.0.1:{NODE_PORT}",
                "--hosts", *table]  # fmt: skip
        proc = subprocess.Popen(host.exec(args), stdout=subprocess.PIPE, text=True, cwd=ROOT)
        if "listening" not in proc.stdout.readline():
            proc.kill()
            raise NetemUnavailable(f"the relay of {host.ns} did not start (exit {proc.wait()})")
        return proc

    def probe(self, src: Host, dst: Host, seconds: float = 3.0) -> dict:
        """``scripts.netem.probe``'s measurement from ``src`` to ``dst`` through ``dst``'s
        relay (started already): round trip and throughput both ways, as a dict."""
        serve = [sys.executable, "-m", "scripts.netem.probe", "serve", "--port", str(NODE_PORT)]
        server = subprocess.Popen(dst.exec(serve), stdout=subprocess.PIPE, text=True, cwd=ROOT)
        try:
            server.stdout.readline()
            to = f"{dst.address}:{RELAY_PORT}"
            measure = [sys.executable, "-m", "scripts.netem.probe", "measure", "--to", to,
                       "--seconds", str(seconds)]  # fmt: skip
            out = subprocess.run(src.exec(measure), capture_output=True, text=True, cwd=ROOT,
                                 check=True, timeout=60 + 4 * seconds)  # fmt: skip
            return json.loads(out.stdout)
        finally:
            server.kill()
            server.wait()

    def cut(self, host: Host) -> None:
        """Partition ``host``: its link goes down (a cable pulled). Packets to and from it
        are dropped; open connections hang until their peers time out."""
        _ip("link", "set", host.veth_bridge, "down")

    def heal(self, host: Host) -> None:
        """Undo ``cut``: the cable is plugged back in (the shaping stays)."""
        _ip("link", "set", host.veth_bridge, "up")


def _tc(ns: str | None, dev: str, mbit: float) -> None:
    prefix = ["ip", "netns", "exec", ns] if ns else []
    cmd = [*prefix, "tc", "qdisc", "replace", "dev", dev, "root", *_tbf(mbit)]
    subprocess.run(cmd, capture_output=True, text=True, check=True)


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)


def check() -> None:
    """Raise ``NetemUnavailable`` naming the first thing this machine lacks."""
    if os.geteuid() != 0:
        raise NetemUnavailable("network namespaces need root (run as root or with sudo)")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise NetemUnavailable(f"'{tool}' not found (install iproute2)")
    probe = f"{PREFIX}chk{uuid.uuid4().hex[:4]}"
    steps = [
        ("network namespaces", ["netns", "add", probe]),
        ("bridges", ["link", "add", f"{probe}br", "type", "bridge"]),
        ("veth pairs", ["link", "add", f"{probe}a", "type", "veth", "peer", "name", f"{probe}b"]),
    ]
    try:
        for what, args in steps:
            r = _ip(*args, check=False)
            if r.returncode:
                raise NetemUnavailable(f"cannot create {what}: {r.stderr.strip()}")
        r = subprocess.run(["tc", "qdisc", "add", "dev", f"{probe}a", "root", *_tbf(50)],
                           capture_output=True, text=True)  # fmt: skip
        if r.returncode:
            raise NetemUnavailable(f"the tbf qdisc is unavailable: {r.stderr.strip()}")
    finally:
        remove(probe)


def pids_in(ns: str) -> list[int]:
    r = _ip("netns", "pids", ns, check=False)
    return [int(p) for p in r.stdout.split()]


def remove(prefix: str = PREFIX) -> list[str]:
    """Kill every process in, and delete, each namespace and link whose name starts with
    ``prefix``; return what was removed."""
    names = _ip("netns", "list", check=False).stdout.split("\n")
    spaces = [n.split()[0] for n in names if n.startswith(prefix)]
    for ns in spaces:
        for pid in pids_in(ns):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while any(pids_in(ns) for ns in spaces) and time.monotonic() < deadline:
        time.sleep(0.1)
    for ns in spaces:
        _ip("netns", "del", ns, check=False)
    links = []
    for line in _ip("-o", "link", "show", check=False).stdout.splitlines():
        name = line.split(":")[1].strip().split("@")[0]
        if name.startswith(prefix):
            links.append(name)
            _ip("link", "del", name, check=False)
    return spaces + links
