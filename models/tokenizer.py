"""Tokenizers a run's data is cut with: byte-level (the default: vocabulary 256, nothing to
pin) or a Hugging Face ``tokenizers`` file (``tokenizer.json``), and BPE training.

Both encode text to a 1-D numpy array of token ids and decode ids back to text; a run's
shards are written once with one of them (``models.shards``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Protocol

import numpy as np

TOKENIZER_FILE = "tokenizer.json"
BYTE_VOCAB = 256


class Tokenizer(Protocol):
    vocab_size: int

    def encode(self, text: str) -> np.ndarray: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens (vocabulary 256): what every run used before tokenizers."""

    vocab_size = BYTE_VOCAB

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


class FileTokenizer:
    """A ``tokenizer.json`` (Hugging Face ``tokenizers``): its vocabulary counts added
    tokens too."""

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises its own Exception for a bad file
            raise ValueError(f"{path}: not a tokenizers file ({e})") from None
        self.path = path
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text).ids, dtype=np.int64)

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids])


def load_tokenizer(path: Path | None) -> Tokenizer:
    """The tokenizer in ``path`` (a ``tokenizer.json``, or a directory holding one);
    byte-level when None. ``ValueError`` naming the path when it is missing or unreadable."""
    if path is None:
        return ByteTokenizer()
    path = path.expanduser()
    if path.is_dir():
        path = path / TOKENIZER_FILE
    if not path.is_file():
        raise ValueError(f"{path}: no such tokenizer file")
    return FileTokenizer(path)


def train_bpe(texts: Iterable[str], vocab_size: int) -> str:
    """A byte-level BPE tokenizer of ``vocab_size`` tokens (its 256 byte tokens included,
    so any text encodes) trained on ``texts``, as the text of a ``tokenizer.json``.
    ``ValueError`` if ``vocab_size`` is 256 or less or the texts are too few to reach it."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    if vocab_size <= BYTE_VOCAB:
        raise ValueError(
            f"--vocab-size {vocab_size}: a BPE tokenizer needs more than its "
            f"{BYTE_VOCAB} byte tokens (byte-level runs need no tokenizer)"
        )
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    got = tok.get_vocab_size(with_added_tokens=True)
    if got != vocab_size:
        raise ValueError(
            f"the data gave {got} tokens, not --vocab-size {vocab_size}: give more text or "
            f"a vocabulary of at most {got}"
        )
    return tok.to_str()
