"""Averaging among the peers of one stage: keys, progress records, the round rule, and how
a round combines the groupmates' parts (``robust_mean``).

Each peer of a stage publishes, under one DHT key per stage and its peer id as subkey,
how many samples it has accumulated toward the stage's next step (``Progress``, a signed
record: ``protocol.progress``). Every
peer reads all of them and applies the same pure rule (``decide``): when the samples of
the peers at its epoch reach ``target_batch_size``, the peers average (or, alone, step
alone); a peer that sees a peer ahead of it downloads the state instead, and the peers
ahead hold a due step for it (``Patience`` bounds whom and how long). ``OuterRound``
counts a DiLoCo copy's samples around its rounds and says what it may do while one is in
flight; ``resync_source`` brings copies that stepped alone (``fork_lineage``) back to one;
``download_patience_s`` says how long a download of a stage's state may take, and
``drain_wait_s`` how long a gradient round waits for the gradients of the micro-batches
its peer admitted. No clock, no network here: ``node.averaging`` does the I/O.
"""

from __future__ import annotations

import hashlib
import math
from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

import torch

from protocol.progress import (  # noqa: F401  (re-exported: the round rule's input)
    MAX_EPOCH,
    Progress,
    decode_progress,
    encode_progress,
    progress_key,
)
from protocol.records import check_run_name


def averaging_prefix(run: str, stage: int) -> str:
    """The hivemind averager prefix (group keys, RPC namespace) of a run's stage. hivemind
    forbids '.' in prefixes; run names allow it and never contain '~', so the mapping is
    one to one."""
    return f"{check_run_name(run).replace('.', '~')}_stage{int(stage)}"


class Action(StrEnum):
    WAIT = "wait"  # fewer than target samples at our epoch, or waiting for peers behind
    AVERAGE = "average"  # target reached and other peers share our epoch: run a round
    STEP_ALONE = "step_alone"  # target reached, no other peer at our epoch, none awaited
    CATCH_UP = "catch_up"  # a peer is ahead of us: download the state


@dataclass(frozen=True)
class Decision:
    action: Action
    samples: int  # counted at our epoch, ours included
    peers: int  # other peers at our epoch
    waiting_for: tuple[str, ...] = ()  # peers behind that a step now due waits for


def decide(
    me: str,
    epoch: int,
    samples: int,
    others: Sequence[Progress],
    target: int,
    *,
    catch_up: bool = True,
    per_peer: bool = False,
    patient_for: Collection[str] = (),
) -> Decision:
    """What a peer at ``epoch`` holding ``samples`` does, given the other peers' records.

    ``per_peer``: the target is per peer at our epoch (DiLoCo: each peer's share of inner
    steps), so it grows with their number. ``catch_up`` False: a download just failed, so
    a peer behind waits rather than try again at once. ``patient_for``: peers whose step
    is due wait instead while any of these is behind them (a joiner downloading the
    state), so that it lands at their epoch and averages with them rather than chase a
    stage that steps faster than a download; ``Patience`` says whom and bounds the wait
    (``waiting_for`` says whom a WAIT waits for). A peer's count is
    capped at the target: one peer claiming huge numbers can start a round early, not skip
    one. Records of ``me`` are ignored (our own count is ``samples``)."""
    if target < 1:
        raise ValueError(f"target must be >= 1, got {target}")
    others = [p for p in others if p.peer_id != me]
    if any(p.epoch > epoch for p in others):
        # Behind: whatever we step on now is thrown away when we download the state.
        return Decision(Action.CATCH_UP if catch_up else Action.WAIT, samples, 0)
    same = [p for p in others if p.epoch == epoch]
    if per_peer:
        target *= 1 + len(same)
    total = min(samples, target) + sum(min(p.samples, target) for p in same)
    if total < target:
        return Decision(Action.WAIT, total, len(same))
    behind = sorted({p.peer_id for p in others if p.epoch < epoch and p.peer_id in patient_for})
    if behind:
        return Decision(Action.WAIT, total, len(same), tuple(behind))
    # A peer with no samples of its own still averages (with weight 0): it applies the same
    # step as the others and stays in step with them without downloading their state.
    return Decision(Action.AVERAGE if same else Action.STEP_ALONE, total, len(same))


