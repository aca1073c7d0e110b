"""One peer's placement over time, as a sans-I/O state machine: events in, actions out.

:class:`PeerPlacement` sequences the decisions of ``protocol.assignment`` (which are
pure) for one peer: join, reconsider, load, perhaps take a second stage, check
periodically, check early on an alarm, confirm a move. It reads no clock (every event
carries ``now``), does no I/O (it returns actions for the caller to carry out) and draws
every random number from the seed it is given. The node drives it with real time, DHT
records and gossip (``node.placement.driver``); the simulator drives the same class with
a virtual clock (``scripts.simulate_assignment``), so a simulated figure is a figure of
the sequence that nodes run.

Events (each carries ``now``, in the driver's clock; views are of the *other* peers, the
machine adds its own claim):

- :class:`Join`: start joining. It listens about a settle period (others re-announce
  within it) before choosing; a peer restarted with checkpoints takes one of their
  stages at once.
- :class:`Timer`: the wake the machine asked for last (:class:`Wake`) is due, with a view
  read then, and the arrival rate if the driver counts arrivals (:class:`ArrivalCount`).
- :class:`Look`: a view read between checks. While serving, a stage that lost
  ``Params.alarm_drop`` of its total since the last check (or that nobody holds) brings
  the next check forward to a seeded draw within two settle periods: the peers alarmed
  by one loss then check one after another, each seeing the moves announced before it.
- :class:`Loaded`: the stage the machine said to load (:class:`Load` or :class:`Moved`)
  serves now, with a view read then.
- :class:`Declined`: the peer did not take the second stage it was told to.
- (a :class:`Timer` while it waits for a second stage: see the sequence below.)

Actions: :class:`Wake` (send a :class:`Timer` at ``at``; it replaces any earlier wake),
:class:`Announce` (gossip this claim now), :class:`Chose` (a joiner's choice, first or
revised), :class:`Load` (load this stage), :class:`HoldSecond` (load this stage as well:
the peer then never moves), :class:`AwaitSecond` (a restarted peer waits for a second
stage's state; for logs), :class:`Moving` (a check decided to move; announced, to be
confirmed), :class:`Moved` (confirmed: unload the old stage, load the new one),
:class:`Stay` (not confirmed), :class:`Alarmed` (for logs).

The sequence, and why:

- A joiner listens, chooses (``choose_stage``, seeded by its own seed so that a wave of
  joiners spreads out), announces the choice as an intent, listens again, and
  reconsiders once (``decide_move`` with ``serving=False``): a change of mind before
  loading is free. Both waits are drawn in 0.5-1.5 settle periods, so that joiners of one
  wave decide at different moments and see each other's intents.
- Once its stage serves, a joiner (not a peer that moved) asks ``second_stage`` whether
  to load a second stage too; a peer holding two never moves.
- A peer restarted with checkpoints of its own (``Join.kept``) takes the kept stage that
  the fewest others claim (``resume_stage``) without listening, and holds it for
  ``Params.resume_hold_s``: its checkpoint may be the only copy of that stage's training,
  and in a swarm restarted as a whole the peers holding the other stages' copies come
  back one after another. Meanwhile its checks do not move it, and it does not take as
  a second stage one that nobody serves and it kept no state of (that would start the
  stage from scratch, and train its own stage against it): it waits, looking every
  settle period, until someone serves that stage, the rule no longer asks for a second
  stage, or the hold ends.
- A serving peer checks every ``check_delay`` seconds (``decide_move``, with the arrival
  rate: where few join, gaps are closed by moves sooner). A move is announced first and
  carried out only if, a settle period later, another peer still serves the stage it
  leaves: two peers that decide at once to leave a stage both back off rather than empty
  it.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Literal

from protocol.assignment import (
    Claim,
    Move,
    Params,
    Seed,
    SwarmView,
    alarm,
    check_delay,
    choose_stage,
    decide_move,
    resume_stage,
    second_stage,
)
from protocol.records import PeerState

MIN_SETTLE_S = 2.0  # two GossipSub heartbeats: the mesh forms and others' intents arrive
ARRIVALS_S = 600.0  # arrivals are counted over this window (and only once watched this long)


def settle_period(update_period_s: float) -> float:
    """The settle period of peers that re-announce every ``update_period_s``: within it
    every peer has re-announced, and gossip has crossed the mesh."""
    if not (math.isfinite(update_period_s) and update_period_s > 0.0):
        raise ValueError(
            f"update period must be a positive number of seconds, got {update_period_s}"
        )
    return max(MIN_SETTLE_S, update_period_s)


# Events.


@dataclass(frozen=True, slots=True)
class Join:
    """The peer starts. ``kept``: the stages whose state it kept from an earlier run of
    its own (checkpoints), the most recent first; with them, ``view`` (the others' claims
    read now; None: nobody seen). It then takes one of those stages at once, without
    listening or choosing (``resume_stage``), so that a swarm restarted as a whole comes
    back on the stages its checkpoints hold, and holds it for ``Params.resume_hold_s``."""

    now: float
    kept: tuple[int, ...] = ()
    view: SwarmView | None = None


@dataclass(frozen=True, slots=True)
class Timer:
    now: float
    view: SwarmView
    arrivals: float | None = None  # joiners per peer-hour lately, if counted


@dataclass(frozen=True, slots=True)
class Look:
    now: float
    view: SwarmView


@dataclass(frozen=True, slots=True)
class Loaded:
    now: float
    view: SwarmView
    second: bool = True  # whether this peer may take a second stage (the node's choice)


@dataclass(frozen=True, slots=True)
class Declined:
    """The peer did not take the second stage the machine said to (no memory for it, or
    its load failed): it serves one stage, and checks like any other."""

    now: float


Event = Join | Timer | Look | Loaded | Declined


# Actions.


@dataclass(frozen=True, slots=True)
class Wake:
    at: float


@dataclass(frozen=True, slots=True)
class Announce:
    """Gossip this claim: ``join`` (an intent on ``stage``), ``move`` (from ``stage`` to
    ``to_stage``), ``serving`` or ``load`` (serves ``stage``), ``leaving``."""

    kind: Literal["join", "move", "serving", "load", "leaving"]
    stage: int | None
    to_stage: int | None = None


@dataclass(frozen=True, slots=True)
class Chose:
    stage: int
    totals: tuple[float, ...]  # the stage totals it chose on, for logs (none: resumed)
    revised: bool = False
    resumed: bool = False  # the stage of its own checkpoint, taken without choosing


@dataclass(frozen=True, slots=True)
class Load:
    stage: int


@dataclass(frozen=True, slots=True)
class AwaitSecond:
    """The rule asks for ``stage`` as a second stage, but nobody serves it and this
    restarted peer kept no state of it: it waits (until ``until`` at most) for a peer
    with that stage's state, rather than start the stage from scratch."""

    stage: int
    until: float


