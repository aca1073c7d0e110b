"""``protocol.reachability`` without a network: the dial-back messages, the addresses a
peer may be dialled at, the verdict rule against lying peers; and relays: which one a
node serves through, when it checks its reservation and chooses another (``RelayWatch``,
and ``RelayKeeper`` with a fake daemon and probe), what it advertises, its record, and its
daemon's flags."""

from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from node.daemon.relay_keeper import RelayKeeper
from node.rpc.relay import RelaySettings, no_relay_config
from protocol.reachability import (
    MAX_MADDRS,
    MAX_MESSAGE_BYTES,
    RELAY_PREFERENCE,
    DialBackAnswer,
    DialBackRequest,
    DialResult,
    Reachability,
    ReachabilityError,
    RelayWatch,
    choose_relay,
    circuit_maddr,
    decode,
    dial_target,
    encode,
    observed_ip,
    offers_no_relay,
    relay_candidates,
    relay_order,
    relay_peer_id,
    relayed_throughput,
    verdict,
)
from protocol.routing import candidates_by_stage, out_of_reach
from tests.records import peer_info

ADDR = "/ip4/10.77.0.2/tcp/4001/p2p/12D3KooWJBUPEnJM45URrg8vwQF2avZFj64LhqLsesoiHbRkj269"
SEEN = ("/ip4/10.77.0.9/tcp/51234",)


def _answer(ok: bool) -> DialBackAnswer:
    result = DialResult(maddr=ADDR, ok=ok, error=None if ok else "no answer within 3 s")
    return DialBackAnswer(observed=SEEN, results=(result,))


YES, NO = _answer(True), _answer(False)


def test_dial_targets_are_ip_tcp_addresses_only():
    assert dial_target(ADDR) == ("10.77.0.2", 4001)
    assert dial_target("/ip6/::1/tcp/80") == ("::1", 80)
    for bad in ("/dns4/example.org/tcp/1", "/ip4/1.2.3.4/udp/1/quic", "/ip4/1.2.3/tcp/1",
                "/ip4/1.2.3.4/tcp/0", "/ip4/1.2.3.4/tcp/70000", "/ip6/1.2.3.4/tcp/1", "ip4/x",
                ADDR + "/p2p-circuit"):  # fmt: skip
        with pytest.raises(ValueError):
            dial_target(bad)


def test_a_relayed_connection_tells_nothing_about_where_the_peer_is():
    assert observed_ip("/ip4/10.77.0.9/tcp/51234") == "10.77.0.9"
    relayed = "/ip4/10.77.0.2/tcp/4001/p2p/12D3KooWJBUPEnJM45URrg8vwQF2avZFj64LhqLsesoiHbRkj269"
    assert observed_ip(relayed + "/p2p-circuit") is None  # 10.77.0.2 is the relay
    assert observed_ip("/dns4/example.org/tcp/1") is None


def test_messages_round_trip_and_bad_bytes_raise_one_error():
    request = DialBackRequest(maddrs=(ADDR,))
    assert decode(encode(request), DialBackRequest) == request
    assert decode(encode(YES), DialBackAnswer).reachable_at == ADDR
    assert NO.reachable_at is None
    too_many = b'{"maddrs": [%s]}' % b",".join([b'"/ip4/1.2.3.4/tcp/1"'] * (MAX_MADDRS + 1))
    for raw in (b"", b"{", b'{"maddrs": []}', b'{"maddrs": ["x"], "more": 1}', too_many,
                b" " * (MAX_MESSAGE_BYTES + 1)):  # fmt: skip
        with pytest.raises(ReachabilityError):
            decode(raw, DialBackRequest)


def test_the_majority_of_answers_decides_and_a_tie_is_unknown():
    assert verdict([]).reachable is None  # nobody to ask: the first node
    reachable = verdict([YES, YES, NO])
    assert (reachable.reachable, reachable.address, reachable.yes, reachable.no) == (
        True, ADDR, 2, 1,
    )  # fmt: skip
    assert verdict([NO, NO, YES]).reachable is False
    assert verdict([NO]).reachable is False and verdict([YES]).reachable is True
    assert verdict([NO]).observed == "10.77.0.9"  # the router's address, behind NAT


def test_one_lying_peer_cannot_flip_the_verdict_alone():
    # a hostile "no" against an honest "yes": unknown, which still serves
    assert verdict([YES, NO]).reachable is None and verdict([YES, NO]).serves
    # a hostile "yes" against an honest "no": not recorded as reachable either
    assert verdict([NO, YES]).reachable is not True
    # with three peers asked, one liar is outvoted both ways
    assert verdict([YES, YES, NO]).reachable is True
    assert verdict([NO, NO, YES]).reachable is False


