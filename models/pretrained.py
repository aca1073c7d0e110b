"""Starting from a local Hugging Face checkpoint: its config, its files' hashes, and the
tensors of one stage.

A checkpoint is a directory with ``config.json`` and one or more ``*.safetensors`` files
(sharded or not; any index file is not needed: each file's header lists its tensors).
Its files are pinned by sha256 (``file_hashes``), so that every peer of a run starts
from the same weights; a peer checks its own copy (``verify_files``) before it loads
from it. A stage reads only its own tensors (``load_stage_state``): safetensors files
are opened lazily, so a stage of a 1B model never holds the whole file in memory.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from models.config import ModelConfig
from models.hf_format import SUPPORTED, HFTensor, model_config, tensor_map

CONFIG_FILE = "config.json"
_CHUNK = 1 << 20


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint directory as a run records it."""

    directory: Path
    architecture: str  # e.g. "LlamaForCausalLM"
    config: ModelConfig
    tied: bool  # its head is its embedding (the run unties them: both start from it)
    files: dict[str, str]  # file name -> sha256 hex, config.json and every *.safetensors


def read_checkpoint(directory: Path) -> Checkpoint:
    """Read and hash the checkpoint in ``directory``, and check that it holds every tensor
    its model needs (by name: none is read). ``ValueError``, one line naming the file, if
    the directory is not a checkpoint of a supported architecture."""
    meta = _read_config(directory)
    config, tied = model_config(meta, str(directory / CONFIG_FILE))
    weights = _weight_files(directory)
    files = {p.name: sha256_of(p) for p in [directory / CONFIG_FILE, *weights]}
    arch = next(a for a in meta["architectures"] if a in SUPPORTED)
    checkpoint = Checkpoint(directory, arch, config, tied, files)
    _check_tensors(checkpoint)
    return checkpoint


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def verify_files(directory: Path, files: Mapping[str, str]) -> None:
    """Check that ``directory`` holds exactly the checkpoint files ``files`` pins (name ->
    sha256). ``ValueError`` naming the first file that is missing or differs."""
    if not directory.is_dir():
        raise ValueError(f"{directory}: no such directory (the run's checkpoint goes there)")
    for name, digest in sorted(files.items()):
        path = directory / name
        if not path.is_file():
            raise ValueError(f"{path}: missing (the run's checkpoint has it)")
        found = sha256_of(path)
        if found != digest:
            raise ValueError(
                f"{path}: differs from the run's checkpoint (sha256 {found[:12]}…, the run "
                f"pins {digest[:12]}…)"
            )


def load_stage_state(checkpoint: Checkpoint, blocks: range) -> dict[str, torch.Tensor]:
    """The tensors of ``blocks`` (a stage's state dict, whole-model names, float32) read
    from ``checkpoint``; nothing else is read. ``ValueError`` naming the directory and
    tensor when one is missing."""
    where = _tensor_index(checkpoint.directory)
    with ExitStack() as stack:
        files: dict[str, Any] = {}

        def read(stored: str) -> torch.Tensor:
            name = where[stored]
            if name not in files:
                path = checkpoint.directory / name
                files[name] = stack.enter_context(safe_open(str(path), framework="pt"))
            return files[name].get_tensor(stored).float()

        return {
            t.ours: t.join(lambda name, t=t: read(_stored(where, checkpoint.directory, t, name)))
            for t in tensor_map(checkpoint.config, blocks, tied=checkpoint.tied)
        }


def load_into(module: torch.nn.Module, state: Mapping[str, torch.Tensor], source: str) -> None:
    """Copy ``state`` into ``module`` (a ``Stage``): every parameter must be there with its
    shape; ``ValueError`` naming ``source`` otherwise."""
    own = module.state_dict()
    missing = sorted(set(own) - set(state))
    if missing:
        raise ValueError(f"{source}: no tensor for {missing[0]} ({len(missing)} missing)")
    for name, tensor in state.items():
        if name in own and own[name].shape != tensor.shape:
            raise ValueError(
                f"{source}: {name} has shape {tuple(tensor.shape)}, the model needs "
                f"{tuple(own[name].shape)}"
            )
    module.load_state_dict({k: v for k, v in state.items() if k in own})


def _read_config(directory: Path) -> dict:
    path = directory / CONFIG_FILE
    if not directory.is_dir():
        raise ValueError(f"{directory}: no such directory")
    try:
        meta = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{path}: missing (a Hugging Face checkpoint has one)") from None
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not a JSON config ({e})") from None
    if not isinstance(meta, dict):
        raise ValueError(f"{path}: not a JSON object")
    return meta


def _weight_files(directory: Path) -> list[Path]:
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{directory}: no *.safetensors files (only safetensors are read)")
    return files


def _tensor_index(directory: Path) -> dict[str, str]:
    """Tensor name -> the file holding it, from the files' headers."""
    where = {}
    for path in _weight_files(directory):
        try:
            with safe_open(str(path), framework="pt") as f:
                where.update(dict.fromkeys(f.keys(), path.name))
        except Exception as e:  # safetensors raises its own error types
            raise ValueError(f"{path}: not a safetensors file ({e})") from None
    return where


def _stored(where: Mapping[str, str], directory: Path, t: HFTensor, name: str) -> str:
    """The name under which the checkpoint stores ``name`` (one of ``t.theirs``): itself,
    or without GPT-2's ``transformer.`` prefix (a checkpoint saved from ``GPT2Model`` has
    none), or else ``t.fallback``'s. ``ValueError`` naming the files if none is there."""
    fallback = t.fallback if len(t.theirs) == 1 else None
    for candidate in (name, fallback):
        for stored in (candidate, candidate and candidate.removeprefix("transformer.")):
            if stored is not None and stored in where:
                return stored
    raise ValueError(
        f"{directory}: no tensor {name!r} in {', '.join(sorted(set(where.values())))} "
        f"(needed for {t.ours})"
    )


def _check_tensors(checkpoint: Checkpoint) -> None:
    """Every tensor the model needs is in the checkpoint (names only: nothing is read)."""
    where = _tensor_index(checkpoint.directory)
    for t in tensor_map(checkpoint.config, range(checkpoint.config.n_blocks), tied=checkpoint.tied):
        for name in t.theirs:
            _stored(where, checkpoint.directory, t, name)
