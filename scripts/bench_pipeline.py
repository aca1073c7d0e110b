"""Swarm vs single process, side by side in one run, on this machine's cores.

Measures samples/s of (a) the single-process baseline (the whole model, all cores) and (b)
a local swarm (``--stages`` x ``--peers`` node processes on 127.0.0.1 and a trainer in
this process, on uvloop as ``swarmtrain train`` runs one) on the same preset, and the
bytes that crossed loopback per sample against the activation bytes the stage boundaries
require (one hidden state forward and one gradient back per boundary), and the CPU seconds
each spends per sample (the swarm's: its node processes with their ``p2pd``, DHT and
averager children, and this process, the trainer, with its own ``p2pd``). Prints the
ratios: where the swarm's CPU per sample is above one process's, the cores it shares bound
it below one process however the pipeline is scheduled. One more run of the baseline with
one torch thread (as each node computes) gives the compute alone, against which the nodes'
own processes' CPU is set.

The swarm runs ``--repeats`` rounds of ``--micro-batches`` each way the trainer can call:
``reused`` (streams kept open per peer and stage, the default) and ``per-call`` (a new
stream per call), alternating in one swarm so that both see the same machine; it prints
each way's median [range] and their ratio round by round. The baseline runs
``--baselines`` times before the swarm starts. The nodes run with the node's own update
period (``--update-period``: how often a node republishes its peer record), not the test
harness's shorter one. With a diloco ``--config``, ``--inner-steps`` sets H: at the spec's
50 a run of a few minutes holds no outer round, and the per-node round lines say how many
fell in the window. ``--idle S`` first counts, over S seconds, the CPU the swarm's
processes use while they serve and nothing trains (what a node costs its machine between
runs' work, and a floor under every rate below).

With ``--rounds`` it compares the two paths of an averaging round instead: matchmaking
from the round's trigger on, overlapping the drain (``early``, the nodes' default), or
after it (``late``; ``node.averaging.averager.EARLY_MATCH_ENV``). ``--swarms`` swarms per
path start and stop in ABBA order; it prints each path's samples/s, swarm / one process,
and each stage's round split (median ms of ``ready``, before the trigger; ``drain``,
``begin``, ``match``, ``allreduce``, ``finish``, from the trigger to the step; ``idle``:
the time in rounds in which the stage served nothing). The rounds' split is also printed
per node in the default mode.

    python -m scripts.bench_pipeline --preset tiny --micro-batches 100 --repeats 5
    python -m scripts.bench_pipeline --preset tiny --micro-batches 100 --repeats 1 --rounds
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import NamedTuple

import psutil
import torch
import uvloop

from models.config import preset
from models.data import load_corpus
from models.training import train_baseline
from node.averaging.averager import EARLY_MATCH_ENV, ROUND_PARTS
from node.cli.train import open_trainer
from node.daemon.settings import NodeSettings
from node.harness.local_swarm import LOCAL, NodeProcess, launch_node, stop_all
from node.pipeline import client as stage_client
from node.pipeline.trainer import TrainerSettings
from node.rpc.dht import SwarmDHT
from protocol.run_spec import read_spec_file
from scripts.bench_swarm import CONFIGS, with_overrides, write_spec
from scripts.swarm_bench.throttle import tree_cpu_seconds, tree_cpu_times


def baseline_rate(preset_name: str, micro_batches: int, corpus) -> tuple[float, float]:
    """Samples/s and CPU seconds per sample of ``train_baseline``'s training steps on about
    ``micro_batches`` micro-batches (at least 2 steps): its first step is the warm-up, and
    its evaluations (before the first step, after the last) are left out."""
    model, optim = preset(preset_name)
    steps = max(2, micro_batches * optim.micro_batch_size // optim.target_batch_size)
    # A step's report counts samples and time from the first step on; the last report's
    # time holds the final evaluation, so the steps timed are 2 .. steps + 1 of steps + 2.
    cpu: list[float] = []  # this process's CPU seconds (all its threads) after each step
    reports = train_baseline(model, optim, corpus, steps=steps + 2, eval_every=10**9,
                             on_step=lambda _: cpu.append(time.process_time())).steps  # fmt: skip
    first, last = reports[0], reports[-2]
    elapsed = last.samples / last.samples_per_s - first.samples / first.samples_per_s
    samples = last.samples - first.samples
    return samples / elapsed, (cpu[-2] - cpu[0]) / samples


def loopback_bytes() -> int:
    lo = psutil.net_io_counters(pernic=True).get("lo")
    return lo.bytes_sent if lo else 0


WAYS = ("reused", "per-call")  # how the trainer's calls get their streams


class Round(NamedTuple):
    """One round of one way of calling: samples/s, loopback bytes per sample, and CPU
    seconds per sample of the swarm's nodes and of the trainer (this process's tree)."""

    rate: float
    wire: float
    node_parts: dict[str, float]  # the nodes' CPU seconds per sample by process (``KINDS``)
    trainer_cpu: float

    @property
    def node_cpu(self) -> float:
        return sum(self.node_parts.values())


# The processes of a node, for the split of its CPU: the node's own, its ``p2pd`` (the
# libp2p daemon every byte it sends or receives crosses), its DHT process (hivemind's
# ``DHT``, the first child a node forks: every DHT read and store, ours and the averagers',
# runs there) and the rest (its averagers).
KINDS = ("node", "p2pd", "dht", "averagers")


def node_cpu_by_kind(pids: tuple[int, ...]) -> dict[str, float]:
    """CPU seconds so far of the process trees of ``pids``, by ``KINDS``."""
    parts = dict.fromkeys(KINDS, 0.0)
    for pid in pids:
        tree = tree_cpu_times(pid)
        forked = []  # the node's direct children that run its own code: DHT, averagers
        for proc, _ in tree[1:]:
            with contextlib.suppress(psutil.NoSuchProcess):
                if proc.ppid() == pid and proc.name() not in ("p2pd", "torch_shm_manager"):
                    forked.append((proc.create_time(), proc.pid))
        dht = min(forked)[1] if forked else None
        for proc, seconds in tree:
            name = ""
            with contextlib.suppress(psutil.NoSuchProcess):
                name = proc.name()
            if proc.pid == pid:
                kind = "node"
            elif name == "p2pd":
                kind = "p2pd"
            else:
                kind = "dht" if proc.pid == dht else "averagers"
            parts[kind] += seconds
    return parts


IDLE_SETTLE_S = 15.0  # after the last node serves, before an idle swarm's CPU is counted


def idle_cpu(pids: tuple[int, ...], seconds: float) -> dict[str, float]:
    """The share of a core that a node's processes use by ``KINDS`` (the mean over
    ``pids``) while the swarm serves and nothing trains: over ``seconds``, from
    ``IDLE_SETTLE_S`` after the call."""
    time.sleep(IDLE_SETTLE_S)
    before, started = node_cpu_by_kind(pids), time.monotonic()
    time.sleep(seconds)
    after, elapsed = node_cpu_by_kind(pids), time.monotonic() - started
    return {k: (after[k] - before[k]) / elapsed / len(pids) for k in KINDS}


def print_idle(shares: dict[str, float], seconds: float) -> None:
    parts = ", ".join(f"{k} {v:.4f}" for k, v in shares.items())
    print(f"idle swarm, {seconds:.0f} s, a node's share of a core: {parts}; "
          f"all {sum(shares.values()):.4f}", flush=True)  # fmt: skip


async def swarm_rates(
    dht: SwarmDHT,
    micro_batches: int,
    in_flight: int,
    repeats: int,
    ways: tuple[str, ...] = WAYS,
    node_pids: tuple[int, ...] = (),
) -> tuple[dict[str, list[Round]], tuple[float, float]]:
    """Each way's rounds (the ways take turns within each round, in alternating order),
    and the wall-clock window of the rounds. CPU counts ``node_pids``' process trees."""
    trainer = await open_trainer(dht, TrainerSettings(in_flight=in_flight, call_timeout_s=120))
    rates: dict[str, list[Round]] = {way: [] for way in ways}

    def cpu() -> tuple[dict[str, float], float]:
        """The nodes' CPU seconds by ``KINDS``, and the rest of this process's tree (the
        nodes are its children)."""
        parts = node_cpu_by_kind(node_pids)
        return parts, tree_cpu_seconds(os.getpid()) - sum(parts.values())

    try:
        await trainer.train(in_flight * 2)  # warm-up: connections, allocations
        window = time.time()
        for i in range(repeats):
            for way in ways if i % 2 == 0 else ways[::-1]:  # ABBA: a drift favours neither
                stage_client.reuse_streams(trainer.p2p, way == "reused")
                before_bytes, before_samples = loopback_bytes(), trainer.stats.samples
                (nodes0, own0), started = cpu(), time.perf_counter()
                await trainer.train(micro_batches)
                elapsed = time.perf_counter() - started
                nodes1, own1 = cpu()
                samples = trainer.stats.samples - before_samples
                wire = (loopback_bytes() - before_bytes) / samples
                parts = {k: (nodes1[k] - nodes0[k]) / samples for k in KINDS}
                rates[way].append(Round(samples / elapsed, wire, parts, (own1 - own0) / samples))
                print(f"  {way:9s} {samples / elapsed:8.1f} samples/s", flush=True)
        return rates, (window, time.time())
    finally:
        stage_client.close_sessions(trainer.p2p)
        await trainer.p2p.shutdown()