RELAY_ID = "12D3KooWRz9zdrgwUPSr3oCuoLJSGHpNsa4eFbhxNP4QS9rWK5t1"
OTHER_ID = "12D3KooWCK7Wpz3NK9qPoLnuTPhyHBxTw9swq33AnmS3krRShawe"
RELAY = f"/ip4/44.77.0.2/tcp/4001/p2p/{RELAY_ID}"
OTHER = f"/ip4/44.77.0.3/tcp/4001/p2p/{OTHER_ID}"


def test_a_relayed_peer_is_dialled_through_its_relay():
    home = ADDR.rsplit("/p2p/", 1)[1]
    assert circuit_maddr(RELAY, home) == f"{RELAY}/p2p-circuit/p2p/{home}"
    assert relay_peer_id(RELAY) == RELAY_ID


def test_the_relay_is_an_initial_peer_known_reachable_else_not_known_unreachable():
    assert choose_relay([RELAY, OTHER], {RELAY_ID: None, OTHER_ID: True}) == OTHER
    assert choose_relay([RELAY, OTHER], {RELAY_ID: False}) == OTHER  # OTHER: no record yet
    assert choose_relay([RELAY, OTHER], {}) == RELAY
    assert choose_relay([RELAY, OTHER], {RELAY_ID: False, OTHER_ID: False}) is None
    # Only a TCP address with a peer id can be announced (and dialled through).
    assert choose_relay(["/dns4/relay.example/tcp/4001/p2p/" + RELAY_ID], {}) is None
    assert choose_relay(["/ip4/44.77.0.2/udp/4001/quic/p2p/" + RELAY_ID], {}) is None
    assert choose_relay([], {}) is None


def test_candidates_put_known_reachable_relays_first_and_drop_known_unreachable_ones():
    assert relay_candidates([RELAY, OTHER], {OTHER_ID: True}) == [OTHER, RELAY]
    assert relay_candidates([RELAY, OTHER, RELAY], {}) == [RELAY, OTHER]
    assert relay_candidates([RELAY, OTHER], {OTHER_ID: False}) == [RELAY]


def test_after_a_failed_relay_the_others_are_tried_first_and_it_last():
    third = "/ip4/44.77.0.4/tcp/4001/p2p/" + RELAY_ID[:-1] + "2"
    assert relay_order([RELAY, OTHER, third], OTHER) == [third, RELAY, OTHER]
    assert relay_order([RELAY, OTHER], None) == [RELAY, OTHER]
    assert relay_order([RELAY], OTHER) == [RELAY]  # the failed one is no candidate now
    assert relay_order([], RELAY) == []


def test_the_watch_checks_rarely_when_well_at_once_when_cut_and_rechooses_after_misses():
    watch = RelayWatch(check_every_s=120, retry_after_s=10, misses_allowed=2)
    watch.chose(0.0, RELAY)
    assert not watch.tick(5.0, connected=True)
    assert watch.tick(120.0, connected=True)
    assert not watch.checked(120.0, ok=True)  # holds: keep it
    assert not watch.tick(125.0, connected=False)  # cut, but checked 5 s ago
    assert watch.tick(130.0, connected=False)
    assert not watch.checked(130.0, ok=False)  # one miss may be a loaded link
    assert not watch.tick(135.0, connected=True) and watch.tick(140.0, connected=True)
    assert watch.checked(140.0, ok=False)  # two in a row: choose again
    watch.chose(141.0, None)  # none held: look again every check_every_s
    assert not watch.tick(200.0, connected=False) and watch.tick(261.0, connected=False)
    with pytest.raises(ValueError, match="retry_after_s"):
        RelayWatch(check_every_s=5, retry_after_s=10)


class _Daemon:
    """What ``RelayKeeper`` asks of a P2P: its peer id and its connections."""

    def __init__(self, connected: set[str]):
        self.peer_id = SimpleNamespace(to_base58=lambda: ADDR.rsplit("/p2p/", 1)[1])
        self.connected = connected

    async def list_peers(self):
        return [SimpleNamespace(peer_id=SimpleNamespace(to_base58=lambda p=p: p))
                for p in self.connected]  # fmt: skip


