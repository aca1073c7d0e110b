"""Averaging rounds between two peers of one stage on loopback (``node.stage_averaging``).

    python scripts/bench_averaging.py [--preset tiny] [--rounds 20] [--compression none]

Two peers (each its own hivemind DHT and averager process, in this process) hold stage 0
of the preset cut in two and are fed ``target_batch_size / 2`` samples each per round.
Printed side by side: a local ``StageOptimizer.step`` on the same stage; a round measured
from its start to the applied step (``AveragingStats.round_s``: matchmaking, all-reduce,
apply); and the time from the last micro-batch fed to both copies stepped, which adds the
progress report period (peers see each other's samples through the DHT). Then the
largest difference between the two copies.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import statistics
import time

import torch

from models.config import preset
from models.stages import Stage, even_boundaries
from models.training import StageOptimizer
from node.dht import SwarmDHT
from node.stage_averaging import StageAverager
from protocol.run_spec import AveragingSpec, RunSpec

LOOPBACK = "/ip4/127.0.0.1/tcp/0"


def _spec(name: str, compression: str) -> RunSpec:
    model, optim = preset(name)
    return RunSpec(
        run=f"bench-{name}",
        arch=dataclasses.asdict(model),
        optimizer=dataclasses.asdict(optim),
        boundaries=tuple((r.start, r.end) for r in even_boundaries(model, 2)),
        averaging=AveragingSpec(compression=compression),
    )


def _backward(stage: Stage, optimizer: StageOptimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    b, t = optimizer.config.micro_batch_size, stage.config.block_size
    x = torch.randint(0, stage.config.vocab_size, (b, t), generator=g)  # (B, T) token ids
    out = stage(x)  # (B, T, C)
    out.backward(torch.randn(out.shape, generator=g))
    optimizer.accumulated(b)


def _feed(stage: Stage, optimizer: StageOptimizer, averager: StageAverager, seed: int) -> None:
    """One micro-batch, as a stage server serves it."""
    with averager.lock:
        _backward(stage, optimizer, seed)
        averager.on_accumulated()


async def _bench(spec: RunSpec, dhts: list[SwarmDHT], rounds: int) -> None:
    stages = [Stage(spec.model, spec.stage_range(0)) for _ in dhts]
    optimizers = [StageOptimizer(s, spec.optim) for s in stages]
    averagers: list[StageAverager] = []
    try:
        for d, s, o in zip(dhts, stages, optimizers, strict=True):
            averagers.append(await StageAverager.create(d, spec, 0, s, o))
            await averagers[-1].load_state()
        while not all(a.peers == 1 for a in averagers):
            await asyncio.sleep(0.05)

        local = Stage(spec.model, spec.stage_range(0))
        local_opt = StageOptimizer(local, spec.optim)
        local_s = []
        for i in range(5):
            _backward(local, local_opt, 10_000 + i)
            started = time.perf_counter()
            local_opt.step()
            local_s.append(time.perf_counter() - started)

        per_peer = spec.optim.target_batch_size // spec.optim.micro_batch_size // 2
        fed_to_step = []
        for r in range(rounds):
            for k, (s, o, a) in enumerate(zip(stages, optimizers, averagers, strict=True)):
                for j in range(per_peer):
                    _feed(s, o, a, 1000 * r + 100 * k + j)
            fed = time.perf_counter()
            while not all(a.epoch == r + 1 and not a.busy for a in averagers):
                await asyncio.sleep(0.005)
            fed_to_step.append(time.perf_counter() - fed)

        n_params = sum(p.numel() for p in stages[0].parameters())
        round_s = averagers[0].stats.round_s
        diff = max(
            (p - q).abs().max().item()
            for p, q in zip(stages[0].parameters(), stages[1].parameters(), strict=True)
        )
        print(f"stage 0 of {spec.model.n_layer}-layer preset: {n_params:,} parameters, "
              f"compression {spec.averaging.compression}, {rounds} rounds")  # fmt: skip
        print(f"  local optimizer step        median {statistics.median(local_s) * 1e3:7.1f} ms")
        print(f"  round (start -> applied)    median {statistics.median(round_s) * 1e3:7.1f} ms"
              f"  (max {max(round_s) * 1e3:.1f})")  # fmt: skip
        print(f"  last sample fed -> stepped  median {statistics.median(fed_to_step) * 1e3:7.1f} ms"
              f"  (report period {spec.averaging.report_period_s * 1e3:.0f} ms)")  # fmt: skip
        print(f"  rounds averaged / alone / caught up: {averagers[0].stats.rounds} / "
              f"{averagers[0].stats.alone} / {averagers[0].stats.catch_ups}")  # fmt: skip
        print(f"  largest difference between the copies: {diff:.2e}")
    finally:
        for a in averagers:
            await a.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--compression", default="none", choices=["none", "float16"])
    args = parser.parse_args()
    torch.set_num_threads(1)
    spec = _spec(args.preset, args.compression)
    dhts = [SwarmDHT.start(spec.run, host_maddrs=[LOOPBACK])]  # before the event loop: forks
    dhts.append(SwarmDHT.start(spec.run, host_maddrs=[LOOPBACK],
                               initial_peers=dhts[0].visible_maddrs()))  # fmt: skip
    try:
        import uvloop

        uvloop.run(_bench(spec, dhts, args.rounds))
    finally:
        for d in dhts:
            d.shutdown()


if __name__ == "__main__":
    main()
