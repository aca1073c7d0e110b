"""What a person running the tools sees, without a network: the progress bar and lines,
``status``'s table of a run (stage totals with two-stage peers, peer ids that can be
passed back), the peer record's served samples and uptime, and when a cached throughput
is measured again."""

from __future__ import annotations

import io
import json

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hivemind.utils import get_dht_time

from node.cli.main import build_parser
from node.cli.node import settings_from
from node.cli.progress import Progress
from node.cli.status import render, summarize
from node.cli.train import CsvLog
from node.measure import capacity
from node.measure.capacity import pick_device, stage_throughputs
from protocol.identity import peer_id_of, resolve_peer_prefix, short_peer_ids
from protocol.ownership import make_run_id
from protocol.records import PeerInfo, decode_peer_info, encode_peer_info
from protocol.run_spec import make_run_spec
from tests.records import peer_info

KEYS = [Ed25519PrivateKey.from_private_bytes(bytes([i]) * 32) for i in range(1, 5)]
IDS = [peer_id_of(k.public_key()) for k in KEYS]
RUN = make_run_id("ops", IDS[0])


class Clock:
    """A monotonic clock that moves when told."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_in_a_log_is_plain_lines_with_an_eta_every_few_seconds():
    stream, clock = io.StringIO(), Clock()
    p = Progress("training", 100, stream=stream, every_s=5, clock=clock)
    p.update(0)
    assert "0/100 [00:00<?" in stream.getvalue()  # no pace yet: no time left to show
    for done in range(1, 21):  # an item every 0.5 s: a line at 5 s and at 10 s
        clock.now = done / 2
        p.update(done, loss=1.0)
    lines = stream.getvalue().splitlines()
    assert len(lines) == 3 and "\r" not in stream.getvalue() and "\x1b" not in stream.getvalue()
    assert "20/100 [00:10<00:40" in lines[-1] and "loss=1" in lines[-1]
    clock.now = 11.0
    p.update(21)  # within 5 s of the last line: held back, until close
    assert len(stream.getvalue().splitlines()) == 3
    p.close()
    assert "21/100 [00:11<" in stream.getvalue().splitlines()[-1]
    clock.now = 12.0
    p.update(100)  # done: written at once
    assert "100/100 [00:12<00:00" in stream.getvalue().splitlines()[-1]


def test_progress_on_a_terminal_is_one_line_redrawn_in_place():
    stream = Terminal()
    p = Progress("training", 10, stream=stream)
    for done in range(1, 11):
        p.update(done, loss=2.0)
    p.close()
    text = stream.getvalue()
    assert text.count("\n") <= 1 and "\r" in text  # redrawn, not appended
    assert "training" in text and "10/10" in text and "loss=2" in text


def test_csv_log_has_a_whole_line_per_row(tmp_path):
    path = tmp_path / "sub" / "loss.csv"
    log = CsvLog(path)
    log.val(0, 5.5)
    log.train(8, 5.25)
    # Nothing buffered: another reader sees every row before the file is closed.
    assert path.read_text() == "samples,train_loss,val_loss\n0,,5.500000\n8,5.250000,\n"
    log.close()
    CsvLog(path).close()  # a new run replaces the file
    assert path.read_text() == "samples,train_loss,val_loss\n"


def test_short_peer_ids_are_unique_prefixes_that_resolve():
    ids = [*IDS, IDS[0][:20] + "x" * (len(IDS[0]) - 20)]  # one sharing 20 characters
    short = short_peer_ids(ids)
    assert all(len(s) >= 16 and pid.startswith(s) for pid, s in short.items())
    assert len(short[IDS[0]]) == 21  # one more than the prefix it shares
    for pid, s in short.items():
        assert resolve_peer_prefix(s, ids) == pid
        assert resolve_peer_prefix(pid, ids) == pid
    with pytest.raises(ValueError, match="start with"):
        resolve_peer_prefix(IDS[0][:20], ids)  # both
    with pytest.raises(ValueError, match="no known peer"):
        resolve_peer_prefix("12D3KooWnobody", ids)
    with pytest.raises(ValueError):
        resolve_peer_prefix("", ids)


def test_status_counts_a_stage_served_only_as_a_second_stage():
    """One peer holds stage 1 first and serves stage 0 as its second: stage 0 is served,
    at the share of the peer's time routing gives it, and the table says so."""
    now = get_dht_time()
    both = peer_info(RUN, IDS[0], stage=1, second_stage=0, second_serving=True, timestamp=now)
    view = summarize([both], 2, now)
    s0, s1 = view["stages"]
    assert (s0["serving"], s0["also_served_by"], s0["peers"]) == (1, 1, 0)
    assert s1["serving"] == 1
    assert s0["throughput"] > 0 and s1["throughput"] > 0
    assert s0["throughput"] + s1["throughput"] == pytest.approx(50.0)  # its time, divided
    assert "stage 0: 0 serving" not in render(view)
    # A fast peer joins stage 1: the two-stage peer gives stage 0 all its time, and stage
    # 0 is still the one the pipeline waits on.
    other = peer_info(RUN, IDS[1], stage=1, throughput=(50.0, 200.0), timestamp=now)
    view = summarize([both, other], 2, now)
    assert [s["throughput"] for s in view["stages"]] == pytest.approx([50.0, 200.0])
    assert view["bottleneck_stage"] == 0


