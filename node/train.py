"""``swarmtrain train``: a trainer without a stage (e.g. a CPU-only machine), and the
progress display and loss curve that the demo shares."""

from __future__ import annotations

import argparse
import asyncio
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from models.data import load_corpus
from node.daemon import NodeError
from node.dht import SwarmDHT
from node.files import load_or_create_key, write_atomic
from node.membership import prove_membership, read_invite
from node.progress import Progress
from node.trainer import MicroBatchResult, Trainer, TrainerSettings
from protocol.ownership import check_run_id


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run", required=True, help="the run's id (NAME@FINGERPRINT)")
    p.add_argument(
        "--initial-peers",
        nargs="+",
        required=True,
        metavar="MADDR",
        help="multiaddrs of nodes of the run (/ip4/HOST/tcp/PORT/p2p/PEER_ID)",
    )
    p.add_argument(
        "--host-maddrs",
        nargs="*",
        default=["/ip4/0.0.0.0/tcp/0"],
        metavar="MADDR",
        help="where to listen",
    )
    p.add_argument("--micro-batches", type=int, default=1000, help="micro-batches to train")
    p.add_argument("--in-flight", type=int, default=4, help="micro-batches in flight at once")
    p.add_argument("--stream", type=int, default=0, help="which data stream of the run to read")
    p.add_argument("--csv", type=Path, help="write the loss curve to this CSV file")
    p.add_argument(
        "--invite", help="private runs: the invite token from the run's owner, or @FILE holding it"
    )
    p.add_argument(
        "--identity", type=Path, help="key file, for an invite bound to a peer id (default: new)"
    )


@dataclass
class Curve:
    """Training loss per micro-batch and validation loss at a few points, by samples seen."""

    train: list[tuple[int, float]] = field(default_factory=list)
    val: list[tuple[int, float]] = field(default_factory=list)

    def write_csv(self, path: Path) -> None:
        rows = [("samples", "train_loss", "val_loss")]
        rows += [(s, f"{v:.6f}", "") for s, v in self.train]
        rows += [(s, "", f"{v:.6f}") for s, v in self.val]
        rows[1:] = sorted(rows[1:], key=lambda r: r[0])
        lines = [",".join(str(c) for c in r) for r in rows]
        write_atomic(path, ("\n".join(lines) + "\n").encode())


async def open_trainer(
    dht: SwarmDHT,
    settings: TrainerSettings,
    spec_timeout_s: float = 60,
    invite: str | None = None,
) -> Trainer:
    """A ``Trainer`` for the run ``dht`` is in, once its spec is found (and, in a private
    run, once ``invite`` proved us a member)."""
    signed = await dht.wait_for_spec(spec_timeout_s)
    if signed is None:
        raise NodeError(f"no spec for run {dht.run!r} found within {spec_timeout_s:.0f} s")
    spec = signed.spec
    dht.use_spec(spec)
    await dht.refresh_revocations()
    membership = prove_membership(dht.policy, dht.peer_id, invite)
    await dht.claim_invite(dht.peer_id, membership)  # a bearer invite: ours now
    corpus = await asyncio.to_thread(load_corpus, spec.data)
    p2p = await dht.replicate_p2p()
    return Trainer(dht, p2p, spec, corpus, settings, membership=membership)


async def train_with_progress(
    trainer: Trainer,
    n_micro_batches: int,
    on_result: Callable[[MicroBatchResult], None] | None = None,
) -> Curve:
    """Validate, train with a progress line (loss and samples/s), validate again."""
    curve = Curve()
    curve.val.append((0, await trainer.evaluate()))
    progress = Progress("training", n_micro_batches)
    started, ema = time.perf_counter(), math.nan

    def record(r: MicroBatchResult) -> None:
        nonlocal ema
        ema = r.loss if math.isnan(ema) else 0.95 * ema + 0.05 * r.loss
        samples = trainer.stats.samples
        curve.train.append((samples, r.loss))
        rate = samples / (time.perf_counter() - started)
        progress.update(trainer.stats.micro_batches, loss=ema, **{"samples/s": rate})
        if on_result:
            on_result(r)

    await trainer.train(n_micro_batches, record)
    progress.close()
    curve.val.append((trainer.stats.samples, await trainer.evaluate()))
    return curve


async def _train(dht: SwarmDHT, args: argparse.Namespace) -> int:
    settings = TrainerSettings(in_flight=args.in_flight, stream=args.stream)
    trainer = await open_trainer(dht, settings, invite=read_invite(args.invite))
    try:
        started = time.perf_counter()
        curve = await train_with_progress(trainer, args.micro_batches)
        rate = trainer.stats.samples / (time.perf_counter() - started)
    finally:
        await trainer.p2p.shutdown()
    (_, before), (_, after) = curve.val[0], curve.val[-1]
    print(f"val loss {before:.3f} -> {after:.3f}  {rate:.0f} samples/s  "
          f"rerouted calls: {sum(trainer.stats.rerouted.values())}")  # fmt: skip
    if args.csv:
        curve.write_csv(args.csv)
    return 0 if after < before else 1


def run(args: argparse.Namespace) -> int:
    import uvloop

    if args.identity is not None:
        load_or_create_key(args.identity)
    dht = SwarmDHT.start(
        check_run_id(args.run),
        initial_peers=args.initial_peers,
        host_maddrs=args.host_maddrs,
        identity_path=args.identity,
        client_mode=True,
    )
    try:
        return uvloop.run(_train(dht, args))
    finally:
        dht.shutdown()
