"""Stage assignment with thousands of virtual peers: our rule vs a Petals-style baseline.

A discrete-event simulation. Peers arrive (a burst into an empty swarm, then a ramp),
leave (cleanly, or killed: then the swarm learns of it only when the record expires),
come in a wave and leave together, and at one moment half the peers of stage 0 are
killed at once. With our rule every peer runs the node's placement state machine
(``protocol.placement.PeerPlacement``: listen, choose, reconsider once, load, perhaps a
second stage, periodic checks, alarms, confirmed moves) on a virtual clock; this loop
only feeds it events and carries out its actions. The view a peer reads is the
announcements of others as of a gossip delay ago (exponential, ``--gossip-delay`` mean),
each of the last ``--reannounce`` seconds' announcements missing with probability
``--gossip-loss`` (older ones have been re-announced or read from the DHT), priced with
the stage prices (``stage_prices``) of the records then in the DHT, refreshed every
minute or when the number of records changed by 3%. Loading a stage takes ``--load``
seconds (about). A node looks at its view every update period for alarms; here, for
speed, serving peers look only when some stage's announced total fell by
``--alarm-drop`` below its highest over the last check period (or nobody holds it): a
look at which no stage fell that far would raise no alarm. The arrival rate the rule is
told is counted once for all peers (``protocol.placement.ArrivalCount``).

The baseline is run on the same peers and the same events. Joining: the weakest stage.
Rebalancing, at the same check times: a peer estimates the bottleneck after the whole
swarm re-settled greedily (itself first, then every peer in random order moving to the
weakest stage until none moves) and moves to the weakest stage if that would raise the
bottleneck by more than a factor 1/0.75 (Petals' ``balance_quality`` of 0.75). For
speed, the re-settled bottleneck is recomputed every 30 s and shared by the checks in
between, and a check is skipped when a bound on the optimum shows it cannot pass.

Figures: the bottleneck (least summed throughput of the peers *serving* each stage) over
an upper bound on the optimum for the peers present: the linear-programming relaxation
of the max-min assignment, solved exactly (to 1e-6) by cutting planes on its dual every
``--lp-every`` seconds and after each mass event; in between, the dual solution's value
on the current peers, which is also an upper bound. An integer assignment built from the
LP solution says how tight the bound is. At each sample the ratio is the product of three
factors, whose steady-state means are printed: serving (what peers still loading hold
back), placement (peers away from their best stage at the prices) and balance (stage
totals apart). Moves per peer-hour count changes of stage by a serving peer (each costs a
load); intent revisions (a joiner changing its mind before it loads anything) are
counted apart. The two rules run in two processes.

Ours has two-stage peers (``--two-stage-reserve``, 0 for none): a joiner whose stage
serves asks ``second_stage`` whether to take a second stage too, as the node does; if so
it loads it (serving its first meanwhile) and never moves. Its record plans it on its
first stage; trainers route to it on each stage at its share of time in the division
that raises the least stage total most (``protocol.routing.second_stage_shares``), and the
simulator takes that division as delivered at each sample (``Sim.bridged``): the same
idealisation as summing a stage's peers, which assumes routing within a stage is perfect.

    python -m scripts.simulate_assignment --peers 1000
    python -m scripts.simulate_assignment --peers 10000 --stages 4 --duration 7200 \\
        --churn 1.0 --seed 0 --seeds 2
"""

from __future__ import annotations

import argparse
import bisect
import heapq
import math
import multiprocessing
import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import numpy as np
from scipy.special import ndtr

from protocol.assignment import (
    DEFAULT_PARAMS,
    Params,
    SwarmView,
    check_delay,
    max_min_lp,
    stage_prices,
)
from protocol.placement import (
    Action,
    Announce,
    ArrivalCount,
    Chose,
    HoldSecond,
    Join,
    Load,
    Loaded,
    Look,
    Moved,
    PeerPlacement,
    Phase,
    Timer,
    Wake,
    settle_period,
)
from protocol.routing import second_stage_shares

RULES = ("ours", "petals")
FACTORS = ("serving", "placement", "balance")
PETALS_QUALITY = 0.75  # Petals' default balance_quality

# Event kinds, in the order they are handled when simultaneous.
ARRIVE, TIMER, LOADED, CHECK, DEPART, VANISH, LOSS, PRICES, SAMPLE, LOOK, SECOND = range(11)
# Phases of a peer.
ABSENT, LISTENING, INTENT, LOADING, SERVING, GONE = range(6)


@dataclass(frozen=True)
class Config:
    peers: int = 1000
    stages: int = 4
    duration: float = 7200.0  # simulated seconds
    churn: float = 1.0  # departures per peer per hour (mean stay: 1/churn hours)
    seed: int = 0
    dist: str = "lognormal"  # or "pareto"
    sigma: float = 1.0  # lognormal: std of log throughput (a 30x spread of devices)
    pareto_shape: float = 2.0  # pareto: tail index
    stage_correlation: float = 0.9  # of one peer's log throughputs across kinds of stage
    last_stage_cost: float = 1.5  # the head and loss make the last stage this much slower
    burst: float = 0.5  # fraction of the initial peers arriving in the first 5 s
    ramp: float = 300.0  # the rest arrive uniformly until then
    wave: float = 0.2  # a wave of this fraction of --peers arrives, and later leaves
    kill_fraction: float = 0.5  # fraction of churn departures that are kills, not leaves
    gossip_delay: float = 1.0  # mean seconds before an announcement reaches a peer
    gossip_loss: float = 0.05
    reannounce: float = 10.0  # a lost announcement is known anyway after this long
    expiry: float = 30.0  # a killed peer's record disappears after this long
    load: float = 30.0  # mean seconds to load a stage's state
    update_period: float = 5.0  # ours: the node's default; its settle period is the same
    period: float = 60.0  # mean seconds between a serving peer's checks
    alarm_drop: float = DEFAULT_PARAMS.alarm_drop  # ours: a stage that lost this fraction
    # since a peer's last check brings its check forward
    sample: float = 10.0
    lp_every: float = 60.0
    price_every: float = 60.0  # ours: peers refresh stage prices from the records this often,
    # and sooner when the number of records changed by more than 3%
    resettle_every: float = 30.0  # baseline: its re-settled bottleneck is reused this long
    settle: float = 600.0  # seconds after a mass event left out of the steady state
    hysteresis: float = DEFAULT_PARAMS.hysteresis
    min_gain: float = DEFAULT_PARAMS.min_gain
    arrival_reference: float = DEFAULT_PARAMS.arrival_reference
    price_hysteresis: float = DEFAULT_PARAMS.price_hysteresis
    sharpness: float = DEFAULT_PARAMS.sharpness
    urgency: float = DEFAULT_PARAMS.urgency
    fit_band: float = DEFAULT_PARAMS.fit_band
    selectivity: float = DEFAULT_PARAMS.selectivity
    size_bias: float = DEFAULT_PARAMS.size_bias
    two_stage_reserve: float = DEFAULT_PARAMS.two_stage_reserve  # ours: see second_stage
    two_stage_min: float = DEFAULT_PARAMS.two_stage_min

    @property
    def wave_at(self) -> float:
        return 0.35 * self.duration

    @property
    def loss_at(self) -> float:
        return 0.55 * self.duration

    @property
    def wave_leaves_at(self) -> float:
        return 0.75 * self.duration

    @property
    def warmup(self) -> float:
        return self.ramp + self.settle

    def params(self) -> Params:
        return Params(
            sharpness=self.sharpness,
            fit_band=self.fit_band,
            selectivity=self.selectivity,
            hysteresis=self.hysteresis,
            min_gain=self.min_gain,
            arrival_reference=self.arrival_reference,
            price_hysteresis=self.price_hysteresis,
            urgency=self.urgency,
            size_bias=self.size_bias,
            alarm_drop=self.alarm_drop,
            two_stage_reserve=self.two_stage_reserve,
            two_stage_min=self.two_stage_min,
            mean_period_s=self.period,
        )


