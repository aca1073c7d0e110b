"""What a run must move per sample, to compare with what crossed the wire; and what
crossed it, by purpose."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Callable

import psutil

from models.stages import Stage
from node.pipeline.wire import COMPRESSIONS, compression_name
from protocol.run_spec import RunSpec
from protocol.stage_messages import wire_nbytes


def loopback_bytes() -> int:
    """Bytes sent on ``lo`` so far, by every process on the machine."""
    lo = psutil.net_io_counters(pernic=True).get("lo")
    return lo.bytes_sent if lo else 0


_BYTES_LINE = re.compile(
    r'^swarmtrain_network_bytes_total\{(?=[^}]*direction="(\w+)")(?=[^}]*purpose="(\w+)")'
    r"[^}]*\}\s+(\S+)$",
    re.M,
)


def node_traffic(
    metrics_url: str, wrap: Callable[[list[str]], list[str]] | None = None
) -> dict[tuple[str, str], int]:
    """Bytes a node moved so far on its streams, by (purpose, direction), read from its
    Prometheus metrics (``swarmtrain_network_bytes_total``: the node and its averager
    processes, ``node.limits``); ``wrap`` runs the fetch elsewhere (inside the node's
    network namespace). Empty when the node does not answer."""
    cmd = ["curl", "-sf", "--max-time", "10", metrics_url]
    done = subprocess.run(wrap(cmd) if wrap else cmd, capture_output=True, text=True)
    return {
        (purpose, direction): int(float(n))
        for direction, purpose, n in _BYTES_LINE.findall(done.stdout)
    }


def required_bytes(spec: RunSpec, peers_per_stage: int) -> dict:
    """Bytes per sample a run needs at the least: one hidden state forward and one
    gradient back per stage boundary (as the spec's compression encodes a micro-batch of
    them: ``wire_nbytes``), and the butterfly
    all-reduce of each stage's gradients once per target batch (each of P peers sends
    2 (P-1)/P of the stage's parameters)."""
    model, optim = spec.model, spec.optim
    micro = optim.micro_batch_size
    hidden = wire_nbytes(
        _wire_name(spec.compression), "float32", micro * model.block_size * model.boundary_width
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
