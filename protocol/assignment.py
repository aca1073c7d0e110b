"""Which stage a peer takes, and when it moves: pure functions of a swarm view and a seed.

Contract: nothing here reads a clock or the network; times are parameters and every
random draw is a hash of the caller's seed, so the same view and seed give the same
answer on every peer and in the simulator. Bad arguments raise ``ValueError`` naming the
numbers. ``protocol.placement`` sequences these decisions over time for one peer.

What a peer maximises is the pipeline's pace, the least stage total (the *bottleneck*),
through two proxies that let one peer among thousands see its effect:

* **Stage prices** (:func:`stage_prices`): the dual of the max-min assignment's linear
  programme (:func:`max_min_lp`) over every peer's throughput vector. ``prices[s] *
  throughput[s]`` is what a peer adds to the best reachable bottleneck on stage s; they
  depend on who is in the swarm, not on who holds what.
* **A smooth, priced bottleneck** ``M(T) = (sum_s prices[s] * T_s ** -a) ** (-1 / a)``
  (:func:`smooth_bottleneck`, ``a = Params.sharpness``): between the least and largest
  total, raised by raising the least, and maximised over fractional assignments by the
  LP's optimum, so peers that each add the most M head for the optimum.

The decisions: :func:`resume_stage` (a peer restarted with checkpoints: the kept stage
fewest others hold), :func:`choose_stage` (a joiner: an empty stage if any, else the best value
of M discounted by how far the stage is from the peer's best priced fit),
:func:`decide_move` (a serving peer: move only when the target is worth ``hysteresis``
more and the gain pays for a state download, with a seeded chance that rations movers to
the size of the gap; a peer misplaced at the prices alone always moves; a stage is never
emptied), :func:`second_stage` (a fast peer also takes its next-best stage while the
two-stage reserve is short), :func:`alarm` (a stage lost ``alarm_drop`` of its total, or
nobody holds it) and :func:`check_delay` (when to check next). Views are small frozen
dataclasses (:class:`SwarmView`), built from :class:`Claim` s or from
:class:`~protocol.records.PeerInfo` records by :func:`view_from_peers`.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from protocol.records import MAX_STAGES, PeerInfo, PeerState

Seed = str | int | bytes

# A stage with no throughput is scored as if it had this fraction of the largest stage's:
# it keeps M finite and makes such a stage worth far more than any other.
_FLOOR = 1e-9
# A stage's price is at least this fraction of the highest price: a stage the optimum
# leaves slack (price 0) still counts a little, so that it is refilled if it runs short
# before prices are refreshed.
PRICE_FLOOR = 0.01
# A move that raises M by this fraction of itself is worth its download whatever
# ``min_gain`` says: in a swarm of a few hundred peers or fewer, joiners are too rare to
# wait for.
WORTH_A_MOVE = 0.01
_ROOM_STEPS = 16  # bisection steps for the room of a move: to 2**-16 of the supply


# Argument checks: a ValueError that names the setting and the number.


def _check_own(throughput: Sequence[float], n: int) -> None:
    if len(throughput) != n:
        raise ValueError(f"own throughput has {len(throughput)} entries for {n} stages")
    for s, t in enumerate(throughput):
        _rate(f"own throughput for stage {s}", t)


def _rate(what: str, v: float) -> None:
    if not (isinstance(v, int | float) and math.isfinite(v) and v >= 0.0):
        raise ValueError(f"{what} must be a finite number >= 0, got {v!r}")


def _all_rates(values: Iterable[float]) -> bool:
    try:
        return all(0.0 <= v < math.inf for v in values)
    except TypeError:
        return False


def _per_stage(what: str, values: Sequence[float], n: int) -> None:
    if len(values) != n:
        raise ValueError(f"{len(values)} {what}s for {n} stages")
    if not _all_rates(values):  # the fast path; the loop names the culprit
        for s, v in enumerate(values):
            _rate(f"{what} of stage {s}", v)


def _stage_index(s: int, n: int, what: str) -> None:
    if not (isinstance(s, int) and not isinstance(s, bool) and 0 <= s < n):
        raise ValueError(f"{what} must be an integer in [0, {n}), got {s!r}")


def _positive_int(what: str, v: int, hi: int) -> None:
    if not (isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= hi):
        raise ValueError(f"{what} must be an integer in [1, {hi}], got {v!r}")


def _positive(what: str, v: float, hi: float) -> None:
    if not (isinstance(v, int | float) and 0.0 < v <= hi):
        raise ValueError(f"{what} must be in (0, {hi:g}], got {v!r}")


def _in_range(what: str, v: float, lo: float, hi: float) -> None:
    if not (isinstance(v, int | float) and lo <= v <= hi):
        raise ValueError(f"{what} must be in [{lo:g}, {hi:g}], got {v!r}")


@dataclass(frozen=True, slots=True)
class Params:
    """The rule's settings. Every peer of a run must use the same ones."""

    # Exponent a of the smooth bottleneck. Higher corrects smaller imbalances (a stage
    # x short is worth (1 + x) ** (a + 1) times more), lower is calmer under noise.
    sharpness: float = 8.0
    # Joiners' choices within this fraction of the best value are drawn at random.
    tie_tolerance: float = 0.02
    # A stage where a peer's priced speed is within this fraction of its best counts at
    # full value; further out, its value is discounted by the fit ** ``selectivity``.
    # Joiners then fill gaps from the peers that lose least by it, and seldom land where
    # the prices would later call them misplaced (the optimum's placement, no moves).
    fit_band: float = 0.05
    # Exponent of that discount: higher keeps peers nearer their best stage, lower lets
    # a gap pull peers from further out.
    selectivity: float = 8.0
    # A serving peer's move must add this much more than staying (relative to what it
    # adds where it is): the band within which joiners, who move for free, fix things.
    hysteresis: float = 0.3
    # ... and add to the smooth bottleneck at least what this many mean joiners would add
    # to a balanced swarm: a move costs a state download, so the few peers whose move
    # buys the most go, and an imbalance that only many small moves would fix is left to
    # the joiners, who arrive at a rate proportional to the swarm's size.
    min_gain: float = 3.0
    # Joiners per peer-hour at and above which ``min_gain`` and ``hysteresis`` hold as
    # they are; a peer that sees fewer arrivals scales them down in proportion (see
    # ``decide_move``'s ``arrivals``): a swarm that one peer in ten or fewer joins per
    # hour is nearly still, and waits for joiners too long. Well under the churn the
    # rule was tuned at (1 per peer-hour), whose measured rate's ups and downs then
    # change nothing.
    arrival_reference: float = 0.1
    # A serving peer misplaced at the prices alone (by more than this factor, minus 1)
    # moves without rationing; wider than ``fit_band``, so that joiners placed inside it
    # are not moved when prices drift.
    price_hysteresis: float = 0.3
    # Expected inflow per check period, as a multiple of the room: about 1/urgency periods
    # to close a gap. Higher recovers faster and overshoots more under gossip delay: after
    # a mass loss an alarm has every peer check within seconds, and what they move before
    # they see each other's moves is an overshoot (6 instead of 4 at 10,000 peers: 90% of
    # a lost half-stage made up in 100 s instead of 180, with 13% more moves).
    urgency: float = 4.0
    # The chance of a move that fixes an imbalance scales as (own speed / the mean
    # peer's) ** size_bias: a gap is closed by few large moves rather than many small.
    size_bias: float = 1.0
    # A joiner that has not loaded yet changes its mind when another stage is worth this
    # much more (it costs nothing, so the margin is small).
    join_margin: float = 0.02
    # A stage whose total fell by more than this fraction since a serving peer's last
    # check (or that nobody holds any more) makes it check at once: see :func:`alarm`.
    alarm_drop: float = 0.2
    # Peers holding two stages (:func:`second_stage`): while their summed throughput is
    # under this many mean stage totals, a joiner at least ``two_stage_min`` times as
    # fast as the mean peer takes a second stage. 0: nobody does. (At 1,000 peers a
    # reserve of 0.25 gave 0.976 of the bound, 1.0 gave 0.981, none 0.959: BENCHMARKS.md.)
    two_stage_reserve: float = 1.0
    two_stage_min: float = 1.0
    mean_period_s: float = 60.0  # mean time between a serving peer's checks
    # A peer restarted on the stage of its own checkpoint holds it this long (it does not
    # move, and takes as a second stage no stage that nobody serves and it kept no state
    # of): its checkpoint may be the swarm's only copy of that stage's training, and the
    # peers of a swarm restarted as a whole, holding the other stages' copies, come back
    # within it. A second stage that nobody else can fill is taken from scratch after it.
    resume_hold_s: float = 300.0
    period_jitter: float = 0.5  # a check period is uniform in mean * (1 +- jitter)

    def __post_init__(self) -> None:
        _positive("sharpness", self.sharpness, hi=1e4)
        _in_range("tie_tolerance", self.tie_tolerance, 0.0, 1.0)
        _in_range("fit_band", self.fit_band, 0.0, 1e6)
        _in_range("selectivity", self.selectivity, 0.0, 1e3)
        _in_range("hysteresis", self.hysteresis, 0.0, 1e6)
        _in_range("min_gain", self.min_gain, 0.0, 1e6)
        _positive("arrival_reference", self.arrival_reference, hi=1e6)
        _in_range("price_hysteresis", self.price_hysteresis, 0.0, 1e6)
        _positive("urgency", self.urgency, hi=1e6)
        _in_range("size_bias", self.size_bias, 0.0, 8.0)
        _in_range("join_margin", self.join_margin, 0.0, 1e6)
        _in_range("alarm_drop", self.alarm_drop, 0.0, 1.0)
        _in_range("two_stage_reserve", self.two_stage_reserve, 0.0, float(MAX_STAGES))
        _in_range("two_stage_min", self.two_stage_min, 0.0, 1e6)
        _positive("mean_period_s", self.mean_period_s, hi=1e9)
        _in_range("period_jitter", self.period_jitter, 0.0, 1.0)
        _in_range("resume_hold_s", self.resume_hold_s, 0.0, 1e9)


