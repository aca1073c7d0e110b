"""The presets on this machine: each stage's memory as computed (``models.memory``) next to
the peak RSS of a real node serving that stage on the CPU; and samples/s of the Llama CPU
preset in a 2 stages x 2 peers swarm against the baseline (one process), side by side.

Memory: for each preset whose swarm fits this machine's memory (as ``swarm_need`` reckons
it, within ``--memory-budget``; or the ``--presets`` named), a run of ``--stages`` stages
x 1 peer: one ``swarmtrain node --spec FILE --stage S --no-train`` process per stage on
127.0.0.1 (one torch thread each), the preset's model and micro-batch with a target batch of one
micro-batch, so that every micro-batch is an optimizer step and AdamW's state exists from
the first. A trainer in this process sends ``--memory-micro-batches`` micro-batches
through them; then each node's peak RSS is read from ``/proc/PID/status`` (``VmHWM``): the
node process alone, its children (the DHT and averager processes, ``p2pd``) apart, as
the sum of their peaks. A preset's runs are ``--repeats`` whole swarms.

Throughput: ``--swarm-preset`` (default ``llama-20m``, the Llama CPU preset) in a 2 x 2
swarm (``scripts.swarm_bench.swarm.BenchSwarm``: pinned stages, one torch thread a node,
gradient averaging between a stage's two peers) and a trainer in this process with
``--in-flight`` micro-batches in flight, against ``models.training.train_baseline`` (what
``swarmtrain baseline`` runs: the whole model in this process, every core unless
``--baseline-threads``), measured in turn in one run (``scripts.bench_pipeline``'s
``baseline_rate`` and ``swarm_rates``). Each of ``--repeats`` rounds measures the
baseline, then the swarm (started once; idle while the baseline runs), and their ratio;
figures are the median and range over the rounds. On a machine whose cores other jobs
load, torch's threads wait on each other and the baseline reads far too low: measure it
on an idle machine.

    python -m scripts.bench_presets --repeats 5
    python -m scripts.bench_presets --quick      # llama-tiny and tiny, one round: a check
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil
import torch

from models.config import PRESETS, preset
from models.data import load_corpus
from models.memory import GIB, stage_memory
from models.stages import even_boundaries
from node.cli.train import open_trainer
from node.files import write_atomic, write_run_spec
from node.harness.local_swarm import LOCAL, NodeProcess, launch_node, stop_all
from node.pipeline.trainer import TrainerSettings
from node.rpc.dht import SwarmDHT
from scripts.bench_pipeline import baseline_rate, swarm_rates
from scripts.bench_swarm import _spread
from scripts.swarm_bench.swarm import BenchSwarm

MIB = 1024**2
# A node with its DHT and averager processes and p2pd, holding almost nothing: about 1.1 GiB.
NODE_OVERHEAD = 3 * GIB // 2
# The logits, their softmax and their gradients: llama-125m's last stage (1 GiB of logits a
# micro-batch) peaked about 6 GiB above its computed memory, its blocks' and a node's.
HEAD_COPIES = 6
QUICK_PRESETS = ("tiny", "llama-tiny")


@dataclass
class StageRow:
    preset: str
    stage: int
    parameters: int
    computed: int  # bytes: weights, gradients, AdamW's moments (models.memory)
    node_peak: list[int]  # bytes, one per run: VmHWM of the node process
    children_peak: list[int]  # bytes, one per run: the sum of its children's VmHWM


def vm_hwm(pid: int) -> int:
    """The peak resident set of process ``pid`` in bytes (``VmHWM``; 0 if it is gone)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    for line in status.splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def children_hwm(pid: int) -> int:
    """The sum of the peaks of ``pid``'s descendants (they need not peak together)."""
    return sum(vm_hwm(c.pid) for c in psutil.Process(pid).children(recursive=True))


def swarm_need(name: str, stages: int) -> int:
    """Bytes a ``stages`` x 1 swarm of preset ``name`` is reckoned to take on this machine,
    per stage: its computed total twice (temporaries, the allocator's slack), a node's
    overhead, one micro-batch's attention matrices per transformer block, and for the last
    stage ``HEAD_COPIES`` times a micro-batch's float32 logits."""
    model, optim = preset(name)
    b, t = optim.micro_batch_size, model.block_size
    attention = 4 * b * model.n_head * t * t
    logits = 4 * b * t * model.vocab_size
    need = HEAD_COPIES * logits
    for r in even_boundaries(model, stages):
        blocks = len(r) - (r.start == 0) - (r.end == model.n_blocks)  # transformer blocks
        need += 2 * stage_memory(model, r).total + NODE_OVERHEAD + blocks * attention
    return need


