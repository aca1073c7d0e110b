"""``swarmtrain tokenizer train``: a BPE tokenizer trained on local text, written as
``OUT/tokenizer.json`` for ``swarmtrain run create --data ... --tokenizer FILE``."""

from __future__ import annotations

import argparse

from models.shards import read_documents
from models.tokenizer import TOKENIZER_FILE, train_bpe
from node.files import write_atomic


def run(args: argparse.Namespace) -> int:
    texts = (text for _, text in read_documents(args.data, args.text_field))
    path = args.out / TOKENIZER_FILE
    write_atomic(path, train_bpe(texts, args.vocab_size).encode())
    print(f"wrote a {args.vocab_size}-token BPE tokenizer to {path}")
    print(f"use it with: swarmtrain run create NAME --data PATH... --tokenizer {path}")
    return 0
