"""What this machine can do: its device, its compute throughput per stage, its bandwidth.

Throughput is measured once per device and model (forward + backward of a micro-batch
through each stage) and cached, since a ``base`` stage takes a while on a CPU.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch

from models.memory import stage_memory as count_stage_memory
from models.stages import Stage
from node.files import write_atomic
from protocol.run_spec import RunSpec

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Device:
    name: str  # "cpu", "cuda", "mps"
    description: str  # shown to others, e.g. "cuda:NVIDIA H200"

    @property
    def torch(self) -> torch.device:
        return torch.device(self.name)


def autocast_for(device: torch.device):
    """bf16 autocast on CUDA (tensor cores, half the activation memory); none elsewhere."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return nullcontext()


def pick_device(choice: str = "auto") -> Device:
    """``auto`` picks CUDA, then MPS, then the CPU; an explicit choice must be available."""
    if choice not in ("auto", "cpu", "cuda", "mps"):
        raise ValueError(f"device must be auto, cpu, cuda or mps, got {choice!r}")
    cuda, mps = torch.cuda.is_available(), torch.backends.mps.is_available()
    if choice == "cuda" and not cuda or choice == "mps" and not mps:
        raise ValueError(
            f"--device {choice}: torch sees no {choice.upper()} device on this machine; "
            "use --device auto (or cpu)"
        )
    if choice == "cuda" or choice == "auto" and cuda:
        return Device("cuda", f"cuda:{torch.cuda.get_device_name()}"[:64])
    if choice == "mps" or choice == "auto" and mps:
        return Device("mps", "mps")
    return Device("cpu", f"cpu:{torch.get_num_threads()}t")


# What training a stage holds (``models.memory``: float32 weights, gradients and the two
# Adam moments) times this, for activations and kept forward graphs.
MEMORY_MARGIN = 1.5


def stage_memory(spec: RunSpec, stage: int) -> int:
    """Bytes that training ``stage`` needs, margin included; counted on the meta device,
    so that nothing is allocated."""
    return int(count_stage_memory(spec.model, spec.stage_range(stage)).total * MEMORY_MARGIN)


def free_memory(device: Device) -> int:
    """Bytes free for another stage: the GPU's own memory, else the machine's."""
    if device.name == "cuda":
        return torch.cuda.mem_get_info()[0]
    return psutil.virtual_memory().available


def measure_stage(spec: RunSpec, stage: int, device: Device, min_time_s: float = 0.5) -> float:
    """Samples/s of forward + backward of one micro-batch through ``stage`` on ``device``."""
    model, optim = spec.model, spec.optim
    module = Stage(model, spec.stage_range(stage)).to(device.torch)
    b, t = optim.micro_batch_size, model.block_size
    if module.takes_tokens:
        x = torch.randint(0, model.vocab_size, (b, t), device=device.torch)
    else:
        x = torch.randn(b, t, model.boundary_width, device=device.torch, requires_grad=True)
    y = torch.randint(0, model.vocab_size, (b, t), device=device.torch)
    tokens = None if module.tail is None else y  # a low-rank boundary's token ids

    def step() -> None:
        with autocast_for(device.torch):
            out = module(x, y, tokens) if module.returns_loss else module(x, tokens=tokens)
        out.backward(torch.ones_like(out))

    step()  # warm-up: allocations, kernel selection
    n, started = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - started) < min_time_s or n < 2:
        step()
        n += 1
    if device.name == "cuda":
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - started
    return n * b / elapsed


def stage_kind(spec: RunSpec, stage: int) -> tuple[bool, int, bool]:
    """What a stage computes: whether it embeds, how many blocks it has, whether it has
    the head. Stages of one kind do the same work, so they run at the same speed."""
    r = spec.stage_range(stage)
    return r.start == 0, len(r), r.end == spec.model.n_blocks


# A cached throughput is checked against a quick measurement of one stage at every start;
# this far off (a factor, either way), the machine is not what it was when the figure was
# measured (measured under load, or a new driver, or now under load) and every stage is
# measured again.
FAR_FACTOR = 3.0
QUICK_CHECK_S = 0.1


def stage_throughputs(
    spec: RunSpec, device: Device, cache_dir: Path | None, *, remeasure: bool = False
) -> list[float]:
    """Throughput of every stage of ``spec`` on ``device``, from the cache when measured before.

    Each kind of stage is measured once and its figure given to every stage of that kind:
    separate measurements of the same work differ by a few percent of noise, which the
    stage prices would take for a real difference and place peers by.

    A cached figure is used only if a quick measurement of one stage (a few passes,
    ``quick_check``) is within ``FAR_FACTOR`` of it; else, or with ``remeasure``, every
    kind is measured again and the cache updated.
    """
    key = hashlib.sha256(
        json.dumps([device.description, spec.arch, spec.boundaries, spec.optimizer]).encode()
    ).hexdigest()[:16]
    cache = cache_dir / "throughput.json" if cache_dir else None
    try:
        cached = json.loads(cache.read_text()) if cache and cache.exists() else {}
    except (OSError, ValueError):  # unreadable: measured again and rewritten
        cached = {}
    kinds = [stage_kind(spec, s) for s in range(spec.n_stages)]
    first = {k: kinds.index(k) for k in kinds}
    if key in cached and not remeasure:
        figures = cached[key]
        quick = quick_check(spec, device)
        if _within(figures[0], quick):
            return figures
        logger.info(
            "the cached throughput of stage 0 (%.1f samples/s) is more than %gx off a quick "
            "check (%.1f samples/s): measuring again",
            figures[0],
            FAR_FACTOR,
            quick,
        )
    logger.info(
        "measuring compute throughput of %d stages (%d kinds) on %s",
        spec.n_stages,
        len(first),
        device.name,
    )
    measured = {k: round(measure_stage(spec, s, device), 3) for k, s in first.items()}
    result = [measured[k] for k in kinds]
    if cache:
        cached[key] = result
        write_atomic(cache, json.dumps(cached, indent=1).encode())
    return result


def quick_check(spec: RunSpec, device: Device) -> float:
    """Samples/s of stage 0, from a warm-up and a few passes (a fraction of a second on
    the presets): rough, but enough to tell a figure that is several times off."""
    return measure_stage(spec, 0, device, min_time_s=QUICK_CHECK_S)


def _within(cached: float, quick: float) -> bool:
    if not (cached > 0 and quick > 0):
        return False
    return 1 / FAR_FACTOR <= quick / cached <= FAR_FACTOR
