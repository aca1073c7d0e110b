"""Whether other peers can dial a node: the dial-back messages, and the verdict rule.

A node asks a few peers "dial me back at these addresses" (``DialBackRequest``). Each
opens a fresh TCP connection to every address whose IP is one it sees the asker connect
from (any other address is refused unchecked: a dial-back never turns a peer into a port
scanner of third parties) and checks that a libp2p listener answers there (its
multistream header), then answers with what it saw (``DialBackAnswer``).

Answers are claims: a hostile peer may lie either way. ``verdict`` therefore takes the
strict majority of the peers that answered, and a tie (one yes against one no, or nobody
answering) is "unknown", which the node treats as reachable: one peer's "no" cannot make
a reachable node stop serving, and one peer's "yes" against another's "no" is not enough
to call the node reachable in its record.
"""

from __future__ import annotations

import ipaddress
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from protocol.records import RELAY_MADDR_PATTERN, first_error

MAX_MADDRS = 8  # addresses checked per request
MAX_MESSAGE_BYTES = 8 * 1024
MULTISTREAM_HEADER = b"\x13/multistream/1.0.0\n"  # what a libp2p listener sends first

Maddr = Annotated[str, Field(min_length=1, max_length=256)]


class ReachabilityError(ValueError):
    """A dial-back request or answer that is malformed or too large."""


