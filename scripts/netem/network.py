"""Hosts as network namespaces on one bridge, each behind its own shaped veth pair.

Host ``i`` is the namespace ``stn<tag>h<i>`` with address ``10.77.0.<i+2>/24`` on its end
of a veth pair; the other end is a port of the bridge ``stn<tag>br``, which has no
address: nothing is reachable from, or added to, the machine's own network. Upload is
shaped with ``tbf`` on the host's end, download on the bridge's end. Every name starts
with ``PREFIX``, so ``cleanup()`` finds whatever a crashed run left.
"""

from __future__ import annotations

import contextlib
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


class Network:
    """Builds the hosts on ``__enter__`` and removes everything on ``__exit__`` (also after
    an exception or Ctrl-C; SIGTERM is turned into the same exit while it is open)."""

    def __init__(self, profiles: Sequence[Profile]) -> None:
        if not 1 <= len(profiles) <= 200:
            raise ValueError(f"1..200 hosts, got {len(profiles)}")
        self.tag = uuid.uuid4().hex[:4]
        self.bridge = f"{PREFIX}{self.tag}br"
        self.hosts = [
            Host(
                i,
                f"{PREFIX}{self.tag}h{i}",
                f"{SUBNET}.{i + 2}",
                p,
                f"{PREFIX}{self.tag}h{i}a",
                f"{PREFIX}{self.tag}h{i}b",
            )  # fmt: skip
            for i, p in enumerate(profiles)
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
        for h in self.hosts:
            _ip("netns", "add", h.ns)
            _ip("link", "add", h.veth_bridge, "type", "veth", "peer", "name", h.veth_host)
            _ip("link", "set", h.veth_host, "netns", h.ns)
            _ip("link", "set", h.veth_bridge, "master", self.bridge, "up")
            _ip("-n", h.ns, "addr", "add", f"{h.address}/24", "dev", h.veth_host)
            _ip("-n", h.ns, "link", "set", h.veth_host, "up")
            _ip("-n", h.ns, "link", "set", "lo", "up")
            _tc(h.ns, h.veth_host, h.profile.up_mbit)
            _tc(None, h.veth_bridge, h.profile.down_mbit)

    def tx_bytes(self) -> int:
        """Bytes all hosts have sent onto the bridge so far (what crossed the 'wire')."""
        total = 0
        for h in self.hosts:
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
