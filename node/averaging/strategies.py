"""What a stage's copy averages with its peers and how it steps: one interface, two modes.

- ``GradientStrategy`` (``mode`` "gradient"): the stage's peers share one target batch;
  a round averages their mean gradients, weighted by their sample counts, and each copy
  takes the same optimizer step on the result (``StageOptimizer.step_with_mean``). With
  ``compression`` uint8 (``compressed``) a round sends one flat vector of the mean
  gradients plus the copy's residual, rounded to 8 bits; the rounding error is the new
  residual (its own, never shipped), so it is sent in a later round. The mean comes back
  exact (``BlockCodec``): every copy still takes the same step.
- ``DiLoCoStrategy`` (``mode`` "diloco"): each copy takes AdamW steps alone, every
  ``target_batch_size`` of its own samples; a round averages the copies' parameter deltas
  since the last outer step, and each takes the same outer Nesterov step from the same
  anchor. With ``density`` below 1 or ``compression`` uint8 (``compressed``) a round sends
  one flat vector instead: the coordinates ``protocol.sparsify`` draws for the epoch, their
  values rounded to 8 bits if asked. What a copy did not send is its error-feedback
  residual (its own, never shipped): after the outer step the copy goes on from the new
  anchor plus that residual, so its inner steps build on its unsent progress and its next
  delta from the anchor carries the residual. The copies agree on the anchor
  (``digest_tensors``, the state joiners download), not on their parameters. With
  ``overlap`` a copy keeps taking inner steps while its round runs: the contribution
  holds a snapshot of the parameters its delta was taken from, and the outer step adds
  the new anchor (minus the residual) less that snapshot to the parameters, so the inner
  steps taken meanwhile carry over into the next round's delta
  (``protocol.averaging.OuterRound`` counts their samples). Without ``overlap`` a round
  that held a micro-batch too long (``overdue``) goes on the same way, from a snapshot
  taken then (the parameters have not moved since its delta was taken).

A strategy holds the copy's state: parameters and inner optimizer (the stage's), its
epoch (rounds behind the parameters) and, for DiLoCo, the anchor and outer optimizer. The
round loop (``node.averaging.averager``) drives it through ``begin`` (take a
contribution), then ``finish`` (apply a result) or ``give_back`` (the round failed); every
method takes the stage's lock itself, except those named ``*_locked``, whose caller (the
compute thread) holds it. A contribution is settled once, by ``finish`` or ``give_back``:
no sample is lost or counted twice.
"""

from __future__ import annotations

import math
import threading
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from models.stages import Stage
from models.training import OptimizerSnapshot, StageOptimizer
from node.averaging import state as stage_state
from node.averaging.state import StageState
from node.pipeline.server import Admission
from protocol import sparsify
from protocol.averaging import OuterRound, Progress
from protocol.run_spec import AveragingSpec

ROUNDS_KEPT = 1024  # successful rounds whose durations ``AveragingStats`` keeps


@dataclass
class AveragingStats:
    rounds: int = 0  # averaged with at least one other peer
    alone: int = 0  # stepped alone: no other peer at our epoch
    fallbacks: int = 0  # a round found no usable result in time: applied our own alone
    discarded: int = 0  # attempts whose result was thrown away (failed, not finite, ...)
    catch_ups: int = 0  # state downloads after falling behind
    samples: int = 0  # our samples in the steps applied (each counted once)
    inner_steps: int = 0  # diloco: local AdamW steps
    last_round_s: float = math.nan  # from our trigger to the applied result
    last_group: int = 0  # peers in the last successful round, us included
    # the last ``ROUNDS_KEPT`` successful rounds' durations
    round_s: deque[float] = field(default_factory=lambda: deque(maxlen=ROUNDS_KEPT))