class _Message(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class DialBackRequest(_Message):
    """Dial the asker back at these addresses (its announced multiaddrs)."""

    maddrs: Annotated[tuple[Maddr, ...], Field(min_length=1, max_length=MAX_MADDRS)]


class DialResult(_Message):
    """One address of a request: whether a fresh connection reached a libp2p listener."""

    maddr: Maddr
    ok: bool
    error: Annotated[str, Field(max_length=200)] | None = None


class DialBackAnswer(_Message):
    """What the answering peer saw: the addresses the asker's connections come from, and
    the outcome for each address asked about."""

    observed: Annotated[tuple[Maddr, ...], Field(max_length=MAX_MADDRS)]
    results: Annotated[tuple[DialResult, ...], Field(max_length=MAX_MADDRS)]

    @property
    def reachable_at(self) -> str | None:
        """The first address the peer reached, if any."""
        return next((r.maddr for r in self.results if r.ok), None)


_M = TypeVar("_M", bound=_Message)


def encode(message: _Message) -> bytes:
    return message.model_dump_json().encode()


def decode(raw: bytes, cls: type[_M]) -> _M:
    """``cls`` from JSON bytes; ``ReachabilityError`` naming what is wrong."""
    if len(raw) > MAX_MESSAGE_BYTES:
        raise ReachabilityError(
            f"a {cls.__name__} of {len(raw)} bytes exceeds the limit of {MAX_MESSAGE_BYTES}"
        )
    try:
        return cls.model_validate_json(raw)
    except ValidationError as e:
        raise ReachabilityError(f"malformed {cls.__name__}: {first_error(e)}") from None


def dial_target(maddr: str) -> tuple[str, int]:
    """``(ip, port)`` of a ``/ip4/A/tcp/P`` or ``/ip6/A/tcp/P`` multiaddr (a ``/p2p/ID``
    suffix allowed); ``ValueError`` for anything else (DNS names, QUIC, relays)."""
    parts = maddr.split("/")
    if parts[-2:-1] == ["p2p"]:
        parts = parts[:-2]
    if len(parts) != 5 or parts[0] or parts[1] not in ("ip4", "ip6") or parts[3] != "tcp":
        raise ValueError(f"{maddr!r:.100} is not an /ip4 or /ip6 TCP address")
    try:
        ip = ipaddress.ip_address(parts[2])
        port = int(parts[4])
    except ValueError:
        raise ValueError(f"{maddr!r:.100} has a bad IP address or port") from None
    if ip.version != (4 if parts[1] == "ip4" else 6) or not 0 < port < 65536:
        raise ValueError(f"{maddr!r:.100} has a bad IP address or port")
    return str(ip), port


def observed_ip(maddr: str) -> str | None:
    """The IP a connection comes from, given its remote multiaddr: None for a relayed one
    (its IP is the relay's, not the peer's) and for anything but ``/ip4`` or ``/ip6``."""
    parts = maddr.split("/")
    if len(parts) < 3 or parts[1] not in ("ip4", "ip6") or "p2p-circuit" in parts:
        return None
    try:
        return str(ipaddress.ip_address(parts[2]))
    except ValueError:
        return None


@dataclass(frozen=True)
class Reachability:
    """The verdict on this node: ``reachable`` True, False, or None (unknown: nobody
    answered, or the answers tied); ``address``: where peers reached it; ``observed``:
    the IP peers see its connections come from (a NAT router's, behind one); ``yes`` and
    ``no``: how many peers answered each way."""

    reachable: bool | None
    address: str | None = None
    observed: str | None = None
    yes: int = 0
    no: int = 0
    declared: bool = False  # said by the node's operator (``--reachable``), not asked

    @classmethod
    def declare(cls, reachable: bool, maddrs: Sequence[str]) -> Reachability:
        """What the operator says, unchecked: reachable at the first of ``maddrs``, or not."""
        address = maddrs[0] if reachable and maddrs else None
        return cls(reachable, address=address, declared=True)

    @property
    def serves(self) -> bool:
        """Whether the node should serve (and be a full DHT node): unless found unreachable."""
        return self.reachable is not False


def verdict(answers: Sequence[DialBackAnswer]) -> Reachability:
    """The strict majority of ``answers`` (one per peer that answered): reachable if more
    peers reached the node than did not, unreachable if fewer, unknown on a tie."""
    reached = [a.reachable_at for a in answers if a.reachable_at is not None]
    yes, no = len(reached), len(answers) - len(reached)
    seen = Counter(ip for a in answers for ip in {observed_ip(m) for m in a.observed} if ip)
    observed = seen.most_common(1)[0][0] if seen else None
    address = Counter(reached).most_common(1)[0][0] if reached else None
    reachable = None if yes == no else yes > no
    return Reachability(reachable, address if reachable else None, observed, yes, no)


# A relayed peer advertises this share of what its relay path carries (or of its own
# throughput, if less): at equal throughput, routing sends more to direct peers.
RELAY_PREFERENCE = 0.9


def circuit_maddr(relay: str, peer_id: str) -> str:
    """The address at which a peer that reserved a slot on ``relay`` (its
    ``/ip4/A/tcp/P/p2p/RELAY`` address) is dialled through it."""
    return f"{relay}/p2p-circuit/p2p/{peer_id}"


def relay_peer_id(relay: str) -> str:
    """The peer id at the end of a relay's ``.../p2p/ID`` address."""
    return relay.rsplit("/p2p/", 1)[-1]


# The protocol a circuit relay (v2) serves reservations and circuits on. A peer whose
# ``p2pd`` offers no relay service refuses it; go-libp2p's dial error then names it as a
# protocol "not supported".
HOP_PROTOCOL = "/libp2p/circuit/relay/0.2.0/hop"


def offers_no_relay(why: str) -> bool:
    """Whether a failed probe's reason (``node.rpc.relay.reservation_holds``) says the
    relay runs no relay service at all: waiting for a reservation there is pointless."""
    return "not supported" in why and HOP_PROTOCOL in why


def relayed_throughput(
    throughput: Sequence[float], relay_mbps: float, bytes_per_sample: float
) -> tuple[float, ...]:
    """A relayed peer's throughput per stage as it advertises it: each stage's, capped by
    the samples/s its relay's link carries (``relay_mbps``, the lesser of the relay's up
    and down rates; 0 if unknown: no cap; every sample crosses it as ``bytes_per_sample``
    each way), times ``RELAY_PREFERENCE``."""
    cap = relay_mbps * 1e6 / 8 / bytes_per_sample if relay_mbps > 0 else float("inf")
    return tuple(min(t, cap) * RELAY_PREFERENCE for t in throughput)


def relay_candidates(trusted: Sequence[str], reachable: dict[str, bool | None]) -> list[str]:
    """The ``trusted`` relays (the initial peers, on which this node's ``p2pd`` reserves
    slots) a node may serve through, best first: those whose peer is known to be reachable
    (``reachable``: peer id -> its record's verdict), then those not known either way;
    never one known to be unreachable. Only ``/ip4`` or ``/ip6`` TCP addresses with a peer
    id qualify (what ``PeerInfo.relay`` holds)."""
    usable = [m for m in dict.fromkeys(trusted) if re.fullmatch(RELAY_MADDR_PATTERN, m)]
    return [m for wanted in (True, None) for m in usable
            if reachable.get(relay_peer_id(m)) is wanted]  # fmt: skip


def choose_relay(trusted: Sequence[str], reachable: dict[str, bool | None]) -> str | None:
    """The best of ``relay_candidates``, or None if there is none."""
    return next(iter(relay_candidates(trusted, reachable)), None)


def relay_order(candidates: Sequence[str], current: str | None) -> list[str]:
    """In which order to try ``candidates`` when the ``current`` relay failed a check: the
    ones after it (in their order, wrapping around) first, and ``current`` itself last (it
    may have come back). With no current relay (or one no longer a candidate), the
    candidates in their order."""
    if current not in candidates:
        return list(candidates)
    i = list(candidates).index(current)
    return [*candidates[i + 1 :], *candidates[:i], current]


@dataclass
class RelayWatch:
    """When a node that serves through a relay checks that the relay still holds its
    reservation, and when it gives up on it: sans-I/O, driven with the time ``now``.

    ``tick`` (the node's cheap, frequent look: is it still connected to the relay?) says
    whether to check the reservation now: every ``check_every_s`` while all is well, and
    every ``retry_after_s`` once the connection is gone or a check failed. ``checked``
    takes the outcome of a check and says whether to choose a relay again: after
    ``misses_allowed`` failed checks in a row (one can fail on a loaded link while the
    reservation holds), and at every check while the node has no relay (``relay`` None:
    no candidate held a reservation at the last choice; it looks again every
    ``check_every_s``)."""

    check_every_s: float
    retry_after_s: float
    misses_allowed: int = 2
    relay: str | None = None
    misses: int = 0
    last_check: float = float("-inf")

    def __post_init__(self) -> None:
        if not 0 < self.retry_after_s <= self.check_every_s or self.misses_allowed < 1:
            raise ValueError(
                "need 0 < retry_after_s <= check_every_s and misses_allowed >= 1, got "
                f"{self.retry_after_s}, {self.check_every_s} and {self.misses_allowed}"
            )

    def tick(self, now: float, connected: bool) -> bool:
        """Whether to check now (``connected``: to the relay, as the daemon says)."""
        hurry = self.relay is not None and (self.misses > 0 or not connected)
        return now - self.last_check >= (self.retry_after_s if hurry else self.check_every_s)

    def checked(self, now: float, ok: bool) -> bool:
        """Record a check of the current relay's reservation (``ok``: it holds); True when
        the node should choose a relay again (then call ``chose``)."""
        self.last_check = now
        self.misses = 0 if ok else self.misses + 1
        return self.relay is None or self.misses >= self.misses_allowed

    def chose(self, now: float, relay: str | None) -> None:
        """The relay chosen (None: no candidate held a reservation)."""
        self.relay, self.misses, self.last_check = relay, 0, now
