"""What a stage checkpoint costs: the copy that holds the stage's lock, the write, the
bytes on disk, and the read back, for the first stage of a preset cut in two.

    python -m scripts.bench_checkpoint [--presets small base] [--runs 5]

The copy (``StageAverager.snapshot``: ``node.averaging.state.capture``) is all that stalls
serving; the write runs off the event loop. Each figure is the median of ``--runs`` with
its range, and the copy is printed next to a plain ``clone`` of the parameters and AdamW
moments (the least any in-memory copy can cost) as a ratio.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from models.stages import Stage
from models.training import StageOptimizer
from node.averaging import state as stage_state
from node.daemon import checkpoint
from protocol.run_spec import make_run_spec

OWNER = "12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"


def _stepped(preset: str) -> tuple[object, Stage, StageOptimizer]:
    """Stage 0 of ``preset`` cut in two, after one AdamW step (so its moments exist)."""
    spec = make_run_spec("bench", preset, 2, owner=OWNER)
    module = Stage(spec.model, spec.stage_range(0))
    optimizer = StageOptimizer(module, spec.optim)
    for p in module.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.accumulated(1)
    optimizer.step()
    return spec, module, optimizer


def _median(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} [{min(values):.3f}, {max(values):.3f}]"


def bench(preset: str, runs: int) -> None:
    spec, module, optimizer = _stepped(preset)
    params = sum(p.numel() for p in module.parameters())
    copy_s, clone_s, write_s, read_s, sizes = [], [], [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for epoch in range(runs):
            started = time.perf_counter()
            metadata, tensors = stage_state.capture(
                module, optimizer, epoch=epoch, mode="gradient", peer="bench"
            )
            copy_s.append(time.perf_counter() - started)
            started = time.perf_counter()
            _ = [p.detach().clone() for p in module.parameters()]
            _ += [s[k].clone() for s in optimizer.optimizer.state.values()
                  for k in ("exp_avg", "exp_avg_sq")]  # fmt: skip
            clone_s.append(time.perf_counter() - started)
            started = time.perf_counter()
            path = checkpoint.write(root, spec, 0, metadata, tensors, keep=1)
            write_s.append(time.perf_counter() - started)
            sizes.append(path.stat().st_size)
            started = time.perf_counter()
            checkpoint.read(path, spec, 0)
            read_s.append(time.perf_counter() - started)
    ratio = [c / k for c, k in zip(copy_s, clone_s, strict=True)]
    print(
        f"{preset} stage 0 of 2 ({params / 1e6:.1f}M parameters, "
        f"{statistics.median(sizes) / 2**20:.0f} MiB on disk): "
        f"copy {_median(copy_s)} s (x{statistics.median(ratio):.2f} a plain clone), "
        f"write {_median(write_s)} s, read and check {_median(read_s)} s"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=["small", "base"])
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    for name in args.presets:
        bench(name, args.runs)


if __name__ == "__main__":
    main()