@dataclass
class Contribution:
    """What this copy puts into one round."""

    weight: int  # samples behind it
    tensors: list[torch.Tensor]  # what is averaged: mean gradients, or parameter deltas
    sums: list[torch.Tensor | None]  # gradient mode: the sums taken out of .grad
    settled: bool = False  # applied, or given back (under the lock): never both
    # compressed: what was rounded into ``tensors`` (flat, the residual in it: diloco's
    # delta from the anchor, or the mean gradients) and, diloco, the coordinates of it
    # sent (``sparsify.choose_indices``; None: all of them, in order)
    pending: torch.Tensor | None = None
    indices: torch.Tensor | None = None
    # overlapped diloco: the parameters the delta was taken from (the copy steps on from
    # them during the round, and keeps that progress when the round's step is applied)
    snapshot: list[torch.Tensor] | None = None

    def emptied(self) -> Contribution:
        """Weight 0 and zeros (to stay in step with the others without contributing); its
        gradient sums are dropped."""
        zeros = [torch.zeros_like(t) for t in self.tensors]
        pending = None if self.pending is None else torch.zeros_like(self.pending)
        return Contribution(
            0,
            zeros,
            [None] * len(self.sums),
            pending=pending,
            indices=self.indices,
            snapshot=self.snapshot,
        )


class Strategy(ABC):
    """One stage copy's steps and contributions; see the module docstring."""

    mode: ClassVar[str]
    # The stage's peers fill one target batch together: the server counts their samples
    # before it admits one, and a round waits for the backwards of admitted micro-batches.
    shares_batch: ClassVar[bool]

    def __init__(
        self,
        module: Stage,
        optimizer: StageOptimizer,
        lock: threading.Lock,
        settings: AveragingSpec,
        stats: AveragingStats,
        *,
        salt: str = "",
    ) -> None:
        self.module = module
        self.optimizer = optimizer
        self.lock = lock  # the stage's: held whenever parameters or gradients change
        self.settings = settings
        self.stats = stats
        self.batch = optimizer.config.target_batch_size
        self.params = [p for _, p in stage_state.trainable(module)]
        self.epoch = 0  # rounds behind the parameters; changes under the lock
        # The copy's lineage (``protocol.averaging.fork_lineage``): shipped with its state
        # and taken from a downloaded one; set by the round loop as the copy forks.
        self.lineage = 0
        self.salt = salt  # names the run and stage: seeds the coordinates a round sends

    @property
    def shapes(self) -> list[torch.Size]:
        """The shapes of the tensors a contribution averages (the same on every copy)."""
        return [p.shape for p in self.params]

    @property
    @abstractmethod
    def target(self) -> int:
        """Samples of one peer that make a round due (``decide``'s target)."""

    @property
    def per_peer(self) -> bool:
        """Whether ``target`` is per peer at our epoch (``decide``'s ``per_peer``)."""
        return not self.shares_batch

    @abstractmethod
    def pending(self) -> int:
        """Samples toward our next round already out of the optimizer's count (a round in
        flight, or inner steps taken)."""

    @abstractmethod
    def admission(self, mine: int, same: Sequence[Progress], busy: bool) -> Admission:
        """Whether the server admits a new training micro-batch, given our samples toward
        the next round, the records of the peers at our epoch, and whether a step is in
        progress."""

    def overdue(self) -> None:
        """A training micro-batch waited the longest a stage holds one (the server admits it
        anyway). Gradient mode: nothing changes (the next one is held again, since a step's
        batch must be computed on the parameters it updates)."""
        return None

    @abstractmethod
    def on_accumulated_locked(self, alone: bool) -> bool:
        """After a micro-batch's gradients landed in ``.grad``. ``alone``: no other peer of
        the stage in sight and no step in progress. True if the copy stepped to the next
        epoch (the caller announces it)."""

    @abstractmethod
    def begin(self) -> Contribution:
        """Take this copy's contribution to a round."""

    def finish(self, result: Sequence[torch.Tensor], contribution: Contribution) -> bool:
        """Apply a round's ``result`` (or our own contribution's tensors, stepping alone):
        the copy moves to the next epoch. False if ``contribution`` was settled already."""
        with self.lock:
            if contribution.settled:
                return False
            contribution.settled = True
            self.stats.samples += contribution.weight
            self._apply_locked(result, contribution)
            self.epoch += 1
            return True

    def give_back(self, contribution: Contribution) -> None:
        """The round failed: what ``begin`` took goes back (a no-op once settled)."""
        with self.lock:
            if not contribution.settled:
                contribution.settled = True
                self._give_back_locked(contribution)

    def forgo(self, contribution: Contribution) -> None:
        """The group stepped on our contribution, but our copy does not take that step (it
        downloads the state of a copy that did): nothing goes back, and the round is over
        (a no-op once settled)."""
        with self.lock:
            if not contribution.settled:
                contribution.settled = True
                self._forgo_locked(contribution)

    @abstractmethod
    def step_alone(self) -> bool:
        """Step on our own samples, no peer at our epoch; False if nothing was due."""

    @abstractmethod
    def digest_tensors(self) -> list[torch.Tensor]:
        """The tensors every copy agreed on at this epoch (their digests are compared).
        Changed only by the round loop, so it may read them without the lock."""

    def momentum(self) -> list[torch.Tensor] | None:
        """The outer optimizer's momentum, shipped with the state (None: there is none)."""
        return None

    def capture(self, peer: str) -> tuple[dict, list[torch.Tensor]]:
        """A copy of the state, as a joiner downloads it (takes the lock)."""
        with self.lock:
            return stage_state.capture(
                self.module,
                self.optimizer,
                epoch=self.epoch,
                mode=self.mode,
                peer=peer,
                params=self._shipped_params(),
                momentum=self.momentum(),
                lineage=self.lineage,
            )

    def apply_state(self, state: StageState) -> None:
        """Replace the copy's state by a downloaded (or saved) one (takes the lock)."""
        with self.lock:
            stage_state.apply(state, self.module, self.optimizer)
            self.epoch = state.epoch
            self.lineage = state.lineage
            self._loaded_locked(state)

    @abstractmethod
    def _apply_locked(self, result: Sequence[torch.Tensor], contribution: Contribution) -> None: ...

    @abstractmethod
    def _give_back_locked(self, contribution: Contribution) -> None: ...

    @abstractmethod
    def _forgo_locked(self, contribution: Contribution) -> None: ...

    def _shipped_params(self) -> list[torch.Tensor] | None:
        return None  # the module's own

    def _loaded_locked(self, state: StageState) -> None:
        return None


