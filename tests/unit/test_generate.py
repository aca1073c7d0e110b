"""Sampling without a swarm: the sampler's context and draws, and generation through a
stage router (a stub whose logits are the stages composed, as the live stages compute
them) writing what the exported model writes, byte for byte."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from models.config import ModelConfig
from models.generate import Sampler
from models.hf_export import save_hf
from models.stages import Stage, even_boundaries
from node.cli.generate import sample_swarm, sample_text

CFG = ModelConfig(block_size=8, n_layer=3, n_head=2, n_embd=16, init_seed=3)
PROMPT = "def f(x):"  # longer than the block: the context slides from the start


def test_the_sampler_keeps_a_block_of_context_and_draws_the_most_likely_at_temperature_0():
    sampler = Sampler(torch.tensor([1, 2, 3]), block_size=2, temperature=0)
    assert sampler.window().tolist() == [[2, 3]]
    assert sampler.draw(torch.tensor([0.0, 5.0, 1.0])) == 1
    assert sampler.window().tolist() == [[3, 1]] and sampler.tokens.tolist() == [1, 2, 3, 1]
    with pytest.raises(ValueError, match="one position"):
        sampler.draw(torch.zeros(1, 3))
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        Sampler(torch.tensor([1]), block_size=2, temperature=-1)
    with pytest.raises(ValueError, match="non-empty"):
        Sampler(torch.tensor([], dtype=torch.long), block_size=2)


class _Router:
    """What ``sample_swarm`` needs of a ``StageRouter``: the spec's model and the last
    position's logits, here from the stages composed in this process."""

    def __init__(self, stages: list[Stage]) -> None:
        self.stages = stages
        self.spec = SimpleNamespace(model=CFG)
        self.calls = 0

    async def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        x = tokens
        with torch.no_grad():
            for stage in self.stages[:-1]:
                x = stage(x)
            return self.stages[-1].logits(x)[:, -1]  # (B, vocab), as the last stage returns


async def _collect(tokens) -> bytes:
    return b"".join([t async for t in tokens])


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_generation_through_the_stages_writes_what_their_export_writes(
    tmp_path: Path, temperature: float
) -> None:
    stages = [Stage(CFG, r) for r in even_boundaries(CFG, 3)]
    save_hf(tmp_path, {k: v for s in stages for k, v in s.state_dict().items()}, CFG)
    exported = b"".join(sample_text(tmp_path, PROMPT, 12, temperature=temperature, seed=5))
    router = _Router(stages)
    swarm = sample_swarm(router, PROMPT, 12, temperature=temperature, seed=5)  # type: ignore[arg-type]
    assert asyncio.run(_collect(swarm)) == exported and len(exported) == 12
    assert router.calls == 12, "one pass through the stages per token"


def test_bad_input_is_refused_before_the_first_byte(tmp_path: Path) -> None:
    router = _Router([Stage(CFG)])
    with pytest.raises(ValueError, match="--prompt is empty"):
        sample_swarm(router, "", 3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="--max-new-tokens must be >= 0"):
        sample_swarm(router, "x", -1)  # type: ignore[arg-type]
    assert router.calls == 0


def test_drawn_bytes_show_as_utf8_text_whatever_they_are(capsysbinary):
    from node.cli.generate import _Text

    text = _Text()
    for token in (b"x", b"\xe2", b"\x82", b"\xac", b"\x92", b"y"):  # a euro sign, a stray byte
        text.write(token)
    assert capsysbinary.readouterr().out == "x€\ufffdy".encode()
    text.write(b"\xe2")
    text.end()  # a character cut off at the end shows as U+FFFD too
    assert capsysbinary.readouterr().out == "\ufffd\n".encode()
