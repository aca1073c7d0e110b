"""Prometheus metrics of one node (``GET /metrics``), in a registry of its own.

Every metric is built at scrape time (``metric_families``, pure) from the same three
sources as the JSON API: a ``NodeSnapshot`` (counters the node keeps: samples trained and
served, requests, stages held, the run's peers as last read), the ``TallyCounts`` of its
events (failed calls, bans, averaging rounds and their durations) and the history's last
point (throughput). So ``/metrics`` and ``/api/state`` never disagree, and nothing is
counted twice. Names follow Prometheus' conventions: ``swarmtrain_`` first, counters end
in ``_total``, units in the name. docs/dashboard.md lists them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
    SummaryMetricFamily,
)

from node.cli.status import summarize
from node.dashboard.history import Point
from node.dashboard.snapshot import NodeSnapshot
from node.dashboard.tally import ROUND_BUCKETS, EventTally, TallyCounts
from protocol.records import PeerState

P = "swarmtrain_"


def _counter(name: str, text: str, labels: Iterable[str] = ()) -> CounterMetricFamily:
    return CounterMetricFamily(P + name, text, labels=list(labels))


def _gauge(name: str, text: str, labels: Iterable[str] = ()) -> GaugeMetricFamily:
    return GaugeMetricFamily(P + name, text, labels=list(labels))


def _one(family: type[Metric], name: str, text: str, value: float | None) -> Metric:
    """A metric of one unlabelled sample (none if ``value`` is None: not known yet)."""
    metric = family(P + name, text, labels=[])
    if value is not None:
        metric.add_metric([], value)
    return metric


def metric_families(
    snapshot: NodeSnapshot, counts: TallyCounts, last: Point | None
) -> list[Metric]:
    """The node's metrics at one moment."""
    s = snapshot
    C, G = CounterMetricFamily, GaugeMetricFamily
    info = _gauge("node_info", "This node (always 1): its run and peer id", ["run", "peer"])
    info.add_metric([s.run, s.peer_id], 1)
    state = _gauge("node_state", "1 for the node's state, 0 for the others", ["state"])
    for st in PeerState:
        state.add_metric([st.value], 1 if st.value == s.state else 0)
    out: list[Metric] = [info, state]
    out += [
        _one(G, "uptime_seconds", "Seconds since the node started", s.uptime_s),
        # Training: this node's trainer.
        _one(C, "samples_trained_total", "Samples this node's trainer trained", s.trained_samples),
        _one(C, "micro_batches_trained_total", "Micro-batches it trained", s.trained_micro_batches),
        SummaryMetricFamily(
            P + "train_loss",
            "Training loss of this node's micro-batches (mean: rate of _sum / rate of _count)",
            count_value=s.trained_micro_batches,
            sum_value=s.loss_sum,
        ),
    ]
    calls = _counter("calls_total", "This node's trainer's stage calls", ["stage", "outcome"])
    for stage in sorted(set(s.calls) | set(counts.calls_failed)):
        calls.add_metric([str(stage), "ok"], s.calls.get(stage, 0))
        calls.add_metric([str(stage), "failed"], counts.calls_failed.get(stage, 0))
    rerouted = _counter("calls_rerouted_total", "Failed calls sent again to a peer", ["stage"])
    for stage, n in sorted(counts.calls_rerouted.items()):
        rerouted.add_metric([str(stage)], n)
    out += [calls, rerouted]

    # Serving: this node's stages.
    out.append(
        _one(
            C, "samples_served_total", "Samples its stages computed a forward for", s.samples_served
        )
    )
    requests = _counter(
        "stage_requests_total",
        "Requests to a held stage since the node took it, by kind (forward, backward, refused)",
        ["stage", "kind"],
    )
    held = _gauge("stage_held", "1 for each stage the node holds", ["stage", "role"])
    load = _gauge("stage_load", "Requests being received, queued or computed", ["stage"])
    steps = _gauge("stage_optimizer_step", "Optimizer steps of the stage's copy", ["stage"])
    epoch = _gauge("stage_averaging_epoch", "Averaging epoch of the stage's copy", ["stage"])
    for st in s.stages:
        label = str(st.stage)
        requests.add_metric([label, "forward"], st.forward)
        requests.add_metric([label, "backward"], st.backward)
        requests.add_metric([label, "refused"], st.refused)
        held.add_metric([label, st.role], 1)
        load.add_metric([label], st.load)
        steps.add_metric([label], st.steps)
        epoch.add_metric([label], st.averaging.epoch)
    out += [requests, _one(G, "stages_held", "Stages it holds", len(s.stages))]
    out += [held, load, steps, epoch]

    # Averaging and the node's other events.
    rounds = _counter("averaging_rounds_total", "Averaging rounds by outcome", ["stage", "how"])
    for (stage, how), n in sorted(counts.rounds.items()):
        rounds.add_metric([str(stage), how], n)
    duration = HistogramMetricFamily(
        P + "averaging_round_duration_seconds",
        "From a round's trigger to its applied step, by outcome",
        labels=["how"],
    )
    for how, d in sorted(counts.round_seconds.items()):
        cumulative, buckets = 0, []
        for bound, n in zip((*map(str, ROUND_BUCKETS), "+Inf"), d.counts, strict=True):
            cumulative += n
            buckets.append((bound, cumulative))
        duration.add_metric([how], buckets, d.total)
    bans = _counter("bans_total", "Callers banned for repeated refusals", ["service"])
    for service, n in sorted(counts.bans.items()):
        bans.add_metric([service], n)
    out += [rounds, duration, bans]
    out += [
        _one(C, "checkpoints_written_total", "Checkpoints written", counts.checkpoints),
        _one(C, "moves_total", "Moves to another stage", counts.moves),
        _one(C, "peers_joined_total", "Peers seen joining the run", counts.peers_joined),
        _one(C, "peers_left_total", "Peers seen leaving the run", counts.peers_left),
    ]

    out += network_families(s)

    # The swarm, as this node last read the run's records.
    view = summarize(list(s.peers), None if s.spec is None else s.spec.n_stages, s.time)
    peers = _gauge(
        "swarm_stage_peers", "Peers serving each stage, as this node sees them", ["stage"]
    )
    capacity = _gauge(
        "swarm_stage_throughput_samples_per_second",
        "Throughput the stage's peers announce (what routing offers on it)",
        ["stage"],
    )
    for stage in view["stages"]:
        peers.add_metric([str(stage["stage"])], stage["serving"])
        capacity.add_metric([str(stage["stage"])], stage["throughput"])
    out += [peers, capacity, _one(G, "swarm_peers", "Peers in the run", len(view["peers"]))]

    # Rates over the history's last period (none before its second reading).
    period = ", over the last history period"
    out += [
        _one(G, "train_throughput_samples_per_second", "Samples/s it trained" + period,
             last and last.train_samples_per_s),
        _one(G, "served_throughput_samples_per_second", "Samples/s it served" + period,
             last and last.served_samples_per_s),
        _one(G, "swarm_throughput_samples_per_second", "Samples/s the swarm trained" + period,
             last and last.swarm_samples_per_s),
    ]  # fmt: skip
    return out


