"""What a Llama-family block has that a GPT-2 block has not: RMSNorm and rotary positions.

The blocks themselves are ``models.gpt``'s, which pick these by ``ModelConfig.family``:
a Llama decoder block is the same pre-norm residual block with RMSNorm in place of
LayerNorm, rotary position embeddings applied to queries and keys in place of a learned
position table, grouped-query attention (``n_kv_head``) and a SwiGLU MLP.
"""

from __future__ import annotations

import torch
import torch.nn as nn


class RMSNorm(nn.Module):
    """``x / rms(x) * weight`` over the last dimension, computed in float32 (a bf16 mean
    of squares loses the small activations) and returned in the input's dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


def rotary_tables(
    t: int, head_dim: int, theta: float, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (T, head_dim) of positions 0..t-1. Frequency ``i`` of ``head_dim / 2``
    turns by ``theta ** (-2i / head_dim)`` radians per position; each is used twice, for
    the pair (i, i + head_dim / 2) that ``rotate`` turns together. Recomputed per call:
    a few thousand multiplies, and no buffer to keep on the right device and dtype."""
    inv_freq = 1.0 / theta ** (
        torch.arange(0, head_dim, 2, device=device, dtype=torch.int64).float() / head_dim
    )  # (hs/2,)
    angles = torch.outer(torch.arange(t, device=device).float(), inv_freq)  # (T, hs/2)
    angles = torch.cat([angles, angles], dim=-1)  # (T, hs)
    return angles.cos(), angles.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate queries or keys (B, nh, T, hs) by their positions' angles: the first and
    second halves of the head dimension are the two coordinates of each rotated pair
    (the layout Hugging Face's Llama checkpoints are stored in)."""
    first, second = x.chunk(2, dim=-1)
    turned = torch.cat([-second, first], dim=-1)  # (B, nh, T, hs)
    return (x * cos + turned * sin).to(x.dtype)
