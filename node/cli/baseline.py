"""``swarmtrain baseline``: the whole model trained in one process, the swarm's reference."""

from __future__ import annotations

import argparse
import csv
import math
from pathlib import Path

from models.config import preset
from models.data import load_corpus
from models.training import BaselineResult, StepReport, train_baseline
from node.cli.progress import Progress


def run(args: argparse.Namespace) -> int:
    model, optim = preset(args.preset)
    corpus = load_corpus(args.data)
    print(
        f"baseline: preset {args.preset}, {args.steps} steps of {optim.target_batch_size} "
        f"samples x {model.block_size} bytes, data {corpus.source} "
        f"({len(corpus.train):,} train / {len(corpus.val):,} val bytes)"
    )
    progress = Progress("training", args.steps)
    last_val: list[float] = []

    def on_step(r: StepReport) -> None:
        if r.val_loss is not None:
            last_val.append(r.val_loss)
        figures: dict = {"loss": r.train_loss, "samples/s": r.samples_per_s}
        if last_val:
            figures["val"] = last_val[-1]
        progress.update(r.step, **figures)

    result = train_baseline(
        model,
        optim,
        corpus,
        args.steps,
        seed=args.seed,
        n_stages=args.stages,
        eval_every=args.eval_every,
        on_step=on_step,
    )
    progress.close()
    if args.csv:
        write_curve(result, args.csv)
        print(f"loss curve written to {args.csv}")
    final = result.steps[-1]
    print(
        f"train loss {final.train_loss:.3f}  val loss {result.initial_val_loss:.3f} -> "
        f"{final.val_loss:.3f} (uniform bytes: {math.log(256):.3f})  "
        f"{final.samples_per_s:.0f} samples/s"
    )
    return 0 if final.val_loss < result.initial_val_loss else 1


def write_curve(result: BaselineResult, path: Path) -> None:
    """CSV of step, samples, train_loss, val_loss (empty where not evaluated)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with tmp.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", "samples", "train_loss", "val_loss"])
        w.writerow([0, 0, "", f"{result.initial_val_loss:.6f}"])
        for r in result.steps:
            val = "" if r.val_loss is None else f"{r.val_loss:.6f}"
            w.writerow([r.step, r.samples, f"{r.train_loss:.6f}", val])
    tmp.replace(path)
