"""``swarmtrain generate``: sample text from an exported model (no swarm needed)."""

from __future__ import annotations

import argparse
import sys

import torch

from models.generate import sample
from models.hf_export import load_gpt2
from models.stages import Stage


def run(args: argparse.Namespace) -> int:
    if args.max_new_tokens < 0:
        raise ValueError(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
    config, state = load_gpt2(args.model)
    model = Stage(config)
    model.load_state_dict(state)
    model.eval()
    prompt = torch.tensor(list(args.prompt.encode()), dtype=torch.long)  # bytes are tokens
    generator = torch.Generator().manual_seed(args.seed)
    out = sys.stdout.buffer
    out.write(args.prompt.encode())
    tokens = sample(
        model.logits,
        prompt,
        args.max_new_tokens,
        block_size=config.block_size,
        temperature=args.temperature,
        generator=generator,
    )
    for token in tokens:
        out.write(bytes([token]))
        out.flush()
    out.write(b"\n")
    out.flush()
    return 0
