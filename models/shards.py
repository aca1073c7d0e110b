"""Token shards: a run's data tokenized once, cut into files of a fixed number of tokens,
pinned by hash in the run's spec and memory-mapped for reading.

A shard is a bare little-endian array of token ids (``uint16`` when the vocabulary fits,
else ``uint32``): no header, so its size is its token count times the width and numpy
maps it as it is. Shards are named ``train-NNNNN.bin`` and ``val-NNNNN.bin``; every shard
but the last of each split holds exactly ``shard_tokens`` tokens.

Sources are text files (one document each), JSONL files (``*.jsonl``: one document per
line, its text in a field), Parquet files (``*.parquet``, one document per row; needs the
``parquet`` extra, pyarrow) and directories of them. Documents go to validation by a hash
of their name (a file's path under the directory given, ``:LINE`` added for JSONL), so
the split is the same on every machine with the same files; with no document held out,
the tail of the last training tokens is (at most half of them, and 5% of the total).
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from models.pretrained import sha256_of

SHARD_TOKENS = 1 << 20  # 2 MiB of uint16: big enough to hash quickly, small to re-fetch
_VAL_PER_MILLE = 50  # as models.data: 5% of documents go to validation
JSONL_SUFFIXES = (".jsonl", ".ndjson")


@dataclass(frozen=True)
class Shard:
    """One shard as written: its file name, split and tokens."""

    name: str
    split: str  # "train" or "val"
    tokens: np.ndarray  # 1-D, of the dataset's dtype


@dataclass(frozen=True)
class Pinned:
    """A shard as a run's spec records it."""

    name: str
    tokens: int
    sha256: str


def dtype_for(vocab_size: int) -> str:
    """The narrowest shard dtype for token ids below ``vocab_size``."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def read_documents(paths: Sequence[Path], text_field: str = "text") -> Iterator[tuple[str, str]]:
    """(name, text) of every document in ``paths`` (files and directories, in sorted order
    within a directory; hidden files skipped). ``ValueError`` naming the file (and line)
    for text that is not UTF-8, a JSONL line that is not a JSON object with a string
    ``text_field`` (a Parquet row likewise, or pyarrow missing), or a path that does not
    exist."""
    for given in paths:
        root = given.expanduser()
        if root.is_file():
            yield from _file_documents(root, root.name, text_field)
        elif root.is_dir():
            files = sorted(p for p in root.rglob("*") if p.is_file() and not _hidden(p, root))
            for path in files:
                yield from _file_documents(path, path.relative_to(root).as_posix(), text_field)
        else:
            raise ValueError(f"--data {given}: no such file or directory")


def _hidden(path: Path, root: Path) -> bool:
    return any(part.startswith(".") for part in path.relative_to(root).parts)


def _file_documents(path: Path, name: str, text_field: str) -> Iterator[tuple[str, str]]:
    if path.suffix == ".parquet":
        yield from _parquet_documents(path, name, text_field)
        return
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(
            f"{path}: not UTF-8 text (byte {e.start} is {raw[e.start]:#04x})"
        ) from None
    if path.suffix not in JSONL_SUFFIXES:
        yield name, text
        return
    # Lines end at "\n" alone: JSON strings may hold U+2028 and the like unescaped, which
    # str.splitlines would cut.
    for number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as e:
            raise ValueError(f"{path}:{number}: not valid JSON ({e})") from None
        value = record.get(text_field) if isinstance(record, dict) else None
        if not isinstance(value, str):
            raise ValueError(
                f"{path}:{number}: no string field {text_field!r} (choose it with --text-field)"
            )
        yield f"{name}:{number}", value


def _parquet_documents(path: Path, name: str, text_field: str) -> Iterator[tuple[str, str]]:
    """One document per row of a Parquet file's ``text_field`` column (named ``:ROW``)."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(
            f"{path}: reading Parquet needs pyarrow: pip install 'swarmtrain[parquet]'"
        ) from None
    try:
        column = pq.read_table(path, columns=[text_field]).column(text_field).to_pylist()
    except Exception as e:  # pyarrow's errors (ArrowInvalid, ArrowIOError, KeyError) vary
        raise ValueError(
            f"{path}: not a Parquet file with a column {text_field!r} (choose it with "
            f"--text-field): {type(e).__name__}: {e}"
        ) from None
    for row, value in enumerate(column, start=1):
        if not isinstance(value, str):
            raise ValueError(f"{path}: row {row}: {text_field!r} is not a string")
        yield f"{name}:{row}", value


