"""What training a stage holds in memory, counted without allocating anything."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from models.config import ModelConfig
from models.stages import Stage, StageRange

GIB = 1024**3


@dataclass(frozen=True)
class StageMemory:
    """Bytes one peer needs to train a stage in float32: its weights, their gradients,
    and AdamW's two moments per weight. Activations come on top (they grow with the
    micro-batch and the context, and bf16 autocast on CUDA halves them). ``fixed``: values
    of buffers that are not trained (a low-rank boundary's fixed embedding columns)."""

    parameters: int
    fixed: int = 0

    @property
    def weights(self) -> int:
        return 4 * self.parameters

    @property
    def gradients(self) -> int:
        return 4 * self.parameters

    @property
    def optimizer(self) -> int:
        return 8 * self.parameters  # exp_avg and exp_avg_sq

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer + 4 * self.fixed


def stage_memory(config: ModelConfig, blocks: StageRange | tuple[int, int]) -> StageMemory:
    """The memory of training ``blocks`` of ``config``; built on the meta device, so a
    1B model's stage is counted in milliseconds and no memory."""
    with torch.device("meta"):
        module = Stage(config, blocks)
    return StageMemory(
        sum(p.numel() for p in module.parameters()), sum(b.numel() for b in module.buffers())
    )