@dataclass(frozen=True, slots=True)
class HoldSecond:
    stage: int
    two_stage: float  # the two-stage peers' summed throughput it saw, for logs
    totals: tuple[float, ...]


@dataclass(frozen=True, slots=True)
class Moving:
    move: Move
    totals: tuple[float, ...]


@dataclass(frozen=True, slots=True)
class Moved:
    move: Move


@dataclass(frozen=True, slots=True)
class Stay:
    move: Move
    totals: tuple[float, ...]


@dataclass(frozen=True, slots=True)
class Alarmed:
    stage: int
    before: float
    now: float
    totals: tuple[float, ...]


Action = Wake | Announce | Chose | Load | AwaitSecond | HoldSecond | Moving | Moved | Stay | Alarmed


class Phase(Enum):
    NEW = "new"
    LISTENING = "listening"  # before choosing
    CHOSEN = "chosen"  # announced, before reconsidering
    LOADING = "loading"
    AWAITING_SECOND = "awaiting_second"  # serves; a second stage waits for its state
    SERVING = "serving"  # checks scheduled
    CONFIRMING = "confirming"  # a move announced, waiting a settle period
    TWO_STAGE = "two_stage"  # holds two stages: never moves


class PlacementError(ValueError):
    """An event the machine cannot take in its phase: a driver's bug, not a peer's."""


