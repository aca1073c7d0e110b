"""The whole model in the Hugging Face format, and back.

A ``gpt`` model is GPT-2's architecture (learned positions, pre-norm LayerNorm blocks,
GELU MLP, fused QKV, untied head) and is written as ``GPT2LMHeadModel``; a ``llama``
model as ``LlamaForCausalLM``. Either is ``config.json`` plus ``model.safetensors``; how
names and shapes map is ``models.hf_format``'s. Nothing here imports ``transformers``:
the format is plain JSON and safetensors.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from models.boundary import fold
from models.config import ModelConfig
from models.hf_format import hf_config, tensor_map

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"


class ExportError(ValueError):
    """A model that cannot be written in the format, or a directory that is not one of ours."""


def to_hf(state: Mapping[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """The whole model's state dict (``blocks.<index>.…``, as ``models.stages.Stage``
    names it) in the Hugging Face architecture's names. A model with a low-rank boundary
    is written as the plain model that computes the same (``models.boundary.fold``).
    ``ExportError`` if a block is missing or the model cannot be written."""
    _config_json(config)
    tensors = tensor_map(config, range(config.n_blocks))
    missing = sorted(t.ours for t in tensors if t.ours not in state)
    if missing:
        raise ExportError(f"the model's state lacks {len(missing)} tensors, e.g. {missing[0]}")
    state = fold(state, config)
    out = {}
    for t in tensors:
        out.update(t.split(state[t.ours].detach().float().cpu()))
    return out


def from_hf(weights: Mapping[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """The inverse of ``to_hf``: a whole-model state dict for ``Stage(config)``."""
    tensors = tensor_map(config, range(config.n_blocks))
    missing = sorted(name for t in tensors for name in t.theirs if name not in weights)
    if missing:
        raise ExportError(f"the weights lack {len(missing)} tensors, e.g. {missing[0]}")
    return {t.ours: t.join(weights.__getitem__) for t in tensors}


def save_hf(directory: Path, state: Mapping[str, torch.Tensor], config: ModelConfig) -> None:
    """Write ``config.json`` and ``model.safetensors`` into ``directory`` (created), each
    file atomically (written beside, then renamed)."""
    weights = to_hf(state, config)
    directory.mkdir(parents=True, exist_ok=True)
    _atomic(directory / WEIGHTS_FILE, lambda path: save_file(weights, str(path)))
    text = json.dumps(_config_json(config), indent=2) + "\n"
    _atomic(directory / CONFIG_FILE, lambda path: path.write_text(text))


def load_hf(directory: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """A directory ``save_hf`` wrote: its ``ModelConfig`` and whole-model state dict."""
    try:
        meta = json.loads((directory / CONFIG_FILE).read_text())
        config = ModelConfig(**meta["swarmtrain"])
        weights = load_file(str(directory / WEIGHTS_FILE))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ExportError(f"{directory} is not a model exported by swarmtrain: {e}") from None
    return config, from_hf(weights, config)


def _config_json(config: ModelConfig) -> dict:
    try:
        return hf_config(config)
    except ValueError as e:
        raise ExportError(str(e)) from None


def _atomic(path: Path, write) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    os.close(fd)
    try:
        write(Path(tmp))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
