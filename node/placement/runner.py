"""The node's side of ``protocol.placement``: feeds the machine events in real time and
carries out its actions, through two seams (a :class:`Clock` and a :class:`ViewSource`)
and a sender, so that the event-to-action translation runs without sockets in tests.

:class:`PlacementRunner` keeps at most one wake: it sleeps until it, and meanwhile (while
the peer serves and waits for a check) looks at the cached view every update period, so
that an alarm can bring the check forward. At a wake it reads a fresh view (a failed read
is retried an update period later) and hands it to the machine.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

from node import events
from protocol.assignment import Move, SwarmView
from protocol.placement import (
    Action,
    Alarmed,
    Announce,
    AwaitSecond,
    Chose,
    Declined,
    HoldSecond,
    Join,
    Load,
    Loaded,
    Look,
    Moved,
    Moving,
    PeerPlacement,
    Phase,
    Stay,
    Timer,
    Wake,
)

logger = logging.getLogger(__name__)


class Clock(Protocol):
    def now(self) -> float: ...

    async def sleep_until(self, when: float) -> None: ...


class LoopClock:
    """The event loop's monotonic clock."""

    def now(self) -> float:
        return asyncio.get_running_loop().time()

    async def sleep_until(self, when: float) -> None:
        await asyncio.sleep(max(0.0, when - self.now()))


class ViewSource(Protocol):
    async def read(self) -> SwarmView:
        """The others' claims, read afresh (the DHT's records and newer gossip)."""
        ...

    def cached(self) -> SwarmView:
        """The others' claims from the last read records and the gossip since."""
        ...

    def arrivals(self) -> float | None:
        """Joiners per peer-hour lately, or None if not known yet."""
        ...