DEFAULT_PARAMS = Params()


@dataclass(frozen=True, slots=True)
class Claim:
    """One peer's hold on a stage, as a deciding peer sees it: serving it, or announced
    (a join or move intent, or loading) and not serving yet."""

    peer: str
    stage: int
    throughput: float  # the peer's measured throughput for this stage, samples/s
    serving: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.peer, str) or not self.peer:
            raise ValueError(f"a claim needs a peer id, got {self.peer!r:.80}")
        _stage_index(self.stage, MAX_STAGES, "claim stage")
        _rate(f"throughput of peer {self.peer}", self.throughput)


@dataclass(frozen=True, slots=True)
class SwarmView:
    """Per-stage sums of the claims a peer knows of, and the stage prices: what the rule
    needs, nothing more.

    ``totals[s]``: summed throughput of every claim on stage s (serving, loading or
    announced); ``counts[s]``: how many claims; ``serving[s]``: how many of those serve;
    ``prices``: from :func:`stage_prices`, or None for equal prices; ``squares[s]``: the
    summed squares of the claims' throughputs (how unequal the peers are, which the
    rationing of moves by size needs), or None: as if a stage's claims were all alike;
    ``two_stage``: the summed throughput (on their first stage) of the peers that hold a
    second stage (their claims there carry no throughput: the rule plans with their time
    on their first stage).
    """

    totals: tuple[float, ...]
    counts: tuple[int, ...]
    serving: tuple[int, ...]
    prices: tuple[float, ...] | None = None
    squares: tuple[float, ...] | None = None
    two_stage: float = 0.0

    def __post_init__(self) -> None:
        n = len(self.totals)
        if not 1 <= n <= MAX_STAGES:
            raise ValueError(f"a view needs 1 to {MAX_STAGES} stages, got {n}")
        if len(self.counts) != n or len(self.serving) != n:
            raise ValueError(
                f"a view's totals, counts and serving must have one entry per stage: "
                f"got {n}, {len(self.counts)} and {len(self.serving)}"
            )
        if not _all_rates(self.totals):  # the fast path; the loop names the culprit
            for s in range(n):
                _rate(f"total of stage {s}", self.totals[s])
        pairs = zip(self.counts, self.serving, strict=True)
        if not all(type(c) is int and type(k) is int and 0 <= k <= c for c, k in pairs):
            for s, (c, k) in enumerate(zip(self.counts, self.serving, strict=True)):
                if not (type(c) is int and type(k) is int and 0 <= k <= c):
                    raise ValueError(
                        f"stage {s}: need integers 0 <= serving <= claims, got {k!r} serving "
                        f"of {c!r}"
                    )
        if self.prices is not None:
            _per_stage("price", self.prices, n)
            if not sum(self.prices) > 0.0:
                raise ValueError(f"prices must not all be 0, got {self.prices}")
        if self.squares is not None:
            _per_stage("squared sum", self.squares, n)
        _rate("two-stage throughput", self.two_stage)

    @property
    def n_stages(self) -> int:
        return len(self.totals)

    @classmethod
    def empty(cls, n_stages: int) -> SwarmView:
        _positive_int("n_stages", n_stages, MAX_STAGES)
        zeros = (0.0,) * n_stages
        return cls(zeros, (0,) * n_stages, (0,) * n_stages, None, zeros)

    @classmethod
    def from_claims(
        cls, n_stages: int, claims: Iterable[Claim], prices: Sequence[float] | None = None
    ) -> SwarmView:
        """Sum ``claims``; a peer may hold one claim (merge a peer's record and its newer
        intent before calling: :func:`view_from_peers` does)."""
        _positive_int("n_stages", n_stages, MAX_STAGES)
        totals, counts, serving = [0.0] * n_stages, [0] * n_stages, [0] * n_stages
        squares = [0.0] * n_stages
        seen: set[str] = set()
        for c in claims:
            if c.peer in seen:
                raise ValueError(f"peer {c.peer} has more than one claim in the view")
            seen.add(c.peer)
            if c.stage >= n_stages:
                raise ValueError(
                    f"peer {c.peer} claims stage {c.stage}, out of range for {n_stages} stages"
                )
            totals[c.stage] += c.throughput
            squares[c.stage] += c.throughput * c.throughput
            counts[c.stage] += 1
            serving[c.stage] += c.serving
        priced = None if prices is None else tuple(float(p) for p in prices)
        return cls(tuple(totals), tuple(counts), tuple(serving), priced, tuple(squares))

    def add(self, claim: Claim) -> SwarmView:
        """This view with one more claim (for instance the deciding peer's own)."""
        _stage_index(claim.stage, self.n_stages, f"stage of peer {claim.peer}")
        s = claim.stage
        return SwarmView(
            _bump(self.totals, s, claim.throughput),
            _bump(self.counts, s, 1),
            _bump(self.serving, s, int(claim.serving)),
            self.prices,
            None if self.squares is None else _bump(self.squares, s, claim.throughput**2),
            self.two_stage,
        )


