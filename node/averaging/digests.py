"""Evidence that the copies of a stage are equal: a digest of a copy's parameters, carried
by the ``averaging.round`` events the averager emits after every epoch, and the check that
compares the digests several peers emitted (``swarmtrain demo`` prints it).

Digests cost a pass over the parameters per epoch, so an averager computes them only when
asked to: by default when the environment sets ``SWARMTRAIN_LOG_DIGESTS`` (the demo sets
it for its nodes).
"""

from __future__ import annotations

import math
import os
import zlib
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

import torch

SKETCH_WIDTH = 4096  # a digest folds the parameters to this many sums, then projects them
SKETCH_DIMS = 4  # random directions of the projection
# Copies closer than this (relative distance) are equal up to float rounding: averaged
# without compression they differ by ~1e-7; one step apart, by ~1e-3 or more.
EQUAL_DISTANCE = 1e-5

# Set (to anything non-empty) in a node's environment: its averagers emit digests.
DIGESTS_ENV = "SWARMTRAIN_LOG_DIGESTS"


def digests_wanted() -> bool:
    """Whether this process's environment asks for digests (``DIGESTS_ENV``)."""
    return bool(os.environ.get(DIGESTS_ENV))


@dataclass(frozen=True)
class ParamDigest:
    """A short fingerprint of a stage's parameters.

    ``crc`` (crc32 of the float32 bytes) is equal only for bitwise equal copies. Copies
    averaged without compression differ in the last bits (each adds its own rounding of
    ``average - own``), so the digest also carries the norm and a random projection of the
    parameters (``sketch``): two copies' sketches differ by about their distance."""

    crc: int
    norm: float
    sketch: tuple[float, ...]

    @classmethod
    def of(cls, tensors: Sequence[torch.Tensor]) -> ParamDigest:
        crc, squares = 0, 0.0
        folded = torch.zeros(SKETCH_WIDTH, dtype=torch.float64)
        for t in tensors:
            flat = t.detach().reshape(-1).float().cpu()
            crc = zlib.crc32(flat.numpy(), crc)
            wide = flat.double()
            squares += float(wide.square().sum())
            pad = -len(wide) % SKETCH_WIDTH
            folded += torch.nn.functional.pad(wide, (0, pad)).view(-1, SKETCH_WIDTH).sum(0)
        sketch = folded @ _directions()
        return cls(crc, math.sqrt(squares), tuple(float(v) for v in sketch))

    def fields(self) -> dict[str, Any]:
        """The event fields (``digest`` of ``averaging.round``): ``hash`` (8 hex digits),
        ``norm``, ``sketch`` (``SKETCH_DIMS`` floats)."""
        return {"hash": f"{self.crc:08x}", "norm": self.norm, "sketch": list(self.sketch)}

    @classmethod
    def from_fields(cls, fields: object) -> ParamDigest:
        """The digest ``fields`` gave; ``ValueError`` if they are not one."""
        if not isinstance(fields, Mapping):
            raise ValueError("a digest is a mapping")
        crc, norm, sketch = fields.get("hash"), fields.get("norm"), fields.get("sketch")
        if not isinstance(crc, str) or len(crc) != 8:
            raise ValueError(f"digest hash must be 8 hex digits, got {crc!r:.20}")
        if not isinstance(sketch, list | tuple) or len(sketch) != SKETCH_DIMS:
            raise ValueError(f"digest sketch must hold {SKETCH_DIMS} numbers")
        values = [norm, *sketch]
        if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in values):
            raise ValueError("digest norm and sketch must be numbers")
        return cls(int(crc, 16), float(norm), tuple(float(v) for v in sketch))  # type: ignore[arg-type]

    def distance(self, other: ParamDigest) -> float:
        """About ``|a - b| / |a|`` for the two copies (0 when bitwise equal)."""
        if self.crc == other.crc:
            return 0.0
        diff = sum((x - y) ** 2 for x, y in zip(self.sketch, other.sketch, strict=True))
        return math.sqrt(diff / SKETCH_DIMS) / max(self.norm, other.norm, 1e-30)


@cache
def _directions() -> torch.Tensor:
    """The sketch's random directions: the same on every peer."""
    g = torch.Generator().manual_seed(0)
    return torch.randn(SKETCH_WIDTH, SKETCH_DIMS, generator=g, dtype=torch.float64)


@dataclass(frozen=True)
class CopiesCheck:
    """Whether the peers of one stage held equal copies at the epochs two or more of them
    emitted a digest for."""

    peers: int  # peers that emitted digests of the stage
    common: int  # epochs digested by two peers or more
    bitwise: int  # of those, epochs at which the copies were bitwise equal
    worst: float  # the largest relative distance between two copies at a common epoch
    differ: tuple[int, ...]  # epochs at which copies were further apart than EQUAL_DISTANCE

    @property
    def equal(self) -> bool:
        return self.peers < 2 or (self.common > 0 and not self.differ)

    def __str__(self) -> str:
        if self.peers < 2:
            return "one copy, nothing to compare"
        if self.common == 0:
            return "COPIES NEVER COMPARED: no epoch was digested by two peers"
        if self.differ:
            return (
                f"COPIES DIFFER at {len(self.differ)} of {self.common} common epochs "
                f"(first at epoch {self.differ[0]}; largest relative distance {self.worst:.1e})"
            )
        text = f"copies equal at {self.common} of {self.common} common epochs (bitwise at "
        if self.bitwise == self.common:
            return text + "all)"
        return text + f"{self.bitwise}, the others within {self.worst:.1e} relative distance)"


def compare_copies(peers_events: Iterable[Iterable[Mapping[str, Any]]], stage: int) -> CopiesCheck:
    """Compare the digests in the ``averaging.round`` events of several peers (one iterable
    of events each) for ``stage``. A peer's last digest of an epoch counts; events of other
    kinds or stages, without a digest, or with a malformed one are skipped."""
    by_epoch: dict[int, list[ParamDigest]] = defaultdict(list)
    peers = 0
    for events in peers_events:
        mine: dict[int, ParamDigest] = {}
        for e in events:
            epoch = e.get("epoch")
            if e.get("event") != "averaging.round" or e.get("stage") != stage:
                continue
            if not isinstance(epoch, int) or "digest" not in e:
                continue
            try:
                mine[epoch] = ParamDigest.from_fields(e["digest"])
            except ValueError:
                continue
        peers += bool(mine)
        for epoch, digest in mine.items():
            by_epoch[epoch].append(digest)
    distances = {
        epoch: max(ds[0].distance(d) for d in ds[1:])
        for epoch, ds in sorted(by_epoch.items())
        if len(ds) > 1
    }
    return CopiesCheck(
        peers=peers,
        common=len(distances),
        bitwise=sum(d == 0.0 for d in distances.values()),
        worst=max(distances.values(), default=0.0),
        differ=tuple(e for e, d in distances.items() if d > EQUAL_DISTANCE),
    )
