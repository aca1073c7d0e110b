"""The dashboard's pure parts (``node.dashboard``): the ``--dashboard`` address, the event
tally fed through ``events.listen``, the history's rates, the JSON document and the
Prometheus metrics, each built from hand-made snapshots. The server itself is tested
live (tests/live/test_dashboard.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from node import events
from node.cli.main import build_parser
from node.cli.node import settings_from
from node.dashboard.address import DEFAULT, Address, parse_address
from node.dashboard.history import History, Totals
from node.dashboard.metrics import NodeCollector, node_registry
from node.dashboard.snapshot import AveragingSnapshot, NodeSnapshot, StageSnapshot
from node.dashboard.state import build_state, preset_of
from node.dashboard.tally import ROUND_BUCKETS, EventTally
from protocol.identity import peer_id_of
from protocol.records import PeerState
from protocol.run_spec import make_run_spec
from tests.records import peer_info

OWNER = peer_id_of(Ed25519PrivateKey.generate().public_key())
SPEC = make_run_spec("dash", "tiny", 2, owner=OWNER)
RUN = SPEC.run
ME, A, B, GONE = (peer_id_of(Ed25519PrivateKey.generate().public_key()) for _ in range(4))


# -- the address ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (DEFAULT, Address("127.0.0.1", 8765)),
        ("auto", Address("127.0.0.1", 0)),
        ("AUTO", Address("127.0.0.1", 0)),
        ("9100", Address("127.0.0.1", 9100)),
        ("localhost:9100", Address("127.0.0.1", 9100)),
        ("0.0.0.0:9100", Address("0.0.0.0", 9100)),
        ("[::1]:9100", Address("::1", 9100)),
        ("off", None),
    ],
)
def test_dashboard_addresses(text: str, expected: Address | None) -> None:
    assert parse_address(text) == expected


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("example.org:80", "IP address or localhost"),
        ("127.0.0.1:99999", "0 to 65535"),
        ("127.0.0.1:", "0 to 65535"),
        ("nonsense", "HOST:PORT, PORT, auto or off"),
        (":8765", "HOST:PORT"),
    ],
)
def test_bad_dashboard_addresses_are_one_line_errors(text: str, says: str) -> None:
    with pytest.raises(ValueError, match=says) as error:
        parse_address(text)
    assert "\n" not in str(error.value) and "--dashboard" in str(error.value)


def test_only_loopback_addresses_are_private() -> None:
    assert Address("127.0.0.1", 1).loopback and Address("::1", 1).loopback
    assert not Address("0.0.0.0", 1).loopback and not Address("192.0.2.1", 1).loopback
    assert Address("::1", 8765).url() == "http://[::1]:8765/"
    assert Address("127.0.0.1", 0).url(port=4321) == "http://127.0.0.1:4321/"


def test_the_flag_defaults_to_loopback_and_refuses_bad_input(capsys) -> None:
    args = build_parser(["node"]).parse_args(["node", "--run", "r"])
    assert settings_from(args).dashboard == DEFAULT
    args = build_parser(["node"]).parse_args(["node", "--run", "r", "--dashboard", "off"])
    assert settings_from(args).dashboard == "off"
    with pytest.raises(SystemExit) as exit_:
        build_parser(["node"]).parse_args(["node", "--run", "r", "--dashboard", "host.example:1"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--dashboard 'host.example:1'" in err


# -- events -> tally -------------------------------------------------------------------


def test_listeners_get_every_event_until_stopped_and_cannot_break_emit() -> None:
    tally = EventTally(recent=3)
    stop = events.listen(tally)

    def broken(record: dict) -> None:
        raise RuntimeError("a bug in a listener")

    stop_broken = events.listen(broken)
    try:
        events.emit("call.failed", stage=1, peer=A, error="StageTimeout: ...")
        events.emit("call.failed", stage=1, peer=B, error="StageTimeout: ...")
        events.emit("call.rerouted", stage=1, peer=B)
        events.emit("peer.banned", peer=A, service="StageServer")
        events.emit("averaging.round", stage=0, epoch=3, peers=2, ok=True, how="averaged",
                    seconds=0.4)  # fmt: skip
        events.emit("averaging.round", stage=0, epoch=4, peers=2, ok=True, how="averaged",
                    seconds=7.0)  # fmt: skip
        events.emit("averaging.round", stage=0, epoch=4, peers=0, ok=True, how="loaded")
        events.emit("checkpoint.written", stage=0, step=4, path=Path("/x"), norm=math.nan)
    finally:
        stop()
        stop_broken()
    events.emit("call.failed", stage=1, peer=A, error="after the listener stopped")
    counts = tally.counts()
    assert counts.calls_failed == {1: 2} and counts.calls_rerouted == {1: 1}
    assert counts.bans == {"StageServer": 1} and counts.checkpoints == 1
    assert counts.rounds == {(0, "averaged"): 2, (0, "loaded"): 1}
    durations = counts.round_seconds["averaged"]
    assert durations.count == 2 and durations.total == pytest.approx(7.4)
    assert durations.counts[ROUND_BUCKETS.index(0.5)] == 1  # 0.4 s: at most 0.5
    assert durations.counts[ROUND_BUCKETS.index(10.0)] == 1  # 7 s: at most 10
    assert "loaded" not in counts.round_seconds  # no duration: not in the histogram
    assert [e["event"] for e in counts.recent] == [
        "averaging.round",
        "averaging.round",
        "checkpoint.written",
    ]  # the last 3, JSON-safe
    assert counts.recent[-1]["path"] == "/x" and counts.recent[-1]["norm"] is None
    json.dumps(counts.recent, allow_nan=False)


# -- history ---------------------------------------------------------------------------


def test_history_rates_loss_and_bounds() -> None:
    history = History(capacity=3)
    assert history.record(Totals(time=100.0, n_stages=2)) is None  # the first: a baseline
    point = history.record(
        Totals(time=105.0, trained_samples=80, trained_micro_batches=10, loss_sum=25.0,
               samples_served=40, n_stages=2)
    )  # fmt: skip
    assert point is not None
    assert point.loss == pytest.approx(2.5) and point.train_samples_per_s == pytest.approx(16)
    assert point.served_samples_per_s == pytest.approx(8)
    idle = history.record(
        Totals(time=110.0, trained_samples=80, trained_micro_batches=10, loss_sum=25.0,
               samples_served=40, n_stages=2)
    )  # fmt: skip
    assert idle.loss is None and idle.train_samples_per_s == 0  # nothing trained: no loss
    assert history.record(Totals(time=110.0, n_stages=2)) is None  # not later: ignored
    for t in (115.0, 120.0):
        history.record(Totals(time=t, n_stages=2))
    assert [p.t for p in history.points()] == [110.0, 115.0, 120.0]  # the oldest went
    went_back, last = history.points()[1:]
    assert went_back.train_samples_per_s is None  # a counter that went back: unknown
    assert last.train_samples_per_s == 0 and history.last() == last


def test_swarm_rate_comes_from_each_peers_records() -> None:
    history = History()
    history.record(Totals(time=0.0, n_stages=2, peers_served={A: (10.0, 100), B: (10.0, 100)}))
    # a: 200 samples in 4 s of its records; b: its record not refreshed yet (rate 0 so far)
    point = history.record(
        Totals(time=5.0, n_stages=2, peers_served={A: (14.0, 900), B: (10.0, 100)})
    )
    assert point.swarm_samples_per_s == pytest.approx(200 / 2)
    point = history.record(
        Totals(time=10.0, n_stages=2, peers_served={A: (14.0, 900), B: (20.0, 1100)})
    )
    assert point.swarm_samples_per_s == pytest.approx((200 + 100) / 2)  # a's last rate kept
    point = history.record(Totals(time=15.0, n_stages=2, peers_served={B: (20.0, 1100)}))
    assert point.swarm_samples_per_s == pytest.approx(100 / 2)  # a is gone


# -- the JSON document and the metrics ------------------------------------------------


def _averaging(**changes) -> AveragingSnapshot:
    fields = dict(
        mode="gradient", epoch=7, rounds=5, alone=2, fallbacks=0, catch_ups=0, discarded=0,
        last_round_s=0.5, mean_round_s=0.4, last_group=2,
    )  # fmt: skip
    return AveragingSnapshot(**{**fields, **changes})


def _snapshot(**changes) -> NodeSnapshot:
    now = 1_000_000.0
    fields = dict(
        time=now, run=RUN, peer_id=ME, state="serving", started=now - 90, spec=SPEC, stage=0,
        device="cpu", micro_batches_served=30, samples_served=240, trained_micro_batches=20,
        trained_samples=160, loss_sum=50.0, calls={0: 20, 1: 20}, peers_read_at=now - 2,
        stages=(StageSnapshot(stage=0, role="first", forward=30, backward=29, refused=1,
                              steps=7, load=2, averaging=_averaging()),),
        peers=(peer_info(RUN, ME, stage=0, timestamp=now - 1, samples_served=240),
               peer_info(RUN, A, stage=1, timestamp=now - 3),
               peer_info(RUN, B, stage=1, timestamp=now - 3, second_stage=0,
                         second_serving=True),
               peer_info(RUN, GONE, stage=0, state=PeerState.LEAVING,
                         timestamp=now - 1)),
    )  # fmt: skip
    return NodeSnapshot(**{**fields, **changes})


def _tally() -> EventTally:
    tally = EventTally()
    for record in (
        {"event": "call.failed", "stage": 1, "peer": A, "error": "x"},
        {"event": "peer.banned", "peer": A, "service": "StageServer"},
        {"event": "averaging.round", "stage": 0, "how": "averaged", "seconds": 0.3},
        {"event": "averaging.round", "stage": 0, "how": "averaged", "seconds": 0.5},
        {"event": "averaging.round", "stage": 0, "how": "alone", "seconds": 0.1},
    ):
        tally(record)
    return tally


def test_state_lists_the_run_the_node_and_every_peer_per_stage() -> None:
    history = History()
    history.record(Totals(time=1.0, n_stages=2))
    history.record(Totals(time=6.0, trained_micro_batches=2, loss_sum=math.nan, n_stages=2))
    state = build_state(_snapshot(), _tally().counts(), history.points(), 5.0)
    json.dumps(state, allow_nan=False)  # JSON-safe: a NaN loss became None
    assert state["history"]["loss"] == [None] and state["history"]["period_s"] == 5.0

    run = state["run"]
    assert run["id"] == RUN and run["owner_fingerprint"] == RUN.partition("@")[2]
    assert run["model"]["preset"] == "tiny" and run["n_stages"] == 2 and not run["private"]

    node = state["node"]
    assert (node["peer_id"], node["state"], node["stage"]) == (ME, "serving", 0)
    assert node["uptime_s"] == 90 and node["mean_loss"] == pytest.approx(50 / 20)
    assert (node["samples_trained"], node["samples_served"]) == (160, 240)
    assert (node["calls_failed"], node["requests_refused"], node["bans"]) == (1, 1, 1)
    assert node["averaging_rounds"] == {
        "by_outcome": {"alone": 1, "averaged": 2},
        "mean_s": pytest.approx(0.3),
    }
    (held,) = node["stages"]
    assert held["stage"] == 0 and held["averaging"]["rounds"] == 5

    swarm = state["swarm"]
    assert {p["peer_id"]: p["stage"] for p in swarm["peers"]} == {ME: 0, A: 1, B: 1}
    assert [p["me"] for p in swarm["peers"] if p["peer_id"] == ME] == [True]
    assert [(s["stage"], s["serving"], s["also_served_by"]) for s in swarm["stages"]] == [
        (0, 2, 1),  # us, and b as its second stage
        (1, 2, 0),
    ]
    assert swarm["read_at"] == pytest.approx(1_000_000.0 - 2)


def test_state_before_the_node_has_joined() -> None:
    snapshot = NodeSnapshot(time=10.0, run="dash", peer_id=ME, state="joining", started=9.0)
    state = build_state(snapshot, EventTally().counts(), [], 5.0)
    json.dumps(state, allow_nan=False)
    assert state["run"] == {"id": "dash", "name": "dash", "owner_fingerprint": None,
                            "known": False}  # fmt: skip
    assert state["node"]["stage"] is None and state["swarm"]["peers"] == []
    assert state["history"]["t"] == []


def test_a_custom_model_has_no_preset_name() -> None:
    custom = make_run_spec("dash", "tiny", 2, owner=OWNER).model_copy(
        update={"arch": {**SPEC.arch, "n_layer": 2}}
    )
    assert preset_of(SPEC) == "tiny" and preset_of(custom) is None


def _scrape(registry) -> dict[tuple[str, tuple], float]:
    text = generate_latest(registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_metrics_follow_the_snapshot_and_the_events() -> None:
    current = [_snapshot()]
    tally = _tally()
    history = History()
    registry = node_registry(NodeCollector(lambda: current[0], tally, history.last))
    first = _scrape(registry)
    assert first[("swarmtrain_samples_trained_total", ())] == 160
    assert first[("swarmtrain_samples_served_total", ())] == 240
    assert first[("swarmtrain_train_loss_sum", ())] == 50.0
    assert first[("swarmtrain_calls_total", (("outcome", "failed"), ("stage", "1")))] == 1
    assert first[("swarmtrain_calls_total", (("outcome", "ok"), ("stage", "0")))] == 20
    assert first[("swarmtrain_bans_total", (("service", "StageServer"),))] == 1
    assert first[("swarmtrain_averaging_rounds_total", (("how", "averaged"), ("stage", "0")))] == 2
    bucket = ("swarmtrain_averaging_round_duration_seconds_bucket", (("how", "averaged"),))
    assert first[(bucket[0], (*bucket[1], ("le", "0.25")))] == 0
    assert first[(bucket[0], (*bucket[1], ("le", "0.5")))] == 2  # cumulative: 0.3 and 0.5
    assert first[(bucket[0], (*bucket[1], ("le", "+Inf")))] == 2
    assert first[("swarmtrain_stages_held", ())] == 1
    assert first[("swarmtrain_node_state", (("state", "serving"),))] == 1
    assert first[("swarmtrain_swarm_stage_peers", (("stage", "0"),))] == 2
    assert first[("swarmtrain_swarm_peers", ())] == 3  # the leaving one is not counted
    assert ("swarmtrain_train_throughput_samples_per_second", ()) not in first  # no point yet
    assert any(name.startswith("process_") for name, _ in first)  # the process's own

    history.record(Totals.of(current[0]))
    current[0] = _snapshot(time=1_000_005.0, trained_samples=240, trained_micro_batches=30)
    history.record(Totals.of(current[0]))
    tally({"event": "averaging.round", "stage": 0, "how": "fallback", "seconds": 40.0})
    second = _scrape(registry)
    assert second[("swarmtrain_samples_trained_total", ())] == 240
    assert second[("swarmtrain_train_throughput_samples_per_second", ())] == pytest.approx(16)
    assert second[("swarmtrain_averaging_rounds_total", (("how", "fallback"), ("stage", "0")))] == 1
