"""``swarmtrain generate``: sample text from an exported model (no swarm needed)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

from models.generate import sample
from models.hf_export import load_gpt2
from models.stages import Stage


def sample_text(
    model_dir: Path, prompt: str, max_new_tokens: int, *, temperature: float = 1.0, seed: int = 0
) -> Iterator[bytes]:
    """The bytes an exported model (``swarmtrain export``) writes after ``prompt``, one
    token (a byte) at a time; the same ``seed`` gives the same text."""
    if max_new_tokens < 0:
        raise ValueError(f"--max-new-tokens must be >= 0, got {max_new_tokens}")
    config, state = load_gpt2(model_dir)
    model = Stage(config)
    model.load_state_dict(state)
    model.eval()
    tokens = sample(
        model.logits,
        torch.tensor(list(prompt.encode()), dtype=torch.long),  # bytes are tokens
        max_new_tokens,
        block_size=config.block_size,
        temperature=temperature,
        generator=torch.Generator().manual_seed(seed),
    )
    for token in tokens:
        yield bytes([token])


def run(args: argparse.Namespace) -> int:
    tokens = sample_text(
        args.model, args.prompt, args.max_new_tokens, temperature=args.temperature, seed=args.seed
    )
    out = sys.stdout.buffer
    out.write(args.prompt.encode())
    for token in tokens:
        out.write(token)
        out.flush()
    out.write(b"\n")
    out.flush()
    return 0
