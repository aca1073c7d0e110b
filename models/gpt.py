"""The blocks of a decoder, built one at a time so any stage can build its own.

One set of blocks for both families of ``ModelConfig.family``: ``gpt`` (GPT-2: learned
positions, LayerNorm, GELU MLP, multi-head attention) and ``llama`` (rotary positions,
RMSNorm, SwiGLU MLP, grouped-query attention; the pieces GPT-2 lacks are in
``models.llama``). Both are the same pre-norm residual stack, so they share the
embedding, block, attention, MLP and head modules and differ only where the family says.

Each block's initial weights come from a generator seeded by ``(init_seed, block index)``,
so a peer that builds only blocks 3..5 gets exactly the weights the whole model has there.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from models.boundary import FixedTail, decode, encode, written
from models.config import ModelConfig
from models.llama import RMSNorm, rotary_tables, rotate


def norm(config: ModelConfig) -> nn.Module:
    """The family's normalisation over the hidden dimension."""
    if config.family == "llama":
        return RMSNorm(config.n_embd, config.norm_eps)
    return nn.LayerNorm(config.n_embd, eps=config.norm_eps, bias=config.bias)


class Embedding(nn.Module):
    """Block 0: token ids (B, T) -> hidden states (B, T, C)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        # Learned absolute positions (gpt); llama turns queries and keys by position instead.
        self.wpe = (
            nn.Embedding(config.block_size, config.n_embd) if config.family == "gpt" else None
        )
        self.drop = nn.Dropout(config.dropout)
        # With a low-rank boundary: columns k.. of the initial tables, kept fixed in
        # place of the trained ones (``models.boundary``); set by ``build_block``.
        self.tail: FixedTail | None = None

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        _, t = idx.shape
        if t > self.config.block_size:
            raise ValueError(f"sequence length {t} exceeds block_size {self.config.block_size}")
        x = self.wte(idx)  # (B, T, C)
        if self.wpe is not None:
            x = x + self.wpe(torch.arange(t, device=idx.device))
        x = self.drop(x)
        if self.tail is not None:  # the trained columns, then the fixed ones
            x = decode(encode(x, self.tail.rank), idx, self.tail)
        return x


class CausalSelfAttention(nn.Module):
    """Causal attention with ``n_head`` query heads sharing ``kv_heads`` key/value heads
    (as many in gpt; fewer in llama with ``n_kv_head``), queries, keys and values from one
    fused projection, rotary positions in llama."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.n_head, self.kv_heads, self.head_dim = config.n_head, config.kv_heads, config.head_dim
        self.rope_theta = config.rope_theta if config.family == "llama" else None
        self.rope_scaling = config.rope_scaling
        kv_width = self.kv_heads * self.head_dim
        self.split = (config.n_embd, kv_width, kv_width)
        self.qkv = nn.Linear(config.n_embd, sum(self.split), bias=config.bias)
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = config.dropout
        self.resid_drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(self.split, dim=2)
        q = q.view(b, t, self.n_head, self.head_dim).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)  # (B, nkv, T, hs)
        v = v.view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)  # (B, nkv, T, hs)
        if self.rope_theta is not None:
            cos, sin = rotary_tables(
                t, self.head_dim, self.rope_theta, x.device, self.rope_scaling
            )  # (T, hs)
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        if self.kv_heads != self.n_head:  # each key/value head serves a group of query heads
            k = k.repeat_interleave(self.n_head // self.kv_heads, dim=1)  # (B, nh, T, hs)
            v = v.repeat_interleave(self.n_head // self.kv_heads, dim=1)  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(b, t, c)  # (B, T, C)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    """gpt: ``proj(gelu(fc(x)))``. llama (SwiGLU): ``fc`` computes the gate and the up
    projection at once (in that order), and ``proj(silu(gate) * up)``."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gated = config.family == "llama"
        self.approximate = "tanh" if config.activation == "gelu_tanh" else "none"
        width = config.mlp_width
        self.fc = nn.Linear(config.n_embd, 2 * width if self.gated else width, bias=config.bias)
        self.proj = nn.Linear(width, config.n_embd, bias=config.bias)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)  # (B, T, 2W) gated, else (B, T, W)
        if self.gated:
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up  # (B, T, W)
        else:
            h = F.gelu(h, approximate=self.approximate)
        return self.drop(self.proj(h))  # (B, T, C)


class TransformerBlock(nn.Module):
    """A pre-norm block: hidden states (B, T, C) -> hidden states (B, T, C)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.ln_1 = norm(config)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = norm(config)
        self.mlp = MLP(config)
        self.rank = config.boundary_rank  # writes only coordinates 0..rank-1 when set

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + written(self.attn(self.ln_1(x)), self.rank)
        return x + written(self.mlp(self.ln_2(x)), self.rank)


class Head(nn.Module):
    """The last block: hidden states (B, T, C) and targets (B, T) -> mean cross-entropy."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.ln_f = norm(config)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))  # (B, T, vocab)

    def forward(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.logits(x)
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def build_block(config: ModelConfig, index: int) -> nn.Module:
    """Block ``index`` of the model, initialised from ``(config.init_seed, index)``."""
    if not 0 <= index < config.n_blocks:
        raise ValueError(f"block index {index} out of range 0..{config.n_blocks - 1}")
    if index == 0:
        block: nn.Module = Embedding(config)
    elif index == config.n_blocks - 1:
        block = Head(config)
    else:
        block = TransformerBlock(config)
    gen = torch.Generator().manual_seed(config.init_seed * 1_000_003 + index)
    _init_weights(block, config, gen)
    if isinstance(block, Embedding) and config.boundary_rank is not None:
        wpe = block.wpe.weight if block.wpe is not None else None
        block.tail = FixedTail(block.wte.weight, wpe, config.boundary_rank)
    return block


def _init_weights(block: nn.Module, config: ModelConfig, gen: torch.Generator) -> None:
    # GPT-2 init: N(0, 0.02), residual projections scaled down by depth so the residual
    # stream's variance does not grow with the number of layers.
    for name, p in sorted(block.named_parameters()):
        if p.dim() < 2 and "weight" in name:  # LayerNorm or RMSNorm gain
            nn.init.ones_(p)
        elif p.dim() < 2:  # biases
            nn.init.zeros_(p)
        else:
            std = 0.02
            if name.endswith("proj.weight"):
                std = 0.02 / math.sqrt(2 * config.n_layer)
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=gen) * std)
