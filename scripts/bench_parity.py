"""Loss per sample: the swarm against the single-process baseline, on the same samples.

    PYTHONPATH=. python -m scripts.bench_parity --runs 3

The baseline (``models.training.train_baseline``, what ``swarmtrain baseline`` runs) and
every swarm configuration read the run's data stream 0 in the same order, with the same
preset; the swarm is a real local one (node processes with p2pd, hivemind averaging, one
trainer in this process). Validation loss (the run's fixed validation windows) is taken
at fixed sample counts: the swarm's trainer stops there, waits until no stage has a step
pending (every peer's progress record shows the same epoch, below a round's samples), and
evaluates through the swarm. Configurations (``--configs``), by name:

    PxF-MODE-sS  P peers per stage, F micro-batches in flight, averaging MODE (gradient,
                 diloco), ``OptimizerConfig.max_staleness`` S (0: stages hold micro-batches
                 while a step is pending; 1: they never hold, as before)
    ...-overlap  (diloco) ``AveragingSpec.overlap``: peers keep taking inner steps while
                 an outer round runs

DiLoCo configurations take ``--inner-steps`` (H) inner steps per peer between outer steps.
It prints one line per run (JSON with ``--json``) and a table of medians [min-max] over
``--runs`` runs, each loss also as a ratio to the baseline's at the same samples, with the
pipeline's idle time in rounds: per round whose step landed while the trainer trained, the
seconds in which the stage server's compute thread served nothing (``idle_s`` of
``averaging.round``), as a median per round, as a share of the rounds' seconds (the
compute thread of a stage that holds its micro-batches during a round is idle for most of
it), and as a share of the training time, summed over the stage's peers and averaged over
the stages (1: every peer idle all the time).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import dataclasses
import json
import math
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

from hivemind.utils import get_dht_time

from models.config import preset
from models.data import eval_batches, load_corpus, sample_batches, stream_seed
from models.stages import Stage, even_boundaries
from models.training import StageOptimizer, evaluate, pipeline_loss, train_baseline
from node.cli.train import open_trainer
from node.files import write_run_spec
from node.harness.local_swarm import LOCAL, launch_node, stop_all
from node.pipeline.trainer import Trainer, TrainerSettings
from node.rpc.dht import SwarmDHT
from protocol.averaging import decode_progress, progress_key
from protocol.run_spec import AveragingSpec

DEFAULT_CONFIGS = ("2x4-gradient-s0", "2x4-gradient-s1", "2x1-gradient-s0", "1x4-gradient-s0")
CONFIG = re.compile(
    r"^(\d+)x(\d+)-(gradient|diloco)-s([01])(-overlap|-spec)?"
    r"(?:-b(none|float16|uint8|int4|int2))?(?:-a(none|float16|uint8))?$"
)


@dataclasses.dataclass(frozen=True)
class SwarmConfig:
    peers: int  # per stage
    in_flight: int
    mode: str = "gradient"
    max_staleness: int = 0
    stages: int = 2
    inner_steps: int = 10  # diloco
    overlap: bool = False  # diloco
    speculate: bool = False  # gradient, s1
    boundary: str | None = None  # the spec's compression (None: its default)
    averaged: str | None = None  # averaging.compression (None: its default)

    @classmethod
    def parse(cls, name: str, inner_steps: int = 10) -> SwarmConfig:
        m = CONFIG.match(name)
        if m is None:
            raise ValueError(
                f"configuration {name!r}: write e.g. 2x4-gradient-s0, or 2x4-gradient-s0-bint4-"
                "auint8 for int4 boundaries and 8-bit averaging"
            )
        return cls(int(m[1]), int(m[2]), m[3], int(m[4]), inner_steps=inner_steps,
                   overlap=m[5] == "-overlap", speculate=m[5] == "-spec",
                   boundary=m[6], averaged=m[7])  # fmt: skip

    @property
    def name(self) -> str:
        suffix = "-overlap" if self.overlap else "-spec" if self.speculate else ""
        suffix += f"-b{self.boundary}" if self.boundary else ""
        suffix += f"-a{self.averaged}" if self.averaged else ""
        return f"{self.peers}x{self.in_flight}-{self.mode}-s{self.max_staleness}{suffix}"


def write_spec(workdir: Path, name: str, config: SwarmConfig, **optim) -> tuple[str, Path]:
    """A public run's signed spec for ``config`` (tiny preset): its id and its file."""
    path = workdir / f"{name}.spec.json"
    spec = write_run_spec(
        path,
        workdir / "owner.key",
        name,
        "tiny",
        config.stages,
        averaging=AveragingSpec(
            mode=config.mode,
            inner_steps=config.inner_steps,
            # Named only when on, so that this runs on code without it.
            **({"overlap": True} if config.overlap else {}),
            **({"speculate": True} if config.speculate else {}),
            **({"compression": config.averaged} if config.averaged else {}),
        ),
        **({"compression": config.boundary} if config.boundary else {}),
        # Named only when it is not the default, so that this runs on code without it.
        **({"max_staleness": config.max_staleness} if config.max_staleness else {}),
        **optim,
    )
    return spec.run, path


