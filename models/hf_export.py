"""The whole model in the Hugging Face format, and back.

The GPT preset is GPT-2's architecture (learned positions, pre-norm LayerNorm blocks,
exact GELU MLP, fused QKV, untied head), so its weights map onto ``GPT2LMHeadModel``:
``config.json`` plus ``model.safetensors``. GPT-2 keeps its linear layers as ``Conv1D``
(weights stored ``(in, out)``), so those are transposed on the way out and back. Nothing
here imports ``transformers``: the format is plain JSON and safetensors.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from models.config import ModelConfig

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
LAYER_NORM_EPS = 1e-5  # torch.nn.LayerNorm's default, which the blocks use

# (our name within a transformer block, GPT-2's name within ``transformer.h.<i>``, transposed)
_BLOCK = (
    ("ln_1.weight", "ln_1.weight", False),
    ("ln_1.bias", "ln_1.bias", False),
    ("attn.qkv.weight", "attn.c_attn.weight", True),
    ("attn.qkv.bias", "attn.c_attn.bias", False),
    ("attn.proj.weight", "attn.c_proj.weight", True),
    ("attn.proj.bias", "attn.c_proj.bias", False),
    ("ln_2.weight", "ln_2.weight", False),
    ("ln_2.bias", "ln_2.bias", False),
    ("mlp.fc.weight", "mlp.c_fc.weight", True),
    ("mlp.fc.bias", "mlp.c_fc.bias", False),
    ("mlp.proj.weight", "mlp.c_proj.weight", True),
    ("mlp.proj.bias", "mlp.c_proj.bias", False),
)


class ExportError(ValueError):
    """A model that cannot be written as GPT-2, or a directory that is not one of ours."""


def _check(config: ModelConfig) -> None:
    if not config.bias:
        raise ExportError("GPT-2 has biases in every layer: a model with bias=False has none")
    if config.tie_embeddings:
        raise ExportError("tied embeddings are not exported (GPT2LMHeadModel would tie them)")


def gpt2_config(config: ModelConfig) -> dict:
    """``config.json`` for ``GPT2LMHeadModel``, plus our own settings under ``swarmtrain``
    (so that the directory loads back into the same ``ModelConfig``)."""
    _check(config)
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": config.vocab_size,
        "n_positions": config.block_size,
        "n_ctx": config.block_size,
        "n_embd": config.n_embd,
        "n_layer": config.n_layer,
        "n_head": config.n_head,
        "n_inner": 4 * config.n_embd,
        "activation_function": "gelu",  # exact GELU (F.gelu), not GPT-2's tanh approximation
        "resid_pdrop": config.dropout,
        "embd_pdrop": config.dropout,
        "attn_pdrop": config.dropout,
        "layer_norm_epsilon": LAYER_NORM_EPS,
        "scale_attn_weights": True,
        "tie_word_embeddings": False,
        "bos_token_id": None,
        "eos_token_id": None,
        "torch_dtype": "float32",
        "swarmtrain": config.to_dict(),
    }


def to_gpt2(state: Mapping[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """The whole model's state dict (``blocks.<index>.…``, as ``models.stages.Stage``
    names it) as ``GPT2LMHeadModel``'s. Raises ``ExportError`` if a block is missing."""
    _check(config)
    head = config.n_blocks - 1
    names = {
        "transformer.wte.weight": ("blocks.0.wte.weight", False),
        "transformer.wpe.weight": ("blocks.0.wpe.weight", False),
        "transformer.ln_f.weight": (f"blocks.{head}.ln_f.weight", False),
        "transformer.ln_f.bias": (f"blocks.{head}.ln_f.bias", False),
        "lm_head.weight": (f"blocks.{head}.lm_head.weight", False),
    }
    for i in range(1, config.n_layer + 1):
        for ours, theirs, transposed in _BLOCK:
            names[f"transformer.h.{i - 1}.{theirs}"] = (f"blocks.{i}.{ours}", transposed)
    missing = sorted(ours for ours, _ in names.values() if ours not in state)
    if missing:
        raise ExportError(f"the model's state lacks {len(missing)} tensors, e.g. {missing[0]}")
    out = {}
    for theirs, (ours, transposed) in names.items():
        t = state[ours].detach().float().cpu()
        out[theirs] = (t.t() if transposed else t).contiguous()
    return out


def from_gpt2(weights: Mapping[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """The inverse of ``to_gpt2``: a whole-model state dict for ``Stage(config)``."""
    head = config.n_blocks - 1
    pairs = {
        "blocks.0.wte.weight": ("transformer.wte.weight", False),
        "blocks.0.wpe.weight": ("transformer.wpe.weight", False),
        f"blocks.{head}.ln_f.weight": ("transformer.ln_f.weight", False),
        f"blocks.{head}.ln_f.bias": ("transformer.ln_f.bias", False),
        f"blocks.{head}.lm_head.weight": ("lm_head.weight", False),
    }
    for i in range(1, config.n_layer + 1):
        for ours, theirs, transposed in _BLOCK:
            pairs[f"blocks.{i}.{ours}"] = (f"transformer.h.{i - 1}.{theirs}", transposed)
    missing = sorted(theirs for theirs, _ in pairs.values() if theirs not in weights)
    if missing:
        raise ExportError(f"the weights lack {len(missing)} tensors, e.g. {missing[0]}")
    return {
        ours: (weights[theirs].t() if transposed else weights[theirs]).contiguous()
        for ours, (theirs, transposed) in pairs.items()
    }


def save_gpt2(directory: Path, state: Mapping[str, torch.Tensor], config: ModelConfig) -> None:
    """Write ``config.json`` and ``model.safetensors`` into ``directory`` (created), each
    file atomically (written beside, then renamed)."""
    weights = to_gpt2(state, config)
    directory.mkdir(parents=True, exist_ok=True)
    _atomic(directory / WEIGHTS_FILE, lambda path: save_file(weights, str(path)))
    text = json.dumps(gpt2_config(config), indent=2) + "\n"
    _atomic(directory / CONFIG_FILE, lambda path: path.write_text(text))


def load_gpt2(directory: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """A directory ``save_gpt2`` wrote: its ``ModelConfig`` and whole-model state dict."""
    try:
        meta = json.loads((directory / CONFIG_FILE).read_text())
        config = ModelConfig(**meta["swarmtrain"])
        weights = load_file(str(directory / WEIGHTS_FILE))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ExportError(f"{directory} is not a model exported by swarmtrain: {e}") from None
    return config, from_gpt2(weights, config)


def _atomic(path: Path, write) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    os.close(fd)
    try:
        write(Path(tmp))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
