"""Compressed averaging: which coordinates of a DiLoCo pseudo-gradient a round sends, how
the values a round sends (those, or gradient mode's mean gradients) are rounded to 8
bits, and the lossless wire codec that carries them.

hivemind's all-reduce averages fixed dense shapes element by element, so every groupmate
of a round must send the same coordinates. ``choose_indices`` derives them from a seed
all groupmates share (``round_seed``: the run, the stage and the epoch): the vector is
cut into blocks of ``stride`` coordinates and each round sends one coordinate per block,
at an offset drawn per block by an integer hash (plain int64 arithmetic, the same on
every machine and torch version). Over many rounds every coordinate is drawn equally
often; what a copy does not send stays in its error-feedback residual
(``node.averaging.strategies``) and is sent when its coordinate is drawn.

``round_to_grid`` rounds values to 8 bits with one power-of-two scale per
``GRID_BLOCK`` values (DiLoCo's deltas) or per ``CODEC_BLOCK`` (gradient mode's mean
gradients, whose magnitudes vary more within a block): the rounded values are exact in
``encode``'s 8-bit blocks (a block of values on a grid of 2**e with at most 127 steps is
exact on any finer grid too), so what travels is exactly what the sender rounded, and
its rounding error stays in its residual. ``encode`` / ``decode`` is the wire format of
one all-reduce part: blocks of ``CODEC_BLOCK`` values, each as 8-bit integers times a
power of two where that is exact, else float16 where that is exact, else float32. It
never changes a value, so the means a reducer returns (float32 differences) reach every
groupmate unrounded and the copies stay as equal as uncompressed ones. ``decode``
refuses malformed bytes with ``CodecError``.

``snap_mean`` is what makes those returned means cheap: the reducer rounds the mean of
one part, per ``CODEC_BLOCK`` values, to the finest power-of-two grid on which every
groupmate's part of that block lies, so that the mean less any part is a whole number
of grid steps (within 127 of them when the parts share a scale: a byte each) and every
copy still applies the same mean bitwise. The rounding (at most half a step of that grid,
the same for every copy) is the reducer's alone.
"""

from __future__ import annotations

import hashlib
import math

import numpy as np
import torch

GRID_BLOCK = 4096  # values per power-of-two scale in ``round_to_grid``
CODEC_BLOCK = 64  # values per block of the wire format
LEVELS = 127  # 8-bit values are -127..127 times the block's power of two
MIN_EXP, MAX_EXP = -126, 127  # of the power-of-two scales (float32 normal range)

_P = 2**31 - 1  # the hash works modulo this prime: every product fits in int64


def stride_of(density: float) -> int:
    """Coordinates per block: one of every ``stride`` is sent (density rounded to
    1 / stride)."""
    if not 0.0 < density <= 1.0:
        raise ValueError(f"density must be in (0, 1], got {density}")
    return max(1, round(1.0 / density))


def sent_count(n: int, density: float) -> int:
    """How many values a round sends for a vector of ``n`` coordinates."""
    return math.ceil(n / stride_of(density))


def round_seed(salt: str, epoch: int) -> tuple[int, int]:
    """The seed of the coordinates sent at ``epoch``: the same for every groupmate of a
    round (``salt`` names the run and stage)."""
    digest = hashlib.sha256(f"{salt}/{int(epoch)}".encode()).digest()
    return int.from_bytes(digest[:4], "big") % _P, int.from_bytes(digest[4:8], "big") % _P


def _hash(j: torch.Tensor, seed: tuple[int, int]) -> torch.Tensor:
    x = (j * 48271 + seed[0]) % _P
    x = x ^ (x >> 11)
    x = (x * 16807 + seed[1]) % _P
    x = x ^ (x >> 15)
    x = (x * 48271) % _P
    return x ^ (x >> 13)


def choose_indices(n: int, density: float, seed: tuple[int, int]) -> torch.Tensor:
    """The coordinates (int64, ``sent_count(n, density)`` of them, ascending) of a vector
    of ``n`` that a round with ``seed`` sends; -1 marks a slot past the end of the vector
    (the last block may be short), which carries a zero."""
    if n < 1:
        raise ValueError(f"a vector of {n} coordinates")
    stride = stride_of(density)
    blocks = torch.arange(sent_count(n, density), dtype=torch.int64)
    idx = blocks * stride + _hash(blocks, seed) % stride
    return torch.where(idx < n, idx, torch.full_like(idx, -1))