# The parts of an ``averaging.round`` event's time, in order (``node.events``): ``ready``
# comes before the trigger, the others from the trigger to the step; ``idle`` overlaps them.
SPLIT = ("ready", *ROUND_PARTS, "idle")
# How a round looks for its group (``node.averaging.averager.EARLY_MATCH_ENV``): from its
# trigger on, while the drain runs (the default), or after the drain.
PATHS = {"early": "1", "late": "0"}


def round_events(nodes: list[NodeProcess], window: tuple[float, float]) -> dict[str, list[dict]]:
    """Each node's ``averaging.round`` events within ``window`` (wall clock)."""
    start, end = window
    return {
        node.name: [e for e in node.events("averaging.round") if start <= e["t"] <= end]
        for node in nodes
    }


def split_line(rounds: list[dict]) -> str:
    """The median milliseconds of each part of ``SPLIT`` in ``rounds``."""
    parts = []
    for part in SPLIT:
        values = [e[f"{part}_s"] for e in rounds if e.get(f"{part}_s") is not None]
        if values:
            parts.append(f"{part} {statistics.median(values) * 1000:.0f}")
    return ", ".join(parts)


def print_rounds(rounds: dict[str, list[dict]], window: tuple[float, float]) -> None:
    """Each node's averaging rounds: how many (by ``how``), the median seconds from a
    round's trigger to its step, the share of ``window`` in rounds, and the median of each
    part of a round (``SPLIT``)."""
    start, end = window
    for name, events in rounds.items():
        seconds = [e["seconds"] for e in events if e.get("seconds") is not None]
        median = statistics.median(seconds) if seconds else float("nan")
        hows = ", ".join(f"{h}: {n}" for h, n in Counter(e["how"] for e in events).most_common())
        print(
            f"  {name}: {len(events)} averaging rounds ({hows}), {median:.3f} s median "
            f"from trigger to step, {sum(seconds) / (end - start):.2f} of the time in rounds"
        )
        print(f"    median ms: {split_line(events)}")


