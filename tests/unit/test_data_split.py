"""Trainers of a run read disjoint parts of its shards, chosen alike by every peer from
the set of live trainers."""

from __future__ import annotations

import pytest

from protocol.data_split import TokenRange, share_of

SHARDS = [(f"train-{i:05d}.bin", 1000 + 7 * i) for i in range(5)]


def _tokens(share: tuple[TokenRange, ...]) -> set[tuple[str, int]]:
    return {(r.shard, t) for r in share for t in range(r.start, r.end)}


def _check_partition(shards, trainers):
    shares = {t: share_of(shards, trainers, t) for t in trainers}
    seen: set[tuple[str, int]] = set()
    for share in shares.values():
        assert share, "every trainer reads something"
        tokens = _tokens(share)
        assert not tokens & seen, "no token is read by two trainers"
        seen |= tokens
    assert seen == {(name, t) for name, n in shards for t in range(n)}, "every token is read"
    sizes = [len(_tokens(s)) for s in shares.values()]
    return shares, sizes


def test_two_trainers_take_disjoint_shards():
    shares, _ = _check_partition(SHARDS, ["peerB", "peerA"])
    assert [r.shard for r in shares["peerA"]] == ["train-00000.bin", "train-00002.bin",
                                                  "train-00004.bin"]  # fmt: skip
    assert [r.shard for r in shares["peerB"]] == ["train-00001.bin", "train-00003.bin"]
    assert all(r.start == 0 and r.end == n for r in shares["peerB"] for name, n in SHARDS
               if name == r.shard)  # fmt: skip


def test_more_trainers_than_shards_split_shards_into_slices():
    trainers = [f"p{i}" for i in range(12)]
    _, sizes = _check_partition(SHARDS, trainers)
    assert max(sizes) - min(sizes) <= max(n for _, n in SHARDS) // 3 + 1  # slices of thirds


def test_adding_a_trainer_reassigns_deterministically():
    before = share_of(SHARDS, ["a", "c"], "a")
    assert share_of(SHARDS, ["c", "a", "a"], "a") == before  # order and repeats don't count
    assert share_of(SHARDS, ["c"], "a") == before  # me counts, listed or not
    after = {t: share_of(SHARDS, ["a", "b", "c"], t) for t in "abc"}
    assert after["a"] != before
    assert after == {t: share_of(SHARDS, ["b", "c", "a"], t) for t in "abc"}
    _check_partition(SHARDS, ["a", "b", "c"])


def test_bad_shard_lists_are_refused():
    with pytest.raises(ValueError, match="no training shards"):
        share_of([], ["a"], "a")
    with pytest.raises(ValueError, match="shard x has no tokens"):
        share_of([("x", 0)], ["a"], "a")