def tell_at_once(samples: int, same: Sequence[Progress], target: int, *, per_peer: bool) -> bool:
    """Whether our count, now ``samples``, may make the round due (``decide``) for us or
    a peer at our epoch (``same``: their records), so that they should see it at once,
    not at the next report. With a shared batch (``per_peer`` False) every sample counts
    toward it and toward what the peers admit. With a per-peer target the round is due
    only once the counts, each capped at the target for all, add up to the target for
    all: while ours and every peer's are below one peer's ``target`` the sum cannot reach
    it, whatever ours becomes below that. ``same`` is as our view shows them: a peer
    whose count reached its share tells it at once, and ours is told then."""
    if not per_peer:
        return True
    return samples >= target or any(p.samples >= target for p in same)


# A step that is due waits for the peers behind (``decide``'s ``patient_for``) only while
# the window after our epoch lasts (a download of our state from the slowest peer at our
# epoch: ``download_patience_s``, the same window for all of them); on account of one peer
# for at most ``PATIENT_EPOCHS`` of our epochs in ``PATIENCE_MEMORY_S``; and for all peers
# behind together at most ``PATIENCE_SHARE`` of the memory, which stretches to hold one
# download from us at that share (our own upload rate, not a peer's claim), so that peers
# that never land (dead, lying, many of them, or on a link too slow for the state) cost
# the stage that share of its time at most.
PATIENT_EPOCHS = 3
PATIENCE_MEMORY_S = 600.0
PATIENCE_SHARE = 0.25


@dataclass(frozen=True)
class Held:
    """A wait of our due step for peers behind (``Patience``) that ended."""

    epoch: int  # ours, during the wait
    seconds: float
    peers: tuple[str, ...]  # whom it waited for


