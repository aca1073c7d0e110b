"""Bytes across a stage boundary and the loss they cost: every compression setting side by
side, on the same samples.

    PYTHONPATH=. python -m scripts.bench_boundary --runs 5 --samples 3200

Each run trains the preset (``tiny`` by default) cut into two stages in one process, once
per setting of ``RunSpec.compression``, on the same data stream; the hidden states that
cross the cut, and their gradients on the way back, go through the wire's own
``serialize`` and ``deserialize`` (``node.pipeline.wire``), as between two peers. Steps are
the swarm's arithmetic without the swarm (``scripts.bench_parity --emulate``): a step per
``target_batch_size`` samples, no gradient delay. Validation loss is taken after
``--samples`` samples, through the compressed boundary as a swarm evaluates. Run ``r``
draws data stream ``r`` and seeds the rounding generator with ``r``.

It prints, per setting: bytes per sample across the boundary (activations forward plus
gradients back, as serialized tensors, headers included) and its ratio to ``none``; the
validation loss and its ratio to ``none``'s in the same run, as a median [min-max] over
runs; and the time to encode and decode one micro-batch of each preset in ``--presets``
(bytes per sample there too).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time

import torch

from models.config import preset
from models.data import eval_batches, load_corpus, sample_batches, stream_seed
from models.stages import Stage, even_boundaries
from models.training import StageOptimizer
from node.pipeline import lowbit, wire

SETTINGS = ("none", "float16", "uint8", "int4", "int2")


def parse_setting(setting: str) -> tuple[int | None, str]:
    """``none`` / ``int4`` / ``r16`` / ``r16-int4`` -> (boundary rank, compression)."""
    rank = None
    if setting.startswith("r") and setting[1:2].isdigit():
        head, _, setting = setting.partition("-")
        rank, setting = int(head[1:]), setting or "none"
    if setting not in SETTINGS:
        raise ValueError(f"unknown compression {setting!r}: choose one of {SETTINGS}")
    return rank, setting


class Boundary(torch.autograd.Function):
    """The identity as two peers see it: hidden states through the wire forward, their
    gradients through the wire backward; ``sent`` counts the bytes of both."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, setting: str, sent: list[int]) -> torch.Tensor:
        ctx.setting, ctx.sent = setting, sent
        return _through_wire(hidden, setting, sent)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _through_wire(grad, ctx.setting, ctx.sent), None, None


def _through_wire(tensor: torch.Tensor, setting: str, sent: list[int]) -> torch.Tensor:
    serialized = wire.serialize(tensor, setting)
    sent[0] += serialized.ByteSize()
    return wire.deserialize(serialized)


def _loss(stages: list[Stage], x, y, setting: str, sent: list[int]) -> torch.Tensor:
    hidden = Boundary.apply(stages[0](x), setting, sent)
    if stages[1].rank is None:
        return stages[1](hidden, y)
    sent[0] += wire.serialize(wire.narrow_ids(x)).ByteSize()  # token ids with the states
    return stages[1](hidden, y, tokens=x)