def test_the_keeper_announces_a_relay_that_holds_and_moves_when_it_dies():
    holding = {RELAY, OTHER}
    daemon = _Daemon({RELAY_ID, OTHER_ID})
    probed: list[str] = []

    async def probe(relay: str, peer: str) -> str | None:
        assert peer == daemon.peer_id.to_base58()
        probed.append(relay_peer_id(relay))
        return None if relay in holding else "NO_RESERVATION"

    async def views() -> dict[str, bool | None]:
        return {RELAY_ID: True, OTHER_ID: True}

    async def scenario() -> list[tuple[str | None, str | None]]:
        keeper = RelayKeeper(daemon, [RELAY, OTHER], views, probe=probe,
                             tick_s=0.01, check_every_s=60, retry_after_s=0.02)  # fmt: skip
        holding.discard(RELAY)  # the first has no reservation yet: the next is chosen
        assert await keeper.choose(wait_s=0) == OTHER
        assert probed == [RELAY_ID, OTHER_ID] and list(keeper.tried) == [RELAY]
        changes: list[tuple[str | None, str | None]] = []
        async with asyncio.timeout(5):
            task = asyncio.create_task(keeper.run(lambda *c: changes.append(c)))
            holding.add(RELAY)
            holding.discard(OTHER)  # the relay dies: its connection goes
            daemon.connected.discard(OTHER_ID)
            while not changes:
                await asyncio.sleep(0.01)
            holding.discard(RELAY)  # that one dies too: the node says it has no relay
            daemon.connected.discard(RELAY_ID)
            while len(changes) < 2:
                await asyncio.sleep(0.01)
            task.cancel()
        return changes

    assert asyncio.run(scenario()) == [(OTHER, RELAY), (RELAY, None)]


def test_the_keeper_waits_a_bounded_time_for_a_reservation_at_start():
    async def never(relay: str, peer: str) -> str | None:
        return "NO_RESERVATION"

    async def views() -> dict[str, bool | None]:
        raise TimeoutError("the DHT did not answer")  # read as nothing known

    async def scenario() -> RelayKeeper:
        keeper = RelayKeeper(_Daemon(set()), [RELAY, OTHER], views, probe=never,
                             check_every_s=60, retry_after_s=0.02)  # fmt: skip
        async with asyncio.timeout(5):
            assert await keeper.choose(wait_s=0.1) is None
        return keeper

    keeper = asyncio.run(scenario())
    assert keeper.relay is None and keeper.tried == {
        RELAY: "NO_RESERVATION",
        OTHER: "NO_RESERVATION",
    }


def test_a_relayed_peer_advertises_less_than_its_relay_path_carries():
    per_sample = 2 * 64 * 64 * 4  # activations and grads of tiny, fp32: 32 KiB
    path = 8 * 1e6 / 8 / per_sample  # what 8 Mbit/s carries, samples/s
    assert relayed_throughput((100.0, 10.0), 8.0, per_sample) == pytest.approx(
        (path * RELAY_PREFERENCE, 10.0 * RELAY_PREFERENCE)
    )
    assert relayed_throughput((100.0,), 0.0, per_sample) == (100.0 * RELAY_PREFERENCE,)


def test_routing_sends_a_relayed_peer_less_than_an_equal_direct_one():
    direct = peer_info("r", OTHER_ID, stage=0, reachable=True)
    throughput = relayed_throughput(direct.throughput, 0.0, 1.0)
    home = ADDR.rsplit("/p2p/", 1)[1]
    relayed = peer_info("r", home, stage=0, reachable=False, relay=RELAY, throughput=throughput)
    stage = {c.peer_id: c.throughput for c in candidates_by_stage([direct, relayed], 2)[0]}
    assert stage[home] < stage[OTHER_ID]


def test_an_unreachable_peer_is_routable_only_through_a_relay():
    home = ADDR.rsplit("/p2p/", 1)[1]
    assert not peer_info("r", home, reachable=False).routable
    assert peer_info("r", home, reachable=False, relay=RELAY).routable
    assert not peer_info("r", home, reachable=False, relay=RELAY, stage=None).routable


@pytest.mark.parametrize(
    "relay",
    [
        f"{RELAY}/p2p-circuit",  # a circuit address, not the relay's own
        "/ip4/44.77.0.2/tcp/4001",  # no peer id
        f"/dns4/relay.example/tcp/4001/p2p/{RELAY_ID}",
        "x" * 300,
        "",
    ],
)
def test_a_record_names_its_relay_by_tcp_address_and_peer_id(relay):
    with pytest.raises(ValidationError):
        peer_info("r", ADDR.rsplit("/p2p/", 1)[1], relay=relay)


