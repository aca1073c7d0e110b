"""BPE tokenizers trained on local text, pinned by hash in a run's data, and checked
against the model's embedding."""

from __future__ import annotations

import hashlib

import pytest
import torch

from models.tokenizer import TOKENIZER_FILE, load_tokenizer
from node.cli.main import main
from node.data import open_dataset, write_dataset
from protocol.run_spec import read_spec_file

TEXT = "the quick brown fox jumps over the lazy dog; a lazy fox naps.\n"


@pytest.fixture
def tokenizer(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for i in range(4):
        (src / f"{i}.txt").write_text(TEXT * (20 + i) + f"file number {i}\n")
    (src / "rows.jsonl").write_text('{"text": "jumping foxes and dogs"}\n')
    assert main(["tokenizer", "train", "--data", str(src), "--vocab-size", "300",
                 "--out", str(tmp_path / "tok")]) == 0  # fmt: skip
    return tmp_path / "tok" / TOKENIZER_FILE


def test_a_trained_tokenizer_round_trips_text(tokenizer):
    tok = load_tokenizer(tokenizer)
    assert tok.vocab_size == 300
    for text in (TEXT, "unseen: café, 数据, tabs\tand\nnewlines  "):
        ids = tok.encode(text)
        assert tok.decode(ids.tolist()) == text
    assert len(tok.encode(TEXT)) < len(TEXT.encode()) / 2  # it learned merges


def test_too_few_texts_for_the_vocabulary_are_refused(tmp_path):
    (tmp_path / "a.txt").write_text("ab")
    assert main(["tokenizer", "train", "--data", str(tmp_path / "a.txt"), "--vocab-size",
                 "5000", "--out", str(tmp_path / "tok")]) == 2  # fmt: skip
    assert not (tmp_path / "tok" / TOKENIZER_FILE).exists()


def test_shards_cut_with_a_tokenizer_pin_it(tokenizer, tmp_path):
    src = tmp_path / "data"
    src.mkdir()
    for i in range(30):
        (src / f"d{i}.txt").write_text(TEXT * 3)
    dataset = write_dataset([src], tmp_path / "out", tokenizer=tokenizer, shard_tokens=500)
    assert dataset.tokenizer is not None and dataset.tokenizer.vocab_size == 300
    assert dataset.tokenizer.sha256 == hashlib.sha256(tokenizer.read_bytes()).hexdigest()
    corpus = open_dataset(dataset, tmp_path / "out")
    ids = [t for part in (corpus.train, corpus.val) for t in part[torch.arange(len(part))].tolist()]
    # Every document is the same text: train then validation decode to all of them.
    assert load_tokenizer(tmp_path / "out").decode(ids) == TEXT * 3 * 30
    (tmp_path / "out" / TOKENIZER_FILE).write_text("{}")
    with pytest.raises(ValueError, match="tokenizer.json differs from the run's tokenizer"):
        open_dataset(dataset, tmp_path / "out")


def test_a_tokenizer_that_does_not_fit_the_model_is_one_line(tokenizer, tmp_path, capsys):
    src = tmp_path / "data"
    src.mkdir()
    (src / "a.txt").write_text(TEXT * 50)
    capsys.readouterr()
    assert main(["run", "create", "lab", "--owner-key", str(tmp_path / "owner.key"),
                 "--out", str(tmp_path / "lab.json"), "--data", str(src),
                 "--tokenizer", str(tokenizer)]) == 2  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "the tokenizer has 300 tokens but the model's embedding has 256" in err
    assert not (tmp_path / "lab.json").exists() and not (tmp_path / "lab-data").exists()


def test_a_run_from_a_checkpoint_cuts_its_data_with_its_tokenizer(tokenizer, tmp_path, capsys):
    pytest.importorskip("transformers")
    from tests.hf_checkpoints import tiny_llama

    _, checkpoint = tiny_llama(tmp_path, vocab_size=300)
    src = tmp_path / "data"
    src.mkdir()
    (src / "a.txt").write_text(TEXT * 200)
    argv = ["run", "create", "ft", "--from-pretrained", str(checkpoint), "--data", str(src),
            "--owner-key", str(tmp_path / "o.key"), "--out", str(tmp_path / "ft.json")]  # fmt: skip
    assert main(argv) == 2
    assert f"checkpoint {checkpoint} has no tokenizer.json" in capsys.readouterr().err
    (checkpoint / TOKENIZER_FILE).write_bytes(tokenizer.read_bytes())
    assert main(argv) == 0
    dataset = read_spec_file((tmp_path / "ft.json").read_text()).spec.dataset
    assert dataset.tokenizer.sha256 == hashlib.sha256(tokenizer.read_bytes()).hexdigest()
