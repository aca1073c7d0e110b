"""Export to the Hugging Face format: what ``transformers`` loads computes what the
pipeline's stages compute, composed in order; the directory loads back unchanged."""

from __future__ import annotations

import pytest
import torch

from models.config import ModelConfig
from models.hf_export import ExportError, load_hf, save_hf
from models.stages import Stage, even_boundaries

CFG = ModelConfig(block_size=32, n_layer=3, n_head=2, n_embd=32, init_seed=7)


def _trained_stages(config: ModelConfig, n_stages: int) -> list[Stage]:
    """The stages of a cut, with weights moved off their initial values (as training
    would), so that a swapped or untransposed tensor cannot go unnoticed."""
    stages = [Stage(config, r) for r in even_boundaries(config, n_stages)]
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for stage in stages:
            for p in stage.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return stages


def _whole_state(stages: list[Stage]) -> dict[str, torch.Tensor]:
    state = {}
    for stage in stages:
        state.update(stage.state_dict())  # names are the whole model's: blocks.<index>.…
    return state


def test_transformers_loads_the_export_and_computes_the_pipelines_logits(tmp_path):
    transformers = pytest.importorskip("transformers")
    stages = _trained_stages(CFG, 2)
    save_hf(tmp_path / "model", _whole_state(stages), CFG)

    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "model").eval()
    x = torch.randint(0, CFG.vocab_size, (3, CFG.block_size), generator=torch.Generator())
    with torch.no_grad():
        ours = stages[1].logits(stages[0](x))  # the pipeline, stage after stage
        theirs = hf(x).logits
    assert theirs.shape == ours.shape == (3, CFG.block_size, CFG.vocab_size)
    assert torch.allclose(theirs, ours, atol=1e-4), float((theirs - ours).abs().max())


def test_an_export_loads_back_into_the_same_model(tmp_path):
    stages = _trained_stages(CFG, 3)
    state = _whole_state(stages)
    save_hf(tmp_path / "model", state, CFG)
    config, loaded = load_hf(tmp_path / "model")
    assert config == CFG
    assert loaded.keys() == state.keys()
    assert all(torch.equal(loaded[k], state[k]) for k in state)
    whole = Stage(config)
    whole.load_state_dict(loaded)  # strict: every tensor of the whole model is there


def test_bad_exports_and_directories_are_refused(tmp_path):
    state = _whole_state(_trained_stages(CFG, 1))
    del state["blocks.2.attn.qkv.weight"]
    with pytest.raises(ExportError, match="lacks 1 tensors"):
        save_hf(tmp_path / "model", state, CFG)
    assert not (tmp_path / "model" / "model.safetensors").exists()
    with pytest.raises(ExportError, match="bias=False"):
        save_hf(tmp_path / "m2", {}, ModelConfig(bias=False))
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "config.json").write_text("{}")
    with pytest.raises(ExportError, match="not a model exported by swarmtrain"):
        load_hf(tmp_path / "junk")
