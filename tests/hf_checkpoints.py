"""Small Hugging Face checkpoints made by ``transformers`` itself (random weights, saved
with ``save_pretrained``): the reference the pretrained-start tests compare against.
Import only where ``transformers`` is installed (a dev dependency)."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers


def tiny_llama(tmp_path: Path, **overrides) -> tuple[transformers.LlamaForCausalLM, Path]:
    """A 3-layer Llama with grouped-query attention, saved in ``tmp_path / "llama"``."""
    settings = dict(
        vocab_size=96, hidden_size=32, intermediate_size=80, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        rms_norm_eps=1e-6, rope_theta=5000.0, tie_word_embeddings=False,
    )  # fmt: skip
    config = transformers.LlamaConfig(**(settings | overrides))
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    _perturb_norms(model)
    model.save_pretrained(tmp_path / "llama")
    return model, tmp_path / "llama"


def tiny_gpt2(tmp_path: Path) -> tuple[transformers.GPT2LMHeadModel, Path]:
    """A 3-layer GPT-2 (tanh GELU, tied head), saved in ``tmp_path / "gpt2"``."""
    config = transformers.GPT2Config(
        vocab_size=80, n_positions=32, n_embd=32, n_layer=3, n_head=4, initializer_range=0.2
    )  # GPT-2's defaults otherwise: gelu_new, tied head; weights large enough that exact
    # GELU in place of its tanh approximation would show in the logits
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    _perturb_norms(model)
    model.save_pretrained(tmp_path / "gpt2")
    return model, tmp_path / "gpt2"


def _perturb_norms(model) -> None:
    """Norm gains start at 1 and biases at 0: moved, a swapped one cannot go unnoticed."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