class Patience:
    """Whom a peer's due step waits for: the peers behind it, while the window ``open``
    set after its latest epoch lasts, each for at most ``epochs`` of its epochs within the
    memory, and all together at most ``share`` of it. The memory is ``memory_s`` seconds,
    or ``own_s / share`` where a download from us (``own_s``) is longer than that share.
    ``note`` is told every decision (whom it waited for, if anyone), counts the waits, and
    says when a wait ended (``Held``). Times are the caller's clock, in seconds."""

    def __init__(
        self,
        epochs: int = PATIENT_EPOCHS,
        memory_s: float = PATIENCE_MEMORY_S,
        share: float = PATIENCE_SHARE,
    ) -> None:
        self.epochs, self.memory_s, self.share = epochs, memory_s, share
        self.until = -math.inf
        self._own_s = 0.0
        self._waits: dict[str, dict[int, float]] = {}  # peer -> our epoch -> first wait
        self._spent: list[list[float]] = []  # [start, end] of each wait, oldest first
        self._waiting = False  # the last decision waited (its interval is still open)
        self._held_for: set[str] = set()  # whom the wait going on waited for
        self._held_at = 0  # our epoch during the wait going on

    def open(self, now: float, window_s: float, own_s: float = 0.0) -> None:
        """We reached an epoch at ``now``: peers behind may hold our next step until
        ``window_s`` later; ``own_s``: how long a download of our state from us takes."""
        self._stop(now)
        self.until, self._own_s = now + window_s, own_s

    @property
    def memory(self) -> float:
        """Seconds over which waits are counted."""
        return max(self.memory_s, self._own_s / self.share)

    def spent_s(self, now: float) -> float:
        """Seconds spent waiting within the memory (a wait going on: until now)."""
        since, last = now - self.memory, len(self._spent) - 1
        return sum(
            max(0.0, (now if self._waiting and i == last else end) - max(start, since))
            for i, (start, end) in enumerate(self._spent)
        )

    def deserving(self, others: Sequence[Progress], epoch: int, now: float) -> frozenset[str]:
        """The peers of ``others`` behind ``epoch`` that our step may wait for now."""
        if now >= self.until:
            return frozenset()
        if self.spent_s(now) >= self.share * self.memory:
            return frozenset()
        result = set()
        for p in others:
            if p.epoch >= epoch:
                continue
            waits = self._waits.get(p.peer_id, {})
            recent = sum(now - at < self.memory for at in waits.values())
            if epoch in waits or recent < self.epochs:
                result.add(p.peer_id)
        return frozenset(result)

    def note(self, waiting_for: Sequence[str], epoch: int, now: float) -> Held | None:
        """Our decision at ``epoch`` waited for ``waiting_for`` (empty: it did not wait).
        The wait that this decision ended, if one did."""
        if not waiting_for:
            return self._stop(now)
        if self._waiting:
            self._spent[-1][1] = now
        else:
            self._spent.append([now, now])
            self._waiting, self._held_for, self._held_at = True, set(), epoch
        self._held_for.update(waiting_for)
        for peer in waiting_for:
            self._waits.setdefault(peer, {}).setdefault(epoch, now)
        self._forget(now)
        return None

    def _stop(self, now: float) -> Held | None:
        if not self._waiting:
            return None
        self._spent[-1][1] = now
        self._waiting = False
        start = self._spent[-1][0]
        return Held(self._held_at, now - start, tuple(sorted(self._held_for)))

    def _forget(self, now: float) -> None:
        memory = self.memory
        while self._spent and self._spent[0][1] < now - memory:
            self._spent.pop(0)
        for peer in list(self._waits):
            kept = {e: at for e, at in self._waits[peer].items() if now - at < memory}
            if kept:
                self._waits[peer] = kept
            else:
                del self._waits[peer]


# How long a gradient round waits for the backwards of the micro-batches its peer admitted
# at the epoch (``drain_wait_s``), so that its step takes their gradients: those that come
# later go into the next step, one step stale.
DRAIN_S = 2.0  # at least: a stage with no trip measured waits this long
DRAIN_MARGIN = 1.5  # times the longest recent trip (admission to gradients) at the stage
RECENT_TRIPS = 8  # trips the stage remembers
# An open micro-batch whose backward has not come after this long is forgotten (its trainer
# died, or sent the backward to another peer of the stage): it no longer holds a step back,
# so no drain lasts longer (``drain_wait_s``'s ceiling at a stage server).
OPEN_S = 10.0


def drain_wait_s(
    admitted_at: Sequence[float], trips_s: Sequence[float], now: float, *, ceiling_s: float
) -> float:
    """Seconds a round waits for the open micro-batches admitted at ``admitted_at``: until
    the last of them is due, ``DRAIN_MARGIN`` times the longest of the stage's recent
    ``trips_s`` after its admission; at least ``DRAIN_S`` (also with no trip measured),
    at most ``ceiling_s`` (a lost micro-batch must not hold the stage). 0 with nothing
    open."""
    if not admitted_at:
        return 0.0
    if not trips_s:
        return min(DRAIN_S, ceiling_s)
    due = max(admitted_at) + DRAIN_MARGIN * max(trips_s)
    return min(ceiling_s, max(DRAIN_S, due - now))


