"""A low-rank stage boundary: hidden states that cross a cut as a few values per token.

With ``ModelConfig.boundary_rank`` = k, the residual stream of width C is split in two.
Its first k coordinates are the trained part: the embedding's and every block's writes
(attention and MLP outputs) land there only. The other C - k coordinates hold a fixed
embedding of each token (and, in the gpt family, of its position): the initial
embedding tables' columns k.., never trained. Every peer builds those tables from
``init_seed`` (``build_block(config, 0)``), so a stage that receives the k trained
values and the token ids rebuilds the whole hidden state exactly: a cut sends k / C of
the values a full-width boundary sends, and no information is lost at the cut. The
layers still read all C coordinates (the fixed part carries each token's identity into
every block), so that a low rank costs less of the loss than a narrower model would
(Pluralis' Protocol Models keep block outputs in a subspace and the token embedding
high-rank for the same reason; here the subspace is the first k axes, so encoding is a
slice). What it still costs is measured in BENCHMARKS.md, "Low-rank boundaries".

``fold`` turns such a model's state dict into a plain one (write rows outside the
subspace zeroed, the fixed columns written into the embedding tables), which computes
the same function without any of this: the model its owner exports is a standard one.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn as nn
import torch.nn.functional as F

from models.config import ModelConfig

# The blocks' projections that write into the residual stream (``models.gpt``).
WRITE_PROJECTIONS = ("attn.proj", "mlp.proj")


class FixedTail(nn.Module):
    """Coordinates k.. of the hidden state entering block 1: the initial embedding's
    token (and position) columns, as buffers that no state dict holds."""

    def __init__(self, wte: torch.Tensor, wpe: torch.Tensor | None, rank: int) -> None:
        super().__init__()
        self.rank = rank
        self.register_buffer("wte", wte[:, rank:].detach().clone(), persistent=False)
        self.register_buffer(
            "wpe", None if wpe is None else wpe[:, rank:].detach().clone(), persistent=False
        )

    @classmethod
    def of(cls, config: ModelConfig) -> FixedTail:
        """The fixed tail of ``config``'s model: the initial embedding block's."""
        from models.gpt import build_block  # which gives the embedding its tail

        if config.boundary_rank is None:
            raise ValueError("the model has no low-rank boundary (boundary_rank is None)")
        return build_block(config, 0).tail

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token ids (B, T) -> the fixed coordinates (B, T, C - k)."""
        tail = self.wte[tokens]
        if self.wpe is not None:
            tail = tail + self.wpe[: tokens.shape[1]]
        return tail


def written(update: torch.Tensor, rank: int | None) -> torch.Tensor:
    """A block's write into the residual stream, kept to the trained coordinates."""
    if rank is None:
        return update
    return F.pad(update[..., :rank], (0, update.shape[-1] - rank))


def encode(hidden: torch.Tensor, rank: int) -> torch.Tensor:
    """Hidden states (B, T, C) -> what crosses the boundary (B, T, k)."""
    return hidden[..., :rank]


def decode(sent: torch.Tensor, tokens: torch.Tensor, tail: FixedTail) -> torch.Tensor:
    """What crossed the boundary (B, T, k) and the token ids (B, T) -> hidden states
    (B, T, C), equal to the sender's."""
    if tokens is None:
        raise ValueError("a low-rank boundary needs the token ids with the hidden states")
    if sent.shape[-1] != tail.rank or tuple(tokens.shape) != tuple(sent.shape[:2]):
        raise ValueError(
            f"expected hidden states (B, T, {tail.rank}) and token ids (B, T), got "
            f"{tuple(sent.shape)} and {tuple(tokens.shape)}"
        )
    return torch.cat([sent, tail(tokens).to(sent.dtype)], dim=-1)


def fold(state: Mapping[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """A whole model's state dict (``Stage(config)``'s names) rewritten so that a model
    without ``boundary_rank`` computes the same function: the write projections' rows
    k.. (and biases) zeroed, the embedding tables' columns k.. set to the fixed tail."""
    rank = config.boundary_rank
    if rank is None:
        return dict(state)
    tail = FixedTail.of(config)
    out = dict(state)
    for name, value in state.items():
        if any(f".{proj}." in f".{name}" for proj in WRITE_PROJECTIONS):
            value = value.clone()
            value[rank:] = 0
            out[name] = value
    for table, fixed in (("wte", tail.wte), ("wpe", tail.wpe)):
        key = f"blocks.0.{table}.weight"
        if fixed is not None and key in out:
            value = out[key].clone()
            value[: len(fixed), rank:] = fixed.to(value.dtype)
            out[key] = value
    return out
