"""Cutting a model into pipeline stages: contiguous ranges of blocks.

Stage 0 takes token ids; middle stages take and return hidden states; the last stage
takes hidden states and targets and returns the loss. Running the stages one after
another is exactly the whole model, because the whole model *is* the one-stage cut.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from models.boundary import FixedTail, decode, encode
from models.config import ModelConfig
from models.gpt import Head, build_block


@dataclass(frozen=True)
class StageRange:
    """Blocks ``start`` (inclusive) to ``end`` (exclusive) of a model."""

    start: int
    end: int

    def __len__(self) -> int:
        return self.end - self.start


def validate_boundaries(
    config: ModelConfig, ranges: list[tuple[int, int]] | list[StageRange]
) -> tuple[StageRange, ...]:
    """Check that ``ranges`` cut the model's blocks into contiguous, non-empty stages."""
    stages = tuple(r if isinstance(r, StageRange) else StageRange(*r) for r in ranges)
    if not stages:
        raise ValueError("a model needs at least one stage, got none")
    n = config.n_blocks
    expected_start = 0
    for i, s in enumerate(stages):
        if s.start < 0 or s.end > n:
            raise ValueError(f"stage {i} [{s.start}, {s.end}) is out of range [0, {n})")
        if s.end <= s.start:
            raise ValueError(f"stage {i} [{s.start}, {s.end}) is empty")
        if s.start < expected_start:
            raise ValueError(
                f"stage {i} [{s.start}, {s.end}) overlaps the previous stage, which ends at "
                f"{expected_start}"
            )
        if s.start > expected_start:
            raise ValueError(
                f"stage {i} [{s.start}, {s.end}) leaves blocks {expected_start}..{s.start - 1} "
                "in no stage"
            )
        expected_start = s.end
    if expected_start != n:
        raise ValueError(f"stages end at block {expected_start}, but the model has {n} blocks")
    if config.tie_embeddings and len(stages) > 1:
        raise ValueError(
            f"tie_embeddings=True needs embedding and head in one stage, got {len(stages)} "
            "stages; set tie_embeddings=False to cut the model"
        )
    return stages


def even_boundaries(config: ModelConfig, n_stages: int) -> tuple[StageRange, ...]:
    """Spread the transformer blocks evenly; the embedding rides with the first stage and
    the head with the last, since each costs less than a transformer block."""
    if not 1 <= n_stages <= config.n_layer:
        raise ValueError(f"n_stages must be in 1..n_layer ({config.n_layer}), got {n_stages}")
    cuts = [1 + round(i * config.n_layer / n_stages) for i in range(n_stages + 1)]
    cuts[0], cuts[-1] = 0, config.n_blocks
    return validate_boundaries(config, list(zip(cuts[:-1], cuts[1:], strict=True)))


class Stage(nn.Module):
    """The blocks of one stage. Parameter names are the same as in the whole model
    (``blocks.<index>.…``), so a stage's state dict is a slice of the model's."""

    def __init__(self, config: ModelConfig, blocks: StageRange | tuple[int, int] | None = None):
        super().__init__()
        rng = StageRange(*blocks) if isinstance(blocks, tuple) else blocks
        rng = rng or StageRange(0, config.n_blocks)
        if not 0 <= rng.start < rng.end <= config.n_blocks:
            raise ValueError(
                f"stage [{rng.start}, {rng.end}) is empty or out of range [0, {config.n_blocks})"
            )
        self.config = config
        self.range = rng
        indices = range(rng.start, rng.end)
        self.blocks = nn.ModuleDict({str(i): build_block(config, i) for i in indices})
        if config.tie_embeddings and self.takes_tokens and self.returns_loss:
            self.blocks[str(rng.end - 1)].lm_head.weight = self.blocks[str(rng.start)].wte.weight
        # A low-rank boundary (``models.boundary``): a stage that takes hidden states
        # takes their trained coordinates and rebuilds the rest from the token ids.
        self.rank = config.boundary_rank
        self.tail = FixedTail.of(config) if self.rank and not self.takes_tokens else None

    @property
    def takes_tokens(self) -> bool:
        return self.range.start == 0

    @property
    def returns_loss(self) -> bool:
        return self.range.end == self.config.n_blocks

    def forward(
        self,
        x: torch.Tensor,
        targets: torch.Tensor | None = None,
        tokens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Token ids (B, T) or hidden states (B, T, W) in; hidden states (B, T, W) or the
        loss out. W is ``config.boundary_width``; with a low-rank boundary a stage that
        takes hidden states also takes the sequences' token ids ``tokens`` (B, T)."""
        x = self._widen(x, tokens)
        for block in self.blocks.values():
            if isinstance(block, Head):
                if targets is None:
                    raise ValueError("the last stage needs targets to compute the loss")
                return block(x, targets)
            x = block(x)
        return encode(x, self.rank) if self.rank else x

    def logits(self, x: torch.Tensor, tokens: torch.Tensor | None = None) -> torch.Tensor:
        """The vocabulary logits (B, T, vocab), for a stage that holds the head."""
        x = self._widen(x, tokens)
        for block in self.blocks.values():
            x = block.logits(x) if isinstance(block, Head) else block(x)
        return x

    def _widen(self, x: torch.Tensor, tokens: torch.Tensor | None) -> torch.Tensor:
        return decode(x, tokens, self.tail) if self.tail is not None else x