# How long a peer waits for a stage's state from a peer of it: the state's bytes over the
# upload rate its source announces, times ``DOWNLOAD_MARGIN`` (framing, a loaded machine,
# TCP's ramp over a long round trip), and never less than the round's timeout. A source
# that announces no rate is assumed to send ``ASSUMED_UPLOAD_MBPS``; a claimed rate counts
# as at least ``MIN_UPLOAD_MBPS`` and at most ``MAX_UPLOAD_MBPS``, so that a claim can
# neither make us wait without end nor cut a download short of the round's timeout. A
# source that stops sending altogether is dropped sooner, by the transport's chunk timeout.
DOWNLOAD_MARGIN = 2.0
ASSUMED_UPLOAD_MBPS = 10.0
MIN_UPLOAD_MBPS = 1.0
MAX_UPLOAD_MBPS = 10_000.0


def download_patience_s(state_bytes: int, upload_mbps: Sequence[float], *, floor_s: float) -> float:
    """Seconds to wait for a state of ``state_bytes`` from one of the peers whose announced
    upload rates (Mbit/s; 0: not announced) are ``upload_mbps``: paced by the slowest of
    them (any may be the one that answers), at least ``floor_s``. No rate at all: one
    source at ``ASSUMED_UPLOAD_MBPS``."""
    if state_bytes < 0 or not floor_s >= 0:
        raise ValueError(f"state_bytes and floor_s must be >= 0, got {state_bytes}, {floor_s}")
    rates = [
        min(max(r, MIN_UPLOAD_MBPS), MAX_UPLOAD_MBPS) if r > 0 else ASSUMED_UPLOAD_MBPS
        for r in upload_mbps
        if math.isfinite(r)
    ] or [ASSUMED_UPLOAD_MBPS]
    return max(floor_s, DOWNLOAD_MARGIN * state_bytes * 8 / (min(rates) * 1e6))


def fork_lineage(peer: str, epoch: int) -> int:
    """The lineage of a copy that ``peer`` stepped alone to ``epoch + 1`` in a fallback: a
    value of its own (below 2**48), which no other copy holds. Copies start at lineage 0;
    a copy downloaded or averaged keeps its lineage (``resync_source``)."""
    digest = hashlib.sha256(f"{peer}/{int(epoch)}".encode()).digest()
    return 1 + int.from_bytes(digest[:6], "big") % (2**48 - 1)


def resync_source(me: str, lineages: Mapping[str, int]) -> str | None:
    """After a round that averaged, given each groupmate's lineage (``lineages``, ``me``
    included: the copies it holds share one if they have been one copy since their last
    fallback, ``fork_lineage``), the groupmate whose state ``me`` downloads so that the
    group holds one copy again; None: keep ours (the copies agree, or ours is the one).

    Every groupmate computes the same choice: the lineage most groupmates hold (ties: the
    lowest value), and of its holders the lowest peer id. The holders of another lineage
    download that peer's state instead of taking the round's step."""
    if me not in lineages:
        raise ValueError(f"{me} is not in the group it averaged with")
    counts = Counter(lineages.values())
    chosen = min(counts, key=lambda lineage: (-counts[lineage], lineage))
    if lineages[me] == chosen:
        return None
    return min(peer for peer, lineage in lineages.items() if lineage == chosen)


