"""Which part of a run's training shards each trainer reads: a pure function of the shards
and the set of live trainers, so that every trainer computes the same split and no two
feed the same tokens.

The rule (a stride by rank): trainers are ranked by their sorted peer ids; with ``n``
trainers and ``S`` shards, each shard is cut into ``k = ceil(n / S)`` equal slices (one
while there are at least as many shards as trainers), and slice ``u`` of the shards in the
spec's order (shard-major) goes to the trainer of rank ``u mod n``. Every trainer gets at
least one slice, shares differ by at most one slice, no token is in two shares and every
token is in one. A trainer joining or leaving changes the split for everyone, the same way
on every peer that reads the same set.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, order=True)
class TokenRange:
    """Tokens ``start`` (included) to ``end`` (excluded) of shard ``shard``."""

    shard: str
    start: int
    end: int

    def __len__(self) -> int:
        return self.end - self.start


def share_of(
    shards: Sequence[tuple[str, int]], trainers: Iterable[str], me: str
) -> tuple[TokenRange, ...]:
    """The ranges trainer ``me`` reads of ``shards`` ((name, tokens), in the spec's order)
    among the live ``trainers`` (peer ids; ``me`` is one whether listed or not), by the
    module's rule. ``ValueError`` if there are no shards or a shard has no tokens."""
    if not shards:
        raise ValueError("no training shards to split among trainers")
    empty = [name for name, tokens in shards if tokens <= 0]
    if empty:
        raise ValueError(f"shard {empty[0]} has no tokens")
    ranked = sorted({*trainers, me})
    n, rank = len(ranked), ranked.index(me)
    k = -(-n // len(shards))  # slices per shard
    share = []
    for i, (name, tokens) in enumerate(shards):
        for j in range(k):
            if (i * k + j) % n == rank:
                share.append(TokenRange(name, tokens * j // k, tokens * (j + 1) // k))
    return tuple(share)