def test_status_shows_samples_served_and_uptime():
    now = get_dht_time()
    p = peer_info(RUN, IDS[0], samples_served=1234, started=now - 90, timestamp=now)
    # the fields travel in the signed record
    raw = encode_peer_info(p, KEYS[0])
    assert decode_peer_info(raw, subkey=IDS[0], run=RUN, now=now, max_age_s=60) == p
    row = summarize([p], 2, now)["peers"][0]
    assert row["samples_served"] == 1234 and row["uptime_s"] == pytest.approx(90, abs=1)
    assert row["short_id"] in render(summarize([p], 2, now))
    old = peer_info(RUN, IDS[1], timestamp=now)  # a record without them
    assert summarize([old], 2, now)["peers"][0]["uptime_s"] is None
    with pytest.raises(ValueError):
        peer_info(RUN, IDS[0], samples_served=-1)
    with pytest.raises(ValueError):
        peer_info(RUN, IDS[0], started=now + 60, timestamp=now)
    assert PeerInfo.model_fields["samples_served"].default == 0


def test_a_cached_throughput_far_off_a_quick_check_is_measured_again(tmp_path, monkeypatch):
    spec = make_run_spec("capacity", "tiny", 2, owner=IDS[0])
    device = pick_device("cpu")
    calls = []
    real = capacity.measure_stage

    def measure(*args, **kwargs) -> float:  # a few passes: which stages, not how precisely
        calls.append(args[1])
        return real(*args, **{"min_time_s": 0.02, **kwargs})

    monkeypatch.setattr(capacity, "measure_stage", measure)
    measured = stage_throughputs(spec, device, tmp_path)
    cache = tmp_path / "throughput.json"
    key = next(iter(json.loads(cache.read_text())))

    def plant(figures: list[float]) -> None:
        cache.write_text(json.dumps({key: figures}))

    calls.clear()
    monkeypatch.setattr(capacity, "quick_check", lambda spec, device: measured[0])
    # Measured under load: 100x too low. A quick check tells, and every stage is measured.
    plant([measured[0] / 100, measured[1] / 100])
    again = stage_throughputs(spec, device, tmp_path)
    assert again[0] > measured[0] / 10 and calls == [0, 1]
    assert json.loads(cache.read_text())[key] == again  # and cached for the next start
    # Within 3x of the quick check: the cache is kept as it is, nothing measured.
    calls.clear()
    plant([measured[0] * 2, 7.0])
    assert stage_throughputs(spec, device, tmp_path) == [measured[0] * 2, 7.0] and not calls
    # ... unless asked to measure again.
    assert stage_throughputs(spec, device, tmp_path, remeasure=True) != [measured[0] * 2, 7.0]
    assert calls == [0, 1]


def test_node_takes_remeasure():
    args = build_parser().parse_args(["node", "--run", "r", "--remeasure"])
    assert settings_from(args).remeasure
    assert not settings_from(build_parser().parse_args(["node", "--run", "r"])).remeasure


def test_revoke_takes_a_unique_prefix_as_status_shows_it():
    """``run revoke --peer`` completes a prefix from the run's peers; a whole id needs no
    lookup (a revoked peer may be offline), and an ambiguous prefix is refused."""
    import asyncio
    from types import SimpleNamespace

    from node.cli.run import _full_peer_ids

    class Peers:  # the run's records in the DHT, as ``SwarmDHT.peers`` returns them
        reads = 0

        async def peers(self):
            Peers.reads += 1
            return [SimpleNamespace(peer_id=p) for p in IDS]

    short = short_peer_ids(IDS)
    assert asyncio.run(_full_peer_ids(Peers(), [IDS[0]])) == [IDS[0]]
    assert Peers.reads == 0
    assert asyncio.run(_full_peer_ids(Peers(), [short[IDS[1]]])) == [IDS[1]]
    with pytest.raises(ValueError, match="give more of the id"):
        asyncio.run(_full_peer_ids(Peers(), ["12D3KooW"]))


def test_status_shows_reachability_and_counts_no_unreachable_server():
    now = get_dht_time()
    home = peer_info(RUN, IDS[0], stage=None, state="joining", reachable=False, timestamp=now)
    public = peer_info(RUN, IDS[1], stage=0, reachable=True, timestamp=now)
    # found unreachable after it took a stage: still listed, but routing skips it
    late = peer_info(RUN, IDS[2], stage=1, reachable=False, timestamp=now)
    view = summarize([home, public, late], 2, now)
    rows = {p["peer_id"]: p for p in view["peers"]}
    assert [rows[i]["reachable"] for i in IDS[:3]] == [False, True, False]
    assert [s["serving"] for s in view["stages"]] == [1, 0]
    lines = {line.split()[0]: line for line in render(view).splitlines()[1:4]}
    assert lines[rows[IDS[0]]["short_id"]].endswith(" no (trainer only)")
    assert lines[rows[IDS[1]]["short_id"]].endswith(" yes")
    assert (
        render(summarize([peer_info(RUN, IDS[0], timestamp=now)], 2, now))
        .splitlines()[1]
        .endswith(" ?")
    )
