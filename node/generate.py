"""``swarmtrain generate``: sample text from an exported model (no swarm needed)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from models.generate import sample
from models.hf_export import load_gpt2
from models.stages import Stage


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, type=Path, help="a directory `export` wrote")
    p.add_argument("--prompt", required=True, help="the text to continue")
    p.add_argument("--max-new-tokens", type=int, default=200, help="bytes to generate")
    p.add_argument("--temperature", type=float, default=0.8, help="0: always the most likely byte")
    p.add_argument("--seed", type=int, default=0, help="of the draws (temperature > 0)")


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
