"""What a Llama-family block has that a GPT-2 block has not: RMSNorm and rotary positions.

The blocks themselves are ``models.gpt``'s, which pick these by ``ModelConfig.family``:
a Llama decoder block is the same pre-norm residual block with RMSNorm in place of
LayerNorm, rotary position embeddings applied to queries and keys in place of a learned
position table, grouped-query attention (``n_kv_head``) and a SwiGLU MLP.
"""

from __future__ import annotations

import math

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


def rotary_frequencies(
    head_dim: int,
    theta: float,
    scaling: tuple[float, float, float, int] | None,
    device: torch.device,
) -> torch.Tensor:
    """Radians per position of each of the ``head_dim / 2`` rotated pairs: pair ``i`` turns
    by ``theta ** (-2i / head_dim)``.

    With Llama 3's ``scaling`` (factor, low, high, original context L), a pair whose
    wavelength (2 pi / frequency) is longer than L / low was rarely seen turning in
    pre-training and is slowed down by ``factor``; one shorter than L / high is kept; in
    between, the frequency moves linearly in L / wavelength from the slowed one to the
    kept one."""
    exponents = torch.arange(0, head_dim, 2, device=device, dtype=torch.int64).float() / head_dim
    freq = 1.0 / theta**exponents  # (hs/2,)
    if scaling is None:
        return freq
    factor, low, high, original = scaling
    turns = original * freq / (2 * math.pi)  # L / wavelength: turns within the old context
    kept = ((turns - low) / (high - low)).clamp(0.0, 1.0)  # 0: slowed, 1: kept
    return freq * kept + freq / factor * (1.0 - kept)


def rotary_tables(
    t: int,
    head_dim: int,
    theta: float,
    device: torch.device,
    scaling: tuple[float, float, float, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (T, head_dim) of positions 0..t-1 (``rotary_frequencies``); each
    frequency is used twice, for the pair (i, i + head_dim / 2) that ``rotate`` turns
    together. Recomputed per call: a few thousand multiplies, and no buffer to keep on
    the right device and dtype."""
    freq = rotary_frequencies(head_dim, theta, scaling, device)  # (hs/2,)
    angles = torch.outer(torch.arange(t, device=device).float(), freq)  # (T, hs/2)
    angles = torch.cat([angles, angles], dim=-1)  # (T, hs)
    return angles.cos(), angles.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate queries or keys (B, nh, T, hs) by their positions' angles: the first and
    second halves of the head dimension are the two coordinates of each rotated pair
    (the layout Hugging Face's Llama checkpoints are stored in)."""
    first, second = x.chunk(2, dim=-1)
    turned = torch.cat([-second, first], dim=-1)  # (B, nh, T, hs)
    return (x * cos + turned * sin).to(x.dtype)