@dataclass(frozen=True, slots=True)
class Move:
    """A decision to move, to announce before unloading ``from_stage``."""

    from_stage: int
    to_stage: int
    gain: float  # value at the target over value where it is, minus 1 (inf: fills a gap)
    probability: float  # the chance with which it was drawn, for logs
    reason: str  # "empty" (fills an empty stage), "price" (misplaced), "imbalance"


def stage_prices(throughputs: Sequence[Sequence[float]] | np.ndarray) -> tuple[float, ...]:
    """The stage prices of a swarm: rows are peers, columns stages, entries each peer's
    throughput for each stage (all of the swarm's peers, wherever they are now).

    The dual solution of :func:`max_min_lp` (to a relative gap of 1e-4), floored at
    ``PRICE_FLOOR`` times the highest and normalised to sum to 1. Sort the peers (by id)
    before calling, so that every peer computes the same prices.
    """
    t = np.asarray(throughputs, dtype=float)
    if t.ndim != 2 or not 1 <= t.shape[1] <= MAX_STAGES:
        raise ValueError(f"throughputs must be a peers x stages table, got shape {t.shape}")
    if not np.isfinite(t).all() or (t < 0).any():
        raise ValueError(f"throughputs must be finite and >= 0, least {t.min(initial=0.0)}")
    n, s = t.shape
    if n == 0 or s == 1 or not t.any():
        return tuple([1.0 / s] * s)
    _, lam = max_min_lp(t)
    prices = [float(x) for x in lam]
    top = max(prices)
    prices = [max(p, PRICE_FLOOR * top) for p in prices]
    total = sum(prices)
    return tuple(p / total for p in prices)