def write_spec(workdir: Path, name: str, stages: int) -> tuple[str, Path]:
    """A public run of preset ``name`` whose every micro-batch is an optimizer step: its
    id and its signed spec file."""
    _, optim = preset(name)
    path = workdir / f"{name}.spec.json"
    spec = write_run_spec(path, workdir / "owner.key", "mem-" + name, name, stages,
                          target_batch_size=optim.micro_batch_size)  # fmt: skip
    return spec.run, path


async def _drive(run: str, maddr: str, micro_batches: int) -> None:
    dht = SwarmDHT.start(run, initial_peers=[maddr], host_maddrs=[LOCAL], client_mode=True)
    try:
        # A stage call of the larger presets takes minutes on one loaded core.
        settings = TrainerSettings(in_flight=1, call_timeout_s=1800, stage_wait_s=600)
        trainer = await open_trainer(dht, settings)
        try:
            await trainer.train(micro_batches)
        finally:
            await trainer.p2p.shutdown()
    finally:
        dht.shutdown()


def measure_memory(workdir: Path, name: str, stages: int, micro_batches: int) -> list[tuple]:
    """One run of preset ``name``: (node peak, children's peaks) in bytes, per stage."""
    workdir.mkdir(parents=True)
    run, spec_file = write_spec(workdir, name, stages)
    nodes: list[NodeProcess] = []
    try:
        for s in range(stages):
            peers = [nodes[0].maddr] if nodes else []
            extra = ["--spec", str(spec_file), "--stage", str(s)]
            nodes.append(launch_node(workdir, f"s{s}", run, initial_peers=peers, extra=extra))
        for n in nodes:
            n.wait_serving(600)
        asyncio.run(_drive(run, nodes[0].maddr, micro_batches))
        steps = [max((e["epoch"] for e in n.events("averaging.round")), default=0) for n in nodes]
        if min(steps) < 1:
            raise RuntimeError(f"{name}: a stage took no optimizer step ({steps})")
        return [(vm_hwm(n.proc.pid), children_hwm(n.proc.pid)) for n in nodes]
    finally:
        stop_all(nodes)


def memory_rows(args: argparse.Namespace, names: list[str], workdir: Path) -> list[StageRow]:
    rows: list[StageRow] = []
    for name in names:
        model, _ = preset(name)
        mine = [StageRow(name, s, (m := stage_memory(model, r)).parameters, m.total, [], [])
                for s, r in enumerate(even_boundaries(model, args.stages))]  # fmt: skip
        for k in range(args.repeats):
            started = time.monotonic()
            peaks = measure_memory(workdir / f"{name}-{k}", name, args.stages,
                                   args.memory_micro_batches)  # fmt: skip
            for row, (node, children) in zip(mine, peaks, strict=True):
                row.node_peak.append(node)
                row.children_peak.append(children)
            print(f"  {name} run {k + 1}: node peaks "
                  f"{', '.join(f'{p / MIB:,.0f} MiB' for p, _ in peaks)}; children's "
                  f"{', '.join(f'{c / MIB:,.0f} MiB' for _, c in peaks)} "
                  f"({time.monotonic() - started:.0f} s)", flush=True)  # fmt: skip
        rows += mine
    return rows


