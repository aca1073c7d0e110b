"""``swarmtrain demo``: a local swarm trains the ``tiny`` model and survives a kill -9.

It starts ``stages x peers`` node processes of an uncompressed run (``write_spec``) on
127.0.0.1, trains through them from this
process with a progress line, SIGKILLs one peer part way through and starts a
replacement later, then prints a per-stage table and writes the loss curve (CSV and
PNG). Exit status 0 only if the validation loss fell and the peers of each stage held
equal copies at every epoch they shared (their averagers emit a digest per epoch in
their ``averaging.round`` events, on in the demo's nodes). With ``--baseline`` it also
trains the single-process baseline on the same samples, prints the ratio of the two
validation losses, and fails if the swarm's is more than 2% above. Last, it exports the
trained model from the live swarm to ``OUT/model`` (Hugging Face GPT-2 format) and prints
a sample of what it writes; a failed export fails the demo. Every process it started is
stopped on the way out, also on Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import shutil
import signal
import time
import uuid
from pathlib import Path

from models.data import load_corpus
from models.hf_export import save_hf
from models.hf_format import ARCHITECTURE_OF
from models.training import train_baseline
from node.averaging.digests import DIGESTS_ENV, compare_copies
from node.cli.export import from_swarm
from node.cli.generate import sample_text
from node.cli.train import Curve, open_trainer, train_with_progress
from node.files import write_run_spec
from node.harness.local_swarm import LOCAL, NodeProcess, launch_node, stop_all
from node.pipeline.trainer import MicroBatchResult, Trainer, TrainerSettings
from node.rpc.dht import SwarmDHT
from protocol.run_spec import (
    AveragingSpec,
    RunSpec,
)

logger = logging.getLogger(__name__)


class Demo:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.run = f"demo-{uuid.uuid4().hex[:8]}"
        self.workdir = args.out / "nodes"
        self.nodes: list[NodeProcess] = []
        self.stage_of: dict[str, int] = {}  # node name -> stage
        self.events: list[tuple[int, str]] = []  # (samples, what happened)
        self.spec_file = Path()  # ``write_spec``'s

    def write_spec(self) -> Path:
        """The demo run's signed spec, uncompressed: its peers share one machine, where
        sending costs nothing and a codec only costs CPU (a run between homes keeps the
        defaults, ``swarmtrain run create``)."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        path = self.workdir / "demo.spec.json"
        spec = write_run_spec(path, self.workdir / "owner.key", self.run, self.args.preset,
                              self.args.stages, compression="none",
                              averaging=AveragingSpec(compression="none"))  # fmt: skip
        self.run = spec.run  # NAME@FINGERPRINT: how the nodes join
        return path

    def start_swarm(self) -> None:
        a = self.args
        # Its nodes emit their parameter digests: ``copies`` reads them from their events.
        os.environ[DIGESTS_ENV] = "1"
        self.spec_file = self.write_spec()
        print(f"starting {a.stages} stages x {a.peers} peers on 127.0.0.1 (run {self.run})")
        for i in range(a.stages * a.peers):
            stage = i % a.stages
            peers = [self.nodes[0].maddr] if self.nodes else []
            self._launch(f"peer{i}", stage, peers, ["--stage", str(stage)])
        for n in self.nodes:
            n.wait_serving()

    def _launch(
        self, name: str, stage: int, peers: list[str], extra: list[str], wait: bool = True
    ) -> NodeProcess:
        extra = ["--spec", str(self.spec_file), *extra]
        node = launch_node(
            self.workdir, name, self.run, initial_peers=peers, extra=extra, wait=wait
        )
        self.nodes.append(node)
        self.stage_of[name] = stage
        return node

    def on_result(self, trainer: Trainer):
        total = self.args.micro_batches
        kill_at, replace_at = int(total * self.args.kill_at), int(total * self.args.replace_at)
        last = self.args.stages - 1
        state = {"victim": None}

        def hook(r: MicroBatchResult) -> None:
            done = trainer.stats.micro_batches
            if done == kill_at and self.args.peers > 1:
                victim = next(n for n in self.nodes if self.stage_of[n.name] == last)
                victim.proc.send_signal(signal.SIGKILL)
                state["victim"] = victim
                self.events.append((trainer.stats.samples, f"SIGKILL {victim.name}"))
                logger.info("SIGKILLed %s (stage %d)", victim.name, last)
            if done == replace_at and state["victim"] is not None:
                name = f"{state['victim'].name}-replacement"
                peers = [n.maddr for n in self.nodes if n.alive()][:1]
                # Not waited for: the trainer keeps going while the replacement starts.
                self._launch(name, last, peers, ["--stage", str(last)], wait=False)
                self.events.append((trainer.stats.samples, f"{name} joined"))

        return hook

    def table(self, trainer: Trainer) -> str:
        rows = [f"{'stage':>5} {'peer':<22} {'alive':>5} {'micro-batches served':>21}"]
        for n in self.nodes:
            s = self.stage_of[n.name]
            served = trainer.stats.calls[(s, n.peer_id)] if n.maddrs_file.exists() else 0
            rows.append(f"{s:>5} {n.name:<22} {'yes' if n.alive() else 'no':>5} {served:>21}")
        for s in range(self.args.stages):
            rows.append(f"stage {s}: failed calls rerouted to another peer: "
                        f"{trainer.stats.rerouted[s]}")  # fmt: skip
        return "\n".join(rows)

    def copies(self) -> tuple[str, bool]:
        """Whether the peers of each stage held equal parameters at the epochs they share,
        from the digests in the ``averaging.round`` events their averagers emit."""
        rounds = [n.events("averaging.round") for n in self.nodes]
        checks = [compare_copies(rounds, s) for s in range(self.args.stages)]
        text = "\n".join(f"stage {s}: {c}" for s, c in enumerate(checks))
        return text, all(c.equal for c in checks)

    def write_curve(self, curve: Curve) -> None:
        """The loss curve as CSV, and as a PNG where matplotlib is installed (else one
        line says how to get it)."""
        from node.cli.plot import PlotUnavailable, write_line_chart

        out = self.args.out
        curve.write_csv(out / "loss.csv")
        smooth, ema = [], None
        for s, v in curve.train:
            ema = v if ema is None else 0.95 * ema + 0.05 * v
            smooth.append((s, ema))
        try:
            write_line_chart(
                out / "loss.png",
                {"train loss (EMA)": smooth, "validation loss": curve.val},
                title=f"swarmtrain demo: {self.args.stages} stages x {self.args.peers} peers",
                x_label="samples",
                y_label="loss",
                markers=self.events,
            )
        except PlotUnavailable as e:
            print(f"loss curve written to {out / 'loss.csv'}; no PNG: {e}")
            return
        print(f"loss curve written to {out / 'loss.csv'} and {out / 'loss.png'}")


