"""What a run must move per sample, to compare with what crossed the wire."""

from __future__ import annotations

import psutil

from models.stages import Stage
from node.pipeline.wire import COMPRESSIONS, compression_name
from protocol.run_spec import RunSpec
from protocol.stage_messages import wire_nbytes


def loopback_bytes() -> int:
    """Bytes sent on ``lo`` so far, by every process on the machine."""
    lo = psutil.net_io_counters(pernic=True).get("lo")
    return lo.bytes_sent if lo else 0


def required_bytes(spec: RunSpec, peers_per_stage: int) -> dict:
    """Bytes per sample a run needs at the least: one hidden state forward and one
    gradient back per stage boundary (as the spec's compression encodes a micro-batch of
    them: ``wire_nbytes``), and the butterfly
    all-reduce of each stage's gradients once per target batch (each of P peers sends
    2 (P-1)/P of the stage's parameters)."""
    model, optim = spec.model, spec.optim
    micro = optim.micro_batch_size
    hidden = wire_nbytes(
        _wire_name(spec.compression), "float32", micro * model.block_size * model.n_embd
    )
    activations = 2 * (spec.n_stages - 1) * hidden / micro
    avg_width = 2 if spec.averaging.compression == "float16" else 4
    p = peers_per_stage
    averaging = 0.0
    if spec.averaging.mode == "gradient":
        for s in range(spec.n_stages):
            params = sum(t.numel() for t in Stage(model, spec.stage_range(s)).parameters())
            averaging += 2 * (p - 1) * params * avg_width / optim.target_batch_size
    return {"activation_bytes": activations, "averaging_bytes": averaging,
            "mode": spec.averaging.mode}  # fmt: skip


def _wire_name(compression: str) -> str:
    """The wire name (``CompressionType``'s, or one of ours) of a spec's compression."""
    return compression_name(COMPRESSIONS[compression])
