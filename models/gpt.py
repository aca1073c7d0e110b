"""The blocks of a GPT-style decoder, built one at a time so any stage can build its own.

Each block's initial weights come from a generator seeded by ``(init_seed, block index)``,
so a peer that builds only blocks 3..5 gets exactly the weights the whole model has there.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from models.config import ModelConfig


class Embedding(nn.Module):
    """Block 0: token ids (B, T) -> hidden states (B, T, C)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        _, t = idx.shape
        if t > self.config.block_size:
            raise ValueError(f"sequence length {t} exceeds block_size {self.config.block_size}")
        pos = torch.arange(t, device=idx.device)
        return self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, C)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = config.dropout
        self.resid_drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q = q.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(b, t, c)  # (B, T, C)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))  # (B, T, C)


class TransformerBlock(nn.Module):
    """A pre-norm block: hidden states (B, T, C) -> hidden states (B, T, C)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Head(nn.Module):
    """The last block: hidden states (B, T, C) and targets (B, T) -> mean cross-entropy."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
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
    return block


def _init_weights(block: nn.Module, config: ModelConfig, gen: torch.Generator) -> None:
    # GPT-2 init: N(0, 0.02), residual projections scaled down by depth so the residual
    # stream's variance does not grow with the number of layers.
    for name, p in sorted(block.named_parameters()):
        if p.dim() < 2 and "weight" in name:  # LayerNorm gain
            nn.init.ones_(p)
        elif p.dim() < 2:  # biases
            nn.init.zeros_(p)
        else:
            std = 0.02
            if name.endswith("proj.weight"):
                std = 0.02 / math.sqrt(2 * config.n_layer)
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=gen) * std)