class PeerPlacement:
    """One peer's placement. ``handle`` takes one event and returns the actions to carry
    out, in order. ``stage`` is the stage it holds or intends (None before choosing);
    ``pending`` the move announced and not yet confirmed or dropped."""

    def __init__(
        self,
        seed: str,
        throughput: Sequence[float],
        params: Params,
        *,
        settle_s: float,
    ) -> None:
        if not (math.isfinite(settle_s) and settle_s > 0.0):
            raise ValueError(f"settle_s must be a positive number of seconds, got {settle_s}")
        self.seed = seed
        self.throughput = tuple(throughput)
        self.params = params
        self.settle_s = settle_s
        self.phase = Phase.NEW
        self.stage: int | None = None
        self.pending: Move | None = None
        self.moved = False  # it moved once: it never takes a second stage
        self.kept: frozenset[int] = frozenset()  # stages it kept checkpoints of
        self.hold_until = -math.inf  # a restarted peer holds its stage until then
        self._awaited: int | None = None  # the second stage last awaited (logged once)
        self._checks = 0
        self._deadline = math.inf  # of the periodic check
        self._alarmed = False  # an early check is scheduled
        self._reference: SwarmView | None = None  # the view at the last check
        self._announced: tuple[int | None, PeerState] | None = None
        # Settle waits: uniform in 0.5-1.5 settle periods; an alarm's in 0-2.
        self._settle = Params(mean_period_s=settle_s, period_jitter=0.5)
        self._alarm_spread = Params(mean_period_s=settle_s, period_jitter=1.0)

    def handle(self, event: Event) -> list[Action]:
        if isinstance(event, Join):
            return self._join(event)
        if isinstance(event, Timer):
            return self._timer(event)
        if isinstance(event, Look):
            return self._look(event)
        if isinstance(event, Loaded):
            return self._loaded(event)
        if isinstance(event, Declined):
            self._expect(event, Phase.TWO_STAGE)
            self.phase, self._reference = Phase.SERVING, None  # the next look sets it
            return [self._schedule(event.now)]
        raise PlacementError(f"not a placement event: {event!r:.100}")

    # -- transitions ---------------------------------------------------------------------

    def _join(self, e: Join) -> list[Action]:
        self._expect(e, Phase.NEW)
        if e.kept:
            n = len(self.throughput)
            view = SwarmView.empty(n) if e.view is None else e.view
            if view.n_stages != n:
                raise PlacementError(f"a view of {view.n_stages} stages for a run of {n}")
            try:
                stage = resume_stage(view, e.kept)
            except ValueError as error:
                raise PlacementError(f"cannot resume: {error}") from None
            self.kept, self.hold_until = frozenset(e.kept), e.now + self.params.resume_hold_s
            self.stage, self.phase = stage, Phase.LOADING
            return [Chose(stage, view.totals, resumed=True), self._claim("join", stage),
                    Load(stage)]  # fmt: skip
        self.phase = Phase.LISTENING
        return [Wake(e.now + check_delay(f"{self.seed}/listen", self._settle))]

    def _timer(self, e: Timer) -> list[Action]:
        if self.phase is Phase.LISTENING:
            stage = choose_stage(e.view, self.throughput, self.seed, self.params)
            self.stage, self.phase = stage, Phase.CHOSEN
            wake = Wake(e.now + check_delay(f"{self.seed}/reconsider", self._settle))
            return [Chose(stage, e.view.totals), self._claim("join", stage), wake]
        if self.phase is Phase.CHOSEN:
            return self._reconsider(e)
        if self.phase is Phase.SERVING:
            return self._check(e)
        if self.phase is Phase.AWAITING_SECOND:
            view = e.view.add(self._own(self._held(), serving=True))
            return self._after_load(e.now, view, second=True)
        if self.phase is Phase.CONFIRMING:
            return self._confirm(e)
        raise PlacementError(f"a timer in phase {self.phase.value}: no wake was asked for")

    def _reconsider(self, e: Timer) -> list[Action]:
        stage = self._held()
        view = e.view.add(self._own(stage, serving=False))
        seed = f"{self.seed}/join"
        move = decide_move(view, stage, self.throughput, seed, self.params, serving=False)
        self.phase = Phase.LOADING
        if move is None:
            return [Load(stage)]
        self.stage = move.to_stage
        chose = Chose(move.to_stage, view.totals, revised=True)
        return [chose, self._claim("join", move.to_stage), Load(move.to_stage)]

    def _loaded(self, e: Loaded) -> list[Action]:
        self._expect(e, Phase.LOADING)
        stage = self._held()
        view = e.view.add(self._own(stage, serving=True))
        serving = self._claim("serving", stage)
        return [serving, *self._after_load(e.now, view, second=e.second and not self.moved)]

    def _after_load(self, now: float, view: SwarmView, *, second: bool) -> list[Action]:
        """Its stage serves (``view`` counts it): a second stage, a wait for one, or
        periodic checks."""
        if second:
            stage = second_stage(view, self._held(), self.throughput, self.params)
            if stage is not None and self.holding(now) and not self._has_state(stage, view):
                self.phase = Phase.AWAITING_SECOND
                wake = Wake(min(self.hold_until, now + self.settle_s))
                if stage == self._awaited:
                    return [wake]
                self._awaited = stage
                return [AwaitSecond(stage, self.hold_until), wake]
            if stage is not None:
                self.phase = Phase.TWO_STAGE
                return [HoldSecond(stage, view.two_stage, view.totals)]
        self.phase = Phase.SERVING
        self._reference = view
        return [self._schedule(now)]

    def holding(self, now: float) -> bool:
        """Whether this restarted peer still holds the stage it resumed (no moves, no
        second stage from scratch): ``Params.resume_hold_s`` after it started."""
        return now < self.hold_until

    def _has_state(self, stage: int, view: SwarmView) -> bool:
        """Whether taking ``stage`` loads a state others trained: this peer kept a
        checkpoint of it, or a peer serves it (the load takes the newest of these)."""
        return stage in self.kept or view.serving[stage] > 0

    def _schedule(self, now: float) -> Wake:
        self._checks += 1
        self._alarmed = False
        self._deadline = now + check_delay(self._check_seed, self.params)
        return Wake(self._deadline)

    @property
    def _check_seed(self) -> str:
        return f"{self.seed}/{self._checks}"

    def _look(self, e: Look) -> list[Action]:
        if self.phase is not Phase.SERVING or self._alarmed or e.now >= self._deadline:
            return []  # only a serving peer between checks is alarmed
        now = e.view.add(self._own(self._held(), serving=True))
        before = self._reference
        if before is None or before.n_stages != now.n_stages:
            self._reference = now
            return []
        short = alarm(before, now, self.params)
        if short is None:
            return []
        self._alarmed = True
        delay = check_delay(f"{self._check_seed}/alarm", self._alarm_spread)
        return [
            Alarmed(short, before.totals[short], now.totals[short], now.totals),
            Wake(e.now + delay),
        ]

    def _check(self, e: Timer) -> list[Action]:
        stage = self._held()
        view = e.view.add(self._own(stage, serving=True))
        self._reference = view
        if self.holding(e.now):  # its checkpoint may be the only copy: it stays
            return [self._schedule(e.now)]
        seed = self._check_seed
        move = decide_move(view, stage, self.throughput, seed, self.params, arrivals=e.arrivals)
        if move is None:
            return [self._schedule(e.now)]
        self.phase, self.pending = Phase.CONFIRMING, move
        announce = self._claim("move", move.from_stage, move.to_stage)
        return [Moving(move, view.totals), announce, Wake(e.now + self.settle_s)]

    def _confirm(self, e: Timer) -> list[Action]:
        move = self.pending
        assert move is not None  # set with the phase
        self.pending = None
        if e.view.serving[move.from_stage] >= 1:
            self.stage, self.phase, self.moved = move.to_stage, Phase.LOADING, True
            return [Moved(move), self._claim("join", move.to_stage)]
        self.phase = Phase.SERVING
        stay = self._claim("serving", move.from_stage)
        return [Stay(move, e.view.totals), stay, self._schedule(e.now)]

    # -- gossip --------------------------------------------------------------------------

    def announcement(self, stage: int | None, state: PeerState) -> Announce | None:
        """What to gossip when the peer re-announces its record's ``stage`` and ``state``
        (every update period, and at once on a change): a pending move's intent while it
        is confirmed; ``leaving``; an intent while joining or loading; ``serving`` on the
        first announcement that it serves, ``load`` after. None: nothing to say yet."""
        previous = self._announced
        if self.pending is not None and (stage, state) == (
            self.pending.from_stage,
            PeerState.SERVING,
        ):
            return self._claim("move", self.pending.from_stage, self.pending.to_stage)
        self._announced = (stage, state)
        if state is PeerState.LEAVING:
            return Announce("leaving", stage)
        if stage is None:
            return None
        if state is not PeerState.SERVING:
            return Announce("join", stage)
        return Announce("serving" if previous != (stage, state) else "load", stage)

    def _claim(
        self, kind: Literal["join", "move", "serving"], stage: int, to: int | None = None
    ) -> Announce:
        if kind == "join":
            self._announced = (stage, PeerState.JOINING)
        elif kind == "serving":
            self._announced = (stage, PeerState.SERVING)
        return Announce(kind, stage, to)

    # -- helpers -------------------------------------------------------------------------

    def _own(self, stage: int, serving: bool) -> Claim:
        return Claim(self.seed, stage, self.throughput[stage], serving)

    def _held(self) -> int:
        assert self.stage is not None  # set when the machine leaves LISTENING
        return self.stage

    def _expect(self, event: Event, phase: Phase) -> None:
        if self.phase is not phase:
            raise PlacementError(
                f"{type(event).__name__} in phase {self.phase.value}, expected {phase.value}"
            )