def test_relay_flags_offer_a_limited_relay_and_use_only_the_trusted_ones():
    flags = RelaySettings(data_limit_bytes=2**20, time_limit_s=60).flags([RELAY, OTHER])
    assert "-relayService=true" in flags and "-relayDataLimit=1048576" in flags
    assert "-relayTimeLimit=60s" in flags and "-relayMaxReservations=4" in flags
    assert f"-trustedRelays={RELAY},{OTHER}" in flags
    assert "-autoRelay=true" in flags and "-relayDiscovery=false" in flags
    assert "-autoRelay=true" not in RelaySettings().flags([])  # no relay to reserve on
    # p2pd's default config enables its relay code whatever -relay* say: a config file
    off = RelaySettings(serve=False, use=False).flags([RELAY])
    config = no_relay_config()
    assert off == (f"-f={config}", "-relay=false", "-relayService=false")
    assert json.loads(config.read_bytes()) == {"Relay": {"Enabled": False}}
    with pytest.raises(ValueError, match="serve=False needs use=False"):
        RelaySettings(serve=False, use=True)
    with pytest.raises(ValueError, match="max_circuits"):
        RelaySettings(max_circuits=0)


def test_a_declared_verdict_is_the_operators_word_and_says_so():
    yes = Reachability.declare(True, ["/ip4/1.2.3.4/tcp/4000", "/ip4/10.0.0.2/tcp/4000"])
    assert (yes.reachable, yes.address, yes.declared, yes.serves) == (
        True, "/ip4/1.2.3.4/tcp/4000", True, True,
    )  # fmt: skip
    no = Reachability.declare(False, ["/ip4/1.2.3.4/tcp/4000"])
    assert (no.reachable, no.address, no.declared, no.serves) == (False, None, True, False)


def test_a_caller_without_relays_never_routes_to_a_peer_reachable_only_through_one():
    home = ADDR.rsplit("/p2p/", 1)[1]
    direct = peer_info("r", OTHER_ID, stage=0, reachable=True)
    unknown = peer_info("r", RELAY_ID, stage=0)  # not known either way: tried as direct
    relayed = peer_info("r", home, stage=0, reachable=False, relay=RELAY)
    assert relayed.routable_by(True) and not relayed.routable_by(False)
    assert direct.routable_by(False) and unknown.routable_by(False)
    assert not peer_info("r", home, reachable=False).routable_by(True)
    peers = [direct, unknown, relayed]
    with_relays = candidates_by_stage(peers, 2)[0]
    without = candidates_by_stage(peers, 2, dials_relays=False)[0]
    assert {c.peer_id for c in with_relays} == {OTHER_ID, RELAY_ID, home}
    assert {c.peer_id for c in without} == {OTHER_ID, RELAY_ID}
    assert out_of_reach(peers, dials_relays=False) == [home]
    assert out_of_reach(peers, dials_relays=True) == []
    leaving = relayed.model_copy(update={"state": "leaving"})  # not routable for anyone
    assert out_of_reach([leaving], dials_relays=False) == []


def test_a_daemon_without_relay_code_dials_no_circuit():
    assert RelaySettings().dials_circuits and RelaySettings(use=False).dials_circuits
    assert not RelaySettings(serve=False, use=False).dials_circuits


NO_SERVICE = (
    "ControlFailure: Connect failed. msg=failed to dial ... error opening hop stream to relay: "
    "failed to negotiate protocol: protocols not supported: [/libp2p/circuit/relay/0.2.0/hop]"
)


def test_a_refusal_names_a_relay_with_no_relay_service_and_nothing_else():
    assert offers_no_relay(NO_SERVICE)
    assert not offers_no_relay("NO_RESERVATION")
    assert not offers_no_relay("no connection through the relay within 20 s")
    assert not offers_no_relay("protocols not supported: [/ipfs/id/1.0.0]")


def test_the_keeper_stops_waiting_when_every_relay_runs_no_relay_service():
    """No candidate will ever hold a reservation: the keeper says so at once, not after
    its wait; one that may still reserve keeps it waiting."""
    reasons = {RELAY: NO_SERVICE, OTHER: NO_SERVICE}

    async def probe(relay: str, peer: str) -> str | None:
        return reasons[relay]

    async def views() -> dict[str, bool | None]:
        return {}

    async def choose() -> tuple[str | None, float]:
        keeper = RelayKeeper(_Daemon(set()), [RELAY, OTHER], views, probe=probe,
                             check_every_s=60, retry_after_s=0.05)  # fmt: skip
        started = time.monotonic()
        async with asyncio.timeout(30):
            found = await keeper.choose(wait_s=0.5)
        return found, time.monotonic() - started

    found, took = asyncio.run(choose())
    assert found is None and took < 0.05
    reasons[OTHER] = "NO_RESERVATION"
    found, took = asyncio.run(choose())
    assert found is None and took >= 0.4