@dataclass
class OuterRound:
    """DiLoCo's count of a copy's inner samples around its outer rounds, and what the copy
    may do while a round is in flight (events in: ``begin``, ``stepped``, ``finished``,
    ``given_back``, ``loaded``; no tensors, no clock).

    ``begin`` takes the samples stepped on since the last outer step (the round's weight)
    and starts the round; at most one is in flight (``may_begin``). Without ``overlap`` the
    copy takes no inner step and admits no micro-batch until the round ends; with it the
    copy goes on stepping, and what it steps on from ``begin`` on counts toward the next
    round. A round that ends with a step (``finished``) consumes its weight; one that fails
    (``given_back``) returns it, so that the next round takes those samples too: no sample
    is lost or counted twice.

    A round without ``overlap`` that has held a micro-batch for as long as a stage holds
    one (``overdue``: a slow link, a loaded machine, a round falling back to its timeout)
    is overlapped from then on: the copy admits micro-batches and takes inner steps as with
    ``overlap``, so the pipeline keeps training instead of passing one micro-batch per
    hold. Short rounds still hold (their step lands on exactly the parameters they
    averaged); only long ones pay overlap's one-round-late pseudo-gradient."""

    overlap: bool = False
    inner: int = 0  # samples stepped on that no round took yet
    in_round: int = 0  # the weight of the round in flight
    in_flight: bool = False
    late: bool = False  # the round in flight held a micro-batch too long: overlapped now

    @property
    def pending(self) -> int:
        """Samples toward our next round, the round in flight included (what the copy
        publishes: its groupmates must see it reach the round's target until it ends)."""
        return self.in_round + self.inner

    @property
    def may_begin(self) -> bool:
        return not self.in_flight

    @property
    def overlapped(self) -> bool:
        """Whether the copy goes on (admits, steps) now: no round in flight, ``overlap``,
        or the round in flight is ``overdue``."""
        return self.overlap or not self.in_flight or self.late

    def may_step(self, accumulated: int, batch: int) -> bool:
        """Whether an inner step on ``accumulated`` samples is due now."""
        return accumulated >= batch and self.overlapped

    def admits(self, committed: int, batch: int) -> bool:
        """Whether a new micro-batch may enter, ``committed`` samples (accumulated and in
        flight) toward the next inner step: not once they make up its batch (they wait for
        the step), nor during a round without ``overlap`` until that round is ``overdue``."""
        return committed < batch and self.overlapped

    def overdue(self) -> bool:
        """A micro-batch waited as long as a stage holds one. True if that turns the round
        in flight overlapped now: the caller keeps the parameters as they are, which are
        those the round's delta was taken from (no inner step ran since ``begin``)."""
        if not self.in_flight or self.overlap or self.late:
            return False
        self.late = True
        return True

    def stepped(self, samples: int) -> None:
        self.inner += samples

    def begin(self) -> int:
        """Start a round; its weight. ``RuntimeError`` if one is in flight."""
        if self.in_flight:
            raise RuntimeError("an outer round is in flight already")
        self.in_flight, self.in_round, self.inner = True, self.inner, 0
        self.late = False
        return self.in_round

    def finished(self) -> None:
        """The round's step was applied."""
        self.in_flight, self.in_round, self.late = False, 0, False

    def given_back(self, weight: int) -> None:
        """The round failed; ``weight`` of its samples go back (0: its contribution was
        dropped, as unfit to send)."""
        self.in_flight, self.in_round, self.inner = False, 0, self.inner + weight
        self.late = False

    def loaded(self) -> None:
        """A downloaded state replaced the copy's: its inner steps are gone."""
        self.inner = 0


# Averaged entries are per-sample mean gradients or DiLoCo parameter deltas: training
# produces values orders of magnitude below this, so a part beyond it is a faulty or
# hostile peer's, and is dropped like a non-finite one.
MAX_ABS_CONTRIBUTION = 1e4


def max_abs(t: torch.Tensor) -> float:
    """The largest absolute value in ``t`` (0 if empty): NaN if any value is NaN, inf if
    any is infinite, so one pass tells both finiteness and range."""
    return float(t.abs().max()) if t.numel() else 0.0


def within_bounds(tensors: Sequence[torch.Tensor]) -> bool:
    """Finite, and within what training produces (``MAX_ABS_CONTRIBUTION``): a
    contribution fit to send, or a result fit to apply (an average of such values is)."""
    return all(max_abs(t) <= MAX_ABS_CONTRIBUTION for t in tensors)  # False for NaN


def check_weight(weight: float) -> bool:
    """A peer's averaging weight (its sample count) is usable."""
    return isinstance(weight, int | float) and math.isfinite(weight) and weight >= 0