def max_min_lp(
    throughputs: np.ndarray, tol: float = 1e-4, max_steps: int = 500
) -> tuple[float, np.ndarray]:
    """The best bottleneck over fractional assignments of the peers (rows) to stages
    (columns), and the stage prices that certify it: ``(bound, prices)``.

    Solves the dual, ``min over prices p >= 0, sum(p) = 1, of sum_i max_s p_s * t[i, s]``,
    by Kelley's cutting planes (a linear programme with S + 1 variables per step) to a
    relative gap of ``tol``. Any prices bound the optimum from above, so ``bound`` is an
    upper bound within ``tol`` of it. No peers: ``(0, equal prices)``.
    """
    from scipy.optimize import linprog  # hivemind depends on scipy; imported when needed

    t = np.asarray(throughputs, dtype=float)
    n, s = t.shape
    if n == 0:
        return 0.0, np.full(s, 1.0 / s)
    rows = np.arange(n)
    scale = max(t.sum() / s, 1e-300)
    cuts: list[np.ndarray] = []
    lam = np.full(s, 1.0 / s)
    best, best_lam = math.inf, lam
    for _ in range(max_steps):
        v = t * lam  # (n, S)
        pick = v.argmax(1)
        upper = float(v[rows, pick].sum())  # any prices bound the optimum from above
        if upper < best:
            best, best_lam = upper, lam
        cuts.append(np.bincount(pick, weights=t[rows, pick], minlength=s) / scale)
        res = linprog(
            np.r_[np.zeros(s), 1.0],
            A_ub=np.hstack([np.array(cuts), -np.ones((len(cuts), 1))]),
            b_ub=np.zeros(len(cuts)),
            A_eq=np.r_[np.ones(s), 0.0][None],
            b_eq=[1.0],
            bounds=[(0.0, None)] * s + [(None, None)],
            method="highs",
        )
        if res.status != 0:  # cannot happen for this bounded, feasible master
            raise ValueError(f"price computation failed: {res.message}")
        if best - res.fun * scale <= tol * best:  # the master's value bounds from below
            break
        lam = np.clip(res.x[:s], 0.0, None)
        lam = lam / lam.sum()
    return best, best_lam