class ArrivalCount:
    """Peers that arrived per peer-hour over the last ``window_s`` seconds (times are the
    caller's clock). Feed it either the set of peer ids present at each read
    (:meth:`saw`: the peers of the first read were there before us; a peer gone and first
    seen before the window is forgotten, and counts again if it comes back), or each
    arrival and the number present (:meth:`arrived`, :meth:`present`)."""

    def __init__(self, window_s: float = ARRIVALS_S) -> None:
        if not (math.isfinite(window_s) and window_s > 0.0):
            raise ValueError(f"window_s must be a positive number of seconds, got {window_s}")
        self.window_s = window_s
        self._times: deque[float] = deque()  # arrival times within the window
        self._first_seen: dict[str, float] = {}
        self._since: float | None = None
        self._present = 0

    def saw(self, present: Collection[str], now: float) -> None:
        first = self._since is None
        self.present(len(present), now)
        if first:  # there before us: not arrivals
            self._first_seen = dict.fromkeys(present, -math.inf)
            return
        for peer in set(present) - self._first_seen.keys():
            self._first_seen[peer] = now
            self.arrived(now)
        cutoff = now - self.window_s
        seen = self._first_seen.items()
        self._first_seen = {p: t for p, t in seen if p in present or t >= cutoff}

    def arrived(self, now: float) -> None:
        self._times.append(now)
        self._forget(now)

    def present(self, count: int, now: float) -> None:
        if self._since is None:
            self._since = now
        self._present = count

    def rate(self, now: float) -> float | None:
        """None until watched for a whole window (or while nobody is present)."""
        self._forget(now)
        if self._since is None or now - self._since < self.window_s or not self._present:
            return None
        return len(self._times) * 3600.0 / self.window_s / self._present

    def _forget(self, now: float) -> None:
        """Drop the arrivals before the window: a node that never asks for the rate (it
        stays on its stage) keeps counting them for days."""
        while self._times and self._times[0] < now - self.window_s:
            self._times.popleft()


__all__ = [
    "ARRIVALS_S",
    "MIN_SETTLE_S",
    "Action",
    "Alarmed",
    "Announce",
    "ArrivalCount",
    "AwaitSecond",
    "Chose",
    "Declined",
    "Event",
    "HoldSecond",
    "Join",
    "Load",
    "Loaded",
    "Look",
    "Moved",
    "Moving",
    "PeerPlacement",
    "Phase",
    "PlacementError",
    "Seed",
    "Stay",
    "Timer",
    "Wake",
    "settle_period",
]