def network_families(s: NodeSnapshot) -> list[Metric]:
    """Bytes by purpose and direction, the waits for the limits, the limits and the
    bandwidth the node's record advertises."""
    out: list[Metric] = []
    t = s.traffic
    if t is not None:
        moved = _counter(
            "network_bytes_total",
            "Bytes this node sent and received on its streams, by purpose (activations, "
            "gradients, averaging, state, probe, other)",
            ["purpose", "direction"],
        )
        for (purpose, direction), n in t.bytes.items():
            moved.add_metric([purpose, direction], n)
        waited = _counter(
            "network_throttled_seconds_total",
            "Seconds its sends and reads waited for --max-upload-mbps / --max-download-mbps",
            ["direction"],
        )
        limit = _gauge(
            "network_limit_bytes_per_second", "The limit a volunteer set, if any", ["direction"]
        )
        for direction, seconds in t.waited_s.items():
            waited.add_metric([direction], seconds)
            if t.limits[direction] is not None:
                limit.add_metric([direction], t.limits[direction])
        out += [moved, waited, limit]
    advertised = _gauge(
        "advertised_bandwidth_bytes_per_second",
        "The bandwidth this node's record advertises (measured or declared, capped by its "
        "limits), what routing and assignment plan with",
        ["direction"],
    )
    if s.advertised_mbps is not None:
        for direction, mbps in zip(("up", "down"), s.advertised_mbps, strict=True):
            advertised.add_metric([direction], mbps * 1e6 / 8)
    return [*out, advertised]


class NodeCollector:
    """A prometheus_client collector: ``metric_families`` of the node now."""

    def __init__(
        self,
        source: Callable[[], NodeSnapshot],
        tally: EventTally,
        last_point: Callable[[], Point | None],
    ) -> None:
        self._source, self._tally, self._last = source, tally, last_point

    def collect(self) -> Iterable[Metric]:
        return metric_families(self._source(), self._tally.counts(), self._last())


def node_registry(collector: NodeCollector) -> CollectorRegistry:
    """A registry of one node's metrics and its process's (CPU, memory, open files); not
    prometheus_client's global one, so that nothing else in the process adds to it."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    ProcessCollector(registry=registry)
    return registry
