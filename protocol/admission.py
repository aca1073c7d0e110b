"""Which incoming requests a serving node takes on: caps on requests in flight and on the
bytes they bring, per caller and in total, and how long a stream may take to deliver its
request. Pure: no clock, no I/O (times are the caller's).

A stream is admitted (``InFlight.admit``) when it opens, before anything is read: a caller
holds at most ``AdmissionLimits.per_caller`` streams at once and all callers together
``total``. As a request's tensor headers arrive it is charged the bytes they declare
(``InFlight.charge``): at most ``per_caller_bytes`` per caller and ``total_bytes`` in all,
except that a caller with nothing charged is always allowed one request (a request within
the stage's message limit is never refused for its size alone). Whatever is refused is
refused at once, cheaply, with a message that starts with ``BUSY``: the caller reroutes to
another peer of the stage and does not count it against this one (it is overloaded, not
faulty). The caps make a flood from one identity cost the node a few requests' worth of
memory and descriptors, and leave room for everybody else.

A stream must bring its first message within ``first_s`` and the whole request within
``request_deadline_s`` (a few seconds more, scaled to the stage's message limit over the
node's download bandwidth, and never less than a request takes over a ``slow_link_mbps``
link): a stream that opens and says nothing holds its slot for seconds, not for the
minute a large request may take to arrive.

``RefusalTally`` decides when a run of refusals is worth an event: the first of each
(caller, reason), then at most one per ``every_s`` carrying how many it stands for.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

# Starts the error a node sends for a request it sheds for load (or that did not arrive in
# time): the caller may send it to another peer of the stage at once, and should not hold
# it against this one. Not ``node.pipeline.wire.REFUSED`` (the request is malformed: any
# peer refuses it) nor ``FAILED`` (this peer broke).
BUSY = "stage busy: "
MIB = 2**20


class Refusal(enum.Enum):
    """Why a request was shed."""

    CALLER_REQUESTS = "caller_requests"  # the caller has its share of requests in flight
    TOTAL_REQUESTS = "total_requests"  # the node has all the requests in flight it takes
    CALLER_BYTES = "caller_bytes"  # the caller's requests in flight hold its share of bytes
    TOTAL_BYTES = "total_bytes"  # the requests in flight hold all the bytes the node takes
    SLOW = "slow"  # the request did not arrive within its deadline


@dataclass(frozen=True)
class AdmissionLimits:
    """The caps and deadlines of ``InFlight`` and ``request_deadline_s``.

    The defaults leave an honest trainer room (it keeps a few micro-batches in flight, one
    call each per stage) and bound a flood: 64 requests of the ``tiny`` preset's largest
    message (1 MiB) is 64 MiB."""

    per_caller: int = 16
    total: int = 64
    per_caller_bytes: int = 64 * MIB
    total_bytes: int = 256 * MIB
    first_s: float = 5.0  # for a stream's first message (its metadata)
    slow_link_mbps: float = 10.0  # a request is never expected faster than over this link
    link_share: float = 2.0  # requests arriving at once on the same link
    max_s: float = 60.0  # the longest any request may take to arrive

    def __post_init__(self) -> None:
        counts = (self.per_caller, self.total, self.per_caller_bytes, self.total_bytes)
        if min(counts) < 1 or self.per_caller > self.total:
            raise ValueError(
                f"need 1 <= per_caller ({self.per_caller}) <= total ({self.total}), "
                f"per_caller_bytes ({self.per_caller_bytes}) and total_bytes "
                f"({self.total_bytes}) >= 1"
            )
        if min(self.first_s, self.slow_link_mbps, self.link_share) <= 0:
            raise ValueError(
                f"first_s ({self.first_s}), slow_link_mbps ({self.slow_link_mbps}) and "
                f"link_share ({self.link_share}) must be > 0"
            )
        if self.max_s < self.first_s:
            raise ValueError(f"max_s ({self.max_s}) must be >= first_s ({self.first_s})")


def request_deadline_s(
    limits: AdmissionLimits, max_bytes: int, download_mbps: float | None = None
) -> float:
    """Seconds from a stream's opening for a whole request of at most ``max_bytes`` to
    arrive: ``first_s`` plus ``link_share`` such requests over the slower of the node's
    download (``download_mbps``, measured or declared; None or 0: unknown) and
    ``slow_link_mbps``, at most ``max_s``."""
    if max_bytes < 0:
        raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
    rate = limits.slow_link_mbps
    if download_mbps:
        rate = min(rate, download_mbps)
    transfer = limits.link_share * max_bytes * 8 / (rate * 1e6)
    return min(limits.max_s, limits.first_s + transfer)


@dataclass
class Ticket:
    """One admitted stream: its caller and the bytes charged to it so far."""

    caller: str
    nbytes: int = 0
    released: bool = False


@dataclass
class InFlight:
    """The requests a node has admitted and not finished, shared by all its stage servers.

    ``admit`` when a stream opens, ``charge`` as its request declares bytes, ``release``
    when it is done (idempotent). Every refusal names the numbers behind it (``reason``)."""

    limits: AdmissionLimits = field(default_factory=AdmissionLimits)
    requests: int = 0
    nbytes: int = 0
    _callers: dict[str, list[int]] = field(default_factory=dict)  # caller -> [requests, bytes]

    def admit(self, caller: str) -> Ticket | Refusal:
        """A ticket for a new stream of ``caller``, or why it is refused."""
        mine = self._callers.get(caller, [0, 0])
        if mine[0] >= self.limits.per_caller:
            return Refusal.CALLER_REQUESTS
        if self.requests >= self.limits.total:
            return Refusal.TOTAL_REQUESTS
        self._callers[caller] = [mine[0] + 1, mine[1]]
        self.requests += 1
        return Ticket(caller)

    def charge(self, ticket: Ticket, nbytes: int) -> Refusal | None:
        """Charge ``nbytes`` more to ``ticket`` (a tensor header declared them); None if
        they fit, else why not (nothing is charged then)."""
        if ticket.released:
            raise ValueError(f"ticket of {ticket.caller} is released")
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        mine = self._callers[ticket.caller]
        if mine[1] and mine[1] + nbytes > self.limits.per_caller_bytes:
            return Refusal.CALLER_BYTES
        if self.nbytes and self.nbytes + nbytes > self.limits.total_bytes:
            return Refusal.TOTAL_BYTES
        mine[1] += nbytes
        self.nbytes += nbytes
        ticket.nbytes += nbytes
        return None

    def release(self, ticket: Ticket) -> None:
        """The stream of ``ticket`` is done: its request and bytes leave the counts."""
        if ticket.released:
            return
        ticket.released = True
        mine = self._callers[ticket.caller]
        mine[0] -= 1
        mine[1] -= ticket.nbytes
        self.requests -= 1
        self.nbytes -= ticket.nbytes
        if mine[0] == 0:
            del self._callers[ticket.caller]

    def of(self, caller: str) -> tuple[int, int]:
        """``caller``'s requests and bytes in flight."""
        requests, nbytes = self._callers.get(caller, (0, 0))
        return requests, nbytes

    def reason(self, refusal: Refusal, caller: str) -> str:
        """A one-line explanation of ``refusal`` for ``caller``, with the numbers."""
        limits, (requests, nbytes) = self.limits, self.of(caller)
        if refusal is Refusal.CALLER_REQUESTS:
            return f"peer {caller} has {requests} requests in flight (limit {limits.per_caller})"
        if refusal is Refusal.TOTAL_REQUESTS:
            return f"{self.requests} requests in flight (limit {limits.total})"
        if refusal is Refusal.CALLER_BYTES:
            return f"peer {caller} has {nbytes} bytes in flight (limit {limits.per_caller_bytes})"
        if refusal is Refusal.TOTAL_BYTES:
            return f"{self.nbytes} bytes in flight (limit {limits.total_bytes})"
        return "the request did not arrive in time"


@dataclass
class RefusalTally:
    """Counts refusals per (caller, reason); ``note`` says when to report them: the first
    one, then at most once per ``every_s``, with the number since the last report."""

    every_s: float = 1.0
    max_keys: int = 10_000  # the oldest keys are forgotten first: fresh identities cost nothing
    _pending: dict[tuple[str, Refusal], tuple[float, int]] = field(default_factory=dict)
    totals: dict[Refusal, int] = field(default_factory=dict)  # every refusal, by reason

    def note(self, caller: str, refusal: Refusal, now: float) -> int | None:
        """Count one refusal at ``now``; the number to report now, or None (not yet)."""
        self.totals[refusal] = self.totals.get(refusal, 0) + 1
        key = (caller, refusal)
        reported, count = self._pending.pop(key, (None, 0))
        count += 1
        if reported is None or now - reported >= self.every_s:
            self._pending[key] = (now, 0)
            report = count
        else:
            self._pending[key] = (reported, count)
            report = None
        while len(self._pending) > self.max_keys:
            del self._pending[next(iter(self._pending))]
        return report