class PlacementRunner:
    """Runs one :class:`~protocol.placement.PeerPlacement` for the node. ``send`` gossips
    an :class:`~protocol.placement.Announce`; ``on_action`` (optional) sees every action,
    with the clock's time, before it is carried out."""

    def __init__(
        self,
        machine: PeerPlacement,
        clock: Clock,
        source: ViewSource,
        send: Callable[[Announce], Awaitable[None]],
        *,
        update_period_s: float,
        on_action: Callable[[float, Action], None] | None = None,
    ) -> None:
        self.machine = machine
        self.clock = clock
        self.source = source
        self.send = send
        self.update_period_s = update_period_s
        self.on_action = on_action
        self._wake = math.inf
        self._on_choice: Callable[[int], None] | None = None

    async def join(self, on_choice: Callable[[int], None], kept: Sequence[int] = ()) -> int:
        """Listen, choose, announce, reconsider (or, with ``kept``, the stages of this
        node's own checkpoints, take one of them at once: see ``protocol.placement.Join``);
        ``on_choice`` hears each choice before it is gossiped. Returns the stage to load."""
        self._on_choice = on_choice
        try:
            view = await self._read() if kept else None
            join = Join(self.clock.now(), kept=tuple(kept), view=view)
            actions = await self._carry_out(self.machine.handle(join))
            while not any(isinstance(a, Load) for a in actions):
                actions = await self._at_wake(looking=False)
        finally:
            self._on_choice = None
        return next(a.stage for a in actions if isinstance(a, Load))

    async def loaded(self, *, second: bool) -> int | None:
        """The stage the machine said to load serves now; the second stage to take as
        well (only if ``second``), or None: then checks are scheduled. A restarted node
        may wait here for a second stage's state (``protocol.placement.AwaitSecond``)."""
        view = await self._read()
        actions = await self._carry_out(
            self.machine.handle(Loaded(self.clock.now(), view, second=second))
        )
        while self.machine.phase is Phase.AWAITING_SECOND:
            actions = await self._at_wake(looking=False)
        return next((a.stage for a in actions if isinstance(a, HoldSecond)), None)

    async def next_move(self) -> Move:
        """Wait for a check that decides to move (announced; to be confirmed)."""
        if self.machine.phase is Phase.LOADING:  # loaded after a move, or no second asked
            await self.loaded(second=False)
        elif self.machine.phase is Phase.TWO_STAGE:  # the node did not take the second
            await self._carry_out(self.machine.handle(Declined(self.clock.now())))
        while True:
            actions = await self._at_wake(looking=True)
            for a in actions:
                if isinstance(a, Moving):
                    return a.move
            if self.machine.phase is Phase.SERVING:  # a check that kept the stage
                events.emit("placement.checked", stage=self.machine.stage)

    async def confirm_move(self) -> bool:
        """A settle period after the move was announced: whether it goes ahead."""
        while True:
            for a in await self._at_wake(looking=False):
                if isinstance(a, Moved):
                    return True
                if isinstance(a, Stay):
                    return False

    async def _at_wake(self, *, looking: bool) -> list[Action]:
        """Sleep until the wake (looking every update period if ``looking``), then hand
        the machine the view read then."""
        while (now := self.clock.now()) < self._wake:
            until = min(self._wake, now + self.update_period_s) if looking else self._wake
            await self.clock.sleep_until(until)
            now = self.clock.now()
            if looking and now < self._wake:
                try:
                    view = self.source.cached()
                except Exception as e:  # the check itself will say it at warning level
                    logger.debug("alarm look skipped: %s", e)
                    continue
                await self._carry_out(self.machine.handle(Look(now, view)))
        view = await self._read()
        timer = Timer(self.clock.now(), view, self.source.arrivals())
        return await self._carry_out(self.machine.handle(timer))

    async def _read(self) -> SwarmView:
        while True:
            try:
                return await self.source.read()
            except Exception as e:  # a DHT hiccup: read again an update period later
                logger.warning("reading the swarm's view failed (retrying): %s", e)
                await self.clock.sleep_until(self.clock.now() + self.update_period_s)

    async def _carry_out(self, actions: list[Action]) -> list[Action]:
        for a in actions:
            if self.on_action is not None:
                self.on_action(self.clock.now(), a)
            if isinstance(a, Wake):
                self._wake = a.at
            elif isinstance(a, Announce):
                await self.send(a)
            elif isinstance(a, Chose):
                if a.resumed:
                    logger.info("resuming stage %d, of which this node kept a checkpoint", a.stage)
                else:
                    verb = "reconsidered: stage" if a.revised else "chose stage"
                    logger.info("%s %d; stage totals seen: %s", verb, a.stage, _totals(a.totals))
                events.emit("placement.chose", stage=a.stage, resumed=a.resumed)
                if self._on_choice is not None:
                    self._on_choice(a.stage)
            elif isinstance(a, AwaitSecond):
                left = max(0.0, a.until - self.clock.now())
                logger.info(
                    "not taking stage %d as a second stage yet: nobody serves it and this "
                    "node kept no state of it; waiting up to %.0f s for a peer that did",
                    a.stage,
                    left,
                )
                events.emit("placement.waiting", stage=a.stage, hold_s=round(left, 1))
            elif isinstance(a, HoldSecond):
                logger.info(
                    "taking stage %d as a second stage (two-stage peers hold %.1f samples/s); "
                    "stage totals seen: %s",
                    a.stage,
                    a.two_stage,
                    _totals(a.totals),
                )
            elif isinstance(a, Moving):
                m = a.move
                logger.info(
                    "rebalancing: move from stage %d to %d (%s, gain %.2f, drawn with p=%.2f); "
                    "stage totals seen: %s",
                    m.from_stage,
                    m.to_stage,
                    m.reason,
                    m.gain,
                    m.probability,
                    _totals(a.totals),
                )
            elif isinstance(a, Moved):
                events.emit("placement.moved", **{"from": a.move.from_stage, "to": a.move.to_stage})
            elif isinstance(a, Stay):
                logger.info(
                    "not moving: nobody else would serve stage %d (stage totals seen: %s)",
                    a.move.from_stage,
                    _totals(a.totals),
                )
            elif isinstance(a, Alarmed):
                logger.info(
                    "alarm: stage %d holds %.0f (was %.0f at the last check); checking soon "
                    "(stage totals seen: %s)",
                    a.stage,
                    a.now,
                    a.before,
                    _totals(a.totals),
                )
        return actions


def _totals(totals: tuple[float, ...]) -> str:
    return "[" + ", ".join(f"{t:.0f}" for t in totals) + "]"