class GradientStrategy(Strategy):
    """Averages mean gradients; one optimizer step per round."""

    mode = "gradient"
    shares_batch = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._round_samples = 0  # samples of the round in flight
        # ``speculate``: the state before the local step taken at the round's start
        self._before: OptimizerSnapshot | None = None
        self.compressed = self.settings.compression == "uint8"
        self._numels = [p.numel() for p in self.params]
        # What the 8-bit rounding left out of the mean gradients this copy sent (flat,
        # float32): its own, never shipped, added to its next round's mean gradients.
        self._residual = torch.zeros(sum(self._numels) if self.compressed else 0)

    @property
    def residual(self) -> torch.Tensor:
        """What this copy's rounding left out and has not sent yet (flat; empty unless
        ``compressed``)."""
        return self._residual

    @property
    def shapes(self) -> list[torch.Size]:
        if not self.compressed:
            return super().shapes
        return [torch.Size([sum(self._numels)])]

    @property
    def target(self) -> int:
        return self.batch

    def pending(self) -> int:
        return self._round_samples

    def admission(self, mine: int, same: Sequence[Progress], busy: bool) -> Admission:
        """FULL while the samples committed to this epoch at the stage (ours and our
        peers') make up its batch, or a step is in progress; SHARE once ours make up our
        share of it (the server waits a little before it takes more)."""
        if busy:
            return Admission.FULL
        target = self.target
        if min(mine, target) + sum(min(p.samples, target) for p in same) >= target:
            return Admission.FULL
        if same and mine >= math.ceil(target / (1 + len(same))):
            return Admission.SHARE
        return Admission.OPEN

    def on_accumulated_locked(self, alone: bool) -> bool:
        # Nobody to average with: step now, as the micro-batch that completed the target
        # batch returns, so that the next one sees the step (a single-peer stage then
        # computes exactly what one process would).
        if alone and self.optimizer.samples >= self.target:
            self._step_own_locked()
            return True
        return False

    def begin(self) -> Contribution:
        """Move the accumulated gradients out of ``.grad``: micro-batches that arrive from
        now on count toward the next epoch."""
        with self.lock:
            n, sums = self.optimizer.take_accumulated()
            self._round_samples = n
        means = [
            torch.zeros(p.shape) if g is None or n == 0 else (g / n).float().cpu()
            for p, g in zip(self.params, sums, strict=True)
        ]
        if self.settings.speculate and n and all(bool(m.isfinite().all()) for m in means):
            # Serve the round's duration on our own step; ``finish`` or ``give_back``
            # goes back to the parameters before it.
            with self.lock:
                self._before = self.optimizer.snapshot()
                self.optimizer.step_with_mean(means)
        if not self.compressed:
            return Contribution(weight=n, tensors=means, sums=sums)
        # compressed: one flat vector, the residual in it (not with no samples: weight 0
        # carries nothing), rounded to 8 bits per block of the wire format.
        pending = torch.cat([m.reshape(-1) for m in means])
        if n:
            pending += self._residual
        sent = sparsify.round_to_grid(pending, block=sparsify.CODEC_BLOCK)
        return Contribution(weight=n, tensors=[sent], sums=sums, pending=pending)

    def step_alone(self) -> bool:
        with self.lock:
            if self.optimizer.samples < self.target:  # stepped already
                return False
            self._step_own_locked()
            return True

    def digest_tensors(self) -> list[torch.Tensor]:
        return self.params

    def _step_own_locked(self) -> None:
        self.stats.samples += self.optimizer.samples
        self.optimizer.step()
        self.epoch += 1
        self.stats.alone += 1

    def _apply_locked(self, result: Sequence[torch.Tensor], contribution: Contribution) -> None:
        """The step on the averaged mean gradients (compressed: one flat vector, and the
        residual becomes what our rounding left out of what we sent)."""
        self._unspeculate_locked()
        if self.compressed:
            (averaged,) = result
            result = [
                m.reshape(p.shape)
                for m, p in zip(averaged.float().split(self._numels), self.params, strict=True)
            ]
            if contribution.weight:
                self._residual = contribution.pending - contribution.tensors[0]
        self.optimizer.step_with_mean(result)
        self._round_samples = 0

    def _give_back_locked(self, contribution: Contribution) -> None:
        # The residual is unchanged: the next round's contribution holds it again.
        self._unspeculate_locked()
        self.optimizer.restore_accumulated(contribution.weight, contribution.sums)
        self._round_samples = 0

    def _forgo_locked(self, contribution: Contribution) -> None:
        self._unspeculate_locked()
        self._round_samples = 0
        self._residual.zero_()  # of a copy whose state the download replaces

    def _loaded_locked(self, state: StageState) -> None:
        self._before = None  # the downloaded state replaces the speculative step
        self._residual.zero_()

    def _unspeculate_locked(self) -> None:
        """Back to the parameters and optimizer state before the speculative step (if one
        was taken): every copy then takes the round's step from the same state."""
        if self._before is not None:
            self.optimizer.restore(self._before)
            self._before = None