async def _train(demo: Demo, dht: SwarmDHT) -> int:
    a = demo.args
    trainer = await open_trainer(dht, TrainerSettings(in_flight=a.in_flight, call_timeout_s=10))
    try:
        started = time.perf_counter()
        curve = await train_with_progress(trainer, a.micro_batches, demo.on_result(trainer))
        elapsed = time.perf_counter() - started
    finally:
        await trainer.p2p.shutdown()
    print(demo.table(trainer))
    copies, equal = demo.copies()
    print(copies)
    demo.write_curve(curve)
    (_, before), (_, after) = curve.val[0], curve.val[-1]
    print(f"validation loss {before:.3f} -> {after:.3f} in {trainer.stats.samples} samples, "
          f"{trainer.stats.samples / elapsed:.0f} samples/s")  # fmt: skip
    as_one_process = True
    if a.baseline:
        base = await asyncio.to_thread(baseline_loss, trainer.spec, trainer.stats.samples)
        print(f"baseline (one process, the same {trainer.stats.samples} samples in the same "
              f"order): {base:.3f}; swarm / baseline: {after / base:.3f}")  # fmt: skip
        as_one_process = after <= PARITY * base
    await take_home(dht, a.out / "model")
    return 0 if after < before and equal and as_one_process else 1


async def take_home(dht: SwarmDHT, model_dir: Path) -> None:
    """Export the trained model from the live swarm (``swarmtrain export``'s way) and
    print a sample of what it writes (``swarmtrain generate``'s way)."""
    spec, state, _ = await from_swarm(dht, EXPORT_TIMEOUT_S)
    if model_dir.exists():
        shutil.rmtree(model_dir)
    save_hf(model_dir, state, spec.model)
    text = b"".join(sample_text(model_dir, SAMPLE_PROMPT, 160, temperature=0.8))
    print(f"model exported to {model_dir} ({ARCHITECTURE_OF[spec.model.family]}); it writes, after "
          f"{SAMPLE_PROMPT!r}:")  # fmt: skip
    print(SAMPLE_PROMPT + text.decode(errors="replace"))


# With --baseline, the swarm's validation loss may be at most this times the baseline's.
PARITY = 1.02
EXPORT_TIMEOUT_S = 60.0  # for each stage's state to come from a live peer
SAMPLE_PROMPT = "def "


def baseline_loss(spec: RunSpec, samples: int) -> float:
    """What ``swarmtrain baseline`` reaches on the run's data stream 0 (the demo trainer's)
    after ``samples`` samples, in steps of the target batch."""
    optim = spec.optim
    result = train_baseline(spec.model, optim, load_corpus(spec.data),
                            steps=samples // optim.target_batch_size, seed=spec.seed,
                            eval_every=10**9)  # fmt: skip
    return result.steps[-1].val_loss


def run(args: argparse.Namespace) -> int:
    import uvloop

    demo = Demo(args)
    dht = None
    try:
        demo.start_swarm()
        dht = SwarmDHT.start(demo.run, initial_peers=[demo.nodes[0].maddr],
                             host_maddrs=[LOCAL], client_mode=True)  # fmt: skip
        return uvloop.run(_train(demo, dht))
    finally:
        if dht is not None:
            dht.shutdown()
        stop_all(demo.nodes)
