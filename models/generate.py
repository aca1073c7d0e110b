"""Sampling text from a model that computes vocabulary logits, one token at a time.

``Sampler`` holds no model: it says which context to compute the next logits on
(``window``) and draws the next token from them (``draw``). A model in this process
(``sample``) and the stages of a live swarm (``swarmtrain generate --run``, whose logits
arrive over the network) drive the same sampler, so both draw alike from equal logits.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch


class Sampler:
    """The tokens so far and the draws: ``prompt`` (token ids (T,)) continued one token
    per ``draw``, over at most ``block_size`` tokens of context. Temperature 0 takes the
    most likely token, so the output is deterministic; above 0, draws come from
    ``generator`` (the same seed gives the same tokens)."""

    def __init__(
        self,
        prompt: torch.Tensor,
        *,
        block_size: int,
        temperature: float = 1.0,
        generator: torch.Generator | None = None,
    ) -> None:
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        if prompt.dim() != 1 or len(prompt) == 0:
            raise ValueError("the prompt must be a non-empty sequence of token ids")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.temperature = temperature
        self.generator = generator
        self.tokens = prompt.clone()  # (T,) the prompt and every token drawn since

    def window(self) -> torch.Tensor:
        """The context of the next token's logits: the last ``block_size`` tokens, (1, T)."""
        return self.tokens[-self.block_size :].unsqueeze(0)

    def draw(self, logits: torch.Tensor) -> int:
        """Draw the next token from ``logits`` (vocab,), the last position's logits over
        ``window()``, and append it."""
        if logits.dim() != 1:
            raise ValueError(f"expected the logits of one position (vocab,), got {logits.shape}")
        logits = logits.float()
        if self.temperature == 0:
            token = int(logits.argmax())
        else:
            probs = torch.softmax(logits / self.temperature, dim=-1)
            token = int(torch.multinomial(probs, 1, generator=self.generator))
        self.tokens = torch.cat([self.tokens, torch.tensor([token], dtype=self.tokens.dtype)])
        return token


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
    the last position's logits (``logits_of``: (1, T) -> (1, T, vocab)) by a ``Sampler``."""
    sampler = Sampler(prompt, block_size=block_size, temperature=temperature, generator=generator)
    for _ in range(max_new_tokens):
        yield sampler.draw(logits_of(sampler.window())[0, -1])  # (vocab,)
