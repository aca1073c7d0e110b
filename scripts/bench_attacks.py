"""The 2 x 2 tiny swarm (2 stages, 2 peers each, real ``swarmtrain node`` processes on
127.0.0.1) trained undisturbed and under each attack of ``node.harness.attackers``, in one
run: the trainer's samples/s and its validation loss before and after, per row.

Each row starts a fresh swarm (so that no attack's records outlive its row), starts the
attack once every node serves, and runs ``swarmtrain train`` for ``--micro-batches``.
Rows, by name (``--attacks``):

- ``none``: undisturbed;
- ``sybil``: 1,000 sybil records of the largest size the run allows, claiming 1e9 samples/s;
- ``claims``: 20 sybil records claiming 1e9 samples/s on stage 0;
- ``progress``: claims of epoch 2^50 on every stage (unsigned, stranger-signed, member-signed);
- ``replay``: every node's own record re-stored 5 s later to outlive its fresh ones;
- ``requests``: 200 max-size forwards kept in flight against one peer of the last stage;
- ``reducer``: a fifth peer averaging with stage 0 that returns -100 x the true mean of
  the share it reduces (``attackers.ReversingReducer``, in its own process).

Each row also counts the shares its nodes refused as a reducer's (``averaging.part_rejected``).

    python -m scripts.bench_attacks [--attacks none,sybil,...] [--micro-batches 48] [--repeat 3]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from hivemind.p2p import P2P, PeerID

from models.config import tiny
from node.harness.attackers import (
    RequestFlood,
    attacker_dht,
    forge_progress,
    max_forward,
    replay_record,
    sybil_flood,
)
from node.harness.local_swarm import LOCAL, NodeProcess, launch_node, stop_all, wait_until
from node.pipeline import client as stage_client
from protocol.records import MAX_RECORD_AGE_S, PeerBounds

ROWS = ("none", "sybil", "claims", "progress", "replay", "requests", "reducer")
READY_S = 120.0  # for the hostile reducer to join and hold its stage's state
_TRAINED = re.compile(
    r"trained (\d+) micro-batches \((\d+) samples, (\d+) samples/s\); "
    r"val loss ([\d.]+) -> ([\d.]+); rerouted calls: (\d+)"
)


def _swarm(workdir: Path, name: str) -> list[NodeProcess]:
    """Four nodes, two pinned to each stage, all serving."""
    nodes = [launch_node(workdir, f"{name}-a", name, extra=["--stage", "0"])]
    run, first = nodes[0].run_id, nodes[0].maddr
    for i, stage in ((1, 0), (2, 1), (3, 1)):
        nodes.append(
            launch_node(
                workdir, f"{name}-{'abcd'[i]}", run, initial_peers=[first],
                extra=["--stage", str(stage)],
            )
        )  # fmt: skip
    for n in nodes:
        n.wait_serving(timeout=120)
    return nodes


@contextlib.contextmanager
def _attack(name: str, nodes: list[NodeProcess]) -> Iterator[None]:
    """Start attack ``name`` against the swarm of ``nodes``; stop it on leaving."""
    if name == "none":
        yield
        return
    run, maddr = nodes[0].run_id, nodes[0].maddr
    if name == "reducer":
        with _reducer(run, maddr, nodes[0].log.parent / "reducer.log"):
            yield
        return
    if name == "requests":
        cfg = tiny()[0]
        last = nodes[-1]
        meta, tensors = max_forward(run, 1, cfg.block_size, cfg.n_embd, cfg.vocab_size)

        async def request(client: P2P, peer: PeerID) -> None:
            await stage_client.call(client, peer, "forward", meta, tensors, stage=1, timeout=30)

        with RequestFlood(last.maddr, last.peer_id, request):
            yield
        return
    attacker = attacker_dht(maddr)
    try:
        if name == "sybil":
            largest = PeerBounds(2, private=False).max_bytes
            sybil_flood(attacker, run, 1000, max_bytes=largest, throughput=(1e9, 1e9))
        elif name == "claims":
            sybil_flood(attacker, run, 20, stage=0, throughput=(1e9, 0.0))
        elif name == "progress":
            forge_progress(attacker, run, 2)
        elif name == "replay":
            for n in nodes:
                replay_record(attacker, run, n.peer_id)
        else:
            raise ValueError(f"unknown attack {name!r}; choose from {', '.join(ROWS)}")
        yield
    finally:
        attacker.shutdown()


@contextlib.contextmanager
def _reducer(run: str, maddr: str, log: Path) -> Iterator[None]:
    """A hostile reducer of stage 0 (``python -m node.harness.attackers``), holding the
    stage's state inside; killed on leaving."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    command = [sys.executable, "-m", "node.harness.attackers", "--run", run,
               "--initial-peer", maddr, "--stage", "0"]  # fmt: skip
    with log.open("w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:

        def ready() -> bool:
            if proc.poll() is not None:
                raise RuntimeError(f"the hostile reducer exited: {log.read_text()[-2000:]}")
            return "READY" in log.read_text()

        wait_until(ready, READY_S, "the hostile reducer to hold stage 0")
        yield
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _train(run: str, maddrs: list[str], micro_batches: int, timeout: float) -> dict:
    """``swarmtrain train`` to the end: its figures (or its error)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    command = [sys.executable, "-m", "node.cli", "train", "--run", run, "--initial-peers",
               *maddrs, "--host-maddrs", LOCAL, "--micro-batches", str(micro_batches)]  # fmt: skip
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"did not finish in {timeout:.0f} s"}
    found = _TRAINED.search(proc.stdout)
    if proc.returncode != 0 or not found:
        return {"error": (proc.stderr.strip().splitlines() or ["no output"])[-1][:120]}
    _, _, rate, before, after, rerouted = found.groups()
    return {"rate": float(rate), "before": float(before), "after": float(after),
            "rerouted": int(rerouted)}  # fmt: skip


def _row(name: str, workdir: Path, micro_batches: int, say: Callable[[str], None]) -> dict:
    nodes = _swarm(workdir / name, f"atk-{name}")
    try:
        run = nodes[0].run_id
        with _attack(name, nodes):
            started = time.monotonic()
            figures = _train(run, [n.maddr for n in nodes], micro_batches, MAX_RECORD_AGE_S)
            refused = sum(len(n.events("averaging.part_rejected")) for n in nodes)
            figures["refused"] = refused
            say(f"{name}: {figures} ({time.monotonic() - started:.0f} s)")
        return figures
    finally:
        stop_all(nodes)


def _summary(runs: list[dict]) -> dict | None:
    """The median of each figure over the runs that finished (rate: also its range)."""
    done = [r for r in runs if "error" not in r]
    if not done:
        return None
    median = {k: statistics.median(r[k] for r in done) for k in done[0] if k != "refused"}
    rates = [r["rate"] for r in done]
    return {**median, "low": min(rates), "high": max(rates), "n": len(done),
            "refused": sum(r["refused"] for r in done)}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--attacks", default=",".join(ROWS), help="rows to run, comma-separated")
    p.add_argument("--micro-batches", type=int, default=48)
    p.add_argument("--repeat", type=int, default=1, help="runs of every row, interleaved")
    args = p.parse_args(argv)
    names = [a for a in args.attacks.split(",") if a]
    if unknown := [a for a in names if a not in ROWS]:
        p.error(f"unknown attacks {unknown}; choose from {', '.join(ROWS)}")
    if args.repeat < 1:
        p.error("--repeat must be >= 1")
    load = os.getloadavg()[0]
    runs: dict[str, list[dict]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory(prefix="bench-attacks-") as tmp:
        for i in range(args.repeat):  # row after row, then again: load drifts across all
            for name in names:
                say = lambda s: print(s, flush=True)  # noqa: E731
                runs[name].append(_row(name, Path(tmp) / str(i), args.micro_batches, say))
    rows = {name: _summary(r) for name, r in runs.items()}
    calm = (rows.get("none") or {}).get("rate")
    print(
        f"\n2 x 2 tiny swarm, {args.micro_batches} micro-batches a row, {args.repeat} runs "
        f"(medians; samples/s range in brackets); load at start {load:.1f}, at end "
        f"{os.getloadavg()[0]:.1f}"
    )
    print(
        f"{'attack':<10} {'samples/s':>15} {'vs none':>8} {'val loss':>15} {'rerouted':>8} "
        f"{'refused':>7}"
    )
    for name, r in rows.items():
        if r is None:
            print(f"{name:<10} failed: {runs[name][-1]['error']}")
            continue
        rate = f"{r['rate']:.0f} [{r['low']:.0f}-{r['high']:.0f}]"
        ratio = f"{r['rate'] / calm:.2f}x" if calm else "-"
        loss = f"{r['before']:.3f} -> {r['after']:.3f}"
        failed = f" ({args.repeat - r['n']} failed)" if r["n"] < args.repeat else ""
        print(
            f"{name:<10} {rate:>15} {ratio:>8} {loss:>15} {r['rerouted']:>8.0f} "
            f"{r['refused']:>7}{failed}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
