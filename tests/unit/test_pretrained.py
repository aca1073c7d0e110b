"""Starting from a local Hugging Face checkpoint: every stage built from it, composed,
computes what ``transformers`` computes; the run exports back into the same format."""

from __future__ import annotations

import json

import pytest
import torch

from models.hf_export import load_hf, save_hf
from models.pretrained import load_into, load_stage_state, read_checkpoint, verify_files
from models.stages import Stage, even_boundaries

transformers = pytest.importorskip("transformers")

from tests.hf_checkpoints import tiny_gpt2, tiny_llama  # noqa: E402  (needs transformers)


def _stages_from(directory, n_stages):
    checkpoint = read_checkpoint(directory)
    stages = []
    for r in even_boundaries(checkpoint.config, n_stages):
        stage = Stage(checkpoint.config, r)
        load_into(stage, load_stage_state(checkpoint, range(r.start, r.end)), str(directory))
        stages.append(stage)
    return checkpoint, stages


def _pipeline_logits(stages, x):
    with torch.no_grad():
        for s in stages[:-1]:
            x = s(x)
        return stages[-1].logits(x)


# Llama 3's stretched rotary frequencies; with an original context of 16 and head size 8,
# one pair is kept, one interpolated and two slowed down.
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}  # fmt: skip


def tiny_llama3(tmp_path):
    return tiny_llama(tmp_path, rope_scaling=LLAMA3, rope_theta=100.0)


@pytest.mark.parametrize("make", [tiny_llama, tiny_llama3, tiny_gpt2])
def test_stages_built_from_a_checkpoint_compute_transformers_logits(tmp_path, make):
    hf, directory = make(tmp_path)
    checkpoint, stages = _stages_from(directory, 3)
    assert checkpoint.architecture == hf.config.architectures[0]
    assert set(checkpoint.files) == {"config.json", "model.safetensors"}
    x = torch.randint(0, hf.config.vocab_size, (2, 24), generator=torch.Generator())
    with torch.no_grad():
        theirs = hf(x).logits
    ours = _pipeline_logits(stages, x)
    assert ours.shape == theirs.shape
    assert torch.allclose(ours, theirs, atol=1e-4), float((ours - theirs).abs().max())


def test_a_stage_reads_only_its_own_tensors(tmp_path, monkeypatch):
    _, directory = tiny_llama(tmp_path)
    checkpoint = read_checkpoint(directory)
    read = []
    from safetensors import safe_open

    class Spy:
        def __init__(self, *a, **k):
            self.f = safe_open(*a, **k)

        def __enter__(self):
            self.inner = self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def keys(self):
            return self.inner.keys()

        def get_tensor(self, name):
            read.append(name)
            return self.inner.get_tensor(name)

    monkeypatch.setattr("models.pretrained.safe_open", Spy)
    state = load_stage_state(checkpoint, range(2, 3))  # the second decoder layer only
    assert sorted(state) == sorted(Stage(checkpoint.config, (2, 3)).state_dict())
    assert read and all(name.startswith("model.layers.1.") for name in read), read


def test_a_llama_run_exports_as_a_llama_that_transformers_loads(tmp_path):
    _, directory = tiny_llama3(tmp_path)
    checkpoint, stages = _stages_from(directory, 2)
    with torch.no_grad():  # as training would move them
        for s in stages:
            for p in s.parameters():
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(2)) * 0.02)
    state = {k: v for s in stages for k, v in s.state_dict().items()}
    save_hf(tmp_path / "out", state, checkpoint.config)
    meta = json.loads((tmp_path / "out" / "config.json").read_text())
    assert meta["architectures"] == ["LlamaForCausalLM"]
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "out").eval()
    x = torch.randint(0, 96, (2, 20), generator=torch.Generator())
    with torch.no_grad():
        theirs = hf(x).logits
    ours = _pipeline_logits(stages, x)
    assert torch.allclose(ours, theirs, atol=1e-4), float((ours - theirs).abs().max())
    config, loaded = load_hf(tmp_path / "out")
    assert config == checkpoint.config
    assert all(torch.equal(loaded[k], state[k]) for k in state)
    # The export is itself a checkpoint a run can start from.
    assert read_checkpoint(tmp_path / "out").config == checkpoint.config


def test_a_tied_checkpoint_starts_both_ends_from_the_embedding(tmp_path):
    hf, directory = tiny_gpt2(tmp_path)  # GPT-2 ties its head (no lm_head.weight stored)
    checkpoint, stages = _stages_from(directory, 2)
    assert checkpoint.tied and not checkpoint.config.tie_embeddings
    head = stages[-1].blocks[str(checkpoint.config.n_blocks - 1)].lm_head.weight
    assert torch.equal(head, hf.transformer.wte.weight)
    assert head.data_ptr() != stages[0].blocks["0"].wte.weight.data_ptr()


def test_a_changed_or_missing_file_is_named(tmp_path):
    _, directory = tiny_llama(tmp_path)
    files = read_checkpoint(directory).files
    verify_files(directory, files)
    (directory / "config.json").write_text((directory / "config.json").read_text() + " ")
    with pytest.raises(ValueError, match=r"config.json: differs from the run's checkpoint"):
        verify_files(directory, files)
    (directory / "model.safetensors").unlink()
    with pytest.raises(ValueError, match=r"model.safetensors: missing"):
        verify_files(directory, {"model.safetensors": files["model.safetensors"]})


def test_bad_checkpoints_get_one_line_naming_the_file_and_problem(tmp_path):
    _, directory = tiny_llama(tmp_path)
    config = directory / "config.json"
    meta = json.loads(config.read_text())

    def rewritten(**changes) -> str:
        config.write_text(json.dumps(meta | changes))
        with pytest.raises(ValueError) as e:
            read_checkpoint(directory)
        assert "\n" not in str(e.value)
        return str(e.value)

    err = rewritten(architectures=["MistralForCausalLM"])
    assert str(config) in err and "MistralForCausalLM is not supported" in err
    assert "LlamaForCausalLM, GPT2LMHeadModel" in err
    err = rewritten(hidden_size=30)
    assert str(config) in err and "hidden_size (30)" in err and "num_attention_heads (4)" in err
    err = rewritten(num_key_value_heads=3)
    assert str(config) in err and "n_head (4) must be divisible by n_kv_head (3)" in err
    err = rewritten(rope_scaling={"rope_type": "yarn", "factor": 8.0})
    assert "rope_scaling" in err and "not supported" in err
    err = rewritten(rope_scaling={"rope_type": "llama3", "factor": 8.0})
    assert str(config) in err and "lacks 'low_freq_factor'" in err

    # A checkpoint that lacks a tensor: named, with the file it looked in.
    config.write_text(json.dumps(meta))
    from safetensors.torch import load_file, save_file

    weights = load_file(str(directory / "model.safetensors"))
    del weights["model.layers.2.mlp.up_proj.weight"]
    save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
    err = rewritten()
    assert "model.layers.2.mlp.up_proj.weight" in err and "model.safetensors" in err