def view_from_peers(
    peers: Iterable[PeerInfo],
    n_stages: int,
    intents: Iterable[Claim] = (),
    exclude: Collection[str] = (),
    own: Sequence[float] | None = None,
    priced: bool = True,
) -> SwarmView:
    """The view from peer records and announced intents.

    A record counts on its stage unless the peer is leaving (or has no stage yet); it
    serves if its state is serving. A second stage counts as held (and served, once the
    record says so) with no throughput, and adds the peer's first-stage throughput to
    ``two_stage``. An intent from a peer replaces what its record says
    (it is newer). Peers in ``exclude`` are left out of the claims (the deciding peer
    itself, or peers known to have left). A record on a stage outside ``range(n_stages)``
    is dropped: it was validated, but for another layout, and must not break a decision.
    With ``priced``, prices come from the throughput vectors of every record that is not
    leaving (excluded ones too: they are still in the swarm) plus ``own``, the deciding
    peer's, in peer id order.
    """
    _positive_int("n_stages", n_stages, MAX_STAGES)
    records = sorted(
        (p for p in peers if p.state is not PeerState.LEAVING), key=lambda p: p.peer_id
    )
    claims: dict[str, Claim] = {}
    for p in records:
        if p.stage is None or p.stage >= n_stages:
            continue
        claims[p.peer_id] = Claim(
            p.peer_id, p.stage, p.throughput[p.stage], p.state is PeerState.SERVING
        )
    for c in intents:
        if c.stage < n_stages:
            claims[c.peer] = c
    prices = None
    if priced:
        vectors = [p.throughput for p in records if len(p.throughput) == n_stages]
        if own is not None:
            _check_own(own, n_stages)
            vectors.append(tuple(own))
        prices = stage_prices(np.array(vectors, dtype=float).reshape(len(vectors), n_stages))
    kept = (c for k, c in claims.items() if k not in exclude)
    view = SwarmView.from_claims(n_stages, kept, prices)
    seconds = [
        p
        for p in records
        if p.second_stage is not None
        and max(p.stage, p.second_stage) < n_stages
        and p.peer_id not in exclude
    ]
    if not seconds:
        return view
    counts, serving = list(view.counts), list(view.serving)
    for p in seconds:
        counts[p.second_stage] += 1
        serving[p.second_stage] += p.second_serving and p.state is PeerState.SERVING
    two = sum(p.throughput[p.stage] for p in seconds)
    return SwarmView(view.totals, tuple(counts), tuple(serving), view.prices, view.squares, two)


def bottleneck(totals: Sequence[float]) -> float:
    """The pipeline's pace: the least stage total."""
    if not totals:
        raise ValueError("bottleneck of no stages")
    return min(totals)


def smooth_bottleneck(
    totals: Sequence[float], sharpness: float, prices: Sequence[float] | None = None
) -> float:
    """M(T), the priced power mean of the totals with exponent ``-sharpness`` (see the
    module's docstring); a stage with nothing counts as 1e-9 of the largest; 0 if all are 0."""
    if not totals:
        raise ValueError("smooth bottleneck of no stages")
    _positive("sharpness", sharpness, hi=1e4)
    return _smooth(list(totals), _weights(len(totals), prices), sharpness)


def stage_values(view: SwarmView, throughput: Sequence[float], params: Params) -> list[float]:
    """What a peer not in ``view`` would add to M at each stage, with its own
    ``throughput[s]`` for stage s."""
    _check_own(throughput, view.n_stages)
    w = _weights(view.n_stages, view.prices)
    return _values(list(view.totals), w, throughput, params.sharpness)


