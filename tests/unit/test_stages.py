"""Stages cut from a model compose to exactly the whole model."""

import pytest
import torch

from models.config import ModelConfig, preset
from models.stages import Stage, even_boundaries, validate_boundaries
from models.training import pipeline_loss

CFG = ModelConfig(block_size=16, n_layer=4, n_head=2, n_embd=16, vocab_size=256)


def _batch(cfg, b=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, cfg.vocab_size, (b, cfg.block_size), generator=g)
    y = torch.randint(0, cfg.vocab_size, (b, cfg.block_size), generator=g)
    return x, y


@pytest.mark.parametrize(
    "cuts",
    [
        [(0, 6)],
        [(0, 1), (1, 6)],
        [(0, 3), (3, 6)],
        [(0, 5), (5, 6)],
        [(0, 2), (2, 4), (4, 6)],
        [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5), (5, 6)],
    ],
)
def test_stages_equal_whole_model_in_float64(cuts):
    whole = Stage(CFG).double()
    stages = [Stage(CFG, c).double() for c in cuts]
    x, y = _batch(CFG)

    # Built independently, every stage already holds the whole model's initial weights.
    full_state = whole.state_dict()
    for s in stages:
        for name, t in s.state_dict().items():
            assert torch.equal(t, full_state[name]), name

    ref = whole(x, y)
    ref.backward()
    out = pipeline_loss(stages, x, y)
    out.backward()
    assert torch.allclose(out, ref, atol=1e-6, rtol=0)
    grads = {n: p.grad for s in stages for n, p in s.named_parameters()}
    assert set(grads) == {n for n, _ in whole.named_parameters()}
    for n, p in whole.named_parameters():
        assert torch.allclose(grads[n], p.grad, atol=1e-6, rtol=0), n


def test_stage_contract():
    first, middle, last = (Stage(CFG, c) for c in [(0, 2), (2, 4), (4, 6)])
    x, y = _batch(CFG)
    h = first(x)
    assert h.shape == (3, CFG.block_size, CFG.n_embd) and h.dtype == torch.float32
    h2 = middle(h)
    assert h2.shape == h.shape
    loss = last(h2, y)
    assert loss.dim() == 0
    assert first.takes_tokens and not first.returns_loss and last.returns_loss
    with pytest.raises(ValueError, match="needs targets"):
        last(h2)


@pytest.mark.parametrize(
    "cuts, message",
    [
        ([(0, 3), (3, 3), (3, 6)], r"stage 1 \[3, 3\) is empty"),
        ([(0, 4), (3, 6)], r"stage 1 \[3, 6\) overlaps the previous stage, which ends at 4"),
        ([(0, 3), (3, 7)], r"stage 1 \[3, 7\) is out of range \[0, 6\)"),
        ([(0, 2), (3, 6)], r"leaves blocks 2..2 in no stage"),
        ([(0, 3), (3, 5)], r"stages end at block 5, but the model has 6 blocks"),
        ([(1, 6)], r"leaves blocks 0..0 in no stage"),
        ([], "at least one stage"),
    ],
)
def test_bad_boundaries_name_the_numbers(cuts, message):
    with pytest.raises(ValueError, match=message):
        validate_boundaries(CFG, cuts)


def test_tied_embeddings_cannot_be_cut_but_work_whole():
    tied = ModelConfig(block_size=8, n_layer=2, n_head=2, n_embd=8, tie_embeddings=True)
    with pytest.raises(ValueError, match="tie_embeddings"):
        validate_boundaries(tied, [(0, 2), (2, 4)])
    model = Stage(tied)
    assert model.blocks["3"].lm_head.weight is model.blocks["0"].wte.weight
    x, y = _batch(tied)
    model(x, y).backward()


def test_even_boundaries():
    assert [(r.start, r.end) for r in even_boundaries(CFG, 2)] == [(0, 3), (3, 6)]
    assert len(even_boundaries(CFG, 4)) == 4
    with pytest.raises(ValueError, match=r"n_stages must be in 1..n_layer \(4\), got 5"):
        even_boundaries(CFG, 5)


def test_config_checks_name_the_setting():
    with pytest.raises(ValueError, match=r"n_embd \(10\) must be divisible by n_head \(3\)"):
        ModelConfig(n_embd=10, n_head=3)
    with pytest.raises(ValueError, match="unknown preset"):
        preset("huge")


def test_preset_sizes():
    def n_params(name):
        # On the meta device: shapes only, no 130M weights to allocate and initialise.
        with torch.device("meta"):
            return sum(p.numel() for p in Stage(preset(name)[0]).parameters())

    assert n_params("tiny") < 1_000_000
    assert 10e6 <= n_params("small") <= 20e6
    assert 110e6 <= n_params("base") <= 140e6
