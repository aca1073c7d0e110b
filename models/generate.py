"""Sampling text from a model that computes vocabulary logits, one token at a time."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch


@torch.no_grad()
def sample(
    logits_of: Callable[[torch.Tensor], torch.Tensor],
    prompt: torch.Tensor,
    max_new_tokens: int,
    *,
    block_size: int,
    temperature: float = 1.0,
    generator: torch.Generator | None = None,
) -> Iterator[int]:
    """Yield ``max_new_tokens`` tokens after ``prompt`` (token ids (T,)), each drawn from
    the last position's logits (``logits_of``: (1, T) -> (1, T, vocab)) over at most
    ``block_size`` tokens of context. Temperature 0 takes the most likely token, so the
    output is deterministic."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if prompt.dim() != 1 or len(prompt) == 0:
        raise ValueError("the prompt must be a non-empty sequence of token ids")
    context = prompt.clone()
    for _ in range(max_new_tokens):
        logits = logits_of(context[-block_size:].unsqueeze(0))[0, -1].float()  # (vocab,)
        if temperature == 0:
            token = int(logits.argmax())
        else:
            probs = torch.softmax(logits / temperature, dim=-1)
            token = int(torch.multinomial(probs, 1, generator=generator))
        context = torch.cat([context, torch.tensor([token], dtype=context.dtype)])
        yield token