def run_swarm(
    args: argparse.Namespace, ways: tuple[str, ...], path: str | None = None
) -> tuple[dict[str, list[Round]], dict[str, list[dict]], tuple[float, float]]:
    """Start the swarm (its rounds on ``path`` of ``PATHS``; None: the nodes' default),
    measure ``swarm_rates`` and stop it: the rates, each node's rounds, and their window."""
    nodes, dht = [], None
    saved = os.environ.get(EARLY_MATCH_ENV)
    if path is not None:
        os.environ[EARLY_MATCH_ENV] = PATHS[path]  # the nodes inherit it
    with tempfile.TemporaryDirectory() as tmp:
        try:
            settings = with_overrides(CONFIGS[args.config], args)
            spec = write_spec(Path(tmp), args.preset, args.stages, settings)
            for i in range(args.stages * args.peers):
                stage = i % args.stages
                extra = ["--stage", str(stage), "--spec", str(spec)]
                peers = [nodes[0].maddr] if nodes else []
                run = nodes[0].run_id if nodes else read_spec_file(spec.read_text()).spec.run
                nodes.append(launch_node(Path(tmp), f"p{i}", run, initial_peers=peers, extra=extra,
                                         update_period=args.update_period))  # fmt: skip
            for n in nodes:
                n.wait_serving(120)
            pids = tuple(n.proc.pid for n in nodes)
            if args.idle:
                print_idle(idle_cpu(pids, args.idle), args.idle)
            if not args.repeats:  # the idle count alone
                return {way: [] for way in ways}, {}, (0.0, 0.0)
            dht = SwarmDHT.start(nodes[0].run_id, initial_peers=[nodes[0].maddr],
                                 host_maddrs=[LOCAL], client_mode=True)  # fmt: skip
            rates, window = uvloop.run(  # the event loop ``swarmtrain train`` runs on
                swarm_rates(dht, args.micro_batches, args.in_flight, args.repeats, ways, pids)
            )
            return rates, round_events(nodes, window), window
        finally:
            if dht is not None:
                dht.shutdown()
            stop_all(nodes)
            if saved is None:
                os.environ.pop(EARLY_MATCH_ENV, None)
            else:
                os.environ[EARLY_MATCH_ENV] = saved