def choose_stage(
    view: SwarmView,
    throughput: Sequence[float],
    seed: Seed,
    params: Params = DEFAULT_PARAMS,
) -> int:
    """The stage a joining peer takes, given the claims of the others (not its own)."""
    _check_own(throughput, view.n_stages)
    empty = [s for s, c in enumerate(view.counts) if c == 0]
    if empty:
        return _pick(empty, seed, "join")
    w = _weights(view.n_stages, view.prices)
    values = _values(list(view.totals), w, throughput, params.sharpness)
    scores = _scores(values, w, throughput, params)
    best = max(scores)
    if not best > 0.0:  # a peer that adds nothing anywhere: any stage will do
        return _pick(list(range(view.n_stages)), seed, "join")
    cut = best * (1.0 - params.tie_tolerance)
    return _pick([s for s, v in enumerate(scores) if v >= cut], seed, "join")


def resume_stage(view: SwarmView, kept: Sequence[int]) -> int:
    """The stage a restarted peer takes again, given the stages it kept checkpoints of
    (``kept``, its most recent first) and the claims of the others: the kept stage the
    fewest others claim, the most recent on a tie. A kept stage that nobody holds comes
    first: there, its checkpoint may be the swarm's only copy of the stage's training,
    which taking another stage would leave behind."""
    if not kept:
        raise ValueError("resume_stage needs at least one kept stage")
    for s in kept:
        _stage_index(s, view.n_stages, "kept stage")
    order = {s: i for i, s in reversed(list(enumerate(kept)))}
    return min(order, key=lambda s: (view.counts[s], order[s]))


def decide_move(
    view: SwarmView,
    stage: int,
    throughput: Sequence[float],
    seed: Seed,
    params: Params = DEFAULT_PARAMS,
    *,
    serving: bool = True,
    arrivals: float | None = None,
) -> Move | None:
    """Whether the peer holding ``stage`` (counted in ``view``) moves now, and where.

    ``serving``: whether it serves its stage already. A peer that has only announced (a
    joiner reconsidering once others' intents have arrived) may leave a stage that
    others hold, and pays no load for a change of mind. ``arrivals``: joiners per
    peer-hour lately, if the caller knows (None: ``params.arrival_reference``); fewer
    make a serving peer's move worth its download sooner.
    """
    move = _move_candidate(
        view, stage, throughput, seed, params, serving=serving, arrivals=arrivals
    )
    return None if move is None else _draw_move(move, seed)


def _move_candidate(
    view: SwarmView,
    stage: int,
    throughput: Sequence[float],
    seed: Seed,
    params: Params,
    *,
    serving: bool,
    arrivals: float | None,
) -> Move | None:
    """The move ``decide_move`` draws from (with ``Move.probability``), or None."""
    n = view.n_stages
    _check_own(throughput, n)
    _stage_index(stage, n, "stage")
    holders = view.serving[stage] if serving else view.counts[stage]
    if holders < 1:
        raise ValueError(
            f"the view must count the deciding peer on stage {stage}: it has "
            f"{view.counts[stage]} claims there, {view.serving[stage]} serving"
        )
    if n == 1 or holders < 2:  # never empty a stage
        return None
    me = throughput[stage]
    rest = list(view.totals)
    rest[stage] = max(0.0, rest[stage] - me)
    counts = list(view.counts)
    counts[stage] -= 1

    empty = [s for s in range(n) if counts[s] == 0]
    if empty:  # a stage with nobody: any peer that can spare itself is a candidate
        target = _pick(empty, seed, "target")
        level = sum(rest) / (n - len(empty))
        supply = sum(view.totals)
        p = 1.0 if supply <= 0.0 else min(1.0, params.urgency * level / supply)
        return Move(stage, target, math.inf, p, "empty")

    w, a = _weights(n, view.prices), params.sharpness
    values = _values(rest, w, throughput, a)
    scores = _scores(values, w, throughput, params)
    here = scores[stage]
    best = max(v for s, v in enumerate(scores) if s != stage)
    # What joiners will fix for free, which the bars below leave to them, in proportion
    # to how many arrive (all of it at ``arrival_reference`` and above).
    joining = 1.0
    if arrivals is not None:
        _rate("arrivals", arrivals)
        joining = min(1.0, arrivals / params.arrival_reference)
    margin = max(params.join_margin, params.hysteresis * joining if serving else 0.0)
    if not best > 0.0 or not best > here * (1.0 + margin):
        return None
    cut = best * (1.0 - params.tie_tolerance)
    target = _pick([s for s, v in enumerate(scores) if s != stage and v >= cut], seed, "target")
    if serving:
        joiner = joining * sum(view.totals) / (sum(view.counts) * n)  # a mean joiner's gain
        worth = min(params.min_gain * joiner, WORTH_A_MOVE * (_smooth(rest, w, a) + values[stage]))
        if not values[target] - values[stage] > worth:
            return None  # not worth a state download: joiners will do it
    gain = scores[target] / here - 1.0 if here > 0.0 else math.inf
    if w[target] * throughput[target] > (1.0 + params.price_hysteresis) * w[stage] * me:
        # Misplaced at the prices alone: the optimum puts it there whatever others do,
        # and the misplaced peers of every stage moving at once converge on a balanced
        # assignment (the optimum's), so there is nothing to ration.
        return Move(stage, target, gain, 1.0, "price")
    # The fit discounts of target and stage, which the room must keep paying for too.
    tilt = (scores[target] / values[target]) / (here / values[stage]) if here > 0.0 else 1.0
    room = _room(rest, w, stage, target, me, throughput[target], a, margin, tilt)
    supply = sum(view.totals) - view.totals[target]
    others = sum(view.counts) - view.counts[target]
    mean = supply / others if others > 0 else 0.0
    size = (me / mean) ** params.size_bias if mean > 0.0 else 1.0
    share = params.urgency * room / supply * size if supply > 0.0 else 1.0
    if view.squares is not None and supply > 0.0:
        # Favouring large peers must not add inflow. Summed over the peers outside the
        # target, share * speed is urgency * room times their mean squared speed over the
        # squared mean (2.7 for lognormal speeds of sigma 1) when size_bias is 1; dividing
        # by that ** size_bias makes it urgency * room for 0 and 1, and about that between.
        moment = (sum(view.squares) - view.squares[target]) * others / supply**2
        share /= max(1.0, moment) ** params.size_bias
    return Move(stage, target, gain, min(1.0, share), "imbalance")