class DiLoCoStrategy(Strategy):
    """Inner AdamW steps alone; rounds average parameter deltas for an outer Nesterov step."""

    mode = "diloco"
    shares_batch = False

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        s = self.settings
        # inner samples and the round in flight; without overlap, inner steps wait for it
        self._rounds = OuterRound(overlap=s.overlap)
        self._anchor = [p.detach().clone() for p in self.params]  # at the last outer step
        self._outer = torch.optim.SGD(
            self._anchor, lr=s.outer_lr, momentum=s.outer_momentum, nesterov=True
        )
        self.compressed = s.density < 1.0 or s.compression == "uint8"
        self._size = sum(p.numel() for p in self.params)
        # What this copy did not send yet (flat, float32): its own, never shipped.
        self._residual = torch.zeros(self._size if self.compressed else 0)
        # The parameters the round in flight took its delta from, once it is overdue
        # (``overdue``): its outer step keeps the inner steps taken since.
        self._late_snapshot: list[torch.Tensor] | None = None

    @property
    def residual(self) -> torch.Tensor:
        """What this copy held and has not sent yet (flat; empty unless ``compressed``)."""
        return self._residual

    @property
    def shapes(self) -> list[torch.Size]:
        if not self.compressed:
            return super().shapes
        return [torch.Size([sparsify.sent_count(self._size, self.settings.density)])]

    @property
    def target(self) -> int:
        return self.batch * self.settings.inner_steps

    def pending(self) -> int:
        return self._rounds.pending

    @property
    def in_flight(self) -> bool:
        """An outer round took its contribution and has not ended."""
        return self._rounds.in_flight

    @property
    def holding(self) -> bool:
        """An outer round is in flight and holds new micro-batches (no ``overlap``, not
        overdue yet)."""
        return not self._rounds.overlapped

    def admission(self, mine: int, same: Sequence[Progress], busy: bool) -> Admission:
        """Inner steps are this copy's own batches: FULL while one is complete and not yet
        stepped on, or (without overlap) an outer round is in flight and not overdue."""
        admits = self._rounds.admits(mine - self.pending(), self.batch)
        return Admission.OPEN if admits else Admission.FULL

    def overdue(self) -> None:
        """The outer round in flight held a micro-batch too long: it is overlapped from now
        on (``OuterRound.overdue``), from a snapshot of the parameters taken now (still
        those its delta was taken from); a complete batch that waited for it steps now."""
        with self.lock:
            if self._rounds.overdue():
                self._late_snapshot = [p.detach().clone() for p in self.params]
                if self._rounds.may_step(self.optimizer.samples, self.batch):
                    self._inner_step_locked()

    def on_accumulated_locked(self, alone: bool) -> bool:
        if self._rounds.may_step(self.optimizer.samples, self.batch):
            self._inner_step_locked()
        return False

    def begin(self) -> Contribution:
        """Our delta from the anchor (compressed: the coordinates of it this epoch sends);
        without overlap, inner steps wait until the round ends."""
        return self._begin(sparse=True)

    def _begin(self, sparse: bool) -> Contribution:
        with self.lock:
            weight = self._rounds.begin()
            deltas = [
                (a - p.detach()).float().cpu()
                for a, p in zip(self._anchor, self.params, strict=True)
            ]
            snapshot = [p.detach().clone() for p in self.params] if self.settings.overlap else None
            if not self.compressed:
                return Contribution(weight=weight, tensors=deltas, sums=[], snapshot=snapshot)
            pending = torch.cat([d.reshape(-1) for d in deltas])  # the residual included
        if not sparse:  # stepping alone: everything we hold, unrounded
            return Contribution(
                weight, [pending], [], pending=pending, indices=None, snapshot=snapshot
            )
        seed = sparsify.round_seed(self.salt, self.epoch)
        indices = sparsify.choose_indices(self._size, self.settings.density, seed)
        values = sparsify.gather(pending, indices)
        if self.settings.compression == "uint8":
            values = sparsify.round_to_grid(values)
        return Contribution(
            weight, [values], [], pending=pending, indices=indices, snapshot=snapshot
        )

    def step_alone(self) -> bool:
        """Alone, nothing travels: the whole delta (and residual) steps."""
        contribution = self._begin(sparse=False)
        self.finish(contribution.tensors, contribution)
        self.stats.alone += 1
        return True

    def digest_tensors(self) -> list[torch.Tensor]:
        return self._anchor

    def momentum(self) -> list[torch.Tensor] | None:
        if not self._outer.state:
            return None
        return [self._outer.state[a]["momentum_buffer"] for a in self._anchor]

    def _inner_step_locked(self) -> None:
        self._rounds.stepped(self.optimizer.samples)
        self.optimizer.step()
        self.stats.inner_steps += 1

    @torch.no_grad()
    def _apply_locked(self, result: Sequence[torch.Tensor], contribution: Contribution) -> None:
        """One outer Nesterov step on the anchor with the averaged delta (compressed: zero
        where nothing was sent); the parameters become the new anchor (compressed: minus
        our residual, what we held and did not send), plus, with overlap, the progress of
        the inner steps taken since the contribution's snapshot."""
        if self.compressed:
            result = self._expand(result, contribution)
        for a, d in zip(self._anchor, result, strict=True):
            a.grad = d.to(a.device, a.dtype)
        self._outer.step()
        self._outer.zero_grad(set_to_none=True)
        # Each copy goes on from the new anchor, plus (compressed) its unsent progress, plus
        # (overlap) what it stepped on since the round took its delta.
        kept = self._residual.split(self._numels()) if self.compressed else None
        late = self._late_snapshot
        snapshot = late if contribution.snapshot is None else contribution.snapshot
        for i, (p, a) in enumerate(zip(self.params, self._anchor, strict=True)):
            target = a if kept is None else a - kept[i].reshape(a.shape).to(a.device, a.dtype)
            if snapshot is None:
                p.copy_(target)
            else:
                p.add_(target - snapshot[i])
        self._late_snapshot = None
        self._rounds.finished()
        if self._rounds.may_step(self.optimizer.samples, self.batch):  # what waited meanwhile
            self._inner_step_locked()

    def _expand(self, result: Sequence[torch.Tensor], contribution: Contribution) -> list:
        """The averaged vector as one dense delta per parameter; the residual becomes what
        ``contribution`` held and did not send."""
        (averaged,) = result
        sent, indices = contribution.tensors[0], contribution.indices
        if indices is None:  # everything was sent (stepping alone)
            dense = averaged.float()
            self._residual = contribution.pending - sent
        else:
            dense = sparsify.scatter(averaged.float(), indices, self._size)
            self._residual = contribution.pending - sparsify.scatter(sent, indices, self._size)
        return [
            d.reshape(a.shape)
            for d, a in zip(dense.split(self._numels()), self._anchor, strict=True)
        ]

    def _numels(self) -> list[int]:
        return [a.numel() for a in self._anchor]

    def _give_back_locked(self, contribution: Contribution) -> None:
        # The anchor and residual are unchanged: the next delta holds all of this one, and
        # (overlap) the progress since its snapshot.
        self._late_snapshot = None
        self._rounds.given_back(contribution.weight)

    def _forgo_locked(self, contribution: Contribution) -> None:
        self._late_snapshot = None
        self._rounds.given_back(0)  # its samples are in the steps of the copies that took it

    def _shipped_params(self) -> list[torch.Tensor] | None:
        return self._anchor  # the parameters all copies agreed on, not our inner progress

    @torch.no_grad()
    def _loaded_locked(self, state: StageState) -> None:
        for a, t in zip(self._anchor, state.params, strict=True):
            a.copy_(t)
        self._outer.state.clear()
        if state.momentum is not None:
            for a, m in zip(self._anchor, state.momentum, strict=True):
                self._outer.state[a] = {"momentum_buffer": m.to(a.device, a.dtype).clone()}
        self._rounds.loaded()
        self._late_snapshot = None
        self._residual.zero_()  # deltas from an anchor we left: the state holds our rounds


STRATEGIES: dict[str, type[Strategy]] = {s.mode: s for s in (GradientStrategy, DiLoCoStrategy)}


def make_strategy(
    module: Stage,
    optimizer: StageOptimizer,
    lock: threading.Lock,
    settings: AveragingSpec,
    stats: AveragingStats,
    *,
    salt: str = "",
) -> Strategy:
    """The strategy of ``settings.mode``; ``salt`` names the run and stage (the copies of
    a stage must agree on it: it seeds the coordinates a compressed round sends)."""
    return STRATEGIES[settings.mode](module, optimizer, lock, settings, stats, salt=salt)
