"""Llama-family blocks: cut into stages like GPT, each stage building only its own
blocks, and the stages composed are exactly the whole model."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from models.config import PRESETS, ModelConfig, preset
from models.stages import Stage, even_boundaries
from models.training import StageOptimizer, pipeline_loss

CFG = ModelConfig(
    family="llama", bias=False, block_size=16, n_layer=4, n_head=4, n_kv_head=2, n_embd=32
)


def test_llama_stages_composed_are_the_whole_model():
    whole = Stage(CFG)
    x = torch.randint(0, CFG.vocab_size, (2, CFG.block_size), generator=torch.Generator())
    with torch.no_grad():
        expected = whole.logits(x)
        for n in (2, 3):
            stages = [Stage(CFG, r) for r in even_boundaries(CFG, n)]
            for s in stages:  # each stage built only its blocks, with the whole's weights
                assert set(s.state_dict()) < set(whole.state_dict())
                assert all(torch.equal(v, whole.state_dict()[k]) for k, v in s.state_dict().items())
            h = x
            for s in stages[:-1]:
                h = s(h)
            assert torch.equal(stages[-1].logits(h), expected)
            assert torch.equal(pipeline_loss(stages, x, x), whole(x, x))


def test_llama_attention_is_causal_and_uses_positions():
    whole = Stage(CFG)
    x = torch.randint(0, CFG.vocab_size, (1, CFG.block_size), generator=torch.Generator())
    y = x.clone()
    y[0, -1] = (y[0, -1] + 1) % CFG.vocab_size
    with torch.no_grad():
        a, b = whole.logits(x), whole.logits(y)
        assert torch.equal(a[:, :-1], b[:, :-1])  # a later token changes no earlier logit
        # Without a position table, only rotary embeddings tell positions apart: the same
        # token at two positions after the same prefix gets different logits.
        same = torch.full((1, 4), 7)
        out = whole.logits(same)
        assert not torch.allclose(out[0, 1], out[0, 3])


def test_llama_trains_through_the_stage_optimizer():
    stages = [Stage(CFG, r) for r in even_boundaries(CFG, 2)]
    opts = [StageOptimizer(s, preset("llama-tiny")[1]) for s in stages]
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 16, (4, CFG.block_size), generator=g)  # a small, learnable alphabet
    losses = []
    for _ in range(30):
        loss = pipeline_loss(stages, x[:, :-1], x[:, 1:])
        (loss * len(x)).backward()
        for o in opts:
            o.accumulated(len(x))
            o.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < losses[0] - 1.0, losses


@pytest.mark.parametrize("name", [n for n in PRESETS if n.startswith("llama-")])
def test_llama_presets_are_the_size_they_are_named(name):
    model, _ = preset(name)
    with torch.device("meta"):
        n = sum(p.numel() for p in Stage(model).parameters())
    size = name.removeprefix("llama-")
    expected = {"tiny": 0.23e6, "20m": 20e6, "125m": 125e6, "350m": 350e6, "1b": 1.1e9}[size]
    assert 0.9 * expected < n < 1.1 * expected, n


def test_bad_llama_configs_say_what_to_change():
    with pytest.raises(ValueError, match=r"n_head \(4\) must be divisible by n_kv_head \(3\)"):
        ModelConfig(family="llama", n_head=4, n_kv_head=3, n_embd=32)
    with pytest.raises(ValueError, match="even head size"):
        ModelConfig(family="llama", n_head=4, n_embd=36)
    with pytest.raises(ValueError, match="n_kv_head.*needs family='llama'"):
        ModelConfig(n_kv_head=2)
    with pytest.raises(ValueError, match="family must be one of gpt, llama"):
        ModelConfig(family="mamba")
    with pytest.raises(ValueError, match="rope_scaling.*needs family='llama'"):
        ModelConfig(rope_scaling=(8.0, 1.0, 4.0, 8192))
    with pytest.raises(ValueError, match="0 < low_freq_factor < high_freq_factor"):
        ModelConfig(family="llama", bias=False, rope_scaling=(8.0, 4.0, 1.0, 8192))


def test_gpt_configs_keep_the_dict_they_had():
    """Specs are signed: a GPT config written today is the one written before the llama
    settings existed, and one that sets them round-trips."""
    assert set(ModelConfig().to_dict()) == {
        "vocab_size", "block_size", "n_layer", "n_head", "n_embd", "dropout", "bias",
        "tie_embeddings", "init_seed",
    }  # fmt: skip
    assert ModelConfig(**CFG.to_dict()) == CFG
    assert CFG.to_dict()["family"] == "llama"
    scaled = dataclasses.replace(CFG, rope_scaling=(8.0, 1.0, 4.0, 8192))
    assert ModelConfig(**json.loads(json.dumps(scaled.to_dict()))) == scaled  # a list in JSON