def second_stage(
    view: SwarmView, stage: int, throughput: Sequence[float], params: Params = DEFAULT_PARAMS
) -> int | None:
    """The second stage a peer that serves ``stage`` (counted in ``view``) takes as
    well, or None: while the peers holding two stages sum to less than
    ``params.two_stage_reserve`` mean stage totals, a peer at least ``two_stage_min``
    times the mean claim's speed takes the stage where its priced speed is next best (it
    loses least there when its time goes to that stage). A peer that the rule might move
    now (its stage holds more than its share) takes none: a peer holding two stages
    never moves, and joiners that all locked themselves onto one crowded stage would
    leave the swarm unbalanced for good."""
    n = view.n_stages
    _check_own(throughput, n)
    _stage_index(stage, n, "stage")
    claims, total = sum(view.counts), sum(view.totals)
    if params.two_stage_reserve <= 0.0 or n < 2 or claims == 0 or total <= 0.0:
        return None
    if view.two_stage >= params.two_stage_reserve * total / n:
        return None
    if throughput[stage] < params.two_stage_min * total / claims:
        return None
    settled = SwarmView(  # as if every claim served: those loading now will soon
        view.totals, view.counts, view.counts, view.prices, view.squares, view.two_stage
    )
    move = _move_candidate(
        settled, stage, throughput, "second", params, serving=True, arrivals=None
    )
    if move is not None and move.probability > 0.0:
        return None
    w = _weights(n, view.prices)
    return max((s for s in range(n) if s != stage), key=lambda s: w[s] * throughput[s])


def alarm(before: SwarmView, now: SwarmView, params: Params = DEFAULT_PARAMS) -> int | None:
    """A stage that calls for a check before the period is out: one whose total in
    ``now`` fell by more than ``params.alarm_drop`` from ``before`` (the view at the
    peer's last check), or that nobody holds any more; the first such stage, or None."""
    if now.n_stages != before.n_stages:
        raise ValueError(f"views of {before.n_stages} and {now.n_stages} stages")
    keep = 1.0 - params.alarm_drop
    for s in range(now.n_stages):
        if now.counts[s] == 0 or now.totals[s] < keep * before.totals[s]:
            return s
    return None


def check_delay(seed: Seed, params: Params = DEFAULT_PARAMS) -> float:
    """Seconds until a serving peer's next check: uniform around the mean period, so that
    checks spread out instead of firing together."""
    u = _uniform(seed, "period")
    return params.mean_period_s * (1.0 + params.period_jitter * (2.0 * u - 1.0))


# The first rule, for callers that know only the others' records (the daemon's first
# assignment, the status table). ``stage_throughput`` is also what a status line shows.


def stage_throughput(peers: Iterable[PeerInfo], n_stages: int) -> list[float]:
    """Summed throughput per stage of the peers that hold (or are loading) it."""
    totals = [0.0] * n_stages
    for p in peers:
        if p.state is not PeerState.LEAVING and p.stage is not None and p.stage < n_stages:
            totals[p.stage] += p.throughput[p.stage] if p.stage < len(p.throughput) else 0.0
    return totals


