"""The benchmark's swarm: ``stages x peers`` node processes, on loopback or one per
emulated host, with seeded kills and replacements."""

from __future__ import annotations

import contextlib
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import psutil

from node.harness.local_swarm import LOCAL, NodeProcess, launch_node, stop_all, wait_until
from protocol.run_spec import read_spec_file
from scripts.netem.network import NODE_PORT, Home, Host, Network, pids_in
from scripts.swarm_bench.wire import node_traffic


class BenchSwarm:
    """Node ``i`` serves stage ``i % stages``. Under ``net``, node ``i`` runs in host ``i``
    (behind its latency relay, unless ``direct``: then on the host's address, its link
    shaped but not delayed), or in ``homes[i]`` (behind NAT: it serves through a circuit
    relay on the first node), and the trainer in the last host. Behind the latency relay,
    every connection reaches a node from 127.0.0.1, which hides from libp2p's AutoNAT where
    peers are: swarms with homes need ``direct``. With ``spec`` (a signed spec file),
    every node starts from it (``--spec``) instead of a run made from ``preset``; with
    ``dashboards``, every node serves its metrics (``traffic`` reads them)."""

    def __init__(
        self,
        workdir: Path,
        stages: int,
        peers: int,
        preset: str,
        net: Network | None = None,
        homes: dict[int, Home] | None = None,
        direct: bool = False,
        spec: Path | None = None,
        dashboards: bool = False,
    ) -> None:
        self.workdir, self.stages, self.peers, self.preset, self.net = (
            workdir, stages, peers, preset, net,
        )  # fmt: skip
        self.homes, self.direct = homes or {}, direct
        self.launched: dict[str, float] = {}  # node name -> time.time() at launch
        self.nodes: list[NodeProcess] = []
        self.stage_of: dict[str, int] = {}
        self.host_of: dict[str, Host] = {}
        self.relays: dict[str, subprocess.Popen] = {}  # host namespace -> its relay
        self._stopped: dict[str, list[psutil.Process]] = {}  # loopback partitions
        self.spec, self.dashboards = spec, dashboards
        self.run = "" if spec is None else read_spec_file(spec.read_text()).spec.run

    def start(self, extra: dict[int, list[str]] | None = None) -> None:
        """Start every node (``extra[i]``: more arguments for node ``i``), until all serve."""
        extra = extra or {}
        if self.net is not None and not self.direct:
            for h in self.net.hosts[:-1]:
                self.relays[h.ns] = self.net.start_relay(h)
        first_args = [] if self.spec else ["--preset", self.preset, "--stages", str(self.stages)]
        first = self._launch("p0", 0, [*first_args, *extra.get(0, [])], host_index=0)
        first.wait_serving(120)
        self.run = first.run_id
        for i in range(1, self.stages * self.peers):
            self._launch(f"p{i}", i % self.stages, extra.get(i, []), host_index=i)
        for n in self.nodes:
            n.wait_serving(180)

    def _launch(self, name: str, stage: int, extra: Sequence[str], host_index: int) -> NodeProcess:
        peers = [n.maddr for n in self.serving()][:1]
        args = ["--stage", str(stage), *extra]
        if self.spec is not None:
            args += ["--spec", str(self.spec)]
        if self.dashboards:  # after launch_node's own --dashboard off: the last one counts
            args += ["--dashboard", "auto"]
        if self.net is None:
            node = launch_node(self.workdir, name, self.run or "bench", initial_peers=peers,
                               extra=args, wait=False)  # fmt: skip
        elif host_index in self.homes:  # behind NAT: dials out only, announces nothing
            node = launch_node(self.workdir, name, self.run or "bench", initial_peers=peers,
                               extra=args, wait=False, host_maddr="/ip4/0.0.0.0/tcp/0",
                               wrap=self.homes[host_index].exec)  # fmt: skip
        elif self.direct:
            host = self.net.hosts[host_index]
            node = launch_node(self.workdir, name, self.run or "bench", initial_peers=peers,
                               extra=args, wait=False, wrap=host.exec,
                               host_maddr=f"/ip4/{host.address}/tcp/{NODE_PORT}")  # fmt: skip
            self.host_of[name] = host
        else:
            # Inside the host's namespace, announcing its relay, which delays its traffic.
            # Every connection reaches it from the relay (127.0.0.1): peers asked to dial
            # it back cannot see where it connects from, so it says it is reachable.
            host = self.net.hosts[host_index]
            node = launch_node(self.workdir, name, self.run or "bench", initial_peers=peers,
                               extra=["--announce-maddrs", host.relay_maddr,
                                      "--reachable", "yes", *args],
                               wait=False, host_maddr=f"/ip4/127.0.0.1/tcp/{NODE_PORT}",
                               wrap=host.exec)  # fmt: skip
            self.host_of[name] = host
        self.nodes.append(node)
        self.launched[name] = time.time()
        self.stage_of[name] = stage
        return node

    def serving(self) -> list[NodeProcess]:
        return [n for n in self.nodes if n.alive() and n.stage() is not None]

    def traffic(self) -> dict[tuple[str, str], int]:
        """Bytes every live node moved so far, by (purpose, direction), summed (with
        ``dashboards``; else empty)."""
        total: dict[tuple[str, str], int] = {}
        for n in self.nodes if self.dashboards else []:
            started = n.events("node.started")
            if not n.alive() or not started or not started[-1].get("metrics"):
                continue
            host = self.host_of.get(n.name)
            for key, b in node_traffic(started[-1]["metrics"], host and host.exec).items():
                total[key] = total.get(key, 0) + b
        return total

    def kill_random(self, rng: random.Random) -> NodeProcess | None:
        """SIGKILL a random serving peer of a stage that has another; None if none has."""
        serving = self.serving()
        count = Counter(self.stage_of[n.name] for n in serving)
        eligible = [n for n in serving if count[self.stage_of[n.name]] > 1]
        if not eligible:
            return None
        victim = rng.choice(eligible)
        victim.proc.send_signal(signal.SIGKILL)
        victim.proc.wait()
        return victim

    def partition(self, node: NodeProcess) -> None:
        """Cut ``node`` off from everyone: under ``net``, its host's link goes down; on
        loopback, SIGSTOP of its processes (node, p2pd, DHT and averager children), which
        peers see the same way: connections open, nothing answered."""
        if self.net is not None:
            self.net.cut(self.host_of[node.name])
            return
        self._stopped[node.name] = _tree(node.proc.pid)
        for p in self._stopped[node.name]:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.send_signal(signal.SIGSTOP)

    def heal(self, node: NodeProcess) -> None:
        """Undo ``partition``."""
        if self.net is not None:
            self.net.heal(self.host_of[node.name])
            return
        for p in self._stopped.pop(node.name, []):
            with contextlib.suppress(psutil.NoSuchProcess):
                p.send_signal(signal.SIGCONT)

    def replace(self, victim: NodeProcess) -> NodeProcess:
        """A new peer (a new identity) for ``victim``'s stage, not waited for."""
        name = f"{victim.name}r"
        host_index = 0
        if self.net is not None:
            host = self.host_of[victim.name]
            relay = self.relays[host.ns].pid
            # the namespace's port is free once the victim's p2pd has died with it
            wait_until(lambda: set(pids_in(host.ns)) <= {relay}, 30, f"{victim.name} to exit")
            host_index = host.index
        return self._launch(name, self.stage_of[victim.name], [], host_index)

    def worker_command(
        self,
        phases: Sequence[str],
        in_flight: int,
        trace_picks: bool = False,
        validate: bool = False,
        gate: bool = False,
    ) -> list[str]:
        """The trainer's command (``scripts.swarm_bench.worker``: its flags)."""
        cmd = [sys.executable, "-m", "scripts.swarm_bench.worker", "--run", self.run,
               "--initial-peers", self.serving()[0].maddr, "--in-flight", str(in_flight),
               "--peers-per-stage", str(self.peers), "--phases", *phases]  # fmt: skip
        flags = {"--trace-picks": trace_picks, "--validate": validate, "--gate": gate}
        cmd += [flag for flag, on in flags.items() if on]
        if self.net is None:
            return [*cmd, "--host-maddrs", LOCAL]
        return self.net.hosts[-1].exec(cmd)

    def close(self) -> None:
        """Kill nodes and relays; under ``net``, until the hosts are empty again, so the
        next swarm can bind the same ports."""
        for name in list(self._stopped):  # SIGCONT first, so stopped processes die too
            self.heal(next(n for n in self.nodes if n.name == name))
        stop_all(self.nodes)
        for relay in self.relays.values():
            relay.kill()
            relay.wait()
        if self.net is not None:
            for h in self.net.hosts:
                wait_until(lambda h=h: not pids_in(h.ns), 30, f"{h.ns} to be empty")


def _tree(pid: int) -> list[psutil.Process]:
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]