async def settled(dht: SwarmDHT, trainer: Trainer, timeout: float = 90.0) -> list[int]:
    """Wait until no stage has a step pending: all of a stage's peers publish the same
    epoch, and their samples at it are below what starts a round. Returns each stage's
    epoch."""
    spec = trainer.spec
    peers = [len(v) for v in trainer._view]
    target = spec.optim.target_batch_size
    if spec.averaging.mode == "diloco":
        target *= spec.averaging.inner_steps
    deadline = time.monotonic() + timeout
    while True:
        epochs = []
        for s in range(spec.n_stages):
            found = await dht.dht.get(progress_key(spec.run, s), latest=True, return_future=True)
            records = [] if found is None else [
                decode_progress(v.value, subkey=k, run=spec.run, now=get_dht_time())
                for k, v in found.value.items()
            ]  # fmt: skip
            stage_target = target * (len(records) if spec.averaging.mode == "diloco" else 1)
            if (
                len(records) == peers[s]
                and len({r.epoch for r in records}) == 1
                and sum(r.samples for r in records) < stage_target
            ):
                epochs.append(records[0].epoch)
        if len(epochs) == spec.n_stages:
            return epochs
        if time.monotonic() > deadline:
            raise TimeoutError(f"the stages did not settle within {timeout:.0f} s")
        await asyncio.sleep(0.2)


def run_swarm(
    config: SwarmConfig,
    checkpoints: list[int],
    workdir: Path,
    *,
    optim: dict | None = None,
    timeout_s: float = 900.0,
) -> dict:
    """Train a local swarm of ``config`` to each of ``checkpoints`` (samples, ascending);
    returns validation losses by samples, the stages' epochs there, and samples/s."""
    workdir.mkdir(parents=True, exist_ok=True)
    name = f"parity-{config.name}-{int(time.time() * 1000) % 10**8}"
    run, spec_path = write_spec(workdir, name, config, **(optim or {}))
    nodes, dht = [], None
    try:
        for i in range(config.stages * config.peers):
            peers = [nodes[0].maddr] if nodes else []
            extra = ["--spec", str(spec_path), "--stage", str(i % config.stages)]
            # the joiners need only the first node's address: they start together
            nodes.append(launch_node(workdir, f"p{i}", run, initial_peers=peers, extra=extra,
                                     wait=not nodes))  # fmt: skip
        for n in nodes:
            n.wait_serving(120)
        dht = SwarmDHT.start(run, initial_peers=[nodes[0].maddr], host_maddrs=[LOCAL],
                             client_mode=True)  # fmt: skip
        result = asyncio.run(asyncio.wait_for(_train(dht, config, checkpoints), timeout_s))
        idle = idle_in_rounds(nodes, result.pop("windows"))
        return result | idle | {"logs": [str(n.log) for n in nodes]}
    finally:
        if dht is not None:
            dht.shutdown()
        stop_all(nodes)