def compare_paths(args: argparse.Namespace, base: float | None) -> None:
    """``--swarms`` swarms per round path, in ABBA order (a drift favours neither), each
    measured with reused streams; prints each path's samples/s, its ratio to ``base``, and
    the round split of each stage (medians over its peers' rounds)."""
    order = [p for i in range(args.swarms) for p in (("early", "late"), ("late", "early"))[i % 2]]
    rates: dict[str, list[float]] = {p: [] for p in PATHS}
    rounds: dict[str, dict[int, list[dict]]] = {p: {} for p in PATHS}
    for path in order:
        measured, events, window = run_swarm(args, ("reused",), path)
        rate = statistics.median(r.rate for r in measured["reused"])
        rates[path].append(rate)
        print(f"{path:5s} swarm: {rate:.1f} samples/s  load average: "
              f"{psutil.getloadavg()[0]:.1f}", flush=True)  # fmt: skip
        print_rounds(events, window)
        for k, name in enumerate(sorted(events, key=lambda n: int(n[1:]))):
            rounds[path].setdefault(k % args.stages, []).extend(events[name])
    print(f"round paths, {args.swarms} swarms each (ABBA), reused streams:")
    for path in PATHS:
        line = f"  {path:5s}: {spread(rates[path], 1)} samples/s"
        if base is not None:
            line += f", swarm / one process {spread([r / base for r in rates[path]])}"
        print(line)
        for stage, events in sorted(rounds[path].items()):
            seconds = [e["seconds"] for e in events if e.get("seconds") is not None]
            median = statistics.median(seconds) * 1000 if seconds else float("nan")
            print(f"    stage {stage}: trigger to step {median:.0f} ms; {split_line(events)}")
    paired = [e / lt for e, lt in zip(rates["early"], rates["late"], strict=True)]
    print(f"  ratio early / late, swarm by swarm pair: {spread(paired)}")