@dataclass
class Population:
    """Every peer of the run, the same for both rules: when it comes and goes, how fast."""

    arrive: np.ndarray  # (P,)
    depart: np.ndarray  # (P,) inf: stays to the end
    killed: np.ndarray  # (P,) bool: its departure is a kill
    thr: np.ndarray  # (P, S) samples/s for each stage
    load: np.ndarray  # (P,) seconds to load a stage


def make_population(cfg: Config) -> Population:
    rng = np.random.default_rng([cfg.seed, 1])
    n, horizon = cfg.peers, cfg.duration
    n_burst = int(round(cfg.burst * n))
    arrive = [rng.uniform(0.0, 5.0, n_burst), rng.uniform(5.0, cfg.ramp, n - n_burst)]
    life = 3600.0 / cfg.churn if cfg.churn > 0 else math.inf
    depart = [np.full(n, math.inf)]
    if cfg.churn > 0:
        depart = [arrive[0] + rng.exponential(life, n_burst)]
        depart.append(arrive[1] + rng.exponential(life, n - n_burst))
        k = rng.poisson(n * cfg.churn * horizon / 3600.0)
        late = np.sort(rng.uniform(0.0, horizon, k))
        arrive.append(late)
        depart.append(late + rng.exponential(life, k))
    n_wave = int(round(cfg.wave * n))
    arrive.append(cfg.wave_at + rng.uniform(0.0, 10.0, n_wave))
    depart.append(np.full(n_wave, cfg.wave_leaves_at))
    arrive_a, depart_a = np.concatenate(arrive), np.concatenate(depart)
    depart_a[depart_a > horizon] = math.inf
    total = len(arrive_a)
    killed = rng.random(total) < cfg.kill_fraction
    killed[total - n_wave :] = False  # the wave leaves cleanly
    thr = draw_throughputs(rng, total, cfg)
    load = cfg.load * np.exp(0.3 * rng.standard_normal(total))
    return Population(arrive_a, depart_a, killed, thr, load)


def draw_throughputs(rng: np.random.Generator, n: int, cfg: Config) -> np.ndarray:
    """Heavy-tailed per-stage throughputs, correlated across a peer's kinds of stage (one
    device is fast or slow at everything, give or take memory and kernel differences).
    The middle stages do the same work (blocks only, as many of them), and a node measures
    one figure for them all (``node/capacity.py``); the first (embedding) and last (head)
    are kinds of their own."""
    s, rho = cfg.stages, cfg.stage_correlation
    kinds = [0] + [1] * (s - 2) + [2] if s >= 3 else list(range(s))
    own = rng.standard_normal((n, max(kinds) + 1))[:, kinds]
    g = math.sqrt(rho) * rng.standard_normal((n, 1)) + math.sqrt(1 - rho) * own
    # (n, S) standard normal, correlation rho between kinds, 1 within a kind
    if cfg.dist == "lognormal":
        t = np.exp(cfg.sigma * g)
    elif cfg.dist == "pareto":  # the same dependence (Gaussian copula), Pareto margins
        t = (1.0 - ndtr(g)).clip(1e-300) ** (-1.0 / cfg.pareto_shape)
    else:
        raise ValueError(f"unknown distribution {cfg.dist!r}: use lognormal or pareto")
    cost = np.ones(s)
    cost[-1] = cfg.last_stage_cost
    return t / cost


# The optimum: an upper bound from the LP relaxation, and an integer assignment under it.


def integer_assignment(t: np.ndarray, lam: np.ndarray, steps: int = 400) -> float:
    """The bottleneck of an integer assignment: each peer where lam_s t_is is highest,
    then single moves into the weakest stage while they raise the bottleneck. Where peers
    have several best stages (within 0.1%; where every stage is alike, all of them), also
    from a start that deals those out largest first, each to the one with the least priced
    total so far; the better of the two."""
    n, s = t.shape
    if n == 0:
        return 0.0
    idx = np.arange(n)
    v = t * lam
    a = v.argmax(1)
    best = v >= v[idx, a][:, None] * (1 - 1e-3)
    tied = np.flatnonzero(best.sum(1) > 1)
    if not len(tied):
        return _improve(t, a, steps)
    dealt = a.copy()
    dealt[tied] = -1
    placed = dealt >= 0
    tot = np.bincount(dealt[placed], weights=t[idx, dealt][placed], minlength=s).astype(float)
    for i in tied[np.argsort(-v[tied].max(1))]:
        options = np.flatnonzero(best[i])
        dealt[i] = options[int((tot[options] * lam[options]).argmin())]
        tot[dealt[i]] += t[i, dealt[i]]
    return max(_improve(t, a, steps), _improve(t, dealt, steps))


