"""A run's data as shards pinned by hash: written once, checked on every trainer, read
memory-mapped; bad input refused naming the file (and line)."""

from __future__ import annotations

import hashlib
import json
import sys

import numpy as np
import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from models.data import eval_batches, sample_batches
from models.shards import TokenStream, cut_shards, read_documents
from models.tokenizer import ByteTokenizer
from node.cli.main import main
from node.data import open_dataset, training_data, write_dataset
from protocol.identity import peer_id_of
from protocol.run_spec import AveragingSpec, make_run_spec, read_spec_file, sign_run_spec


def _texts(root, n=12, size=300):
    root.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        (root / f"doc{i:02d}.txt").write_text(f"document {i}: " + "abcdefgh " * (size // 9) + "\n")
    return root


def test_shards_round_trip_with_their_hashes(tmp_path):
    src = _texts(tmp_path / "src", n=40)
    dataset = write_dataset([src], tmp_path / "out", shard_tokens=1000)
    assert len(dataset.train) > 2 and dataset.val and dataset.dtype == "uint16"
    for shard in (*dataset.train, *dataset.val):
        raw = (tmp_path / "out" / shard.name).read_bytes()
        assert len(raw) == 2 * shard.tokens and hashlib.sha256(raw).hexdigest() == shard.sha256
    assert all(s.tokens == 1000 for s in dataset.train[:-1])  # all but the last are full
    corpus = open_dataset(dataset, tmp_path / "out")
    everything = b"".join(p.read_bytes() for p in sorted(src.iterdir()))
    train = corpus.train[torch.arange(len(corpus.train))]
    val = corpus.val[torch.arange(len(corpus.val))]
    assert len(train) + len(val) == len(everything)
    assert sorted(bytes(train.tolist()) + bytes(val.tolist())) == sorted(everything)
    # Written again from the same files: the same shards, byte for byte.
    assert write_dataset([src], tmp_path / "again", shard_tokens=1000) == dataset


def test_a_token_stream_reads_as_the_concatenated_tensor():
    parts = [np.arange(i * 100, i * 100 + n, dtype=np.uint16) for i, n in enumerate([70, 5, 90])]
    stream, whole = TokenStream(parts), torch.from_numpy(np.concatenate(parts).astype(np.int64))
    assert len(stream) == len(whole) == 165
    a, b = sample_batches(stream, 16, 4, seed=3), sample_batches(whole, 16, 4, seed=3)
    for _ in range(5):  # windows crossing shard boundaries included
        assert all(torch.equal(p, q) for p, q in zip(next(a), next(b), strict=True))
    assert torch.equal(eval_batches(stream, 8, 2, 3)[2][1], eval_batches(whole, 8, 2, 3)[2][1])


def test_a_modified_or_missing_shard_is_named(tmp_path):
    dataset = write_dataset([_texts(tmp_path / "src", n=30)], tmp_path / "out", shard_tokens=800)
    victim = tmp_path / "out" / dataset.train[1].name
    data = bytearray(victim.read_bytes())
    data[10] ^= 1
    victim.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=rf"shard .*{dataset.train[1].name} differs"):
        open_dataset(dataset, tmp_path / "out")
    victim.write_bytes(bytes(data[:-2]))  # truncated: refused by its size alone
    with pytest.raises(ValueError, match=rf"{dataset.train[1].name} differs.*bytes"):
        open_dataset(dataset, tmp_path / "out")
    victim.unlink()
    with pytest.raises(ValueError, match=rf"shard {dataset.train[1].name} is missing"):
        open_dataset(dataset, tmp_path / "out")


def test_jsonl_with_a_text_field_and_a_malformed_line(tmp_path):
    path = tmp_path / "d.jsonl"
    rows = [{"body": f"row {i}\u2028", "id": i} for i in range(3)]
    path.write_text("\r\n".join(json.dumps(r, ensure_ascii=False) for r in rows) + "\n\n")
    docs = list(read_documents([path], text_field="body"))
    assert docs == [(f"d.jsonl:{i + 1}", f"row {i}\u2028") for i in range(3)]
    with pytest.raises(ValueError, match=r"d.jsonl:1: no string field 'text'"):
        list(read_documents([path]))
    path.write_text('{"text": "fine"}\n{"text": "broken\n')
    with pytest.raises(ValueError, match=r"d.jsonl:2: not valid JSON"):
        list(read_documents([path]))


def test_non_utf8_text_is_refused_naming_the_file(tmp_path):
    _texts(tmp_path / "src", n=2)
    (tmp_path / "src" / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin1.txt: not UTF-8 text \(byte 3 is 0xe9\)"):
        list(read_documents([tmp_path / "src"]))
    with pytest.raises(ValueError, match="no such file or directory"):
        list(read_documents([tmp_path / "nowhere"]))


def test_one_document_holds_out_the_tail_of_its_tokens():
    docs = [("one.txt", "x" * 999)]
    shards = list(cut_shards(docs, ByteTokenizer().encode, 256, shard_tokens=400))
    assert [(s.name, len(s.tokens)) for s in shards] == [
        ("train-00000.bin", 400),
        ("train-00001.bin", 400),
        ("train-00002.bin", 150),
        ("val-00000.bin", 50),  # 5% of 1000
    ]


def test_old_specs_sign_to_the_same_bytes():
    # The bytes of this spec as signed before ``dataset`` existed (commit 557d710).
    key = Ed25519PrivateKey.from_private_bytes(bytes(range(32)))
    # Its settings, named: the defaults have changed since (int4 boundaries, 8-bit rounds).
    plain = {"compression": "none", "averaging": AveragingSpec(compression="none")}
    spec = make_run_spec("old", "tiny", 2, owner=peer_id_of(key.public_key()), created=1.0, **plain)
    raw = sign_run_spec(spec, key).raw
    assert hashlib.sha256(raw).hexdigest() == (
        "07a3be89baaba4e7a43331c5850d42b547d14931204352f1e5c2a48db3b4b3ba"
    )


def test_run_create_with_data_pins_the_shards_and_nodes_check_them(tmp_path, capsys):
    src = _texts(tmp_path / "src", n=40, size=600)
    spec_file = tmp_path / "lab.spec.json"
    argv = ["run", "create", "lab", "--owner-key", str(tmp_path / "owner.key"),
            "--out", str(spec_file), "--data", str(src)]  # fmt: skip
    assert main(argv) == 0
    spec = read_spec_file(spec_file.read_text()).spec
    assert spec.data == "shards" and spec.dataset is not None and spec.dataset.tokenizer is None
    data_dir = tmp_path / "lab-data"
    assert sorted(p.name for p in data_dir.iterdir()) == sorted(
        s.name for s in (*spec.dataset.train, *spec.dataset.val)
    )
    assert len(training_data(spec, data_dir).train) == sum(s.tokens for s in spec.dataset.train)
    with pytest.raises(ValueError, match="give this machine's copy of them with --data DIR"):
        training_data(spec, None)
    (data_dir / spec.dataset.val[0].name).unlink()
    with pytest.raises(ValueError, match=rf"--data: shard {spec.dataset.val[0].name} is missing"):
        training_data(spec, data_dir)
    capsys.readouterr()
    (src / "bad.jsonl").write_text("{oops\n")
    assert main([*argv[:-2], "--data", str(src), "--data-out", str(tmp_path / "d2")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "bad.jsonl:1: not valid JSON" in err, err


def test_parquet_without_pyarrow_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # as if it were not installed
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    (tmp_path / "t.parquet").write_bytes(b"PAR1")
    with pytest.raises(
        ValueError, match=r"t.parquet: reading Parquet needs pyarrow: .*\[parquet\]"
    ):
        list(read_documents([tmp_path / "t.parquet"]))


def test_parquet_rows_are_documents(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({"body": ["one", "two"]}), tmp_path / "t.parquet")
    docs = list(read_documents([tmp_path / "t.parquet"], text_field="body"))
    assert docs == [("t.parquet:1", "one"), ("t.parquet:2", "two")]
    with pytest.raises(ValueError, match=r"t.parquet: not a Parquet file with a column 'text'"):
        list(read_documents([tmp_path / "t.parquet"]))