def print_memory(rows: list[StageRow], stages: int, skipped: dict[str, int]) -> None:
    print(f"\nper-stage memory, {stages} stages x 1 peer, CPU float32 (MiB; measured: median "
          "[range] over runs)")  # fmt: skip
    header = ("preset", "stage", "parameters", "computed", "node peak RSS", "peak - computed",
              "children's peaks")  # fmt: skip
    table = [header]
    for r in rows:
        over = [p - r.computed for p in r.node_peak]
        table.append((r.preset, str(r.stage), f"{r.parameters:,}", f"{r.computed / MIB:,.0f}",
                      _mib(r.node_peak), _mib(over), _mib(r.children_peak)))  # fmt: skip
    widths = [max(len(row[c]) for row in table) for c in range(len(header))]
    for row in table:
        print("  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)))
    for name, need in skipped.items():
        print(f"{name}: not measured (its swarm is reckoned at {need / GIB:.1f} GiB)")


def _mib(xs: list[int]) -> str:
    med = statistics.median(xs) / MIB
    if len(xs) < 2:
        return f"{med:,.0f}"
    return f"{med:,.0f} [{min(xs) / MIB:,.0f}-{max(xs) / MIB:,.0f}]"


def measure_throughput(args: argparse.Namespace, workdir: Path) -> dict[str, list[float]]:
    """Rounds of (baseline, swarm) samples/s of ``--swarm-preset``, each measured in turn."""
    corpus = load_corpus()
    swarm = BenchSwarm(workdir, 2, 2, args.swarm_preset)
    rates: dict[str, list[float]] = {"baseline": [], "swarm": [], "ratio": []}
    dht = None
    try:
        swarm.start()
        dht = SwarmDHT.start(swarm.run, initial_peers=[swarm.serving()[0].maddr],
                             host_maddrs=[LOCAL], client_mode=True)  # fmt: skip
        for k in range(args.repeats):
            base = baseline_rate(args.swarm_preset, args.micro_batches, corpus)
            ways, _ = asyncio.run(
                swarm_rates(dht, args.micro_batches, args.in_flight, 1, ways=("reused",))
            )
            rate = ways["reused"][0][0]
            for key, value in (("baseline", base), ("swarm", rate), ("ratio", rate / base)):
                rates[key].append(value)
            print(f"  round {k + 1}: baseline {base:.2f}, swarm {rate:.2f} samples/s, "
                  f"ratio {rate / base:.3f}", flush=True)  # fmt: skip
    finally:
        if dht is not None:
            dht.shutdown()
        swarm.close()
    return rates


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--presets", nargs="+", choices=sorted(PRESETS),
                   help="measure these (default: every preset whose swarm fits)")  # fmt: skip
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--memory-budget", type=float, metavar="GIB",
                   help="default: 90%% of the memory available at start")  # fmt: skip
    p.add_argument("--memory-micro-batches", type=int, default=3,
                   help="micro-batches (optimizer steps) before the peaks are read")  # fmt: skip
    p.add_argument("--swarm-preset", default="llama-20m")
    p.add_argument("--micro-batches", type=int, default=32, help="per measured swarm phase")
    p.add_argument("--in-flight", type=int, default=4)
    p.add_argument("--baseline-threads", type=int, metavar="N",
                   help="torch threads of the baseline (default: torch's, every core)")  # fmt: skip
    p.add_argument("--repeats", type=int, default=5, help="runs of each measurement")
    p.add_argument("--quick", action="store_true",
                   help=f"a check: {' and '.join(QUICK_PRESETS)} only, one run, "
                   "fewer micro-batches")  # fmt: skip
    p.add_argument("--skip", choices=["memory", "throughput"], action="append", default=[])
    p.add_argument("--json", type=Path, help="also write every run's figures here")
    args = p.parse_args()
    if args.quick:
        args.presets = args.presets or list(QUICK_PRESETS)
        args.repeats, args.memory_micro_batches, args.micro_batches = 1, 2, 8
    if args.repeats < 1 or args.memory_micro_batches < 1 or args.micro_batches < 1:
        p.error("--repeats and the micro-batch counts must be at least 1")
    if args.baseline_threads is not None:
        if args.baseline_threads < 1:
            p.error("--baseline-threads must be at least 1")
        torch.set_num_threads(args.baseline_threads)

    budget = int((args.memory_budget or psutil.virtual_memory().available * 0.9 / GIB) * GIB)
    if args.presets:
        names, skipped = args.presets, {}
    else:
        needs = {name: swarm_need(name, args.stages) for name in PRESETS}
        names = [n for n, need in needs.items() if need <= budget]
        skipped = {n: need for n, need in needs.items() if need > budget}
    load = " ".join(f"{x:.1f}" for x in psutil.getloadavg())
    total = psutil.virtual_memory().total / GIB
    print(f"cores: {psutil.cpu_count()}, memory {total:.1f} GiB (budget {budget / GIB:.1f} "
          f"GiB), load average {load}, baseline torch threads {torch.get_num_threads()}; "
          f"{args.repeats} run(s) each")  # fmt: skip
    record: dict = {"argv": sys.argv[1:]}
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench-presets-") as tmp:
        if "memory" not in args.skip:
            print(f"memory: {', '.join(names)}", flush=True)
            rows = memory_rows(args, names, Path(tmp) / "memory")
            print_memory(rows, args.stages, skipped)
            record["memory"] = [asdict(r) for r in rows]
        if "throughput" not in args.skip:
            print(f"\nthroughput: {args.swarm_preset}, 2 stages x 2 peers vs one process, "
                  f"{args.micro_batches} micro-batches a phase, {args.in_flight} in flight",
                  flush=True)  # fmt: skip
            rates = measure_throughput(args, Path(tmp) / "throughput")
            print(f"baseline (one process) samples/s: {_spread(rates['baseline'], 2)}")
            print(f"swarm (2 x 2) samples/s:          {_spread(rates['swarm'], 2)}")
            print(f"ratio swarm / baseline:           {_spread(rates['ratio'], 3)}")
            record["throughput"] = rates
    if args.json:
        write_atomic(args.json, json.dumps(record, indent=1).encode())
    print(f"done in {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
