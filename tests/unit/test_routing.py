"""Probation routing (``protocol.routing.Probation``, ``route``, ``keep_unproven``): a peer
earns its share of calls by calls that succeed, whatever its record claims."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from protocol.routing import Candidate, Probation, keep_unproven, refresh_period, route

HONEST = Candidate("honest", 100.0, 0)
SYBILS = [Candidate(f"sybil{i:04d}", 1e9, 0) for i in range(1000)]


def _draws(candidates, probation, n=2000, now=0.0, **kwargs) -> Counter:
    rng = random.Random(0)
    return Counter(route(candidates, rng, probation, now, **kwargs)[0] for _ in range(n))


def test_a_new_peer_earns_its_share_by_successes():
    p = Probation(start_share=1 / 16)
    assert not p.proven("a") and p.share("a") == 0.0
    shares = []
    for _ in range(6):
        p.succeeded("a")
        shares.append(p.share("a"))
    assert shares == [1 / 16, 1 / 8, 1 / 4, 1 / 2, 1.0, 1.0]
    p.failed("a", now=0.0)
    assert p.share("a") == 0.5 and p.proven("a") and not p.suspect("a", 0.0)


def test_an_unproven_peer_that_fails_is_a_suspect_for_longer_each_time():
    p = Probation(suspect_s=10.0)
    p.failed("s", now=0.0)
    assert p.suspect("s", 9.9) and not p.suspect("s", 10.0)
    p.failed("s", now=10.0)
    assert p.suspect("s", 29.9) and not p.suspect("s", 30.0)
    p.succeeded("s")  # it served after all
    assert p.proven("s") and not p.suspect("s", 30.0)


def test_claims_of_unproven_peers_draw_only_the_probe_share():
    p = Probation(probe_share=0.1)
    p.succeeded("honest")
    drawn = _draws([HONEST, *SYBILS], p)
    assert 0.85 < drawn["honest"] / 2000 < 0.95  # 1e9 claims count for nothing


def test_one_probe_at_a_time_while_a_proven_peer_is_there():
    p = Probation()
    p.succeeded("honest")
    rng = random.Random(1)
    picks = {route([HONEST, *SYBILS], rng, p, 0.0, probing=True) for _ in range(200)}
    assert picks == {("honest", False)}


def test_with_no_proven_peer_every_call_probes_and_connected_peers_go_first():
    p = Probation()
    drawn = _draws([HONEST, *SYBILS], p, n=200, preferred={"honest"})
    assert drawn == {"honest": 200}
    rng = random.Random(2)
    assert route([HONEST, *SYBILS], rng, p, 0.0)[1] is True
    spread = _draws([HONEST, *SYBILS], p, n=2000)
    assert spread["honest"] < 20  # uniformly drawn: the 1e9 claims do not help them either


def test_suspects_are_skipped_until_nothing_else_is_left():
    p = Probation()
    for c in SYBILS[:999]:
        p.failed(c.peer_id, now=0.0)
    drawn = _draws(SYBILS, p, n=100, now=1.0)
    assert drawn == {SYBILS[999].peer_id: 100}
    p.failed(SYBILS[999].peer_id, now=0.0)
    assert sum(_draws(SYBILS, p, n=100, now=1.0).values()) == 100  # all suspects: still a peer


def test_proven_peers_share_by_throughput_share_and_load():
    p = Probation()
    for _ in range(5):
        p.succeeded("a")
    p.succeeded("b")  # one success: 1/16 of its claim
    drawn = _draws([Candidate("a", 100.0, 0), Candidate("b", 100.0, 0)], p, n=4000)
    assert 0.9 < drawn["a"] / 4000 < 0.97
    drawn = _draws([Candidate("a", 100.0, 0), Candidate("b", 1600.0, 0)], p, n=4000)
    assert 0.45 < drawn["a"] / 4000 < 0.55  # b claims 16x, and has earned 1/16 of it
    drawn = _draws([Candidate("a", 100.0, 3), Candidate("b", 1600.0, 0)], p, n=4000)
    assert 0.15 < drawn["a"] / 4000 < 0.25  # a's queue: 4x its expected busy time


def test_a_reader_keeps_a_bounded_number_of_unproven_peers():
    p = Probation()
    p.succeeded("honest")
    ids = ["honest", *(c.peer_id for c in SYBILS)]
    for c in SYBILS[:500]:
        p.failed(c.peer_id, now=0.0)
    rng = random.Random(3)
    kept = keep_unproven(ids, p, 1.0, 16, rng, preferred={"sybil0999"})
    assert len(kept) == 16 and "honest" not in kept and kept[0] == "sybil0999"
    assert all(int(k[5:]) >= 500 for k in kept)  # suspects last
    later = keep_unproven(ids, p, 1.0, 16, rng)
    assert set(later) != set(kept)  # another draw: a flood is gone through in turn
    assert len(keep_unproven(ids[:10], p, 1.0, 16, rng)) == 9


def test_probation_settings_are_checked():
    with pytest.raises(ValueError, match="start_share"):
        Probation(start_share=0.0)
    with pytest.raises(ValueError, match="suspect_s"):
        Probation(suspect_s=0.0)
    with pytest.raises(ValueError, match="no peer serves"):
        route([], random.Random(0), Probation(), 0.0)


def test_when_every_proven_peer_is_banned_calls_wait_for_them_not_for_the_flood():
    """A proven peer that shed a call (busy) is banned for a moment: the flood's records
    must not take the calls meanwhile, unless a connected peer can be probed."""
    p = Probation(probe_share=0.0)
    p.succeeded("honest")
    banned = frozenset({"honest"})
    drawn = _draws([HONEST, *SYBILS], p, n=200, banned=banned)
    assert drawn == {"honest": 200}
    rng = random.Random(4)
    picked = route([HONEST, *SYBILS], rng, p, 0.0, banned=banned, preferred={"sybil0007"})
    assert picked == ("sybil0007", True)  # a connected peer runs a host: worth a probe
    assert _draws(SYBILS, p, n=50, banned=banned)["honest"] == 0  # none proven: probes


def test_a_large_run_is_read_less_often_within_a_bound():
    assert refresh_period(2.0, 4) == 2.0
    assert refresh_period(2.0, 64) == 2.0
    assert refresh_period(2.0, 256) == 8.0
    assert refresh_period(2.0, 2000) == 16.0  # at most 8x