def gather(flat: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """The values of ``flat`` at ``idx`` (zeros at -1 slots)."""
    valid = idx >= 0
    out = torch.zeros(idx.shape, dtype=flat.dtype)
    out[valid] = flat[idx[valid]]
    return out


def scatter(values: torch.Tensor, idx: torch.Tensor, n: int) -> torch.Tensor:
    """A vector of ``n`` zeros with ``values`` at ``idx`` (-1 slots dropped)."""
    valid = idx >= 0
    out = torch.zeros(n, dtype=values.dtype)
    out[idx[valid]] = values[valid]
    return out


def _exponents(absmax: np.ndarray) -> np.ndarray:
    """The smallest power-of-two exponent e with absmax <= LEVELS * 2**e (MIN_EXP for 0)."""
    with np.errstate(divide="ignore"):
        e = np.ceil(np.log2(absmax / LEVELS))
    e = np.where(absmax > 0, e, MIN_EXP)
    # log2 can land one off at exact powers: fix it so that absmax <= LEVELS * 2**e holds.
    e = np.where(absmax > LEVELS * np.exp2(e), e + 1, e)
    return np.clip(e, MIN_EXP, MAX_EXP).astype(np.int32)


def round_to_grid(values: torch.Tensor, block: int = GRID_BLOCK) -> torch.Tensor:
    """``values`` (1-d, finite) rounded to 8 bits: per ``block`` values, to the nearest of
    -127..127 times the smallest power of two that holds the block's largest magnitude.
    float32. ``block`` a multiple or divisor of ``CODEC_BLOCK`` keeps the rounded values
    exact in ``encode``'s 8-bit blocks."""
    x = values.detach().float().reshape(-1)
    n = len(x)
    blocks = _padded(x, block).view(-1, block)
    exponents = _exponents(blocks.abs().amax(dim=1).numpy())
    scale = torch.from_numpy(np.exp2(exponents).astype(np.float32)).unsqueeze(1)
    # Dividing by a power of two is exact, and round() rounds half to even, as rint does.
    q = (blocks / scale).round_().clamp_(-LEVELS, LEVELS).mul_(scale)
    return q.view(-1)[:n]


def _padded(x: torch.Tensor, block: int) -> torch.Tensor:
    """``x`` (1-d) with zeros after it up to a whole number of ``block`` values."""
    pad = (-len(x)) % block
    return torch.cat([x, x.new_zeros(pad)]) if pad else x


_NO_GRID = 1 << 20  # the grid exponent of 0: on every grid


def grid_exponents(values: np.ndarray) -> np.ndarray:
    """Per value (float32, finite), the largest e such that it is a whole multiple of
    2**e (``_NO_GRID`` for 0). Read from the float32 bits: a normal value is its 24-bit
    significand times 2**(field - 150), a subnormal one its 23 bits times 2**-149, and
    the lowest set bit of the significand adds its place."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.int32)
    field = (bits >> 23) & 0xFF
    significand = bits & 0x7FFFFF
    normal = field > 0
    significand[normal] |= 0x800000
    low = significand & -significand  # its lowest set bit: a power of two, or 0
    place = ((low.astype(np.float32).view(np.int32) >> 23) & 0xFF) - 127  # log2, exactly
    e = np.where(normal, field - 150, -149) + place
    return np.where(significand > 0, e, _NO_GRID).astype(np.int64)


def snap_mean(mean: torch.Tensor, parts: list[torch.Tensor]) -> torch.Tensor:
    """``mean`` (of ``parts``, each of its shape) rounded to nearest, per block of
    ``CODEC_BLOCK`` values of the flattened tensors, to the finest power-of-two grid that
    holds every part's values of that block exactly: ``mean - part`` is then a whole
    number of that grid's steps for every part (``encode`` carries it in a byte per value
    if there are at most 127), and ``part + (mean - part)`` equals it exactly in float32.
    Unchanged if a value is not finite or a block's grid is finer than float32 can hold
    at its mean (no rounding then)."""
    m = mean.detach().float().reshape(-1)
    xs = [p.detach().float().reshape(-1) for p in parts]
    if not xs or not bool(m.isfinite().all()) or not all(bool(x.isfinite().all()) for x in xs):
        return mean
    n = len(m)
    grid = np.full(math.ceil(n / CODEC_BLOCK), _NO_GRID, np.int64)
    for x in xs:
        e = grid_exponents(_padded(x, CODEC_BLOCK).numpy())
        grid = np.minimum(grid, e.reshape(-1, CODEC_BLOCK).min(axis=1))
    # Parts are float32, so a grid is never finer than 2**-149; in float64, multiplying by
    # a power of two of this range is exact, and rint rounds to a whole number of steps (a
    # grid finer than m's own last bit leaves m as it is).
    step = np.clip(grid, -149, MAX_EXP)[:, None]
    blocks = _padded(m, CODEC_BLOCK).numpy().astype(np.float64).reshape(-1, CODEC_BLOCK)
    snapped = np.rint(blocks * np.ldexp(1.0, -step)) * np.ldexp(1.0, step)
    return torch.from_numpy(snapped.astype(np.float32).reshape(-1)[:n].copy()).reshape(mean.shape)


class CodecError(ValueError):
    """Bytes that ``decode`` cannot read as a part of the size it expects."""


_INT8, _F16, _F32 = 1, 2, 3
_WIDTH = {_INT8: 1, _F16: 2, _F32: 4}


def encode(values: torch.Tensor) -> bytes:
    """``values`` (float32, any shape: flattened) in the wire format, losslessly:
    a kind byte and an exponent byte per ``CODEC_BLOCK`` values, then the 8-bit blocks,
    then the float16 blocks, then the float32 blocks."""
    x = values.detach().float().reshape(-1).numpy()
    n = len(x)
    pad = (-n) % CODEC_BLOCK
    blocks = np.concatenate([x, np.zeros(pad, np.float32)]).reshape(-1, CODEC_BLOCK)
    finite = np.isfinite(blocks).all(axis=1)
    safe = np.where(finite[:, None], blocks, 0.0)
    exps = _exponents(np.abs(safe).max(axis=1))
    q = safe / np.exp2(exps)[:, None].astype(np.float32)
    int8 = finite & (q == np.rint(q)).all(axis=1) & (np.abs(q) <= LEVELS).all(axis=1)
    rest = np.flatnonzero(~int8 & finite)  # float16 where exact: checked only where needed
    exact = (blocks[rest].astype(np.float16).astype(np.float32) == blocks[rest]).all(axis=1)
    f16 = np.zeros(len(blocks), bool)
    f16[rest[exact]] = True
    kinds = np.where(int8, _INT8, np.where(f16, _F16, _F32)).astype(np.uint8)
    return b"".join(
        (
            kinds.tobytes(),
            np.where(int8, exps, 0).astype(np.int8).tobytes(),
            q[int8].astype(np.int8).tobytes(),
            blocks[f16].astype(np.float16).tobytes(),
            blocks[kinds == _F32].astype(np.float32).tobytes(),
        )
    )


def decode(data: bytes, n: int) -> torch.Tensor:
    """The ``n`` float32 values ``encode`` wrote into ``data``; ``CodecError`` if ``data``
    is not exactly that (a wrong size, an unknown kind, an exponent out of range)."""
    if n < 0:
        raise CodecError(f"a part of {n} values")
    nb = math.ceil(n / CODEC_BLOCK)
    if len(data) < 2 * nb:
        raise CodecError(f"{len(data)} bytes cannot hold the headers of {n} values")
    buf = memoryview(data)
    kinds = np.frombuffer(buf, np.uint8, nb)
    exps = np.frombuffer(buf, np.int8, nb, offset=nb).astype(np.int32)
    if not np.isin(kinds, list(_WIDTH)).all():
        raise CodecError("an unknown block kind")
    if ((exps < MIN_EXP) | (exps > MAX_EXP)).any():
        raise CodecError("an exponent out of range")
    counts = {k: int((kinds == k).sum()) for k in _WIDTH}
    expected = 2 * nb + sum(CODEC_BLOCK * _WIDTH[k] * c for k, c in counts.items())
    if len(data) != expected:
        raise CodecError(f"{len(data)} bytes for {n} values in these blocks, expected {expected}")
    out = np.empty((nb, CODEC_BLOCK), np.float32)
    offset = 2 * nb
    for kind, dtype in ((_INT8, np.int8), (_F16, np.float16), (_F32, np.float32)):
        count = counts[kind] * CODEC_BLOCK
        part = np.frombuffer(buf, dtype, count, offset=offset).reshape(-1, CODEC_BLOCK)
        offset += count * _WIDTH[kind]
        mask = kinds == kind
        if kind == _INT8:
            scale = np.exp2(exps[mask]).astype(np.float32)[:, None]
            out[mask] = part.astype(np.float32) * scale
        else:
            out[mask] = part.astype(np.float32)
    return torch.from_numpy(out.reshape(-1)[:n].copy())