def spread(values: list[float], digits: int = 3) -> str:
    """``median [min-max]``."""
    return (
        f"{statistics.median(values):.{digits}f} "
        f"[{min(values):.{digits}f}-{max(values):.{digits}f}]"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="small")
    p.add_argument("--stages", type=int, default=2)
    p.add_argument(
        "--config",
        default="default",
        choices=sorted(CONFIGS),
        help="the run's settings, as bench_swarm names them (none: uncompressed)",
    )
    p.add_argument(
        "--inner-steps", type=int, help="DiLoCo's H, for a diloco --config (default: the spec's)"
    )
    p.add_argument("--peers", type=int, default=2, help="peers per stage")
    p.add_argument("--micro-batches", type=int, default=120)
    p.add_argument("--in-flight", type=int, default=4)
    p.add_argument("--repeats", type=int, default=5,
                   help="rounds of each way of calling (0: none, only --idle)")  # fmt: skip
    p.add_argument("--baselines", type=int, default=1, help="runs of the baseline (0: none)")
    p.add_argument("--rounds", action="store_true",
                   help="compare the round paths (early and late matchmaking) instead of the "
                        "ways of calling")  # fmt: skip
    p.add_argument("--swarms", type=int, default=2, help="with --rounds: swarms per path")
    p.add_argument("--idle", type=float, default=0.0,
                   help="first count the CPU of the serving swarm with nothing training, "
                        "over this many seconds (0: not)")  # fmt: skip
    p.add_argument("--update-period", type=float, default=NodeSettings.update_period_s,
                   help="the nodes' --update-period (default: the node's own; the test "
                        "harness's 1 s republishes peer records five times as often)")  # fmt: skip
    p.set_defaults(target_batch=None)  # the preset's (``with_overrides`` reads it)
    args = p.parse_args()
    if args.inner_steps and CONFIGS[args.config].get("averaging", {}).get("mode") != "diloco":
        p.error(f"--inner-steps sets DiLoCo's H: --config {args.config} is not a diloco one")
    if not args.repeats and (args.rounds or not args.idle):
        p.error("--repeats 0 measures the idle swarm only: it needs --idle S, not --rounds")

    corpus = load_corpus()
    model, optim = preset(args.preset)
    print(f"cores: {psutil.cpu_count()}  torch threads: {torch.get_num_threads()}  "
          f"preset {args.preset}: micro-batch {optim.micro_batch_size} x "
          f"{model.block_size}  load average: {psutil.getloadavg()[0]:.1f}",
          flush=True)  # fmt: skip
    measured = [baseline_rate(args.preset, args.micro_batches, corpus)
                for _ in range(args.baselines)]  # fmt: skip
    bases, base_cpus = [r for r, _ in measured], [c for _, c in measured]
    if bases:
        print(f"baseline (one process):         {spread(bases, 1)} samples/s, "
              f"{spread(base_cpus, 4)} CPU s per sample", flush=True)  # fmt: skip
    base = statistics.median(bases) if bases else None
    base_cpu = statistics.median(base_cpus) if base_cpus else None
    single_cpu = None
    if bases:  # the compute alone, as a node runs it (one torch thread)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            single, single_cpu = baseline_rate(args.preset, args.micro_batches, corpus)
        finally:
            torch.set_num_threads(threads)
        print(f"baseline, one torch thread:     {single:.1f} samples/s, {single_cpu:.4f} CPU s "
              f"per sample", flush=True)  # fmt: skip
    if args.rounds:
        compare_paths(args, base)
        print(f"load average at the end: {psutil.getloadavg()[0]:.1f}")
        return

    rates, rounds, window = run_swarm(args, WAYS)
    if not args.repeats:
        return
    print_rounds(rounds, window)
    needed = 2 * (args.stages - 1) * model.block_size * model.n_embd * 4  # fwd + bwd, float32
    print(f"load average at the end: {psutil.getloadavg()[0]:.1f}")
    for way in WAYS:
        rate, wire = [r.rate for r in rates[way]], [r.wire for r in rates[way]]
        cpu = [r.node_cpu + r.trainer_cpu for r in rates[way]]
        print(f"swarm ({args.stages} stages x {args.peers} peers), {way} streams:")
        print(f"  samples/s:                    {spread(rate, 1)}")
        if base is not None:
            print(f"  ratio swarm / baseline:       {spread([r / base for r in rate])}")
        print(f"  loopback bytes per sample:    {spread(wire, 0)}  (activations: {needed})")
        print(f"  ratio wire / required bytes:  {spread([w / needed for w in wire])}")
        trainer = [r.trainer_cpu / (r.node_cpu + r.trainer_cpu) for r in rates[way]]
        print(f"  CPU s per sample:             {spread(cpu, 4)}  (the trainer's share: "
              f"{spread(trainer, 2)})")  # fmt: skip
        for kind in KINDS:
            parts = [r.node_parts[kind] for r in rates[way]]
            print(f"    nodes' {kind + ':':<22} {spread(parts, 4)}")
        if single_cpu is not None:
            own = [r.node_parts["node"] / single_cpu for r in rates[way]]
            print(f"  nodes' own / one thread's:    {spread(own)}")
        if base_cpu is not None:
            print(f"  ratio CPU per sample / one process's: {spread([c / base_cpu for c in cpu])}")
    paired = [a.rate / b.rate for a, b in zip(rates[WAYS[0]], rates[WAYS[1]], strict=True)]
    print(f"ratio {WAYS[0]} / {WAYS[1]}, round by round: {spread(paired)}")


if __name__ == "__main__":
    main()
