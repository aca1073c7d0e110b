"""Swarm behaviour under heterogeneity, churn and stragglers, measured side by side.

Each scenario starts its own swarm (``--stages`` x ``--peers`` node processes) and a
trainer process, and alternates phases in one run so that the ratios compare like with
like on this machine:

- ``wiring``: one stage-1 peer declares a fifth of the others' throughput and is capped
  at ``--slow-cores`` of CPU, a fixed amount (not a share of what it used, which depends on
  how much routing sent it) so that runs compare; fixed wiring (GPipe-like) vs stochastic
  wiring.
- ``churn``: a random peer of a stage that has another is SIGKILLed every ``--kill-every``
  seconds and replaced at once, vs undisturbed; bytes on the wire per sample vs the
  activation and averaging bytes the run needs.
- ``straggler``: a stage-1 peer is capped at a fifth of its CPU mid-run; throughput before
  and after, and how long until routing avoids it.
- ``partition``: a stage-1 peer is cut off mid-run (its host's link down under ``--netem``;
  on loopback, SIGSTOP of its processes) and reconnected later; throughput during the
  partition and after it against before, how long until micro-batches flow around it
  (and when routing last sent it a call), and how long after reconnecting until it gets
  calls again.
- ``nat`` (network namespaces only; not run unless named): the swarm with every peer of
  stage 1 behind NAT (a home each, serving through a circuit relay on the first node)
  against the same swarm all public, both at once, each on an emulated network of its
  own (the bridge on a public-looking subnet, the ``--netem`` profile's rates, ``home``
  by default, for every host, without the latency relay: it hides where connections come
  from, which AutoNAT needs). Their trainers take turns in ``--phase`` windows, ABBA
  (``--repeat`` blocks), the other idle, so that the other jobs' load weighs on both
  alike; samples/s of each, the ratio of each adjacent pair of windows, and the seconds
  from a stage-1 node's start to serving in each swarm (both started together).
- ``links``: what users get on their links, per run configuration (``--configs``: run
  settings in a signed spec that every node starts from; ``--inner-steps`` and
  ``--target-batch`` apply to each): the same swarm once on loopback (the compute-bound
  rate on this machine) and then with every host behind ``--link`` (the ``home`` profile
  by default), each trained from its start for ``--micro-batches`` after a counted
  warm-up; samples/s of each and their ratio, bytes on the wire per sample by purpose
  (activations and gradients as the trainer counts them, averaging and state as the
  nodes' metrics do, the rest of the wire's count as ``other``), averaging rounds per
  peer (averaged, and each other way a round ended), the median seconds of each of the
  trainer's calls per micro-batch, the mean seconds of a micro-batch in flight with the
  rate ``--in-flight`` micro-batches allow at it (``window samples/s``: near the measured
  rate, the window binds), and the validation loss after those samples, also as a ratio
  to the first configuration's on the same link. It builds its own network: not with
  ``--netem``.

``--runs N`` repeats each scenario as N whole runs (a new swarm each, seeds differing) and
ends with the median of each figure over the runs, with its range; ``results.json`` in
``--out`` holds every run's figures. Loopback by default; ``--netem PROFILE`` runs each
node in its own network namespace behind a shaped link and a latency relay
(``scripts/netem``; root only). PNG plots of throughput over time (from the first run)
go to ``--out``.

    python -m scripts.bench_swarm --scenarios wiring churn straggler partition --runs 3
    python -m scripts.bench_swarm --netem home --scenarios churn
    python -m scripts.bench_swarm --scenarios nat
    python -m scripts.bench_swarm --scenarios links --preset small --configs default \\
        diloco diloco-int4-zip --inner-steps 10 --target-batch 16 --micro-batches 120
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import queue
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from models.config import preset as preset_config
from node.cli.plot import PlotUnavailable, write_line_chart
from node.files import write_run_spec
from node.limits import ACTIVATIONS, AVERAGING, GRADIENTS, SENT, STATE
from protocol.routing import WINDOW
from protocol.run_spec import AveragingSpec
from scripts.netem.network import ROOT, NetemUnavailable, Network
from scripts.netem.profiles import profile
from scripts.swarm_bench.swarm import BenchSwarm
from scripts.swarm_bench.throttle import (
    CpuThrottle,
    ThrottleUnavailable,
    tree_cpu_seconds,
)
from scripts.swarm_bench.wire import loopback_bytes

SLOWDOWN = 5.0
SCENARIOS = ("wiring", "churn", "straggler", "partition")
NAT_SUBNET = "44.77.0"  # public-looking, inside the namespaces only: AutoNAT needs one
# Run settings ``links`` compares (``--configs``): ``write_spec``'s, over the preset's.
# "default" is the spec's defaults; every other names its compressions, so that it means
# the same run whatever the defaults are.
PLAIN = {"compression": "none"}  # uncompressed boundaries (or rounds, under "averaging")
CONFIGS: dict[str, dict] = {
    "default": {},
    "none": PLAIN | {"averaging": PLAIN},
    "uint8": PLAIN | {"averaging": {"compression": "uint8"}},
    "int4-uint8": {"compression": "int4", "averaging": {"compression": "uint8"}},
    "uint8-uint8": {"compression": "uint8", "averaging": {"compression": "uint8"}},
    "diloco": PLAIN | {"averaging": PLAIN | {"mode": "diloco"}},
    "diloco-zip": PLAIN | {"averaging": {"mode": "diloco", "density": 0.1, "compression": "uint8"}},
    "diloco-int4-zip": {
        "compression": "int4",
        "averaging": {"mode": "diloco", "density": 0.1, "compression": "uint8"},
    },
    # small's 384-wide residual stream crossing a cut as 96 values per token (a quarter)
    "r96-int4-uint8": {
        "compression": "int4",
        "averaging": {"compression": "uint8"},
        "arch": {"boundary_rank": 96},
    },
}


@dataclass
class Record:
    """What the trainer reported, with the orchestrator's events and byte counts."""

    spec: dict = field(default_factory=dict)
    phases: list[tuple[str, float]] = field(default_factory=list)  # (name, start)
    wire: dict[str, int] = field(default_factory=dict)  # phase -> wire bytes at its start
    # phase (or "end") -> purpose -> bytes moved so far, when the swarm serves its metrics
    traffic: dict[str, dict[str, int]] = field(default_factory=dict)
    end: float = 0.0
    mbs: list[dict] = field(default_factory=list)
    events: list[tuple[float, str]] = field(default_factory=list)
    picks: list[tuple[float, str]] = field(default_factory=list)  # (time, peer) per call
    val: float = math.nan  # validation loss after the last phase (``validate``)

    def span(self, name: str) -> tuple[float, float]:
        starts = [t for _, t in self.phases] + [self.end]
        i = [n for n, _ in self.phases].index(name)
        return starts[i], starts[i + 1]

    def rate(self, lo: float, hi: float) -> float:
        return sum(m["samples"] for m in self.mbs if lo <= m["t"] < hi) / (hi - lo)

    def phase_rate(self, name: str) -> float:
        return self.rate(*self.span(name))

    def samples(self, name: str) -> int:
        lo, hi = self.span(name)
        return sum(m["samples"] for m in self.mbs if lo <= m["t"] < hi)

    def series(self, bin_s: float = 2.0) -> list[tuple[float, float]]:
        t0 = self.phases[0][1]
        n = int((self.end - t0) // bin_s)
        return [(i * bin_s, self.rate(t0 + i * bin_s, t0 + (i + 1) * bin_s)) for i in range(n)]


class Bench:
    def __init__(
        self, args: argparse.Namespace, net: Network | None, seed: int, plot: bool = True
    ) -> None:
        self.args, self.net, self.plot = args, net, plot
        self.rng = random.Random(seed)
        self.out: Path = args.out
        self.out.mkdir(parents=True, exist_ok=True)

    def wire_bytes(self) -> int:
        return self.net.tx_bytes() if self.net else loopback_bytes()

    def swarm(self, workdir: Path) -> BenchSwarm:
        """The scenario's swarm: a run of ``--preset``, or with ``--configs`` named, the
        first one's run (``write_spec``)."""
        a = self.args
        spec = write_spec(workdir, a.preset, a.stages, a.configs[0][1]) if a.configs else None
        return BenchSwarm(workdir, a.stages, a.peers, a.preset, self.net, spec=spec)

    def run_worker(
        self,
        swarm: BenchSwarm,
        phases: list[str],
        tick: Callable[[Record, str, float], None],
        trace_picks: bool = False,
        validate: bool = False,
    ) -> Record:
        """Run the trainer through ``phases``, calling ``tick(record, phase, seconds into
        it)`` about ten times a second; return what it reported."""
        return self.run_workers([(swarm, phases)], tick, trace_picks, validate)[0]

    def run_workers(
        self,
        runs: list[tuple[BenchSwarm, list[str]]],
        tick: Callable[[Record, str, float], None] = lambda *_: None,
        trace_picks: bool = False,
        validate: bool = False,
    ) -> list[Record]:
        """One trainer per ``(swarm, phases)``, all at once; with several, each waits,
        once open, until all are (``--gate``), so that their phases start together and
        keep in step. ``tick`` as in ``run_worker`` (for the first trainer's phases)."""
        gate, lines = len(runs) > 1, queue.Queue()
        recs, procs, logs, readers = [Record() for _ in runs], [], [], []
        try:
            for k, (swarm, phases) in enumerate(runs):
                logs.append((swarm.workdir / "worker.log").open("w"))
                cmd = swarm.worker_command(
                    phases, self.args.in_flight, trace_picks, validate, gate=gate
                )
                pipes = {"stdout": subprocess.PIPE, "stdin": subprocess.PIPE}
                procs.append(subprocess.Popen(cmd, stderr=logs[-1], text=True, cwd=ROOT, **pipes))
                out = procs[-1].stdout
                readers.append(threading.Thread(
                    target=lambda k=k, out=out: [lines.put((k, x)) for x in out], daemon=True
                ))  # fmt: skip
                readers[-1].start()
            ready: set[int] = set()
            while any(r.is_alive() for r in readers) or not lines.empty():
                try:
                    k, line = lines.get(timeout=0.1)
                    event = json.loads(line)
                except queue.Empty:
                    event = None
                if event is not None and event["event"] == "ready":
                    ready.add(k)
                    if len(ready) == len(runs):
                        for proc in procs:
                            proc.stdin.write("go\n")
                            proc.stdin.flush()
                elif event is not None:
                    self._record(recs[k], event, runs[k][0])
                rec = recs[0]
                if rec.phases and not rec.end:
                    name, start = rec.phases[-1]
                    tick(rec, name, time.time() - start)
        finally:
            for proc in procs:
                proc.kill()
                proc.wait()
            for log in logs:
                log.close()
        for (swarm, _), proc, rec in zip(runs, procs, recs, strict=True):
            if proc.returncode not in (0, -9) or not rec.end:
                tail = (swarm.workdir / "worker.log").read_text(errors="replace")[-3000:]
                raise RuntimeError(f"the trainer failed ({swarm.workdir / 'worker.log'}):\n{tail}")
        return recs

    def _record(self, rec: Record, event: dict, swarm: BenchSwarm) -> None:
        kind = event.pop("event")
        if kind in ("phase", "end") and swarm.dashboards:
            at = event["name"] if kind == "phase" else "end"
            nodes = swarm.traffic()
            rec.traffic[at] = {
                **{p: event["traffic"][p] for p in (ACTIVATIONS, GRADIENTS)},
                **{p: nodes.get((p, SENT), 0) for p in (AVERAGING, STATE)},
            }
        if kind == "spec":
            rec.spec = event
        elif kind == "phase":
            rec.phases.append((event["name"], event["t"]))
            rec.wire[event["name"]] = self.wire_bytes()
        elif kind == "mb":
            rec.mbs.append(event)
        elif kind == "pick":
            rec.picks.append((event["t"], event["peer"]))
        elif kind == "end":
            rec.end = event["t"]
            rec.wire["end"] = self.wire_bytes()
        elif kind == "val":
            rec.val = event["loss"]

    def cap(self, swarm: BenchSwarm, name: str, cores: float) -> CpuThrottle:
        """Cap node ``name`` (its process tree) at ``cores`` of CPU."""
        node = next(n for n in swarm.nodes if n.name == name)
        throttle = CpuThrottle(name)
        throttle.apply(node.proc.pid, cores)
        return throttle

    def cap_relative(self, swarm: BenchSwarm, name: str, since: float, cpu0: float) -> CpuThrottle:
        """Cap node ``name`` at 1/SLOWDOWN of the CPU it used since ``since``."""
        node = next(n for n in swarm.nodes if n.name == name)
        used = (tree_cpu_seconds(node.proc.pid) - cpu0) / (time.time() - since)
        print(f"  {name} used {used:.2f} cores; capped at {used / SLOWDOWN:.3f}")
        return self.cap(swarm, name, used / SLOWDOWN)

    # --- scenarios -----------------------------------------------------------------

    def wiring(self, workdir: Path) -> dict[str, float]:
        a, swarm, throttle = self.args, self.swarm(workdir), None
        slow = f"p{2 * a.stages - 1}"  # stage stages-1's second peer
        phases = [f"warmup:stochastic:{a.warmup}"]
        for i in range(a.repeat):
            phases += [f"fixed{i}:fixed:{a.phase}", f"stochastic{i}:stochastic:{a.phase}"]
        try:
            swarm.start({2 * a.stages - 1: ["--throughput", str(100 / SLOWDOWN)]})

            def tick(rec: Record, phase: str, _: float) -> None:
                nonlocal throttle
                if phase != "warmup" and throttle is None:
                    throttle = self.cap(swarm, slow, a.slow_cores)

            rec = self.run_worker(swarm, phases, tick)
        finally:
            if throttle is not None:
                throttle.close()
            swarm.close()
        ratios = [rec.phase_rate(f"stochastic{i}") / rec.phase_rate(f"fixed{i}")
                  for i in range(a.repeat)]  # fmt: skip
        fixed = [rec.phase_rate(f"fixed{i}") for i in range(a.repeat)]
        stoch = [rec.phase_rate(f"stochastic{i}") for i in range(a.repeat)]
        print(f"wiring, one slow peer ({slow}: declares 1/{SLOWDOWN:.0f} of the others' "
              f"throughput, capped at {a.slow_cores:g} cores):")  # fmt: skip
        print(f"  fixed (GPipe-like) samples/s:  {_spread(fixed)}")
        print(f"  stochastic samples/s:          {_spread(stoch)}")
        print(f"  ratio stochastic / fixed:      {_spread(ratios, 2)}")
        return {
            "fixed samples/s": statistics.median(fixed),
            "stochastic samples/s": statistics.median(stoch),
            "stochastic / fixed": statistics.median(ratios),
            "load (1 min)": os.getloadavg()[0],
        }

    def churn(self, workdir: Path) -> dict[str, float]:
        a, swarm = self.args, self.swarm(workdir)
        phases = [f"warmup:stochastic:{a.warmup}"]
        for i in range(a.repeat):
            phases += [f"steady{i}:stochastic:{a.phase}", f"churn{i}:stochastic:{a.phase}"]
        kills: list[str] = []
        last_kill = {}
        try:
            swarm.start()

            def tick(rec: Record, phase: str, into: float) -> None:
                if not phase.startswith("churn") or into > a.phase * 2 / 3:
                    return  # no kill late in a phase: replacements join within it
                if into - last_kill.get(phase, 0.0) < a.kill_every:
                    return
                last_kill[phase] = into
                victim = swarm.kill_random(self.rng)
                if victim is None:
                    rec.events.append((time.time(), "no peer to kill"))
                    return
                kills.append(victim.name)
                rec.events.append((time.time(), f"kill {victim.name}"))
                swarm.replace(victim)

            rec = self.run_worker(swarm, phases, tick)
        finally:
            swarm.close()
        steady = [rec.phase_rate(f"steady{i}") for i in range(a.repeat)]
        churn = [rec.phase_rate(f"churn{i}") for i in range(a.repeat)]
        ratios = [c / s for c, s in zip(churn, steady, strict=True)]
        print(f"churn: a SIGKILL every {a.kill_every:.0f} s, replaced at once ({len(kills)} kills)")
        print(f"  undisturbed samples/s:         {_spread(steady)}")
        print(f"  with churn samples/s:          {_spread(churn)}")
        print(f"  ratio churn / undisturbed:     {_spread(ratios, 2)}")
        wire = self._wire(rec, [f"steady{i}" for i in range(a.repeat)])
        t0 = rec.phases[0][1]
        markers = [(t - t0, n) for n, t in rec.phases[1:]]
        markers += [(t - t0, what) for t, what in rec.events]
        self._plot("churn", rec, markers, "throughput with a peer SIGKILLed and replaced")
        return {
            "undisturbed samples/s": statistics.median(steady),
            "churn samples/s": statistics.median(churn),
            "churn / undisturbed": statistics.median(ratios),
            "kills": float(len(kills)),
            **wire,
        }

    def _wire(self, rec: Record, names: list[str]) -> dict[str, float]:
        keys = [n for n, _ in rec.phases] + ["end"]
        per_sample = []
        for n in names:
            nxt = keys[keys.index(n) + 1]
            per_sample.append((rec.wire[nxt] - rec.wire[n]) / rec.samples(n))
        need = rec.spec["activation_bytes"] + rec.spec["averaging_bytes"]
        where = "on the bridge (all hosts)" if self.net else "on loopback (whole machine)"
        print(f"  bytes per sample {where}: {_spread(per_sample)}")
        print(f"  needed: activations {rec.spec['activation_bytes']:.0f} + averaging "
              f"({rec.spec['mode']}) {rec.spec['averaging_bytes']:.0f} = {need:.0f}")  # fmt: skip
        print(f"  ratio wire / needed:           {_spread([b / need for b in per_sample], 2)}")
        return {
            "wire bytes / sample": statistics.median(per_sample),
            "wire / needed": statistics.median(per_sample) / need,
        }

    def straggler(self, workdir: Path) -> dict[str, float]:
        a, swarm, throttle = self.args, self.swarm(workdir), None
        slow = f"p{2 * a.stages - 1}"
        at = a.phase  # seconds into the run phase
        phases = [f"warmup:stochastic:{a.warmup}", f"run:stochastic:{3 * a.phase}"]
        state: dict = {}
        try:
            swarm.start()
            node = next(n for n in swarm.nodes if n.name == slow)

            def tick(rec: Record, phase: str, into: float) -> None:
                nonlocal throttle
                if phase == "run" and "t" not in state:
                    state["t"], state["cpu"] = time.time(), tree_cpu_seconds(node.proc.pid)
                if phase == "run" and into >= at and throttle is None:
                    throttle = self.cap_relative(swarm, slow, state["t"], state["cpu"])
                    state["throttled"] = time.time()
                    rec.events.append((state["throttled"], f"{slow} slowed 5x"))

            rec = self.run_worker(swarm, phases, tick)
            peer_id = node.peer_id
        finally:
            if throttle is not None:
                throttle.close()
            swarm.close()
        start, end = rec.span("run")
        t_slow = state["throttled"]
        before, after = rec.rate(start, t_slow), rec.rate(t_slow, end)
        stage = swarm.stage_of[slow]
        share = _share(rec, peer_id, stage, 2.0)
        share_before = _mean([s for t, s in share if start <= t < t_slow])
        avoid = _avoided(share, t_slow, share_before / 2)
        print(f"straggler: {slow} (stage {stage}) capped at 1/{SLOWDOWN:.0f} of its CPU at "
              f"{at:.0f} s")  # fmt: skip
        print(f"  samples/s before {before:.1f}, after {after:.1f}: ratio {after / before:.2f}")
        print(
            f"  its share of micro-batches: {share_before:.2f} before, "
            f"{_mean([s for t, s in share if t >= t_slow + 10]):.2f} from 10 s after"
        )
        print(f"  routing avoids it (share < half of before, 3 bins running) after: "
              f"{'never' if avoid is None else f'{avoid:.1f} s'}")  # fmt: skip
        self._plot_share("straggler", rec, share, "share of micro-batches via the straggler (%)",
                         "throughput with one peer slowed 5x")  # fmt: skip
        return {
            "before samples/s": before,
            "after samples/s": after,
            "after / before": after / before,
            "s until routing avoids it": math.nan if avoid is None else avoid,
        }

    def partition(self, workdir: Path) -> dict[str, float]:
        a, swarm = self.args, self.swarm(workdir)
        cut = f"p{2 * a.stages - 1}"  # stage stages-1's second peer, as in straggler
        phases = [f"warmup:stochastic:{a.warmup}", f"run:stochastic:{3 * a.phase}"]
        how = "its host's link down" if self.net else "SIGSTOP of its processes"
        state: dict = {}
        try:
            swarm.start()
            node = next(n for n in swarm.nodes if n.name == cut)
            peer_id = node.peer_id

            def tick(rec: Record, phase: str, into: float) -> None:
                if phase != "run":
                    return
                if into >= a.phase and "cut" not in state:
                    swarm.partition(node)
                    state["cut"] = time.time()
                    rec.events.append((state["cut"], f"{cut} cut off"))
                if into >= 2 * a.phase and "heal" not in state:
                    swarm.heal(node)
                    state["heal"] = time.time()
                    rec.events.append((state["heal"], f"{cut} back"))

            rec = self.run_worker(swarm, phases, tick, trace_picks=True)
        finally:
            swarm.close()
        start, end = rec.span("run")
        t_cut, t_heal = state["cut"], state["heal"]
        before, during = rec.rate(start, t_cut), rec.rate(t_cut, t_heal)
        after = rec.rate(t_heal, end)
        # Routing stops sending it new calls at once (the last pick below), but the calls
        # already there hang until their timeout and hold the trainer's in-flight slots:
        # micro-batches flow around it only from the end of the last stall (a gap of over
        # 2 s between completions) in the partition.
        stalls = _stalls(rec, t_cut, t_heal)
        flowing = stalls[-1][1] if stalls else t_cut
        stalled_after = max([g for g, _ in _stalls(rec, t_heal, end)], default=0.0)
        picked = [t for t, p in rec.picks if p == peer_id]
        last = max([t for t in picked if t_cut <= t < t_heal], default=t_cut)
        back = min([t for t in picked if t >= t_heal], default=None)
        share = _pick_share(rec, peer_id, 2.0)
        share_before = _mean([s for t, s in share if start <= t < t_cut])
        print(f"partition: {cut} (stage {swarm.stage_of[cut]}) cut off ({how}) from "
              f"{a.phase:.0f} s to {2 * a.phase:.0f} s of the run")  # fmt: skip
        print(f"  samples/s before {before:.1f}, during {during:.1f}, after {after:.1f}: "
              f"ratio during {during / before:.2f}, after {after / before:.2f}")  # fmt: skip
        print(f"  its share of routing picks before: {share_before:.2f}; calls routed to it "
              f"while cut off: {sum(t_cut <= t < t_heal for t in picked)}")  # fmt: skip
        print(f"  last call routed to it: {last - t_cut:.1f} s after the cut; micro-batches "
              f"flow around it from {flowing - t_cut:.1f} s after (stalls: "
              f"{', '.join(f'{g:.1f} s' for g, _ in stalls) or 'none'})")  # fmt: skip
        print(f"  routed to again after reconnecting: "
              f"{'never' if back is None else f'{back - t_heal:.1f} s'}; longest stall after "
              f"reconnecting: {stalled_after:.1f} s")  # fmt: skip
        self._plot_share("partition", rec, share, "share of routing picks to the cut-off peer (%)",
                         "throughput with one peer cut off")  # fmt: skip
        return {
            "before samples/s": before,
            "during samples/s": during,
            "during / before": during / before,
            "after / before": after / before,
            "s until routing avoids it": flowing - t_cut,
            "s until last call routed to it": last - t_cut,
            "s until routed to again": math.nan if back is None else back - t_heal,
            "s stalled after reconnecting": stalled_after,
        }

    def links(self, workdir: Path) -> dict[str, float]:
        """Each of ``--configs`` (run settings, in a signed spec every node starts from) as
        the same swarm on loopback, then on ``--link``: one whole run of each, measured
        over the same micro-batches."""
        a, figures = self.args, {}
        warmup = max(10, a.micro_batches // 5)  # counted, so both runs train the same samples
        phases = [f"warmup:stochastic:{warmup}mb", f"measured:stochastic:{a.micro_batches}mb"]
        configs = a.configs or [("default", with_overrides(CONFIGS["default"], a))]
        ref = configs[0][0]
        for name, settings in configs:
            for where in ("loopback", a.link):
                net = (
                    None
                    if where == "loopback"
                    else Network([profile(a.link)] * (a.stages * a.peers + 1))
                )
                here = workdir / name / where
                spec = write_spec(here, a.preset, a.stages, settings)
                with net if net is not None else contextlib.nullcontext():
                    bench = Bench(a, net, seed=0, plot=False)
                    swarm = BenchSwarm(here, a.stages, a.peers, a.preset, net, spec=spec,
                                       dashboards=True)  # fmt: skip
                    linked = shlex.split(a.link_node_args) if net is not None else []
                    try:
                        swarm.start(dict.fromkeys(range(a.stages * a.peers), linked))
                        rec = bench.run_worker(swarm, phases, lambda *_: None, validate=True)
                        rounds = _rounds(swarm, *rec.span("measured"))
                    finally:
                        swarm.close()
                key = f"{name} {where}"
                figures[f"{key} samples/s"] = rec.phase_rate("measured")
                figures[f"{key} validation loss"] = rec.val
                figures[f"{key} rounds per peer"] = rounds.get("averaged", 0.0)
                for how, per_peer in rounds.items():
                    if how != "averaged":
                        figures[f"{key} rounds {how} per peer"] = per_peer
                split = call_split(rec, *rec.span("measured"), a.stages)
                for call, seconds in split.items():
                    if call != "samples/mb":
                        figures[f"{key} {call} s"] = seconds
                if split:
                    figures[f"{key} window samples/s"] = (
                        a.in_flight * split["samples/mb"] / split["mb"]
                    )
                figures[f"{key} load (1 min)"] = os.getloadavg()[0]
                for purpose, b in _purpose_bytes(rec, "measured", "end").items():
                    figures[f"{key} {purpose} B/sample"] = b / rec.samples("measured")
                print(f"  {key}: " + ", ".join(f"{k[len(key) + 1 :]} {v:.3f}"
                      for k, v in figures.items() if k.startswith(key)), flush=True)  # fmt: skip
            figures[f"{name} {a.link} / loopback"] = (
                figures[f"{name} {a.link} samples/s"] / figures[f"{name} loopback samples/s"]
            )
            for where in ("loopback", a.link):
                figures[f"{name} {where} loss / {ref}'s"] = (
                    figures[f"{name} {where} validation loss"]
                    / figures[f"{ref} {where} validation loss"]
                )
        print(f"links: {a.stages} x {a.peers} {a.preset}, {a.micro_batches} micro-batches after "
              f"{warmup} of warm-up, loopback vs {a.link}; bytes on the wire per sample by "
              "purpose (other: the wire's count less the counted ones: DHT, gossip, "
              "matchmaking, libp2p framing; on loopback every process's)")  # fmt: skip
        for key, value in figures.items():
            print(f"  {key:<48} {value:14.3f}")
        return figures

    def _plot_share(self, name, rec, share, label, title) -> None:
        """The throughput plot with the phase markers and one peer's share (in %) as a
        second line; ``share`` is (time, fraction) pairs on the run's clock."""
        t0 = rec.phases[0][1]
        markers = [(t - t0, what) for t, what in rec.events]
        self._plot(name, rec, markers, title, {label: [(t - t0, 100 * f) for t, f in share]})

    def nat(self, workdir: Path) -> dict[str, float]:
        """Two swarms at once, each on its own emulated network: one all public, one with
        stage 1's peers behind NAT. Their trainers take turns in windows of ``--phase``
        seconds (the other one idle), in ABBA order, so that the load of other jobs on
        the machine falls on both alike; each adjacent pair of windows gives one ratio."""
        a = self.args
        n = a.stages * a.peers
        behind = [i for i in range(n) if i % a.stages == 1]  # stage 1's peers
        link = profile(a.netem or "home")
        turns = nat_turns(a.repeat)
        phases = {
            v: [
                f"warmup-{w}:{'stochastic' if w == v else 'idle'}:{a.warmup}"
                for w in VARIANTS
            ] + [
                f"w{k}:{'stochastic' if w == v else 'idle'}:{a.phase}"
                for k, w in enumerate(turns)
            ]
            for v in VARIANTS
        }  # fmt: skip
        nets = {
            "public": Network([link] * (n + 1), subnet=NAT_SUBNET),
            "nat": Network([link] * (n + 1), [link] * len(behind), subnet=NAT_SUBNET),
        }
        swarms: dict[str, BenchSwarm] = {}
        with nets["public"], nets["nat"]:
            try:
                for v in VARIANTS:
                    homes = dict(zip(behind, nets[v].homes, strict=True)) if v == "nat" else {}
                    swarms[v] = BenchSwarm(workdir / v, a.stages, a.peers, a.preset, nets[v],
                                           homes, direct=True)  # fmt: skip
                with ThreadPoolExecutor(len(VARIANTS)) as pool:  # both start under one load
                    for started in [pool.submit(s.start) for s in swarms.values()]:
                        started.result()
                recs = dict(zip(VARIANTS, self.run_workers(
                    [(swarms[v], phases[v]) for v in VARIANTS]), strict=True))  # fmt: skip
                serving = {
                    v: [node.events("stage.held")[0]["t"] - swarms[v].launched[node.name]
                        for node in swarms[v].nodes if int(node.name[1:]) in behind]
                    for v in VARIANTS
                }  # fmt: skip
            finally:
                for swarm in swarms.values():
                    swarm.close()
        rates = {v: [recs[v].phase_rate(f"w{k}") for k, w in enumerate(turns) if w == v]
                 for v in VARIANTS}  # fmt: skip
        ratios = paired_ratios(turns, [recs[w].phase_rate(f"w{k}") for k, w in enumerate(turns)])
        print(f"nat, stage 1's {len(behind)} peers behind NAT (via a relay) vs public, "
              f"{len(turns)} windows of {a.phase:.0f} s in turns ({link.name} links):")  # fmt: skip
        print(f"  public samples/s:              {_spread(rates['public'])}")
        print(f"  behind NAT samples/s:          {_spread(rates['nat'])}")
        print(f"  ratio NAT / public, per pair:  {_spread(ratios, 2)}")
        for v in VARIANTS:
            print(f"  s from start to serving, stage 1, {v}: {_spread(serving[v])}")
        return {
            "public samples/s": statistics.median(rates["public"]),
            "nat samples/s": statistics.median(rates["nat"]),
            "nat / public (paired)": statistics.median(ratios),
            "nat / public, lowest pair": min(ratios),
            "nat / public, highest pair": max(ratios),
            "public s to serving (stage 1)": statistics.median(serving["public"]),
            "nat s to serving (stage 1)": statistics.median(serving["nat"]),
        }

    def _plot(self, name, rec, markers, title, extra=None) -> None:
        if not self.plot:
            return
        path = self.out / f"{name}{'-' + self.args.netem if self.args.netem else ''}.png"
        series = {"samples/s (2 s bins)": rec.series(), **(extra or {})}
        where = f"netem {self.args.netem}" if self.args.netem else "loopback"
        try:
            write_line_chart(path, series, title=f"{title} ({where})", x_label="seconds",
                             y_label="samples/s", markers=markers)  # fmt: skip
        except PlotUnavailable as e:
            print(f"  no plot: {e}")
            return
        print(f"  plot: {path}")


VARIANTS = ("public", "nat")


def nat_turns(blocks: int) -> list[str]:
    """Which swarm trains in each window: ``blocks`` ABBA blocks (public, nat, nat,
    public, ...), so that a load that drifts linearly over a block weighs on both alike."""
    a, b = VARIANTS
    return [v for _ in range(blocks) for v in (a, b, b, a)]


def paired_ratios(turns: list[str], rates: list[float]) -> list[float]:
    """nat / public for each adjacent pair of windows (``turns[2i]``, ``turns[2i + 1]``,
    one of each variant), given each window's samples/s."""
    out = []
    for i in range(0, len(turns) - 1, 2):
        by = dict(zip(turns[i : i + 2], rates[i : i + 2], strict=True))
        if set(by) != set(VARIANTS):
            raise ValueError(f"windows {i} and {i + 1} are not one of each: {turns[i : i + 2]}")
        out.append(by["nat"] / by["public"] if by["public"] > 0 else math.nan)
    return out


def write_spec(workdir: Path, preset: str, stages: int, settings: dict) -> Path:
    """A run's signed spec file in ``workdir`` (owned by a key made there): ``preset`` cut
    into ``stages``, with ``settings`` (``make_run_spec``'s: ``RunSpec`` and optimizer
    fields; ``averaging`` as a dict of ``AveragingSpec`` fields; ``arch`` as a dict of
    ``ModelConfig`` fields) over its defaults."""
    settings = dict(settings)
    if "averaging" in settings:
        settings["averaging"] = AveragingSpec(**settings["averaging"])
    if "arch" in settings:
        settings["model"] = dataclasses.replace(preset_config(preset)[0], **settings.pop("arch"))
    path = workdir / "bench.spec.json"
    write_run_spec(path, workdir / "owner.key", "bench", preset, stages, **settings)
    return path


def _purpose_bytes(rec: Record, lo: str, hi: str) -> dict[str, float]:
    """Bytes on the wire between the snapshots ``lo`` and ``hi``, by purpose: activations
    and gradients as the trainer counted them (every one crosses between it and a stage),
    averaging and state as the nodes sent them, and ``other``: the wire's count less those."""
    moved = {p: rec.traffic[hi][p] - rec.traffic[lo][p] for p in rec.traffic[lo]}
    moved["other"] = rec.wire[hi] - rec.wire[lo] - sum(moved.values())
    return moved


def _rounds(swarm: BenchSwarm, lo: float, hi: float) -> dict[str, float]:
    """Averaging rounds in [lo, hi) per node, by how they ended (``averaged``: with
    others; ``alone``, ``abandoned``, ``caught_up``, ...: ``node.averaging.averager``)."""
    hows = Counter(e["how"] for n in swarm.nodes for e in n.events("averaging.round")
                   if lo <= e["t"] < hi)  # fmt: skip
    return {how: count / len(swarm.nodes) for how, count in sorted(hows.items())}


def call_names(n_stages: int) -> list[str]:
    """The trainer's calls per micro-batch, in ``MicroBatchResult.call_s``'s order."""
    last = n_stages - 1
    return (
        [f"fwd{s}" for s in range(last)]
        + [f"loss{last}"]
        + [f"bwd{s}" for s in reversed(range(last))]
    )


def call_split(rec: Record, lo: float, hi: float, n_stages: int) -> dict[str, float]:
    """Of the micro-batches completed in [lo, hi): the median seconds of each call
    (``call_names``), the mean seconds of a whole micro-batch (``mb``) and the mean samples
    per micro-batch (``samples/mb``), from which ``links`` takes the rate its window allows
    (Little's law: in flight over time in flight). Empty when the trainer did not report
    call times."""
    mbs = [m for m in rec.mbs if lo <= m["t"] < hi and len(m.get("calls", ())) == 2 * n_stages - 1]
    if not mbs:
        return {}
    split = {
        name: statistics.median(m["calls"][i] for m in mbs)
        for i, name in enumerate(call_names(n_stages))
    }
    split["mb"] = statistics.fmean(sum(m["calls"]) for m in mbs)
    split["samples/mb"] = statistics.fmean(m["samples"] for m in mbs)
    return split


def _config(text: str) -> tuple[str, dict]:
    """``NAME`` (one of ``CONFIGS``) or ``NAME=JSON`` (settings as ``write_spec`` takes)."""
    name, sep, body = text.partition("=")
    if not sep:
        if name not in CONFIGS:
            raise argparse.ArgumentTypeError(
                f"unknown config {name!r}; known: {', '.join(CONFIGS)}, or NAME=JSON"
            )
        return name, CONFIGS[name]
    try:
        settings = json.loads(body)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"config {name}: not JSON: {e}") from None
    if not isinstance(settings, dict):
        raise argparse.ArgumentTypeError(f"config {name}: JSON settings must be an object")
    return name, settings


def _stalls(rec: Record, lo: float, hi: float, gap: float = 2.0) -> list[tuple[float, float]]:
    """(length, end) of each gap of over ``gap`` seconds between completed micro-batches
    in [lo, hi), counting from ``lo`` and to ``hi``."""
    done = [lo, *sorted(m["t"] for m in rec.mbs if lo <= m["t"] < hi), hi]
    return [(b - a, b) for a, b in zip(done, done[1:], strict=False) if b - a > gap]


def _pick_share(rec: Record, peer_id: str, bin_s: float) -> list[tuple[float, float]]:
    """(bin start, fraction of routing picks that went to ``peer_id``); every stage's
    picks count, so a peer of one of two stages gets at most about half."""
    t0, result = rec.phases[0][1], []
    t = t0
    while t < rec.end:
        picks = [p for u, p in rec.picks if t <= u < t + bin_s]
        if picks:
            result.append((t, sum(p == peer_id for p in picks) / len(picks)))
        t += bin_s
    return result


def _share(rec: Record, peer_id: str, stage: int, bin_s: float) -> list[tuple[float, float]]:
    """(bin start, fraction of micro-batches whose route went through ``peer_id``)."""
    t0, result = rec.phases[0][1], []
    t = t0
    while t < rec.end:
        mbs = [m for m in rec.mbs if t <= m["t"] < t + bin_s]
        if mbs:
            result.append((t, sum(m["route"][stage] == peer_id for m in mbs) / len(mbs)))
        t += bin_s
    return result


def _avoided(share: list[tuple[float, float]], since: float, below: float) -> float | None:
    after = [(t, s) for t, s in share if t >= since]
    for i in range(len(after) - 2):
        if all(s < below for _, s in after[i : i + 3]):
            return after[i][0] - since
    return None


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def _summary(name: str, runs: list[dict[str, float]]) -> dict[str, dict]:
    """Print and return each figure's median over ``runs``, its range and count."""
    print(f"{name}: {len(runs)} run(s)")
    result = {}
    for key in runs[0]:
        xs = [r[key] for r in runs if math.isfinite(r[key])]
        missing = len(runs) - len(xs)
        note = f"; not reached in {missing}" if missing else ""
        if not xs:
            print(f"  {key:<28} not reached in any run")
            result[key] = {"median": None, "min": None, "max": None, "n": 0}
            continue
        med = statistics.median(xs)
        print(f"  {key:<28} {med:10.2f}   range {min(xs):.2f}-{max(xs):.2f}, n={len(xs)}{note}")
        result[key] = {"median": med, "min": min(xs), "max": max(xs), "n": len(xs)}
    return result


def _spread(xs: list[float], digits: int = 1) -> str:
    """Median, and the range when there are several."""
    med = f"{statistics.median(xs):.{digits}f}"
    if len(xs) < 2:
        return med
    return f"{med}  (median of {len(xs)}; {min(xs):.{digits}f}-{max(xs):.{digits}f})"


def with_overrides(settings: dict, args: argparse.Namespace) -> dict:
    """``settings`` with ``--inner-steps`` (diloco only) and ``--target-batch`` applied."""
    settings = dict(settings)
    averaging = dict(settings.get("averaging", {}))
    if args.inner_steps and averaging.get("mode") == "diloco":
        settings["averaging"] = {**averaging, "inner_steps": args.inner_steps}
    if args.target_batch:
        settings["target_batch_size"] = args.target_batch
    return settings


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    named_only = ["nat", "links"]  # network namespaces: run when named
    p.add_argument(
        "--scenarios", nargs="+", default=list(SCENARIOS), choices=[*SCENARIOS, *named_only]
    )
    p.add_argument("--netem", help="a link profile (scripts/netem/profiles.py) for every host")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--peers", type=int, default=2, help="peers per stage")
    p.add_argument("--in-flight", type=int, default=WINDOW)
    p.add_argument("--warmup", type=float, default=8.0, help="seconds before measuring")
    p.add_argument("--phase", type=float, default=20.0, help="seconds per measured phase")
    p.add_argument("--repeat", type=int, default=2, help="measured phase pairs per scenario")
    p.add_argument("--kill-every", type=float, default=5.0)
    p.add_argument("--slow-cores", type=float, default=0.08,
                   help="wiring: the CPU the slow peer is capped at, in cores")  # fmt: skip
    p.add_argument("--link", default="home", help="links: the profile to compare with loopback")
    p.add_argument("--micro-batches", type=int, default=200, help="links: measured per swarm")
    p.add_argument("--configs", nargs="+", type=_config, metavar="NAME[=JSON]",
                   help=f"links: run settings side by side, the first the reference of the "
                   f"loss (default: default); other scenarios: their run's settings, the "
                   f"first of them ({', '.join(CONFIGS)}; or NAME=JSON, e.g. "
                   '\'x={"compression": "uint8"}\')')  # fmt: skip
    p.add_argument("--inner-steps", type=int, help="links: DiLoCo's H in every diloco config")
    p.add_argument("--target-batch", type=int, help="links: the target batch of every config")
    p.add_argument("--link-node-args", default="", metavar="ARGS",
                   help="links: flags every node of the --link swarm gets (not the loopback "
                   "one's), as a volunteer on that link would set them, e.g. "
                   "'--max-upload-mbps 40'")  # fmt: skip
    p.add_argument("--runs", type=int, default=1, help="whole runs per scenario")
    p.add_argument("--seed", type=int, default=0, help="of run 1; run k uses seed + k - 1")
    p.add_argument("--out", type=Path, default=Path("bench-out"))
    p.add_argument(
        "--keep",
        action="store_true",
        help="keep the work directory (the nodes' logs and events) and print its path",
    )
    args = p.parse_args()
    if args.runs < 1:
        p.error("--runs must be at least 1")
    if args.peers < 2:
        p.error("--peers must be at least 2: scenarios kill or slow one peer of a stage")
    if args.netem and "links" in args.scenarios:
        p.error("links builds its own network (--link): run it without --netem")
    if args.configs:
        args.configs = [(name, with_overrides(settings, args)) for name, settings in args.configs]

    results: dict[str, list[dict[str, float]]] = {}

    def run_all(net: Network | None) -> None:
        keep = tempfile.mkdtemp(prefix="bench-swarm-") if args.keep else None
        if keep:
            print(f"work directory (kept): {keep}", flush=True)
        with (
            contextlib.nullcontext(keep)
            if keep
            else tempfile.TemporaryDirectory(prefix="bench-swarm-") as tmp
        ):
            for name in args.scenarios:
                for k in range(args.runs):
                    bench = Bench(args, net, seed=args.seed + k, plot=k == 0)
                    print(f"--- {name}, run {k + 1} of {args.runs}", flush=True)
                    figures = getattr(bench, name)(Path(tmp) / f"{name}{k}")
                    results.setdefault(name, []).append(figures)

    started = time.time()
    try:
        if args.netem:
            hosts = [profile(args.netem)] * (args.stages * args.peers + 1)
            with Network(hosts) as net:
                run_all(net)
        else:
            run_all(None)
    except (NetemUnavailable, ThrottleUnavailable) as e:
        print(f"SKIPPED: {e}")
        return 2
    where = f"netem {args.netem}" if args.netem else "loopback"
    if set(args.scenarios) <= set(named_only):  # they build their own emulated networks
        where = "emulated networks of their own"
    print(f"=== medians over whole runs ({where})")
    summary = {name: _summary(name, runs) for name, runs in results.items()}
    runs = {n: [{k: v if math.isfinite(v) else None for k, v in r.items()} for r in rs]
            for n, rs in results.items()}  # fmt: skip
    record = {"argv": sys.argv[1:], "runs": runs, "summary": summary}
    (args.out / "results.json").write_text(json.dumps(record, indent=1))
    print(f"done in {time.time() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
