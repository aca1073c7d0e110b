"""``swarmtrain train``: a trainer without a stage (e.g. a CPU-only machine), and the
progress display and loss curve that the demo shares."""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from node.cli.args import DEFAULT_OWNER_KEY
from node.cli.client import client_dht
from node.cli.progress import Progress
from node.daemon.join import join_run, member_invite
from node.data import training_data
from node.files import write_atomic
from node.pipeline.trainer import MicroBatchResult, Trainer, TrainerError, TrainerSettings
from node.rpc.dht import SwarmDHT
from node.rpc.membership import read_invite
from protocol.ownership import check_run_id


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


class CsvLog:
    """The loss curve as a CSV file written as training goes (``samples,train_loss,
    val_loss``): each row is one ``write`` of a whole line on an append-only descriptor,
    so an interrupted run (Ctrl-C, kill) leaves every row written so far and never half a
    row. The file is replaced when opened."""

    HEADER = "samples,train_loss,val_loss"

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
        self._line(self.HEADER)

    def train(self, samples: int, loss: float) -> None:
        self._line(f"{samples},{loss:.6f},")

    def val(self, samples: int, loss: float) -> None:
        self._line(f"{samples},,{loss:.6f}")

    def _line(self, text: str) -> None:
        data = (text + "\n").encode()
        if os.write(self._fd, data) != len(data):  # a regular file takes it whole
            raise OSError(f"short write to {self.path}")

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def say(message: str) -> None:
    """A line on stderr about what the command is doing (the progress line's stream)."""
    print(message, file=sys.stderr, flush=True)


async def open_trainer(
    dht: SwarmDHT,
    settings: TrainerSettings,
    spec_timeout_s: float = 60,
    invite: str | None = None,
    on_step: Callable[[str], None] | None = None,
    owner_key: Path = DEFAULT_OWNER_KEY,
    data: Path | None = None,
) -> Trainer:
    """A ``Trainer`` for the run ``dht`` is in, once its spec is found (and, in a private
    run, once ``invite``, or the run's owner key at ``owner_key``, proved us a member).
    ``NodeError`` if the run has no spec there (``node.daemon.join.find_spec``: within
    seconds when peers answer) or we are no member. ``on_step`` hears what it is doing
    (reading the spec, loading data). ``data``: this machine's copy of a sharded run's
    shards (``node.data.training_data``)."""
    step = on_step or (lambda _: None)
    step(f"reading the spec of run {dht.run}")
    invite_for = member_invite(invite, owner_key, dht.peer_id)
    joined = await join_run(dht, invite_for, spec_timeout_s=spec_timeout_s)
    spec = joined.spec
    step(f"loading the training data ({spec.data})")
    corpus = await asyncio.to_thread(training_data, spec, data)
    p2p = await dht.replicate_p2p()
    return Trainer(dht, p2p, spec, corpus, settings, membership=joined.membership)


async def train_with_progress(
    trainer: Trainer,
    n_micro_batches: int,
    on_result: Callable[[MicroBatchResult], None] | None = None,
    csv: CsvLog | None = None,
    on_step: Callable[[str], None] | None = None,
) -> Curve:
    """Validate, train with a progress line (loss, samples/s, ETA), validate again; each
    point of the curve also goes to ``csv`` as soon as it is known."""
    curve = Curve()
    if on_step:
        on_step("measuring the validation loss before training")
    curve.val.append((0, await trainer.evaluate()))
    if csv:
        csv.val(0, curve.val[-1][1])
    progress = Progress("training", n_micro_batches)
    started, ema = time.perf_counter(), math.nan

    def record(r: MicroBatchResult) -> None:
        nonlocal ema
        ema = r.loss if math.isnan(ema) else 0.95 * ema + 0.05 * r.loss
        samples = trainer.stats.samples
        curve.train.append((samples, r.loss))
        if csv:
            csv.train(samples, r.loss)
        rate = samples / (time.perf_counter() - started)
        progress.update(trainer.stats.micro_batches, loss=ema, **{"samples/s": rate})
        if on_result:
            on_result(r)

    try:
        await trainer.train(n_micro_batches, record)
    finally:
        progress.close()
    if on_step:
        on_step("measuring the validation loss after training")
    curve.val.append((trainer.stats.samples, await trainer.evaluate()))
    if csv:
        csv.val(*curve.val[-1])
    return curve


async def _train(dht: SwarmDHT, args: argparse.Namespace) -> int:
    """Train ``--micro-batches``; 0 once they are all done, whatever the loss did (a
    contributor's few steps need not lower it), 1 if training could not go on."""
    settings = TrainerSettings(in_flight=args.in_flight, stream=args.stream)
    invite = read_invite(args.invite)
    trainer = await open_trainer(
        dht, settings, invite=invite, on_step=say, owner_key=args.owner_key, data=args.data
    )
    csv = CsvLog(args.csv) if args.csv else None
    stopped: TrainerError | None = None
    try:
        started = time.perf_counter()
        curve = await train_with_progress(trainer, args.micro_batches, csv=csv, on_step=say)
        rate = trainer.stats.samples / (time.perf_counter() - started)
    except* TrainerError as group:  # raised inside the trainer's task group
        stopped = group.exceptions[0]
    finally:
        if csv:
            csv.close()
        await trainer.p2p.shutdown()
    if stopped is not None:
        say(f"swarmtrain train: training stopped after {trainer.stats.micro_batches} "
            f"micro-batches: {stopped}")  # fmt: skip
        return 1
    (_, before), (_, after) = curve.val[0], curve.val[-1]
    print(f"trained {trainer.stats.micro_batches} micro-batches ({trainer.stats.samples} "
          f"samples, {rate:.0f} samples/s); val loss {before:.3f} -> {after:.3f}; "
          f"rerouted calls: {sum(trainer.stats.rerouted.values())}")  # fmt: skip
    return 0


def run(args: argparse.Namespace) -> int:
    import uvloop

    say(f"connecting to the peers of run {args.run}")
    with client_dht(args, check_run_id(args.run), identity=args.identity) as dht:
        return uvloop.run(_train(dht, args))