def _improve(t: np.ndarray, a: np.ndarray, steps: int) -> float:
    n, s = t.shape
    idx = np.arange(n)
    a = a.copy()
    tot = np.bincount(a, weights=t[idx, a], minlength=s).astype(float)
    for _ in range(steps):
        m = int(tot.argmin())
        low = tot[m]
        without = np.array([np.delete(tot, [m, k]).min(initial=np.inf) for k in range(s)])
        new = np.minimum(np.minimum(low + t[:, m], tot[a] - t[idx, a]), without[a])
        new[a == m] = -np.inf
        i = int(new.argmax())
        if new[i] <= low * (1 + 1e-12):
            break
        tot[a[i]] -= t[i, a[i]]
        tot[m] += t[i, m]
        a[i] = m
    return float(tot.min())


# One rule, simulated.


@dataclass
class Result:
    rule: str
    t: list[float] = field(default_factory=list)
    ratio: list[float] = field(default_factory=list)
    ratio_settled: list[float] = field(default_factory=list)
    # ratio = serving x placement x balance (see ``on_sample``), nan where undefined
    factors: list[tuple[float, float, float]] = field(default_factory=list)
    present: list[int] = field(default_factory=list)
    moves: int = 0
    reasons: dict = field(default_factory=dict)  # (reason, steady or not) -> moves
    revisions: int = 0
    alarms: int = 0  # ours: stage losses that brought every serving peer's check forward
    two_stage: int = 0  # ours: peers that took a second stage
    two_serving: list[int] = field(default_factory=list)  # ours: serving both, per sample
    peer_hours: float = 0.0
    empty_held_s: float = 0.0  # time with a stage nobody holds while >= S peers present
    empty_serving_samples: int = 0  # samples after warm-up with a stage nobody serves
    tightness: float = 1.0  # worst integer assignment / LP bound over the solves
    wall_s: float = 0.0


