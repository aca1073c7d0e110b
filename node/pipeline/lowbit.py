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
    # float64 arithmetic: a group's range (max - min) of finite float32 values may overflow
    # float32, its step does not
    rows = padded.view(groups, LOWBIT_GROUP).double()  # (G, LOWBIT_GROUP)
    lo = rows.amin(dim=1, keepdim=True)  # (G, 1)
    step = ((rows.amax(dim=1, keepdim=True) - lo) / levels).float()  # (G, 1), as sent
    safe = torch.where(step > 0, step, torch.ones_like(step)).double()
    noise = torch.rand(rows.shape, generator=generator or ROUNDING, dtype=torch.float64)
    codes = torch.floor((rows - lo) / safe + noise).clamp_(0, levels).to(torch.uint8)
    per_byte = 8 // bits
    codes = codes.view(-1, per_byte)  # (G * LOWBIT_GROUP / per_byte, per_byte)
    packed = torch.zeros(codes.shape[0], dtype=torch.uint8)
    for i in range(per_byte):
        packed |= codes[:, i] << (i * bits)
    return lo.float().numpy().tobytes() + step.numpy().tobytes() + packed.numpy().tobytes()


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
    lo = torch.from_numpy(np.frombuffer(buffer, np.float32, groups).copy())
    step = torch.from_numpy(np.frombuffer(buffer, np.float32, groups, 4 * groups).copy())
    if not (bool(torch.isfinite(lo).all()) and bool((step >= 0).all())):
        raise StageRequestError(f"{name} group minimum or step not finite, or a negative step")
    packed = torch.from_numpy(np.frombuffer(buffer, np.uint8, offset=8 * groups).copy())
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8)  # (per_byte,)
    codes = (packed.unsqueeze(1) >> shifts) & (2**bits - 1)  # (bytes, per_byte)
    rows = codes.view(groups, LOWBIT_GROUP).double()  # as encoded: in float64
    values = (lo.double().unsqueeze(1) + rows * step.double().unsqueeze(1)).view(-1)[:numel]
    values = values.float()  # beyond float32's range: inf, refused below
    if not bool(torch.isfinite(values).all()):
        raise StageRequestError(f"{name} tensor decodes to non-finite values")
    return values.reshape(shape)
