"""``protocol.reachability`` without a network: the dial-back messages, the addresses a
peer may be dialled at, and the verdict rule against lying peers."""

from __future__ import annotations

import pytest

from protocol.reachability import (
    MAX_MADDRS,
    MAX_MESSAGE_BYTES,
    DialBackAnswer,
    DialBackRequest,
    DialResult,
    ReachabilityError,
    decode,
    dial_target,
    encode,
    observed_ip,
    verdict,
)

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