class Sim:
    """Both rules on one population. Ours: each peer runs a
    :class:`~protocol.placement.PeerPlacement`, fed events by this loop (``execute``
    carries out its actions); the baseline's sequence is written here. ``views`` replaces
    the delayed, lossy view a peer reads (a seam for tests: ``views(t, i)`` is the others'
    claims that peer ``i`` sees at ``t``)."""

    def __init__(
        self,
        cfg: Config,
        pop: Population,
        rule: str,
        views: Callable[[float, int], SwarmView] | None = None,
    ):
        self.cfg, self.pop, self.rule = cfg, pop, rule
        self.views = views
        self.params = cfg.params()
        self.settle_s = settle_period(cfg.update_period)
        self.rng = np.random.default_rng([cfg.seed, 2])
        n, s = len(pop.arrive), cfg.stages
        self.S = s
        self.thr_rows = pop.thr.tolist()
        self.phase = np.zeros(n, np.int8)
        self.stage = np.full(n, -1, np.int64)  # what it holds or intends (-1: nothing yet)
        self.machine: list[PeerPlacement | None] = [None] * n  # ours
        self.claimed = np.zeros(n, bool)  # visible in others' views (incl. dead, unexpired)
        self.left = pop.depart.copy()
        self.token = [0] * n  # bumped by a wake, a move, a departure: older events lapse
        self.count = [0] * n  # decisions taken, for the baseline's seeds
        self.n_claimed = 0
        self.serve_tot = [0.0] * s
        self.serve_cnt = [0] * s
        self.held = [0] * s  # claims of live peers
        self.n_present = 0
        # The announcement log (every claim change, in time order) and its running sums:
        # a delayed view is the sums minus the changes a peer has not seen yet.
        self.log_t: list[float] = []
        self.log: list[tuple[int, int, float, int, int]] = []  # peer, stage, d thr/n/serving
        self.ann_thr = [0.0] * s
        self.ann_sq = [0.0] * s  # summed squares of the claims' throughputs
        self.ann_n = [0] * s
        self.ann_serving = [0] * s
        self.announced: list[tuple[int, float, int] | None] = [None] * n  # stage, thr, serving
        self.pyrng = random.Random(cfg.seed)  # scalar draws: gossip delays and losses
        self.log_keep = math.log1p(-cfg.gossip_loss) if 0 < cfg.gossip_loss < 1 else None
        self.heap: list[tuple[float, int, int, int, int]] = []
        self.seq = 0
        self.res = Result(rule)
        self.lam = np.full(s, 1.0 / s)
        self.claim_bound = 0.0  # an upper bound on any assignment of the claimants
        self.last_lp = -math.inf
        self.last_event_t = 0.0
        self.prices: tuple[float, ...] | None = None
        self.priced = (-math.inf, 0)  # (when, how many records) of the last price update
        self.resettled = (-math.inf, 0.0)  # (when, bottleneck) of the baseline's estimate
        # ours: each stage's announced total over the last check period; a fall below it
        # by alarm_drop has every serving peer look at its view (see ``maybe_look``)
        self.recent: list[deque[tuple[float, float]]] = [deque() for _ in range(s)]
        self.arrivals = ArrivalCount()  # ours: one count for all peers, for speed
        # ours, two-stage peers: the second stage (-1: none), and the summed first-stage
        # throughput of those with a record
        self.second = [-1] * n
        self.two_total = 0.0
        self.two_serving: set[int] = set()  # ... and serving both
        self.ann_srv2 = np.zeros(n, bool)  # its announced second claim says it serves
        self.trace: list[tuple[float, int, Action]] | None = None  # ours' actions, if kept

    # Events and announcements.

    def push(self, when: float, kind: int, i: int = -1) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (when, kind, self.seq, i, self.token[i] if i >= 0 else 0))

    def announce(self, t: float, i: int, stage: int, d_thr: float, d_n: int, d_srv: int) -> None:
        self.log_t.append(t)
        self.log.append((i, stage, d_thr, d_n, d_srv))
        self.ann_thr[stage] += d_thr
        self.ann_sq[stage] += d_n * d_thr * d_thr
        self.ann_n[stage] += d_n
        self.ann_serving[stage] += d_srv
        if self.rule == "ours" and (d_thr < 0 or d_n < 0):
            self.maybe_look(t, stage)

    def set_claim(self, t: float, i: int, stage: int | None, serving: bool = False) -> None:
        """Peer ``i``'s first claim as others learn it from gossip and records: on
        ``stage`` (serving or not), or none."""
        old = self.announced[i]
        if old is not None:
            s, thr, srv = old
            self.announce(t, i, s, -thr, -1, -srv)
        if stage is None:
            self.announced[i] = None
            if self.claimed[i]:
                self.claimed[i] = False
                self.n_claimed -= 1
            return
        thr = self.thr_rows[i][stage]
        self.announced[i] = (stage, thr, int(serving))
        self.announce(t, i, stage, thr, 1, int(serving))
        if not self.claimed[i]:
            self.claimed[i] = True
            self.n_claimed += 1
            self.claim_bound += float(np.max(self.lam * self.pop.thr[i]))

    def retract(self, t: float, i: int) -> None:
        """Peer ``i``'s record is gone (it left, or expired after a kill): so are its claims."""
        self.set_claim(t, i, None)
        b = self.second[i]
        if b >= 0:
            self.announce(t, i, b, 0.0, -1, -int(self.ann_srv2[i]))
            self.ann_srv2[i] = False
            self.two_total -= self.thr_rows[i][int(self.stage[i])]
            self.second[i] = -1

    def maybe_look(self, t: float, s: int) -> None:
        """Announcements lowered stage ``s``: if it lost more than ``alarm_drop`` of its
        recent total, or nobody holds it, every serving peer looks at its view (where a
        node looks every update period: a look at which no stage fell that far raises no
        alarm), a gossip delay plus a draw within an update period later. Its machine
        decides, against its own view at its last check, whether that is an alarm."""
        recent = self.recent[s]
        before = max((v for _, v in recent), default=0.0)
        if self.ann_n[s] > 0 and self.ann_thr[s] >= (1.0 - self.cfg.alarm_drop) * before:
            return
        recent.clear()
        recent.append((t, self.ann_thr[s]))
        self.res.alarms += 1
        r, cfg = self.pyrng, self.cfg
        for i in np.nonzero(self.phase == SERVING)[0].tolist():
            delay = r.expovariate(1.0 / cfg.gossip_delay) if cfg.gossip_delay > 0 else 0.0
            self.push(t + delay + r.uniform(0.0, cfg.update_period), LOOK, i)

    def view(self, t: float, i: int, mine: bool = False) -> SwarmView:
        """What peer ``i`` knows at ``t``: the announcements of others as of a gossip
        delay ago, each of the ``reannounce`` seconds before that missing with probability
        ``gossip_loss``; its own claim too if ``mine``."""
        if self.views is not None:
            return self.views(t, i)
        cfg, r, log = self.cfg, self.pyrng, self.log
        seen_until = t - r.expovariate(1.0 / cfg.gossip_delay) if cfg.gossip_delay > 0 else t
        k = bisect.bisect_right(self.log_t, seen_until)
        thr, n, srv = self.ann_thr.copy(), self.ann_n.copy(), self.ann_serving.copy()
        sq = self.ann_sq.copy()

        def unseen(q: int) -> None:
            p, st, d_thr, d_n, d_srv = log[q]
            if p != i:
                thr[st] -= d_thr
                sq[st] -= d_n * d_thr * d_thr
                n[st] -= d_n
                srv[st] -= d_srv

        for q in range(k, len(log)):  # not arrived yet
            unseen(q)
        if self.log_keep is not None:  # lost: jump from one loss to the next
            q = bisect.bisect_right(self.log_t, seen_until - cfg.reannounce) - 1
            while True:
                q += 1 + int(math.log(1.0 - r.random()) / self.log_keep)
                if q >= k:
                    break
                unseen(q)
        own = self.announced[i]
        if own is not None and not mine:
            st, d_thr, d_srv = own
            thr[st] -= d_thr
            sq[st] -= d_thr * d_thr
            n[st] -= 1
            srv[st] -= d_srv
        n = [max(c, 0) for c in n]
        srv = [min(max(c, 0), m) for c, m in zip(srv, n, strict=True)]
        return SwarmView(
            tuple(max(x, 0.0) for x in thr),
            tuple(n),
            tuple(srv),
            self.prices,
            tuple(max(x, 0.0) for x in sq),
            max(self.two_total, 0.0),  # from the records: exact here, for speed
        )

    def seed(self, i: int) -> str:
        self.count[i] += 1
        return f"{self.cfg.seed}:{i}:{self.count[i]}"

    # Changes of state, kept consistent in one place.

    def hold(self, i: int, s: int) -> None:
        """Peer ``i`` now holds (or intends) stage ``s`` instead of what it held."""
        old = int(self.stage[i])
        if old >= 0:
            self.held[old] -= 1
        self.stage[i] = s
        self.held[s] += 1

    def stop_serving(self, i: int) -> None:
        s = int(self.stage[i])
        if self.phase[i] == SERVING:
            self.serve_tot[s] -= self.thr_rows[i][s]
            self.serve_cnt[s] -= 1

    def relocate(self, t: float, i: int, to: int) -> None:
        """A serving peer unloads its stage and loads ``to``: a move."""
        self.stop_serving(i)
        self.hold(i, to)
        self.phase[i] = LOADING
        self.res.moves += 1
        self.token[i] += 1
        self.push(t + self.pop.load[i], LOADED, i)

    def execute(self, t: float, i: int, actions: list[Action]) -> None:
        """Carry out what peer ``i``'s machine says, at ``t``."""
        if self.trace is not None:
            self.trace += [(t, i, a) for a in actions]
        for a in actions:
            if isinstance(a, Wake):
                self.token[i] += 1
                self.push(a.at, TIMER, i)
            elif isinstance(a, Announce):
                if a.kind == "leaving" or a.stage is None:
                    self.set_claim(t, i, None)
                elif a.kind == "move":
                    self.set_claim(t, i, a.to_stage)
                else:
                    self.set_claim(t, i, a.stage, serving=a.kind in ("serving", "load"))
            elif isinstance(a, Chose):
                self.hold(i, a.stage)
                self.phase[i] = INTENT
                self.res.revisions += a.revised
            elif isinstance(a, Load):
                self.phase[i] = LOADING
                self.push(t + self.pop.load[i], LOADED, i)
            elif isinstance(a, HoldSecond):
                self.take_second(t, i, a.stage)
            elif isinstance(a, Moved):
                key = (a.move.reason, bool(steady_mask(self.cfg, np.array([t]))[0]))
                self.res.reasons[key] = self.res.reasons.get(key, 0) + 1
                self.relocate(t, i, a.move.to_stage)

    # The baseline's decisions.

    def petals_check(self, view: SwarmView, i: int, s: int) -> int | None:
        """Petals' rule with stages for blocks: move to the weakest stage if the swarm,
        re-settled greedily, would have a bottleneck more than 1/0.75 times today's."""
        totals = list(view.totals)
        initial = min(totals)
        # The re-settled bottleneck is at most the optimum for the claimants, hence at most
        # claim_bound (a dual bound): when even that is not enough, nobody needs to try.
        if initial >= PETALS_QUALITY * self.claim_bound:
            return None
        eps = 1e-3
        me = self.thr_rows[i]
        totals[s] -= me[s] * (1 + eps)
        target = min(range(self.S), key=totals.__getitem__)
        if target == s:
            return None
        new = self.resettle(self.last_event_t)
        if new < initial or new < eps or initial / new >= PETALS_QUALITY - eps:
            return None
        return target

    def resettle(self, t: float) -> float:
        """The bottleneck after every claimant, in random order, moved to the weakest
        stage until none moves (as a Petals server estimates it). It changes little from
        one check to the next, so it is recomputed every ``resettle_every`` seconds."""
        when, value = self.resettled
        if t - when < self.cfg.resettle_every:
            return value
        eps = 1e-3
        rows, n_st = self.thr_rows, range(self.S)
        peers = np.nonzero(self.claimed)[0]
        self.rng.shuffle(peers)
        where = self.stage[peers].tolist()
        order = peers.tolist()
        totals = [0.0] * self.S
        for p, a in zip(order, where, strict=True):
            totals[a] += rows[p][a]
        for _ in range(20):
            moved = False
            for k, p in enumerate(order):
                a, r = where[k], rows[p]
                totals[a] -= r[a] * (1 + eps)
                b = min(n_st, key=totals.__getitem__)
                totals[a] += r[a] * eps
                if b != a:
                    where[k] = b
                    moved = True
                totals[b] += r[b]
            if not moved:
                break
        self.resettled = (t, min(totals))
        return self.resettled[1]

    # The run.

    def run(self) -> Result:
        cfg, pop = self.cfg, self.pop
        started = time.perf_counter()
        for i in range(len(pop.arrive)):
            self.push(float(pop.arrive[i]), ARRIVE, i)
        for k in range(int(cfg.duration // cfg.sample) + 1):
            self.push(k * cfg.sample, SAMPLE)
        self.push(cfg.loss_at, LOSS)
        if self.rule == "ours":
            for k in range(int(cfg.duration // cfg.price_every) + 1):
                self.push(k * cfg.price_every, PRICES)
        while self.heap:
            t, kind, _, i, tok = heapq.heappop(self.heap)
            if t > cfg.duration:
                break
            self._track_empty(t)
            if kind == ARRIVE:
                self.on_arrive(t, i)
            elif kind == DEPART:
                if self.phase[i] not in (ABSENT, GONE):
                    self.depart(t, i, killed=bool(pop.killed[i]))
            elif kind == VANISH:
                self.retract(t, i)
            elif kind == LOSS:
                self.on_loss(t)
            elif kind == PRICES:
                self.on_prices(t)
            elif kind == SAMPLE:
                self.on_sample(t)
            elif self.phase[i] == GONE:
                continue
            elif kind == LOOK:
                m = self.machine[i]
                if m is not None and self.phase[i] == SERVING and m.phase is Phase.SERVING:
                    self.execute(t, i, m.handle(Look(t, self.view(t, i))))
            elif tok != self.token[i]:
                continue  # superseded by a later wake, a move or a departure
            elif kind == TIMER:
                self.on_timer(t, i)
            elif kind == LOADED:
                self.on_loaded(t, i)
            elif kind == CHECK:
                self.on_check(t, i)
            elif kind == SECOND:
                self.on_second(t, i)
        ends = np.minimum(self.left, cfg.duration)
        self.res.peer_hours = float(np.clip(ends - pop.arrive, 0, None).sum() / 3600.0)
        self.res.wall_s = time.perf_counter() - started
        return self.res

    def on_arrive(self, t: float, i: int) -> None:
        self.n_present += 1
        if math.isfinite(self.pop.depart[i]):
            self.push(float(self.pop.depart[i]), DEPART, i)
        if self.rule == "ours":
            self.arrivals.arrived(t)
            self.arrivals.present(self.n_present, t)
            m = PeerPlacement(
                f"{self.cfg.seed}:{i}", self.thr_rows[i], self.params, settle_s=self.settle_s
            )
            self.machine[i] = m
            self.phase[i] = LISTENING
            self.execute(t, i, m.handle(Join(t)))
            return
        s = int(np.argmin(self.view(t, i).totals))  # the baseline: the weakest stage
        self.hold(i, s)
        self.set_claim(t, i, s)
        self.phase[i] = LOADING
        self.push(t + self.pop.load[i], LOADED, i)

    def on_timer(self, t: float, i: int) -> None:
        m = self.machine[i]
        assert m is not None  # only ours' machines ask for wakes
        self.on_prices(t)
        self.execute(t, i, m.handle(Timer(t, self.view(t, i), self.arrivals.rate(t))))

    def take_second(self, t: float, i: int, b: int) -> None:
        """Ours: peer ``i``'s machine takes stage ``b`` as well, now that its first
        serves (as the node does: it loads the second while it serves the first). It is
        announced with no throughput: the rule plans with the peer's time on its first
        stage, and routing lends it to the second where that one is short (``bridged``)."""
        s = int(self.stage[i])
        self.second[i] = b
        self.held[b] += 1
        self.two_total += self.thr_rows[i][s]
        self.res.two_stage += 1
        self.announce(t, i, b, 0.0, 1, 0)
        self.push(t + self.pop.load[i], SECOND, i)

    def on_loaded(self, t: float, i: int) -> None:
        s = int(self.stage[i])
        self.phase[i] = SERVING
        self.serve_tot[s] += self.thr_rows[i][s]
        self.serve_cnt[s] += 1
        m = self.machine[i]
        if m is not None:
            self.on_prices(t)
            self.execute(t, i, m.handle(Loaded(t, self.view(t, i))))
            return
        self.set_claim(t, i, s, serving=True)
        self.push(t + check_delay(self.seed(i), self.params), CHECK, i)

    def on_second(self, t: float, i: int) -> None:
        """A two-stage peer has loaded its second stage too, and serves it."""
        b = self.second[i]
        self.serve_cnt[b] += 1
        self.two_serving.add(i)
        self.announce(t, i, b, 0.0, 0, 1)
        self.ann_srv2[i] = True

    def on_check(self, t: float, i: int) -> None:
        """The baseline's periodic check."""
        s = int(self.stage[i])
        to = self.petals_check(self.view(t, i, mine=True), i, s)
        if to is None:
            self.push(t + check_delay(self.seed(i), self.params), CHECK, i)
            return
        self.relocate(t, i, to)
        self.set_claim(t, i, to)

    def depart(self, t: float, i: int, killed: bool) -> None:
        self.stop_serving(i)
        s, b = int(self.stage[i]), self.second[i]
        if s >= 0:
            self.held[s] -= 1
        if b >= 0:
            self.held[b] -= 1
            if i in self.two_serving:
                self.serve_cnt[b] -= 1
                self.two_serving.discard(i)
        if killed:  # others keep counting it until its record expires
            self.push(t + self.cfg.expiry, VANISH, i)
        else:
            self.retract(t, i)
        self.phase[i] = GONE
        self.machine[i] = None
        self.token[i] += 1
        self.left[i] = t
        self.n_present -= 1
        if self.rule == "ours":
            self.arrivals.present(self.n_present, t)

    def on_loss(self, t: float) -> None:
        on_0 = (self.stage == 0) | (np.array(self.second) == 0)
        holders = np.nonzero(on_0 & np.isin(self.phase, (INTENT, LOADING, SERVING)))[0]
        victims = self.rng.choice(holders, len(holders) // 2, replace=False)
        for i in victims:
            self.depart(t, int(i), killed=True)
        self.last_lp = -math.inf  # re-solve at the next sample

    def on_prices(self, t: float) -> None:
        """Prices as peers compute them from the records: again when the number of
        records changed by more than 3%, and at least every ``price_every`` seconds."""
        if self.rule != "ours":
            return
        when, size = self.priced
        now = int(self.claimed.sum())
        if now and (t - when >= self.cfg.price_every or abs(now - size) > 0.03 * size):
            self.prices = stage_prices(self.pop.thr[self.claimed])
            self.priced = (t, now)

    def _track_empty(self, t: float) -> None:
        if t > 60.0 and self.n_present >= self.S and min(self.held) == 0:
            self.res.empty_held_s += t - self.last_event_t
        self.last_event_t = t

    def on_sample(self, t: float) -> None:
        cfg = self.cfg
        for recent, total in zip(self.recent, self.ann_thr, strict=True):
            recent.append((t, total))
            while recent[0][0] < t - cfg.period:
                recent.popleft()
        live = np.isin(self.phase, (LISTENING, INTENT, LOADING, SERVING))
        t_live = self.pop.thr[live]
        mass = (cfg.wave_at, cfg.wave_at + 10.0, cfg.loss_at, cfg.wave_leaves_at)
        if t - self.last_lp >= cfg.lp_every or any(0 <= t - m < cfg.sample for m in mass):
            bound, self.lam = max_min_lp(t_live, tol=1e-6)
            self.last_lp = t
            if bound > 0:
                tight = integer_assignment(t_live, self.lam) / bound
                self.res.tightness = min(self.res.tightness, tight)
            claims = self.pop.thr[self.claimed]
            self.claim_bound = float((claims * self.lam).max(1).sum()) if len(claims) else 0.0
        bound = float((t_live * self.lam).max(1).sum()) if len(t_live) else 0.0
        totals = self.bridged()
        achieved = min(totals)
        self.res.t.append(t)
        self.res.ratio.append(achieved / bound if bound > 0 else 1.0)
        # The same, leaving out peers still within their first load time of arriving: no
        # rule can have them serve yet. (Any prices give an upper bound, for any peers.)
        settled = live & (self.pop.arrive + self.pop.load <= t)
        settled_bound = float((self.pop.thr[settled] * self.lam).max(1).sum())
        self.res.ratio_settled.append(achieved / settled_bound if settled_bound > 0 else 1.0)
        self.res.present.append(int(live.sum()))
        self.res.two_serving.append(len(self.two_serving))
        self.res.factors.append(self.factors(bound, totals))
        if t >= cfg.warmup and min(self.serve_cnt) == 0:
            self.res.empty_serving_samples += 1

    def bridged(self) -> list[float]:
        """The serving totals, with the time of serving two-stage peers divided as routing
        divides it (``second_stage_shares``, which the trainer's ``candidates_by_stage``
        scales their throughputs by): the division that raises the least total most. It
        is taken to be instant and exact, as routing within a stage is
        (``scripts/bench_two_stage_routing.py`` measures how near queues come to it)."""
        totals = list(self.serve_tot)
        rates = []  # (first stage, second stage, speed on each), as the records give them
        for i in sorted(self.two_serving):
            a, b, row = int(self.stage[i]), self.second[i], self.thr_rows[i]
            rates.append((a, b, row[a], row[b]))
            totals[a] -= row[a]  # the division starts from the one-stage peers
        for (a, b, on_a, on_b), f in zip(rates, second_stage_shares(totals, rates), strict=True):
            totals[a] += (1.0 - f) * on_a
            totals[b] += f * on_b
        return totals

    def factors(self, bound: float, totals: list[float]) -> tuple[float, float, float]:
        """Where the ratio to the bound goes, as three factors whose product it is:
        *serving*, the bound of the serving peers over that of all present (the rest are
        loading); *placement*, the priced sum of the serving totals over the serving
        peers' bound (each peer's priced speed where it is, over that at its best stage);
        *balance*, the least total over the priced sum (1 when all totals are equal)."""
        srv = self.pop.thr[self.phase == SERVING]
        best = float((srv * self.lam).max(1).sum()) if len(srv) else 0.0
        priced, achieved = float(np.dot(self.lam, totals)), min(totals)
        if min(bound, best, priced) <= 0.0:
            return (math.nan,) * 3
        return best / bound, priced / best, achieved / priced


def simulate(cfg: Config, rule: str) -> Result:
    return Sim(cfg, make_population(cfg), rule).run()


def _simulate_packed(args: tuple[dict, str]) -> Result:
    return simulate(Config(**args[0]), args[1])


def run_both(cfg: Config, jobs: int = 2) -> dict[str, Result]:
    tasks = [(asdict(cfg), rule) for rule in RULES]
    if jobs <= 1:
        return {rule: _simulate_packed(task) for task, rule in zip(tasks, RULES, strict=True)}
    with multiprocessing.get_context("fork").Pool(min(jobs, len(tasks))) as pool:
        return dict(zip(RULES, pool.map(_simulate_packed, tasks), strict=True))


# Figures.


def steady_mask(cfg: Config, t: np.ndarray) -> np.ndarray:
    keep = t >= cfg.warmup
    for m in (cfg.wave_at, cfg.loss_at, cfg.wave_leaves_at):
        keep &= ~((t >= m) & (t < m + cfg.settle))
    return keep


def recovery(cfg: Config, r: Result) -> tuple[float, float, float, float]:
    """After half of stage 0 is killed: (ratio before, worst ratio after, seconds until
    90% of the drop is made up, seconds until back within 0.02 of before); inf when not
    before the wave leaves."""
    t, ratio = np.array(r.t), np.array(r.ratio)
    before = ratio[(t >= cfg.loss_at - cfg.settle) & (t < cfg.loss_at)]
    pre = float(before.mean()) if len(before) else math.nan
    after = (t > cfg.loss_at) & (t < cfg.wave_leaves_at)
    if not after.any():
        return pre, math.nan, math.nan, math.nan
    worst = float(ratio[after].min())
    lowest = np.nonzero(after & (ratio == worst))[0][0]

    def first(level: float) -> float:
        ok = np.nonzero(after & (ratio >= level) & (np.arange(len(t)) > lowest))[0]
        return float(t[ok[0]] - cfg.loss_at) if len(ok) else math.inf

    return pre, worst, first(worst + 0.9 * (pre - worst)), first(pre - 0.02)


def summary(cfg: Config, r: Result) -> dict[str, float]:
    t, ratio = np.array(r.t), np.array(r.ratio)
    keep = steady_mask(cfg, t)
    steady = ratio[keep]
    pre, worst, rec90, rec = recovery(cfg, r)
    return {
        "steady_mean": float(steady.mean()),
        "steady_settled": float(np.array(r.ratio_settled)[keep].mean()),
        "steady_p5": float(np.percentile(steady, 5)),
        **dict(zip(FACTORS, np.nanmean(np.array(r.factors)[keep], axis=0).tolist(), strict=True)),
        "steady_min": float(steady.min()),
        "moves_per_peer_hour": r.moves / r.peer_hours,
        "revisions_per_peer_hour": r.revisions / r.peer_hours,
        "pre_loss": pre,
        "worst_after_loss": worst,
        "recovery_90_s": rec90,
        "recovery_s": rec,
        "empty_held_s": r.empty_held_s,
        "empty_serving_samples": r.empty_serving_samples,
        "tightness": r.tightness,
        "wall_s": r.wall_s,
    }


def report(cfg: Config, results: dict[str, Result], every: float = 600.0) -> str:
    lines = [
        f"assignment simulator: {cfg.peers} peers, {cfg.stages} stages, {cfg.duration:.0f} s, "
        f"churn {cfg.churn}/peer-hour, seed {cfg.seed}; throughputs {cfg.dist} "
        f"(sigma {cfg.sigma}, pareto shape {cfg.pareto_shape}), correlation "
        f"{cfg.stage_correlation} between the first, middle and last stages (the middle "
        f"ones alike), last stage cost x{cfg.last_stage_cost}",
        f"gossip: delay {cfg.gossip_delay} s mean, loss {cfg.gossip_loss}, re-announce "
        f"{cfg.reannounce} s, record expiry {cfg.expiry} s; load {cfg.load} s; check every "
        f"{cfg.period} s (mean); ours: {cfg.params()}",
        f"events: burst of {cfg.burst:.0%} of peers in 5 s then ramp to {cfg.ramp:.0f} s; wave "
        f"of {cfg.wave:.0%} at {cfg.wave_at:.0f} s, leaving at {cfg.wave_leaves_at:.0f} s; "
        f"half of stage 0 killed at {cfg.loss_at:.0f} s",
        "optimum: UPPER BOUND = the LP relaxation of the max-min assignment (solved exactly, "
        f"to 1e-6, every {cfg.lp_every:.0f} s and after mass events; in between its dual "
        "solution evaluated on the peers present, also an upper bound). Ratios below are "
        "bottleneck (serving peers) / bound, so they understate the ratio to the true optimum.",
        "",
        f"{'t [min]':>8} {'peers':>7} " + " ".join(f"{r:>8}" for r in results),
    ]
    first = next(iter(results.values()))
    t = np.array(first.t)
    for start in np.arange(0.0, cfg.duration, every):
        sel = (t >= start) & (t < start + every)
        if not sel.any():
            continue
        peers = np.mean(np.array(first.present)[sel])
        row = f"{start / 60:>4.0f}-{(start + every) / 60:<3.0f} {peers:>7.0f} "
        row += " ".join(f"{np.mean(np.array(r.ratio)[sel]):>8.3f}" for r in results.values())
        lines.append(row)
    sums = {k: summary(cfg, r) for k, r in results.items()}
    rows = [
        ("steady-state ratio to the bound, mean", "steady_mean", "{:.4f}"),
        ("  the same, without peers in their first load", "steady_settled", "{:.4f}"),
        ("  = serving (the rest load) x", "serving", "{:.4f}"),
        ("    placement (priced speed where / at best) x", "placement", "{:.4f}"),
        ("    balance (least total / priced mean)", "balance", "{:.4f}"),
        ("steady-state ratio, 5th percentile", "steady_p5", "{:.4f}"),
        ("steady-state ratio, worst sample", "steady_min", "{:.4f}"),
        ("moves per peer-hour", "moves_per_peer_hour", "{:.4f}"),
        ("intent revisions per peer-hour (no load)", "revisions_per_peer_hour", "{:.4f}"),
        ("ratio before stage 0 lost half its peers", "pre_loss", "{:.4f}"),
        ("worst ratio after the loss", "worst_after_loss", "{:.4f}"),
        ("seconds to make up 90% of the drop", "recovery_90_s", "{:.0f}"),
        ("seconds to recover (within 0.02 of before)", "recovery_s", "{:.0f}"),
        ("seconds with a stage nobody holds (>= S peers)", "empty_held_s", "{:.1f}"),
        ("samples with a stage nobody serves (after warm-up)", "empty_serving_samples", "{:d}"),
        ("integer assignment / LP bound (worst solve)", "tightness", "{:.4f}"),
        ("wall time [s]", "wall_s", "{:.1f}"),
    ]
    lines += ["", f"{'':<52}" + "".join(f"{k:>14}" for k in results)]
    for label, key, fmt in rows:
        lines.append(f"{label:<52}" + "".join(f"{fmt.format(s[key]):>14}" for s in sums.values()))
    if "ours" in results:
        by_reason: dict[str, int] = {}
        for (reason, _), k in results["ours"].reasons.items():
            by_reason[reason] = by_reason.get(reason, 0) + k
        lines.append(
            f"ours' moves by reason: {dict(sorted(by_reason.items()))}; alarms (a stage's loss "
            f"brought every serving peer's check forward): {results['ours'].alarms}"
        )
        if cfg.two_stage_reserve > 0:
            r = results["ours"]
            keep = steady_mask(cfg, np.array(r.t))
            share = np.array(r.two_serving)[keep].sum() / max(1, np.array(r.present)[keep].sum())
            lines.append(
                f"ours: peers that took a second stage: {r.two_stage}; at steady state "
                f"{share:.1%} of the peers present serve two"
            )
    if set(RULES) <= sums.keys():
        ours, base = sums["ours"], sums["petals"]
        never_empty = all(
            x["empty_held_s"] == 0 and x["empty_serving_samples"] == 0 for x in sums.values()
        )
        lines.append(
            f"targets: ours >= 0.97 of the bound at steady state: "
            f"{'yes' if ours['steady_mean'] >= 0.97 else 'NO'}; no empty stage (either rule): "
            f"{'yes' if never_empty else 'NO'}; fewer moves than the baseline: "
            f"{'yes' if ours['moves_per_peer_hour'] < base['moves_per_peer_hour'] else 'NO'}"
        )
    return "\n".join(lines)


def spread(per_seed: list[dict[str, dict[str, float]]]) -> str:
    """Median [least, largest] over seeds of the figures the targets are about."""
    keys = [
        ("steady-state ratio to the bound", "steady_mean", "{:.4f}"),
        ("  without peers in their first load", "steady_settled", "{:.4f}"),
        ("moves per peer-hour", "moves_per_peer_hour", "{:.4f}"),
        ("s to make up 90% of the drop", "recovery_90_s", "{:.0f}"),
        ("s to recover (within 0.02)", "recovery_s", "{:.0f}"),
        ("s with a stage nobody holds", "empty_held_s", "{:.0f}"),
        ("samples with a stage nobody serves", "empty_serving_samples", "{:.0f}"),
    ]
    lines = [f"over {len(per_seed)} seeds: median [least, largest]"]
    for label, key, fmt in keys:
        cells = []
        for rule in per_seed[0]:
            v = np.array([s[rule][key] for s in per_seed], dtype=float)
            lo, mid, hi = (fmt.format(x) for x in (v.min(), np.median(v), v.max()))
            cells.append(f"{rule} {mid} [{lo}, {hi}]")
        lines.append(f"{label:<38}" + "   ".join(cells))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--peers", type=int, default=Config.peers)
    p.add_argument("--stages", type=int, default=Config.stages)
    p.add_argument("--duration", type=float, default=Config.duration, help="simulated seconds")
    p.add_argument("--churn", type=float, default=Config.churn, help="departures/peer-hour")
    p.add_argument("--seed", type=int, default=Config.seed)
    p.add_argument("--seeds", type=int, default=1, help="run seeds --seed, --seed + 1, ...")
    p.add_argument("--dist", choices=("lognormal", "pareto"), default=Config.dist)
    p.add_argument("--sigma", type=float, default=Config.sigma)
    p.add_argument("--pareto-shape", type=float, default=Config.pareto_shape)
    p.add_argument("--stage-correlation", type=float, default=Config.stage_correlation)
    p.add_argument("--last-stage-cost", type=float, default=Config.last_stage_cost)
    p.add_argument("--wave", type=float, default=Config.wave)
    p.add_argument("--gossip-delay", type=float, default=Config.gossip_delay)
    p.add_argument("--gossip-loss", type=float, default=Config.gossip_loss)
    p.add_argument("--expiry", type=float, default=Config.expiry)
    p.add_argument("--load", type=float, default=Config.load)
    p.add_argument("--period", type=float, default=Config.period)
    p.add_argument("--alarm-drop", type=float, default=Config.alarm_drop, help="1: when emptied")
    p.add_argument(
        "--update-period", type=float, default=Config.update_period, help="ours: the node's"
    )
    p.add_argument("--hysteresis", type=float, default=Config.hysteresis)
    p.add_argument("--price-hysteresis", type=float, default=Config.price_hysteresis)
    p.add_argument("--sharpness", type=float, default=Config.sharpness)
    p.add_argument("--urgency", type=float, default=Config.urgency)
    p.add_argument("--selectivity", type=float, default=Config.selectivity)
    p.add_argument("--min-gain", type=float, default=Config.min_gain)
    p.add_argument("--arrival-reference", type=float, default=Config.arrival_reference)
    p.add_argument("--fit-band", type=float, default=Config.fit_band)
    p.add_argument("--size-bias", type=float, default=Config.size_bias)
    p.add_argument("--two-stage-reserve", type=float, default=Config.two_stage_reserve)
    p.add_argument("--two-stage-min", type=float, default=Config.two_stage_min)
    p.add_argument("--report-every", type=float, default=600.0, help="rows of the time series")
    p.add_argument("--jobs", type=int, default=2, help="processes (one per rule)")
    a = p.parse_args(argv)
    if a.seeds < 1:
        p.error(f"need --seeds >= 1, got {a.seeds}")
    if a.peers < a.stages or a.stages < 1:
        p.error(f"need --peers >= --stages >= 1, got {a.peers} peers and {a.stages} stages")
    fields = {f: getattr(a, f) for f in Config.__dataclass_fields__ if hasattr(a, f)}
    started = time.perf_counter()
    per_seed = []
    for seed in range(a.seed, a.seed + a.seeds):
        cfg = Config(**{**fields, "seed": seed})
        results = run_both(cfg, a.jobs)
        print(report(cfg, results, a.report_every), end="\n\n")
        per_seed.append({k: summary(cfg, r) for k, r in results.items()})
    if a.seeds > 1:
        print(spread(per_seed))
    print(f"total wall time: {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
