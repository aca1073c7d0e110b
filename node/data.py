"""A run's data on disk: writing its shards once (``swarmtrain run create --data``) and
opening a trainer's copy of them, checked against the spec's hashes first.

The format and the reading are ``models.shards``'s; this module adds the files (written
atomically) and the spec's records of them (``protocol.run_spec.DatasetSpec``).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from pathlib import Path

from models.data import Corpus, load_corpus
from models.pretrained import sha256_of
from models.shards import (
    SHARD_TOKENS,
    Pinned,
    TokenStream,
    cut_shards,
    dtype_for,
    open_shard,
    read_documents,
    verify_shards,
)
from models.tokenizer import TOKENIZER_FILE, FileTokenizer, load_tokenizer
from node.files import write_atomic
from protocol.data_split import TokenRange
from protocol.run_spec import DatasetSpec, RunSpec, ShardSpec, TokenizerSpec

logger = logging.getLogger(__name__)
SHARDS = "shards"  # a sharded run's ``RunSpec.data``


def write_dataset(
    paths: Sequence[Path],
    out: Path,
    *,
    text_field: str = "text",
    tokenizer: Path | None = None,
    min_tokens: int = 2,
    shard_tokens: int = SHARD_TOKENS,
) -> DatasetSpec:
    """Tokenize the documents of ``paths`` (``models.shards.read_documents``) with
    ``tokenizer`` (a ``tokenizer.json``; None: bytes) into shards written atomically in
    ``out`` (with a copy of the tokenizer), and the spec's record of them. ``ValueError``
    naming the file for bad input, or when a split has fewer than ``min_tokens`` tokens."""
    tok = load_tokenizer(tokenizer)
    tokenizer_spec = None
    if isinstance(tok, FileTokenizer):
        raw = tok.path.read_bytes()
        write_atomic(out / TOKENIZER_FILE, raw)
        tokenizer_spec = TokenizerSpec(
            sha256=hashlib.sha256(raw).hexdigest(), vocab_size=tok.vocab_size
        )
    splits: dict[str, list[ShardSpec]] = {"train": [], "val": []}
    documents = read_documents(paths, text_field)
    for shard in cut_shards(documents, tok.encode, tok.vocab_size, shard_tokens):
        if not len(shard.tokens):
            continue
        data = shard.tokens.tobytes()
        write_atomic(out / shard.name, data)
        digest = hashlib.sha256(data).hexdigest()
        splits[shard.split].append(
            ShardSpec(name=shard.name, tokens=len(shard.tokens), sha256=digest)
        )
    for split, shards in splits.items():
        n = sum(s.tokens for s in shards)
        if n < min_tokens:
            given = " ".join(map(str, paths))
            raise ValueError(
                f"--data {given}: too little text: {n} {split} tokens, need at least {min_tokens}"
            )
    return DatasetSpec(
        dtype=dtype_for(tok.vocab_size),
        tokenizer=tokenizer_spec,
        train=tuple(splits["train"]),
        val=tuple(splits["val"]),
    )


def pinned(shards: Sequence[ShardSpec]) -> list[Pinned]:
    return [Pinned(s.name, s.tokens, s.sha256) for s in shards]


def verify_dataset(dataset: DatasetSpec, directory: Path) -> None:
    """Check ``directory`` against ``dataset``: every shard and the tokenizer present with
    the spec's sha256. ``ValueError`` naming the first file missing or different."""
    itemsize = 2 if dataset.dtype == "uint16" else 4
    verify_shards(directory, pinned((*dataset.train, *dataset.val)), itemsize)
    if dataset.tokenizer is not None:
        path = directory / TOKENIZER_FILE
        if not path.is_file():
            raise ValueError(f"{TOKENIZER_FILE} is missing from {directory}")
        if sha256_of(path) != dataset.tokenizer.sha256:
            raise ValueError(f"{path} differs from the run's tokenizer (sha256)")


def open_dataset(dataset: DatasetSpec, directory: Path) -> Corpus:
    """The run's shards in ``directory``, verified (``verify_dataset``) and memory-mapped:
    ``train`` reads every training shard, ``val`` every held-out one."""
    directory = directory.expanduser()
    verify_dataset(dataset, directory)
    return Corpus(
        str(directory),
        token_stream(dataset, directory, [TokenRange(s.name, 0, s.tokens) for s in dataset.train]),
        token_stream(dataset, directory, [TokenRange(s.name, 0, s.tokens) for s in dataset.val]),
        len(dataset.train) + len(dataset.val),
    )


def token_stream(
    dataset: DatasetSpec, directory: Path, ranges: Sequence[TokenRange]
) -> TokenStream:
    """The tokens of ``ranges`` of ``directory``'s shards (e.g. a trainer's share,
    ``protocol.data_split.share_of``), in order, as one stream (memory-mapped: nothing is
    read until indexed)."""
    return TokenStream(
        [open_shard(directory / r.shard, dataset.dtype)[r.start : r.end] for r in ranges]
    )


def training_data(spec: RunSpec, directory: Path | None) -> Corpus:
    """The data ``spec`` trains on: its shards in ``directory`` (``open_dataset``), or the
    bytes of ``spec.data`` for a run without shards. ``ValueError`` naming the flag to
    give, or the shard that is missing or differs."""
    if spec.dataset is None:
        if directory is not None:
            logger.warning("--data %s: run %s reads %s, not shards", directory, spec.run, spec.data)
        return load_corpus(spec.data)
    if directory is None:
        shards = len(spec.dataset.train) + len(spec.dataset.val)
        raise ValueError(
            f"run {spec.run} trains on {shards} data shards: give this machine's copy of them "
            "with --data DIR"
        )
    logger.info("checking the data shards in %s against the run's hashes", directory)
    try:
        return open_dataset(spec.dataset, directory)
    except ValueError as e:
        raise ValueError(f"--data: {e}") from None