def least_served_stage(peers: Iterable[PeerInfo], n_stages: int, seed: str) -> int:
    """The stage with the least throughput; a seeded draw among near-ties (within 1%)."""
    if n_stages < 1:
        raise ValueError(f"n_stages must be >= 1, got {n_stages}")
    totals = stage_throughput(peers, n_stages)
    low = min(totals)
    tied = [s for s, t in enumerate(totals) if t <= low * 1.01 + 1e-9]
    return random.Random(seed).choice(tied)


# Internals. Plain floats and lists: a decision takes microseconds for a few stages.


def _weights(n: int, prices: Sequence[float] | None) -> list[float]:
    if prices is None:
        return [1.0 / n] * n
    if len(prices) != n:
        raise ValueError(f"{len(prices)} prices for {n} stages")
    total = sum(prices)
    return [p / total for p in prices]


def _smooth(totals: list[float], weights: list[float], a: float) -> float:
    top = max(totals)
    if top <= 0.0:
        return 0.0
    floor = top * _FLOOR
    low = max(min(totals), floor)
    # Factor out the smallest total, so that no power overflows: each ratio is <= 1.
    acc = 0.0
    for t, w in zip(totals, weights, strict=True):
        acc += w * (low / (t if t > floor else floor)) ** a
    return low * acc ** (-1.0 / a) if acc > 0.0 else top


def _values(rest: list[float], weights: list[float], throughput: Sequence[float], a: float):
    base = _smooth(rest, weights, a)
    out = []
    for s, t in enumerate(throughput):
        old = rest[s]
        rest[s] = old + t
        out.append(_smooth(rest, weights, a) - base)
        rest[s] = old
    return out


def _scores(
    values: list[float], weights: list[float], throughput: Sequence[float], params: Params
) -> list[float]:
    """``values`` discounted where the peer's priced speed is more than ``fit_band``
    below its best: by (fit * (1 + fit_band)) ** selectivity."""
    priced = [w * t for w, t in zip(weights, throughput, strict=True)]
    top = max(priced)
    if top <= 0.0:
        return values
    band = 1.0 + params.fit_band
    return [
        v * min(1.0, band * p / top) ** params.selectivity
        for v, p in zip(values, priced, strict=True)
    ]


def _room(
    rest: list[float],
    weights: list[float],
    here: int,
    target: int,
    me_here: float,
    me_there: float,
    a: float,
    h: float,
    tilt: float,
) -> float:
    """How much throughput may flow into ``target`` (taken from every other stage in
    proportion to its total) before a peer like this one no longer gains enough by
    moving there (by the margin ``h``, its fit discounts ``tilt`` included): the size of
    the gap, in the units the move closes it."""
    pool = sum(rest) - rest[target]
    if pool <= 0.0:
        return 0.0

    def still_pays(flow: float) -> bool:
        keep = 1.0 - flow / pool
        shifted = [t * keep for t in rest]
        shifted[target] = rest[target] + flow
        base = _smooth(shifted, weights, a)
        there, stay = shifted.copy(), shifted.copy()
        there[target] += me_there
        stay[here] += me_here
        gain_there = _smooth(there, weights, a) - base
        return gain_there * tilt > (1.0 + h) * (_smooth(stay, weights, a) - base)

    lo, hi = 0.0, pool
    if still_pays(hi):
        return hi
    for _ in range(_ROOM_STEPS):
        mid = 0.5 * (lo + hi)
        if still_pays(mid):
            lo = mid
        else:
            hi = mid
    return lo


def _draw_move(move: Move, seed: Seed) -> Move | None:
    return move if _uniform(seed, "move") < move.probability else None


def _pick(options: list[int], seed: Seed, label: str) -> int:
    if len(options) == 1:
        return options[0]
    return options[min(len(options) - 1, int(_uniform(seed, label) * len(options)))]


def _uniform(seed: Seed, label: str) -> float:
    """A number in [0, 1) from ``seed`` and ``label``; the same on every platform."""
    if isinstance(seed, bytes):
        raw = seed
    elif isinstance(seed, str):
        raw = seed.encode()
    elif isinstance(seed, int) and not isinstance(seed, bool):
        raw = str(seed).encode()
    else:
        raise ValueError(f"a seed must be str, int or bytes, got {type(seed).__name__}")
    digest = hashlib.blake2b(raw, digest_size=8, person=label.encode()[:16]).digest()
    return int.from_bytes(digest, "big") / 2.0**64


def _bump(values: tuple, s: int, by: float) -> tuple:
    return values[:s] + (values[s] + by,) + values[s + 1 :]
