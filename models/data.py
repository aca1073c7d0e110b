"""Byte-level text data: the default corpus, a deterministic split, and seeded samplers.

The default corpus is the Python standard library's own ``.py`` files: present on every
machine that runs this project, so nothing is downloaded. Tokens are bytes (vocabulary 256).
"""

from __future__ import annotations

import itertools
import os
import sysconfig
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypeAlias

import torch

if TYPE_CHECKING:
    from models.shards import TokenStream

# What the samplers index: bytes as a uint8 tensor, or a run's shards.
Tokens: TypeAlias = "torch.Tensor | TokenStream"

STDLIB = "stdlib"
_VAL_PER_MILLE = 50  # 5% of files (or bytes, for a single file) go to validation


class DataError(ValueError):
    """The data source is missing, unreadable or too small."""


@dataclass(frozen=True)
class Corpus:
    """Training and validation tokens of one source: uint8 tensors of bytes, or a run's
    shards (``models.shards.TokenStream``); the samplers index either alike."""

    source: str
    train: Tokens
    val: Tokens
    n_files: int


def _stdlib_files() -> tuple[Path, list[Path]]:
    """The standard library's ``.py`` files; installed packages (``site-packages``, which
    can hold far more files than the library itself) are not walked."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files: list[Path] = []
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = [d for d in subfolders if d != "site-packages"]
        files.extend(Path(folder, n) for n in names if n.endswith(".py"))
    return root, files


def _text_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and not p.name.startswith(".")]


def _is_val(rel_path: str) -> bool:
    return zlib.crc32(rel_path.encode()) % 1000 < _VAL_PER_MILLE


def load_corpus(source: str | Path = STDLIB, min_bytes: int = 4096) -> Corpus:
    """Read ``source``: ``"stdlib"``, a text file, or a directory of text files.

    Files are split into train and validation by a hash of their relative path, so the
    split is the same on every machine with the same files; a single file is split by
    position (its last 5% is validation).
    """
    if str(source) == STDLIB:
        root, files = _stdlib_files()
    else:
        root = Path(source).expanduser()
        if root.is_file():
            data = _read(root)
            cut = len(data) - len(data) * _VAL_PER_MILLE // 1000
            return _corpus(str(root), data[:cut], data[cut:], 1, min_bytes)
        if not root.is_dir():
            raise DataError(f"data source {str(source)!r} is neither a file nor a directory")
        files = _text_files(root)
    train, val = bytearray(), bytearray()
    for path in sorted(files):
        (val if _is_val(path.relative_to(root).as_posix()) else train).extend(_read(path))
    if not val and train:  # few files: keep the split by moving the tail of train
        cut = len(train) - len(train) * _VAL_PER_MILLE // 1000
        train, val = train[:cut], train[cut:]
    return _corpus(str(source), bytes(train), bytes(val), len(files), min_bytes)


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise DataError(f"cannot read data file {path}: {e.strerror}") from e


def _corpus(source: str, train: bytes, val: bytes, n_files: int, min_bytes: int) -> Corpus:
    if len(train) < min_bytes or not val:
        raise DataError(
            f"data source {source!r} is too small: {len(train)} training bytes and {len(val)} "
            f"validation bytes from {n_files} file(s); need at least {min_bytes} training bytes"
        )
    return Corpus(source, _as_tensor(train), _as_tensor(val), n_files)


def _as_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def stream_seed(seed: int, stream: int) -> int:
    """A distinct, reproducible seed for sampler ``stream`` (e.g. one per trainer) of a run."""
    return zlib.crc32(f"{seed}/{stream}".encode())


def sample_batches(
    data: Tokens, block_size: int, batch_size: int, seed: int, start: int = 0
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless random windows: inputs (B, T) and next-byte targets (B, T), as int64, from
    batch ``start`` on. Batch ``i`` depends on ``seed`` and ``i`` alone, so a reader that
    drew ``n`` batches goes on where it stopped with ``start=n``."""
    if len(data) <= block_size + 1:
        raise DataError(f"{len(data)} tokens are too few for windows of {block_size + 1}")
    gen = torch.Generator()
    for i in itertools.count(start):
        gen.manual_seed(zlib.crc32(f"{seed}#{i}".encode()))
        starts = torch.randint(0, len(data) - block_size - 1, (batch_size,), generator=gen)
        yield _windows(data, starts, block_size)


def eval_batches(
    data: Tokens, block_size: int, batch_size: int, n_batches: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Fixed, evenly spaced windows: the same validation set on every machine."""
    n = batch_size * n_batches
    starts = torch.linspace(0, len(data) - block_size - 2, n).long()
    return [_windows(data, starts[i : i + batch_size], block_size) for i in range(0, n, batch_size)]


def _windows(
    data: Tokens, starts: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    idx = starts[:, None] + torch.arange(block_size + 1)  # (B, T+1)
    chunk = data[idx].long()
    return chunk[:, :-1], chunk[:, 1:]  # (B, T), (B, T)
