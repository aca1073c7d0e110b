"""Grouped low-bit quantization of activations and gradients, with stochastic rounding.

The layout of a ``GROUPED_4BIT`` or ``GROUPED_2BIT`` tensor's buffer (wire names in
``protocol.stage_messages.LOWBIT_BITS``): the tensor is flattened and zero-padded to whole
groups of ``LOWBIT_GROUP`` values; then come every group's float32 minimum, every group's
float32 step, and the codes (``bits`` each, packed low bits first, ``8 // bits`` to a byte).
A value decodes to ``minimum + code * step``.

Codes are rounded stochastically (up with probability equal to the remainder), so a decoded
tensor equals the original in expectation: gradients stay unbiased and rounding errors
average out over micro-batches instead of piling up in one direction. The rounding noise
comes from a generator of this process's own (``ROUNDING``), not from torch's global one,
so quantizing never changes what a seeded computation draws.
"""

from __future__ import annotations

import secrets

import numpy as np
import torch

from protocol.stage_messages import LOWBIT_GROUP, StageRequestError, wire_nbytes

ROUNDING = torch.Generator().manual_seed(secrets.randbits(63))


def wire_name(bits: int) -> str:
    """The wire name of ``bits``-bit grouped quantization (2 or 4)."""
    if bits not in (2, 4):
        raise ValueError(f"grouped quantization takes 2 or 4 bits per value, got {bits}")
    return f"GROUPED_{bits}BIT"


def encode(tensor: torch.Tensor, bits: int, generator: torch.Generator | None = None) -> bytes:
    """The buffer of float tensor ``tensor`` quantized to ``bits`` bits per value.

    Finite inputs decode to finite values within one step of the input (the step is the
    group's range over ``2**bits - 1``); a non-finite input makes its group's minimum or
    step non-finite, which ``decode`` refuses."""
    wire_name(bits)
    levels = 2**bits - 1
    flat = tensor.detach().reshape(-1).to(torch.float32)
    groups = -(-flat.numel() // LOWBIT_GROUP)
    padded = torch.zeros(groups * LOWBIT_GROUP, dtype=torch.float32)
    padded[: flat.numel()] = flat
    rows = padded.view(groups, LOWBIT_GROUP)  # (G, LOWBIT_GROUP)
    lo, hi = rows.amin(dim=1, keepdim=True), rows.amax(dim=1, keepdim=True)  # (G, 1)
    # The range of finite float32 values may overflow float32 (its step does not): then
    # the arithmetic runs in float64.
    if not bool(torch.isfinite(hi - lo).all()) and bool(torch.isfinite(rows).all()):
        rows, lo, hi = rows.double(), lo.double(), hi.double()
    step = ((hi - lo) / levels).float()  # (G, 1), as sent
    inverse = 1 / torch.where(step > 0, step, torch.ones_like(step)).to(rows.dtype)
    codes = torch.rand(rows.shape, generator=generator or ROUNDING, dtype=rows.dtype)
    codes.add_((rows - lo).mul_(inverse)).floor_().clamp_(0, levels)
    codes = codes.to(torch.uint8).view(-1, 8 // bits)  # (bytes, values per byte)
    packed = codes[:, 0].clone()
    for i in range(1, 8 // bits):
        packed |= codes[:, i] << (i * bits)
    return lo.float().numpy().tobytes() + step.numpy().tobytes() + packed.numpy().tobytes()


def check_decodes_finite(buffer: bytes, bits: int, numel: int) -> None:
    """Raise ``StageRequestError`` unless ``buffer`` (of the size ``numel`` values need)
    decodes to finite values, which ``decode`` then returns: every group's minimum and
    step finite, no step negative, and the group's largest value (minimum plus the top
    code's steps) finite once rounded to float32, as ``decode`` rounds it. Reads only the
    groups' minima and steps, so it costs a small share of a decode."""
    name = wire_name(bits)
    groups = -(-numel // LOWBIT_GROUP)
    if len(buffer) != wire_nbytes(name, "float32", numel):
        raise StageRequestError(f"{name} buffer of {len(buffer)} bytes for {numel} values")
    lo = np.frombuffer(buffer, np.float32, groups).astype(np.float64)
    step = np.frombuffer(buffer, np.float32, groups, 4 * groups).astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        top = lo + (2**bits - 1) * step
        ok = np.isfinite(lo).all() and (step >= 0).all() and np.isfinite(step).all()
        ok = ok and bool(np.isfinite(top.astype(np.float32)).all())
    if not ok:
        raise StageRequestError(f"{name} tensor does not decode to finite values")


def decode(buffer: bytes, bits: int, shape: tuple[int, ...]) -> torch.Tensor:
    """The float32 tensor of ``shape`` that ``buffer`` encodes.

    Raises ``StageRequestError`` if the buffer has not exactly the size the shape implies,
    or if a group's minimum or step, or a decoded value, is not finite (or a step is
    negative): such a buffer was not made by ``encode`` from finite values."""
    name = wire_name(bits)
    numel = 1
    for s in shape:
        numel *= s
    if len(buffer) != wire_nbytes(name, "float32", numel):
        raise StageRequestError(
            f"{name} buffer of {len(buffer)} bytes, a tensor of {numel} values needs "
            f"{wire_nbytes(name, 'float32', numel)}"
        )
    groups = -(-numel // LOWBIT_GROUP)
    lo = torch.from_numpy(np.frombuffer(buffer, np.float32, groups).copy()).unsqueeze(1)
    step = torch.from_numpy(np.frombuffer(buffer, np.float32, groups, 4 * groups).copy())
    step = step.unsqueeze(1)  # (G, 1), as lo
    if not (bool(torch.isfinite(lo).all()) and bool((step >= 0).all())):
        raise StageRequestError(f"{name} group minimum or step not finite, or a negative step")
    packed = torch.from_numpy(np.frombuffer(buffer, np.uint8, offset=8 * groups).copy())
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8)  # (values per byte,)
    codes = ((packed.unsqueeze(1) >> shifts) & (2**bits - 1)).view(groups, LOWBIT_GROUP)
    values = codes.float().mul_(step).add_(lo)  # (G, LOWBIT_GROUP)
    if not bool(torch.isfinite(values).all()):
        # code * step may overflow float32 where lo + code * step does not
        values = codes.double().mul_(step.double()).add_(lo.double()).float()
        if not bool(torch.isfinite(values).all()):
            raise StageRequestError(f"{name} tensor decodes to non-finite values")
    return values.view(-1)[:numel].reshape(shape)
