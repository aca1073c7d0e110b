"""Swarm vs single process, side by side in one run, on this machine's cores.

Measures samples/s of (a) the single-process baseline (the whole model, all cores) and
(b) a local swarm (``--stages`` x ``--peers`` node processes on 127.0.0.1 and a trainer in
this process) on the same preset, and the bytes that crossed loopback per sample against
the activation bytes the stage boundaries require (one hidden state forward and one
gradient back per boundary). Prints the ratios.

    python -m scripts.bench_pipeline --preset small --micro-batches 120
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

import psutil
import torch

from models.config import preset
from models.data import load_corpus
from models.training import train_baseline
from node.cli.train import open_trainer
from node.harness.local_swarm import LOCAL, launch_node, stop_all
from node.pipeline.trainer import TrainerSettings
from node.rpc.dht import SwarmDHT


def baseline_rate(preset_name: str, micro_batches: int, corpus) -> float:
    """Samples/s of ``train_baseline``'s training steps on about ``micro_batches``
    micro-batches (at least 2 steps): its first step is the warm-up, and its evaluations
    (before the first step, after the last) are left out."""
    model, optim = preset(preset_name)
    steps = max(2, micro_batches * optim.micro_batch_size // optim.target_batch_size)
    # A step's report counts samples and time from the first step on; the last report's
    # time holds the final evaluation, so the steps timed are 2 .. steps + 1 of steps + 2.
    reports = train_baseline(model, optim, corpus, steps=steps + 2, eval_every=10**9).steps
    first, last = reports[0], reports[-2]
    elapsed = last.samples / last.samples_per_s - first.samples / first.samples_per_s
    return (last.samples - first.samples) / elapsed


def loopback_bytes() -> int:
    lo = psutil.net_io_counters(pernic=True).get("lo")
    return lo.bytes_sent if lo else 0


async def swarm_rate(dht: SwarmDHT, micro_batches: int, in_flight: int) -> tuple[float, float]:
    trainer = await open_trainer(dht, TrainerSettings(in_flight=in_flight, call_timeout_s=120))
    try:
        await trainer.train(in_flight * 2)  # warm-up: connections, allocations
        before_bytes, before_samples = loopback_bytes(), trainer.stats.samples
        started = time.perf_counter()
        await trainer.train(micro_batches)
        elapsed = time.perf_counter() - started
        samples = trainer.stats.samples - before_samples
        return samples / elapsed, (loopback_bytes() - before_bytes) / samples
    finally:
        await trainer.p2p.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="small")
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--peers", type=int, default=2, help="peers per stage")
    p.add_argument("--micro-batches", type=int, default=120)
    p.add_argument("--in-flight", type=int, default=4)
    args = p.parse_args()

    corpus = load_corpus()
    model, optim = preset(args.preset)
    print(f"cores: {psutil.cpu_count()}  torch threads: {torch.get_num_threads()}  "
          f"preset {args.preset}: micro-batch {optim.micro_batch_size} x "
          f"{model.block_size}")  # fmt: skip
    base = baseline_rate(args.preset, args.micro_batches, corpus)
    print(f"baseline (one process):         {base:8.1f} samples/s")

    nodes, dht = [], None
    with tempfile.TemporaryDirectory() as tmp:
        try:
            for i in range(args.stages * args.peers):
                stage = i % args.stages
                extra = ["--stage", str(stage), "--preset", args.preset,
                         "--stages", str(args.stages)]  # fmt: skip
                peers = [nodes[0].maddr] if nodes else []
                run = nodes[0].run_id if nodes else "bench"
                nodes.append(launch_node(Path(tmp), f"p{i}", run, initial_peers=peers,
                                         extra=extra))  # fmt: skip
            for n in nodes:
                n.wait_serving(120)
            dht = SwarmDHT.start(nodes[0].run_id, initial_peers=[nodes[0].maddr],
                                 host_maddrs=[LOCAL], client_mode=True)  # fmt: skip
            rate, wire = asyncio.run(swarm_rate(dht, args.micro_batches, args.in_flight))
        finally:
            if dht is not None:
                dht.shutdown()
            stop_all(nodes)

    needed = 2 * (args.stages - 1) * model.block_size * model.n_embd * 4  # fwd + bwd, float32
    print(f"swarm ({args.stages} stages x {args.peers} peers): {rate:8.1f} samples/s")
    print(f"ratio swarm / baseline:         {rate / base:8.3f}")
    print(f"loopback bytes per sample:      {wire:10.0f}  (activations required: {needed})")
    print(f"ratio wire / required bytes:    {wire / needed:8.3f}")


if __name__ == "__main__":
    main()