def _is_val(name: str) -> bool:
    return zlib.crc32(name.encode()) % 1000 < _VAL_PER_MILLE


def cut_shards(
    documents: Iterable[tuple[str, str]],
    encode: Callable[[str], np.ndarray],
    vocab_size: int,
    shard_tokens: int = SHARD_TOKENS,
) -> Iterator[Shard]:
    """Tokenize ``documents`` (a newline ends each one that lacks it) and cut each split's
    tokens into shards of ``shard_tokens``, in order. A token id at or above
    ``vocab_size`` is a ``ValueError`` naming the document."""
    dtype = np.dtype(dtype_for(vocab_size)).newbyteorder("<")
    buffers: dict[str, list[np.ndarray]] = {"train": [], "val": []}
    filled = {"train": 0, "val": 0}
    written = {"train": 0, "val": 0}
    held: Shard | None = None  # the newest training shard, kept back for the fallback split

    def take(split: str, n: int) -> np.ndarray:
        joined = np.concatenate(buffers[split]) if buffers[split] else np.empty(0, dtype)
        buffers[split] = [joined[n:]] if len(joined) > n else []
        filled[split] = len(joined) - min(n, len(joined))
        name = f"{split}-{written[split]:05d}.bin"
        written[split] += 1
        return Shard(name, split, joined[:n])

    for name, text in documents:
        ids = encode(text if text.endswith("\n") else text + "\n")
        if len(ids) and int(ids.max()) >= vocab_size:
            raise ValueError(f"{name}: token {int(ids.max())} is outside the vocabulary")
        split = "val" if _is_val(name) else "train"
        buffers[split].append(ids.astype(dtype))
        filled[split] += len(ids)
        while filled[split] >= shard_tokens:
            shard = take(split, shard_tokens)
            if split == "val":
                yield shard
            else:
                if held is not None:
                    yield held
                held = shard
    if filled["val"]:
        yield take("val", filled["val"])
    if filled["train"]:
        if held is not None:
            yield held
        held = take("train", filled["train"])
    if held is None:
        return
    if written["val"]:
        yield held
        return
    total = (written["train"] - 1) * shard_tokens + len(held.tokens)
    cut = len(held.tokens) - min(len(held.tokens) // 2, -(-total * _VAL_PER_MILLE // 1000))
    yield Shard(held.name, "train", held.tokens[:cut])
    yield Shard("val-00000.bin", "val", held.tokens[cut:])


def verify_shards(directory: Path, shards: Iterable[Pinned], itemsize: int) -> None:
    """Check that ``directory`` holds every shard of ``shards`` with its size and sha256.
    ``ValueError`` naming the first shard that is missing or differs."""
    if not directory.is_dir():
        raise ValueError(f"{directory}: no such directory (the run's data shards go there)")
    for shard in shards:
        path = directory / shard.name
        if not path.is_file():
            raise ValueError(f"shard {shard.name} is missing from {directory}")
        size = path.stat().st_size
        if size != shard.tokens * itemsize:
            raise ValueError(
                f"shard {path} differs from the run's: {size} bytes, the run pins "
                f"{shard.tokens * itemsize}"
            )
        found = sha256_of(path)
        if found != shard.sha256:
            raise ValueError(
                f"shard {path} differs from the run's (sha256 {found[:12]}…, the run pins "
                f"{shard.sha256[:12]}…)"
            )


def open_shard(path: Path, dtype: str) -> np.ndarray:
    """A shard's tokens, memory-mapped read-only."""
    return np.memmap(path, dtype=np.dtype(dtype).newbyteorder("<"), mode="r")


class TokenStream:
    """Token arrays (memory-mapped shards, or ranges of them) read as one sequence: what
    ``models.data.sample_batches`` and ``eval_batches`` index instead of a tensor. Only the
    tokens indexed are read."""

    def __init__(self, parts: Sequence[np.ndarray]) -> None:
        self._parts = [p for p in parts if len(p)]
        self._offsets = np.cumsum([0, *(len(p) for p in self._parts)])

    def __len__(self) -> int:
        return int(self._offsets[-1])

    def __getitem__(self, idx: torch.Tensor) -> torch.Tensor:
        """The tokens at positions ``idx`` (any shape), as int64 of that shape."""
        flat = idx.reshape(-1).numpy()
        part = np.searchsorted(self._offsets, flat, side="right") - 1
        out = np.empty(len(flat), dtype=np.int64)
        for p in np.unique(part):
            here = part == p
            out[here] = self._parts[p][flat[here] - self._offsets[p]]
        return torch.from_numpy(out).reshape(idx.shape)
