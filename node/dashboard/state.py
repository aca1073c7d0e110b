"""The document ``GET /api/state`` answers (docs/dashboard.md describes every field).

``build_state`` is pure: a ``NodeSnapshot``, a ``TallyCounts`` and the history's points
in, a JSON-safe dict out (no NaN or infinity: a figure that is not known is None).
``API_VERSION`` changes when a field changes meaning or goes away; new fields may appear
without it changing.
"""

from __future__ import annotations

import math
from typing import Any

from models.config import PRESETS
from node.cli.status import summarize
from node.dashboard.history import Point
from node.dashboard.snapshot import NodeSnapshot, StageSnapshot
from node.dashboard.tally import TallyCounts
from node.limits import DIRECTIONS, RECEIVED, SENT
from protocol.run_spec import RunSpec

API_VERSION = 1
RECENT_EVENTS = 30  # events the document carries, newest last


def build_state(
    snapshot: NodeSnapshot,
    counts: TallyCounts,
    points: list[Point],
    period_s: float,
) -> dict[str, Any]:
    """The API's document for one moment."""
    return {
        "api": API_VERSION,
        "time": round(snapshot.time, 3),
        "run": run_section(snapshot.run, snapshot.spec),
        "node": node_section(snapshot, counts),
        "swarm": swarm_section(snapshot),
        "history": history_section(points, period_s),
        "events": list(counts.recent[-RECENT_EVENTS:]),
    }


def preset_of(spec: RunSpec) -> str | None:
    """The name of the model preset whose model the run trains, if it is one."""
    model = spec.model
    return next((name for name, make in PRESETS.items() if make()[0] == model), None)


def run_section(run: str, spec: RunSpec | None) -> dict[str, Any]:
    name, _, owner = run.partition("@")
    section: dict[str, Any] = {"id": run, "name": name, "owner_fingerprint": owner or None}
    if spec is None:  # not joined yet: the spec is not known
        return section | {"known": False}
    model, optim = spec.model, spec.optim
    return section | {
        "known": True,
        "private": spec.private,
        "model": {
            "preset": preset_of(spec),
            "n_layer": model.n_layer,
            "n_head": model.n_head,
            "n_embd": model.n_embd,
            "block_size": model.block_size,
        },
        "n_stages": spec.n_stages,
        "boundaries": [list(b) for b in spec.boundaries],
        "compression": spec.compression,
        "averaging": spec.averaging.mode,
        "micro_batch_size": optim.micro_batch_size,
        "target_batch_size": optim.target_batch_size,
        "data": spec.data,
    }


def _stage(s: StageSnapshot) -> dict[str, Any]:
    a = s.averaging
    return {
        "stage": s.stage,
        "role": s.role,
        "forward": s.forward,
        "backward": s.backward,
        "refused": s.refused,
        "steps": s.steps,
        "load": s.load,
        "averaging": {
            "mode": a.mode,
            "epoch": a.epoch,
            "rounds": a.rounds,
            "alone": a.alone,
            "fallbacks": a.fallbacks,
            "catch_ups": a.catch_ups,
            "discarded": a.discarded,
            "last_round_s": _num(a.last_round_s),
            "mean_round_s": _num(a.mean_round_s),
            "last_group": a.last_group,
        },
    }


def node_section(snapshot: NodeSnapshot, counts: TallyCounts) -> dict[str, Any]:
    s = snapshot
    mean_loss = s.loss_sum / s.trained_micro_batches if s.trained_micro_batches else None
    return {
        "peer_id": s.peer_id,
        "state": s.state,
        "stage": s.stage,
        "second_stage": s.second_stage,
        "device": s.device,
        "uptime_s": round(s.uptime_s, 1),
        "samples_trained": s.trained_samples,
        "micro_batches_trained": s.trained_micro_batches,
        "mean_loss": _num(mean_loss),
        "samples_served": s.samples_served,
        "micro_batches_served": s.micro_batches_served,
        "calls_failed": sum(counts.calls_failed.values()),
        "calls_rerouted": sum(counts.calls_rerouted.values()),
        "requests_refused": sum(st.refused for st in s.stages),
        "bans": sum(counts.bans.values()),
        "averaging_rounds": _rounds(counts),
        "checkpoints": counts.checkpoints,
        "moves": counts.moves,
        "stages": [_stage(st) for st in s.stages],
        "network": network_section(s),
    }


def network_section(snapshot: NodeSnapshot) -> dict[str, Any]:
    """Bytes this node sent and received, by purpose (``node.limits.PURPOSES``), the
    seconds its sends and reads waited for its limits, the limits themselves (Mbit/s,
    None: none) and the bandwidth its record advertises."""
    t = snapshot.traffic
    up_down = snapshot.advertised_mbps
    section: dict[str, Any] = {
        "advertised_mbps": None if up_down is None else {"up": up_down[0], "down": up_down[1]}
    }
    if t is None:
        return section
    by = {d: {p: n for (p, dd), n in t.bytes.items() if dd == d} for d in DIRECTIONS}
    return section | {
        "bytes_sent": by[SENT],
        "bytes_received": by[RECEIVED],
        "waited_s": {d: round(s, 3) for d, s in t.waited_s.items()},
        "limit_mbps": {
            d: None if r is None else round(r * 8 / 1e6, 3) for d, r in t.limits.items()
        },
    }


def _rounds(counts: TallyCounts) -> dict[str, Any]:
    """Averaging rounds by outcome (``how``) over the node's stages, and the mean duration
    of those that carry one."""
    by_how: dict[str, int] = {}
    for (_, how), n in counts.rounds.items():
        by_how[how] = by_how.get(how, 0) + n
    timed = [d for d in counts.round_seconds.values() if d.count]
    n = sum(d.count for d in timed)
    return {
        "by_outcome": dict(sorted(by_how.items())),
        "mean_s": _num(sum(d.total for d in timed) / n) if n else None,
    }


def swarm_section(snapshot: NodeSnapshot) -> dict[str, Any]:
    """The run's peers and stages as ``swarmtrain status`` shows them (from the node's
    last read of the run's records), each peer marked with its protocol version,
    whether calls may go to it, and whether it is this node."""
    n_stages = None if snapshot.spec is None else snapshot.spec.n_stages
    view = summarize(list(snapshot.peers), n_stages, snapshot.time)
    records = {p.peer_id: p for p in snapshot.peers}
    for peer in view["peers"]:
        record = records[peer["peer_id"]]
        peer["version"] = record.version
        peer["routable"] = record.routable
        peer["me"] = peer["peer_id"] == snapshot.peer_id
    read_at = snapshot.peers_read_at
    view["read_at"] = None if read_at is None else round(read_at, 3)
    return view


def history_section(points: list[Point], period_s: float) -> dict[str, Any]:
    """Columns, oldest first: ``t`` (Unix seconds) and one list per series."""
    return {
        "period_s": period_s,
        "t": [round(p.t, 3) for p in points],
        "loss": [_num(p.loss, 4) for p in points],
        "train_samples_per_s": [_num(p.train_samples_per_s) for p in points],
        "served_samples_per_s": [_num(p.served_samples_per_s) for p in points],
        "swarm_samples_per_s": [_num(p.swarm_samples_per_s) for p in points],
    }


def _num(x: float | None, digits: int = 3) -> float | None:
    """``x`` rounded, or None if it is None, NaN or infinite (JSON has neither)."""
    return None if x is None or not math.isfinite(x) else round(x, digits)