async def _train(dht: SwarmDHT, config: SwarmConfig, checkpoints: list[int]) -> dict:
    trainer = await open_trainer(dht, TrainerSettings(in_flight=config.in_flight,
                                                      call_timeout_s=10))  # fmt: skip
    try:

        async def full_view() -> bool:
            await trainer.refresh()
            return [len(v) for v in trainer._view] == [config.peers] * config.stages

        deadline = time.monotonic() + 60
        while not await full_view():
            if time.monotonic() > deadline:
                raise TimeoutError("the trainer did not see every peer within 60 s")
            await asyncio.sleep(0.3)
        micro = trainer.spec.optim.micro_batch_size
        val, epochs, busy_s, windows = {}, {}, 0.0, []
        for samples in checkpoints:
            started, wall = time.perf_counter(), time.time()
            await trainer.train((samples - trainer.stats.samples) // micro)
            busy_s += time.perf_counter() - started
            windows.append((wall, time.time()))
            epochs[samples] = await settled(dht, trainer)
            val[samples] = await trainer.evaluate()
        return {
            "config": config.name,
            "val": val,
            "epochs": epochs,
            "samples_per_s": trainer.stats.samples / busy_s,
            "rerouted": sum(trainer.stats.rerouted.values()),
            "windows": windows,
        }
    finally:
        await trainer.p2p.shutdown()


def idle_in_rounds(nodes: list, windows: list[tuple[float, float]]) -> dict:
    """The pipeline's idle time in the rounds whose step landed within ``windows`` (wall
    clock, the trainer training): ``idle_per_round`` (median seconds over every peer's
    rounds), ``idle_in_rounds`` (their idle seconds over their seconds), ``idle_share`` (a
    stage's peers' idle seconds over the training time, mean over the stages) and
    ``rounds`` (per stage, its peers' rounds summed)."""
    trained = sum(end - start for start, end in windows)
    idle, seconds_in_rounds, per_stage = [], 0.0, {}
    for node in nodes:
        stage = node.stage()
        rounds = [
            e for e in node.events("averaging.round")
            if e.get("idle_s") is not None and any(a <= e["t"] <= b for a, b in windows)
        ]  # fmt: skip
        idle.extend(e["idle_s"] for e in rounds)
        seconds_in_rounds += sum(e["seconds"] for e in rounds)
        seconds, count = per_stage.get(stage, (0.0, 0))
        per_stage[stage] = (seconds + sum(e["idle_s"] for e in rounds), count + len(rounds))
    return {
        "idle_per_round": statistics.median(idle) if idle else math.nan,
        "idle_in_rounds": sum(idle) / seconds_in_rounds if seconds_in_rounds else math.nan,
        "idle_share": statistics.mean(s / trained for s, _ in per_stage.values()),
        "rounds": [per_stage[s][1] for s in sorted(per_stage)],
    }


def baseline(checkpoints: list[int], optim: dict | None = None, n_stages: int = 1) -> dict:
    """Validation loss of ``train_baseline`` at ``checkpoints`` (multiples of a step)."""
    model, opt = preset("tiny")
    opt = dataclasses.replace(opt, **(optim or {}))
    step = opt.target_batch_size
    every = math.gcd(*(c // step for c in checkpoints))
    result = train_baseline(model, opt, load_corpus(), steps=max(checkpoints) // step,
                            n_stages=n_stages, eval_every=every)  # fmt: skip
    return {r.samples: r.val_loss for r in result.steps if r.samples in checkpoints}


def emulate(
    checkpoints: list[int],
    batch: int = 32,
    delay: int = 0,
    n_stages: int = 2,
    *,
    peers: int = 1,
    speculative: bool = False,
    seed: int = 0,
) -> dict[int, float]:
    """The swarm's arithmetic in one process, without the swarm: steps of ``batch`` samples
    (a round that overshoots the target takes more), each on gradients computed on the
    parameters of ``delay`` steps before (1: what micro-batches served during a round get).
    ``peers`` copies of each stage compute a batch's micro-batches (micro-batch i on copy
    i % peers of stage 0, (i // peers) % peers of stage 1, ...) and every step is taken on
    the sum of their gradients. ``speculative`` (with ``delay`` 1): each copy computes the
    next batch on the parameters before the step moved by a step on its own gradients alone
    (what a copy that steps locally while its round runs would serve on), the worst case:
    every micro-batch of the next batch computed before the round's step lands. ``seed``:
    of the data stream. Validation loss at ``checkpoints``, as ``baseline``."""
    if delay not in (0, 1):
        raise ValueError(f"delay must be 0 or 1, got {delay}")
    if speculative and delay != 1:
        raise ValueError("speculative steps are one step ahead of the averaged step: delay 1")
    model, opt = preset("tiny")
    opt = dataclasses.replace(opt, target_batch_size=batch)
    corpus = load_corpus()
    stages = [Stage(model, r) for r in even_boundaries(model, n_stages)]
    optimizers = [StageOptimizer(s, opt) for s in stages]
    data = sample_batches(
        corpus.train, model.block_size, opt.micro_batch_size, stream_seed(seed, 0)
    )
    val = eval_batches(corpus.val, model.block_size, opt.micro_batch_size, 8)
    # copies[k][c]: the (stage, optimizer) copy c of stage k computes the next batch on
    copies = [
        [copy.deepcopy(pair) for _ in range(peers)] for pair in zip(stages, optimizers, strict=True)
    ]
    losses, seen, index = {}, 0, 0
    while seen < max(checkpoints):
        samples = [[0] * peers for _ in stages]
        for _ in range(batch // opt.micro_batch_size):
            x, y = next(data)
            route = [(index // peers**k) % peers for k in range(len(stages))]
            index += 1
            computing = [copies[k][c][0] for k, c in enumerate(route)]
            (pipeline_loss(computing, x, y) * len(x)).backward()
            for k, c in enumerate(route):
                samples[k][c] += len(x)
            seen += len(x)
        before = [copy.deepcopy(pair) for pair in zip(stages, optimizers, strict=True)]
        for k, (s, o) in enumerate(zip(stages, optimizers, strict=True)):
            for j, ps in enumerate(s.parameters()):
                grads = [g for c in copies[k] if (g := list(c[0].parameters())[j].grad) is not None]
                ps.grad = sum(grads) if grads else None
            o.accumulated(batch)
            o.step()
        past = before if delay else list(zip(stages, optimizers, strict=True))
        for k in range(len(stages)):
            for c in range(peers):
                own = copies[k][c][0]
                nxt = copy.deepcopy(past[k])
                if speculative and samples[k][c]:
                    for pn, po in zip(nxt[0].parameters(), own.parameters(), strict=True):
                        pn.grad = None if po.grad is None else po.grad.clone()
                    nxt[1].accumulated(samples[k][c])
                    nxt[1].step()
                for pn in nxt[0].parameters():
                    pn.grad = None
                copies[k][c] = nxt
        for mark in checkpoints:
            if seen >= mark and mark not in losses:
                losses[mark] = evaluate(stages, val)
    return losses


def _fmt(values: list[float], digits: int = 3) -> str:
    med, lo, hi = statistics.median(values), min(values), max(values)
    return (
        f"{med:.{digits}f} [{lo:.{digits}f}-{hi:.{digits}f}]"
        if len(values) > 1
        else f"{med:.{digits}f}"
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--configs", nargs="+", default=list(DEFAULT_CONFIGS))
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--checkpoints", type=int, nargs="+", default=[1600, 3200, 6400])
    p.add_argument("--inner-steps", type=int, default=10, help="diloco: H, per peer")
    p.add_argument("--workdir", type=Path, help="node logs (default: a temporary directory)")
    p.add_argument("--json", action="store_true", help="one JSON object per run")
    p.add_argument(
        "--emulate",
        action="store_true",
        help="instead: the swarm's arithmetic in one process (step batch x gradient delay)",
    )
    p.add_argument("--emulate-from", type=int, default=0, help="--emulate: skip the first rows")
    p.add_argument("--seeds", type=int, default=1, help="--emulate: data streams per row")
    args = p.parse_args()
    configs = [SwarmConfig.parse(c, args.inner_steps) for c in args.configs]
    checkpoints = sorted(args.checkpoints)
    if args.emulate:
        print("| stages | copies per stage | batch per step | gradient delay (steps) | "
              + " | ".join(f"val @ {s}" for s in checkpoints) + " |")  # fmt: skip
        print("|" + "---|" * (4 + len(checkpoints)))
        rows = [
            (1, 1, 32, 0),
            (2, 1, 32, 0),
            (2, 1, 48, 0),
            (2, 1, 64, 0),
            (2, 1, 32, 1),
            (2, 1, 64, 1),
            (2, 2, 32, 0),
            (2, 2, 32, 1),
            (2, 2, 32, "1, speculative"),
        ]
        for stages, peers, batch, delay in rows[args.emulate_from :]:  # fmt: skip
            speculative = delay == "1, speculative"
            runs = [emulate(checkpoints, batch, 1 if speculative else delay, stages,
                            peers=peers, speculative=speculative, seed=seed)
                    for seed in range(args.seeds)]  # fmt: skip
            figures = " | ".join(_fmt([r[s] for r in runs]) for s in checkpoints)
            print(f"| {stages} | {peers} | {batch} | {delay} | {figures} |", flush=True)
        return 0
    base = baseline(checkpoints)
    print(json.dumps({"config": "baseline", "val": base}) if args.json else
          f"baseline: {base}", flush=True)  # fmt: skip
    results: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = args.workdir or Path(tmp)
        for i in range(args.runs):
            for c in configs:
                r = run_swarm(c, checkpoints, root / f"{c.name}-{i}")
                results.setdefault(c.name, []).append(r)
                print(json.dumps(r) if args.json else
                      f"{c.name} run {i}: {r['val']} epochs {r['epochs']} "
                      f"{r['samples_per_s']:.0f} samples/s, idle {r['idle_per_round']:.2f} s "
                      f"per round ({r['idle_in_rounds']:.2f} of the rounds' time), "
                      f"{r['idle_share']:.2f} of the training time", flush=True)  # fmt: skip
    print()
    header = ["configuration", *(f"val @ {s}" for s in checkpoints), f"ratio @ {checkpoints[-1]}",
              "samples/s", f"s to {checkpoints[-1]}", "idle s / round",
              "idle / round time", "idle / training time"]  # fmt: skip
    rows = [header, ["baseline"] + [f"{base[s]:.3f}" for s in checkpoints] + ["1.000"]
            + [""] * 5]  # fmt: skip
    last = checkpoints[-1]
    for name, runs in results.items():
        rows.append(
            [name]
            + [_fmt([r["val"][s] for r in runs]) for s in checkpoints]
            + [_fmt([r["val"][last] / base[last] for r in runs])]
            + [_fmt([r["samples_per_s"] for r in runs], digits=0)]
            + [_fmt([last / r["samples_per_s"] for r in runs], digits=0)]
            + [_fmt([r["idle_per_round"] for r in runs], digits=2)]
            + [_fmt([r["idle_in_rounds"] for r in runs], digits=2)]
            + [_fmt([r["idle_share"] for r in runs], digits=2)]
        )
    for i, row in enumerate(rows):
        print("| " + " | ".join(row) + " |")
        if i == 0:
            print("|" + "---|" * len(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
