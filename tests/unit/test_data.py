"""The default corpus, the split and the samplers are deterministic and fail clearly."""

import pytest
import torch

from models.data import DataError, eval_batches, load_corpus, sample_batches, stream_seed


def test_stdlib_corpus_split_is_deterministic(corpus):
    again = load_corpus()
    assert corpus.n_files > 100
    assert torch.equal(corpus.val, again.val)
    assert len(corpus.val) < len(corpus.train) / 5


def test_streams_are_reproducible_and_distinct(corpus):
    def first(seed):
        return next(sample_batches(corpus.train, 32, 4, seed))[0]

    assert torch.equal(first(stream_seed(0, 1)), first(stream_seed(0, 1)))
    assert not torch.equal(first(stream_seed(0, 1)), first(stream_seed(0, 2)))
    x, y = next(sample_batches(corpus.train, 32, 4, 0))
    assert x.shape == y.shape == (4, 32) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the next bytes


def test_a_stream_read_from_a_position_goes_on_where_it_stopped(corpus):
    whole = sample_batches(corpus.train, 32, 4, 7)
    read = [next(whole)[0] for _ in range(5)]
    resumed = sample_batches(corpus.train, 32, 4, 7, start=3)
    assert torch.equal(next(resumed)[0], read[3]) and torch.equal(next(resumed)[0], read[4])
    assert not torch.equal(read[0], read[1])


def test_eval_batches_are_fixed(corpus):
    a = eval_batches(corpus.val, 16, 4, 3)
    b = eval_batches(corpus.val, 16, 4, 3)
    assert len(a) == 3 and all(torch.equal(p[0], q[0]) for p, q in zip(a, b, strict=True))


def test_text_file_and_directory(tmp_path):
    text = ("def f(x):\n    return x + 1\n" * 400).encode()
    (tmp_path / "a.txt").write_bytes(text)
    one = load_corpus(tmp_path / "a.txt")
    assert len(one.train) + len(one.val) == len(text)
    (tmp_path / "b.txt").write_bytes(text)
    both = load_corpus(tmp_path)
    assert both.n_files == 2 and len(both.train) + len(both.val) == 2 * len(text)


def test_bad_sources_raise_clear_errors(tmp_path):
    with pytest.raises(DataError, match="neither a file nor a directory"):
        load_corpus(tmp_path / "missing")
    with pytest.raises(DataError, match="too small"):
        load_corpus(tmp_path)  # empty directory
    (tmp_path / "small.txt").write_text("tiny")
    with pytest.raises(DataError, match="too small"):
        load_corpus(tmp_path / "small.txt")