def train(preset_name: str, setting: str, samples: int, run: int) -> tuple[float, float]:
    """(validation loss after ``samples`` samples, bytes per training sample across the
    boundary) for one setting."""
    model, opt = preset(preset_name)
    rank, setting = parse_setting(setting)
    model = dataclasses.replace(model, boundary_rank=rank)
    stages = [Stage(model, r) for r in even_boundaries(model, 2)]
    optimizers = [StageOptimizer(s, opt) for s in stages]
    corpus = load_corpus()
    data = sample_batches(corpus.train, model.block_size, opt.micro_batch_size, stream_seed(run, 0))
    val = eval_batches(corpus.val, model.block_size, opt.micro_batch_size, 8)
    lowbit.ROUNDING.manual_seed(run)
    sent, seen = [0], 0
    while seen < samples:
        for _ in range(opt.target_batch_size // opt.micro_batch_size):
            x, y = next(data)
            (_loss(stages, x, y, setting, sent) * len(x)).backward()
            seen += len(x)
        for o in optimizers:
            o.accumulated(opt.target_batch_size)
            o.step()
    per_sample = sent[0] / seen
    with torch.no_grad():
        losses = [float(_loss(stages, x, y, setting, [0])) for x, y in val]
    return sum(losses) / len(losses), per_sample


def codec_cost(preset_name: str, repeats: int = 5) -> dict[str, tuple[float, float]]:
    """Per setting: (bytes per sample one way, median ms to encode and decode) for one
    micro-batch of hidden states of ``preset_name``."""
    model, opt = preset(preset_name)
    hidden = torch.randn(opt.micro_batch_size, model.block_size, model.n_embd)
    out = {}
    for setting in SETTINGS:
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            serialized = wire.serialize(hidden, setting)
            wire.deserialize(serialized)
            times.append(1e3 * (time.perf_counter() - started))
        out[setting] = (serialized.ByteSize() / opt.micro_batch_size, statistics.median(times))
    return out


def _fmt(values: list[float], digits: int = 3) -> str:
    med = statistics.median(values)
    if len(values) == 1:
        return f"{med:.{digits}f}"
    return f"{med:.{digits}f} [{min(values):.{digits}f}-{max(values):.{digits}f}]"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="tiny", help="the model trained for the loss")
    p.add_argument("--samples", type=int, default=3200, help="training samples per run")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument(
        "--settings",
        nargs="+",
        default=list(SETTINGS),
        help=f"compressions ({', '.join(SETTINGS)}), or low-rank boundaries r<k>[-<compression>]",
    )
    p.add_argument("--presets", nargs="*", default=["tiny", "small"], help="codec cost of")
    args = p.parse_args()
    for setting in args.settings:
        try:
            parse_setting(setting)
        except ValueError as e:
            p.error(f"--settings {setting}: {e}")
    if "none" not in args.settings:
        args.settings.insert(0, "none")
    torch.set_num_threads(1)  # the settings compete for no cores: figures side by side
    results: dict[str, list[tuple[float, float]]] = {s: [] for s in args.settings}
    for run in range(args.runs):
        for setting in args.settings:
            loss, per_sample = train(args.preset, setting, args.samples, run)
            results[setting].append((loss, per_sample))
            print(f"run {run} {setting}: val {loss:.4f}, {per_sample:.0f} bytes/sample",
                  flush=True)  # fmt: skip
    model, opt = preset(args.preset)
    print(f"\n{args.preset}, 2 stages, {args.samples} samples, {args.runs} runs "
          f"(micro-batch {opt.micro_batch_size}, step {opt.target_batch_size})")  # fmt: skip
    print("| setting | boundary bytes/sample | none / setting | val loss | loss / none |")
    print("|---|---|---|---|---|")
    base = results["none"]
    for setting, runs in results.items():
        per_sample = statistics.median(b for _, b in runs)
        ratio = statistics.median(b for _, b in base) / per_sample
        losses = [loss for loss, _ in runs]
        rel = [loss / b for (loss, _), (b, _) in zip(runs, base, strict=True)]
        print(f"| {setting} | {per_sample:.0f} | {ratio:.1f}x | {_fmt(losses)} "
              f"| {_fmt(rel, 4)} |")  # fmt: skip
    for name in args.presets:
        model, opt = preset(name)
        cost = codec_cost(name)
        print(f"\n{name}: one micro-batch of hidden states ({opt.micro_batch_size} x "
              f"{model.block_size} x {model.n_embd}), one way")  # fmt: skip
        print("| setting | bytes/sample | none / setting | encode + decode ms |")
        print("|---|---|---|---|")
        for setting, (per_sample, ms) in cost.items():
            ratio = cost["none"][0] / per_sample
            print(f"| {setting} | {per_sample:.0f} | {ratio:.1f}x | {ms:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