# Robust aggregation of one part: no single groupmate can drag the mean far. With two
# contributions nobody can tell which one is wrong, so they are plainly averaged.
CLIP_RADIUS = 2.0  # clip radius, in medians of the contributions' distances to their median
CLIP_WEIGHT = 2.0  # a weight counts at most this many times the median weight
CLIP_STEPS = 5  # iterations of centered clipping


def robust_mean(parts: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """The weighted mean of ``parts`` (tensors of one shape), made robust by centered
    clipping (Karimireddy et al., 2021) once three or more carry weight: starting from
    their coordinate-wise median, each step moves toward every part by at most a radius of
    ``CLIP_RADIUS`` times the median distance of the parts to that median, and a weight
    counts at most ``CLIP_WEIGHT`` times the median weight. A groupmate sending finite but
    wrong values (scaled, negated, or claiming a huge sample count) then shifts the result
    by at most about the radius times its share, where a plain mean follows it anywhere.
    Honest parts, spread alike and with weights within ``CLIP_WEIGHT`` of the median, are
    within the radius and get their weighted mean."""
    if len(parts) != len(weights) or not parts:
        raise ValueError(f"{len(parts)} parts with {len(weights)} weights")
    shape = parts[0].shape
    if any(p.shape != shape for p in parts):
        raise ValueError(f"parts of shapes {[tuple(p.shape) for p in parts]}: one expected")
    w = torch.tensor([float(v) for v in weights])
    if not (w.ge(0).all() and w.sum() > 0):
        raise ValueError(f"weights must be >= 0 and not all 0, got {list(weights)}")
    counted = w > 0
    if int(counted.sum()) <= 2:  # the plain weighted mean, without stacking the parts
        total = float(w.sum())
        kept = [(p, float(v) / total) for p, v in zip(parts, w.tolist(), strict=True) if v > 0]
        mean = kept[0][0].float() * kept[0][1]
        for p, share in kept[1:]:
            mean.add_(p.float(), alpha=share)
        return mean
    x = torch.stack([p.float().reshape(-1) for p in parts])[counted]
    w = w[counted]
    w = w.clamp(max=CLIP_WEIGHT * float(w.median()))
    center = x.median(dim=0).values
    radius = CLIP_RADIUS * float((x - center).norm(dim=1).median())
    for _ in range(CLIP_STEPS):
        offsets = x - center
        norms = offsets.norm(dim=1)
        scale = torch.where(norms > radius, radius / norms.clamp(min=1e-30), torch.ones_like(norms))
        center = center + (w * scale) @ offsets / w.sum()
    return center.reshape(shape)


# What a reducer returns. Every groupmate reduces a share of the vector: it gets every
# groupmate's part of that share and returns the (robust) mean to each. A sender cannot
# see the other parts, but it knows its own and its weight's share of the group: an honest
# mean is a positive combination of its part and the others' mean, so it lies within about
# the parts' spread of ours (of the order of their norms), and its cosine with ours is at
# least the others' mean's, higher the more of the weight is ours. The share a sender
# reduces itself shows how far the true mean lies from its part in this round (farther
# when its part is small: a DiLoCo delta of fewer inner steps), so another share may lie
# that far too. A part of little weight says little about the mean: one sample's gradient
# beside 31 others' is sparse in the embeddings (the mean may lie tens of its norms away)
# and, where copies took speculative steps, may point against theirs
# (``tests/unit/test_averaging_refusal.py``), so its checks are lenient in proportion, and
# the groupmates of most weight judge strictly. A mean scaled far up fails for nearly
# everyone; a negated one for the groupmates of most weight.
RETURN_RADIUS = 4.0  # in norms of our part, times our own share's spread (at least 1)
FAR_RADIUS = 4.0  # beyond this many times the radius, a mean is refused at once
# A mean is refused as against our part below this cosine, or below twice our own share's
# cosine if that is lower (it shows how far against ours this round's true mean lies), or
# below ``honest_cosine`` of our weight's share if that is lower. A negated mean lies at
# minus the honest cosine.
AGAINST_COSINE = -0.2
OTHERS_COSINE = -0.9  # how far against ours the others' mean may point (``honest_cosine``)


def weight_share(mine: float, others: Sequence[float]) -> float | None:
    """Our weight's share of a reducer's mean: ``mine`` over the summed weights of the
    parts that carry weight (ours and ``others``, the weights the groupmates declared to
    the reducer we run), each counting at most ``CLIP_WEIGHT`` times their median once
    three or more carry weight, as ``robust_mean`` counts them. None when no part carries
    weight. A groupmate claiming a huge weight makes our share small (and the check of
    its mean lenient) only up to that clip; with two parts it dictates the plain mean as a
    sender anyway."""
    weights = [float(w) for w in (mine, *others) if check_weight(w) and w > 0]
    if not weights:
        return None
    if len(weights) >= 3:
        cap = CLIP_WEIGHT * float(torch.tensor(weights).median())
        weights = [min(w, cap) for w in weights]
        mine = min(mine, cap)
    return max(0.0, float(mine)) / sum(weights)


def honest_cosine(share: float) -> float:
    """The lowest cosine an honest mean has with our part when our weight's share is
    ``share`` and the others' mean lies at ``OTHERS_COSINE`` from ours, each part's norm
    scaling as sampling noise (1 / sqrt(weight)): ``OTHERS_COSINE`` when our share is 0,
    rising to 1 as it nears 1."""
    a = min(1.0, max(0.0, share))
    c = OTHERS_COSINE
    return (math.sqrt(a) + c * math.sqrt(1 - a)) / math.sqrt(1 + 2 * c * math.sqrt(a * (1 - a)))


@dataclass
class ReturnedShare:
    """Running sums over the parts of one reducer's share: ours (``mine``) and the means
    it returned (``averaged``), added part by part (``add``)."""

    mine_sq: float = 0.0
    returned_sq: float = 0.0
    distance_sq: float = 0.0
    dot: float = 0.0
    finite: bool = True

    def add(self, mine: torch.Tensor, averaged: torch.Tensor) -> None:
        # float32 products, summed in Python floats: the checks compare norms, not bits.
        x, r = mine.float().reshape(-1), averaged.float().reshape(-1)
        self.mine_sq += float(x @ x)
        if not math.isfinite(max_abs(r)):
            self.finite = False
            return
        d = r - x
        self.returned_sq += float(r @ r)
        self.distance_sq += float(d @ d)
        self.dot += float(r @ x)

    @property
    def cosine(self) -> float | None:
        """The cosine of the means with our parts (None: either is 0 or not finite)."""
        if not self.finite or self.mine_sq <= 0 or self.returned_sq <= 0:
            return None
        return self.dot / math.sqrt(self.mine_sq * self.returned_sq)

    @property
    def spread(self) -> float | None:
        """How far the means lie from our parts, in norms of ours (None: ours are 0)."""
        return math.sqrt(self.distance_sq / self.mine_sq) if self.mine_sq > 0 else None


@dataclass(frozen=True)
class Refusal:
    """Why a reducer's means were refused. ``ban``: they cannot be an honest mean (not
    finite, or ``FAR_RADIUS`` times beyond the radius): refuse the reducer at once; else
    the share is discarded and the refusal counts as a strike (``ReducerRecord``)."""

    reason: str
    ban: bool

    def __str__(self) -> str:
        return self.reason


def check_returned(
    share: ReturnedShare, own: ReturnedShare | None = None, weight: float | None = None
) -> Refusal | None:
    """Why the means one groupmate returned for its share (``share``) cannot be means of
    parts that include ours, or None. ``own``: the share we reduced ourselves; ``weight``:
    our weight's share of the group (``weight_share``; None: unknown, taken as half).

    They must be finite; lie within ``RETURN_RADIUS`` norms of our part from it, times the
    spread of ``own`` if that is more than 1, times 1 / sqrt(2 ``weight``) if that is more
    than 1 (a part of less than half the weight is a poorer yardstick); and not point
    against it: a cosine below ``AGAINST_COSINE``, below twice that of ``own`` and below
    ``honest_cosine(weight)``. A contribution of zeros (a groupmate with no samples of its
    own) tells nothing: None, even for non-finite means, which an honest reducer returns
    when every sender had weight 0 (its sum over a weight of 0); the caller then discards
    the result as out of bounds."""
    if share.mine_sq == 0:
        return None
    if not share.finite:
        return Refusal("it returned non-finite values", ban=True)
    spread = share.spread
    if spread is None:
        return None
    limit = RETURN_RADIUS * max(1.0, (own.spread if own is not None else None) or 1.0)
    if weight is not None:
        limit *= max(1.0, 1 / math.sqrt(2 * weight)) if weight > 0 else math.inf
    if spread > limit:
        return Refusal(
            f"its mean lies {spread:.3g} norms of our part from it (at most {limit:.3g})",
            ban=spread > FAR_RADIUS * limit,
        )
    cosine = share.cosine
    floor = min(AGAINST_COSINE, 2 * ((own.cosine if own is not None else None) or 0.0))
    if weight is not None:
        floor = min(floor, honest_cosine(weight))
    if cosine is not None and cosine < floor:
        return Refusal(
            f"its mean points against our part (cosine {cosine:.3g}, at least {floor:.3g})",
            ban=False,
        )
    return None


# A reducer whose means were refused in ``STRIKES`` of the last ``STRIKE_ROUNDS`` rounds it
# reduced for us (for their direction, or as a little beyond the radius) is refused for
# ``REFUSED_S``: an honest one is refused now and then, a hostile one every round.
STRIKES = 3
STRIKE_ROUNDS = 10
REFUSED_S = 600.0  # how long a reducer is refused (as a leader, a follower, a sender)


@dataclass
class ReducerRecord:
    """One groupmate's record as a reducer, as one peer keeps it (events in: ``reduced``;
    no clock: the caller passes the time). A refusal that bans, or refusals in
    ``STRIKES`` of the last ``STRIKE_ROUNDS`` rounds, refuse the groupmate until
    ``until``; the attempts of one round (its retries) count as one round, refused if
    any was."""

    rounds: dict[str, bool] = field(default_factory=dict)  # round -> refused, oldest first
    until: float = -math.inf

    def reduced(self, round_key: str, refusal: Refusal | None, now: float) -> bool:
        """It reduced a share for us in round ``round_key`` (at ``now``), and its means
        were refused (``refusal``) or not (None); whether the groupmate is refused from
        now on."""
        refused = self.rounds.pop(round_key, False) or refusal is not None
        self.rounds[round_key] = refused
        for old in list(self.rounds)[:-STRIKE_ROUNDS]:
            del self.rounds[old]
        if (refusal is not None and refusal.ban) or sum(self.rounds.values()) >= STRIKES:
            self.until, self.rounds = now + REFUSED_S, {}
        return self.refuses(now)

    def refuses(self, now: float) -> bool:
        """Whether the groupmate is refused at ``now``."""
        return now < self.until

    def idle(self, now: float) -> bool:
        """Nothing to remember at ``now``: not refused, and no refusal among its rounds."""
        return not self.refuses(now) and not any(self.rounds.values())


def reducer_shares(clients: Sequence[bool]) -> tuple[float, ...]:
    """Each groupmate's share of the vector to reduce: equal among those that reduce (all
    but ``clients``, which cannot be dialed), whatever bandwidth any of them claims (a
    groupmate claiming a fast link would otherwise reduce, and could corrupt, most of it)."""
    if all(clients):
        raise ValueError("a group of clients only has nobody to reduce")
    return tuple(0.0 if client else 1.0 for client in clients)
