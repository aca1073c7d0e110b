"""The two averaging strategies (gradient, DiLoCo) through their one interface, and
``StageOptimizer``'s explicit mean-gradient step, in this process: no averager, no DHT.

A round is driven as the round loop drives it: ``begin`` takes the contribution, then
``finish`` applies a result (here: our own contribution, as a peer stepping alone after a
failed round does) or ``give_back`` returns it."""

from __future__ import annotations

import threading

import pytest
import torch

from models.stages import Stage
from models.training import StageOptimizer
from node.averaging import state as stage_state
from node.averaging.strategies import (
    AveragingStats,
    DiLoCoStrategy,
    GradientStrategy,
    Strategy,
    make_strategy,
)
from node.pipeline.server import Admission
from protocol.averaging import Progress
from tests.averaging_peer import CFG, MICRO, STAGE, TARGET, backward, make_spec

INNER_STEPS = 2


def _stage(spec) -> Stage:
    torch.manual_seed(0)  # every copy starts from the same weights
    return Stage(CFG, spec.stage_range(STAGE))


def _strategy(mode: str, **averaging) -> Strategy:
    spec = make_spec(f"strategy-{mode}", mode=mode, inner_steps=INNER_STEPS, **averaging)
    module = _stage(spec)
    optimizer = StageOptimizer(module, spec.optim)
    return make_strategy(module, optimizer, threading.Lock(), spec.averaging, AveragingStats())


def _feed(strategy: Strategy, seeds, alone: bool = False) -> list[bool]:
    """Micro-batches as a stage server serves them; whether each stepped to a new epoch."""
    stepped = []
    for seed in seeds:
        with strategy.lock:
            strategy.optimizer.accumulated(backward(strategy.module, seed))
            stepped.append(strategy.on_accumulated_locked(alone))
    return stepped


def _params(strategy: Strategy) -> list[torch.Tensor]:
    return [p.detach().clone() for p in strategy.params]


def _reference_step(mode: str, seeds) -> list[torch.Tensor]:
    """One process: plain ``StageOptimizer.step`` every target batch (DiLoCo: its inner
    steps), from the same initial weights."""
    spec = make_spec(f"strategy-{mode}", mode=mode, inner_steps=INNER_STEPS)
    module = _stage(spec)
    optimizer = StageOptimizer(module, spec.optim)
    for i, seed in enumerate(seeds):
        optimizer.accumulated(backward(module, seed))
        if (i + 1) % (TARGET // MICRO) == 0:
            optimizer.step()
    return [p.detach().clone() for p in optimizer.params]


def _equal(a: list[torch.Tensor], b: list[torch.Tensor], atol: float = 0.0) -> bool:
    return all(torch.allclose(x, y, rtol=0, atol=atol) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("mode", ["gradient", "diloco"])
def test_a_round_on_our_own_contribution_is_one_epoch_and_settles_once(mode):
    s = _strategy(mode)
    assert type(s) is {"gradient": GradientStrategy, "diloco": DiLoCoStrategy}[mode]
    assert s.target == TARGET * (INNER_STEPS if mode == "diloco" else 1)
    start = _params(s)
    seeds = range(s.target // MICRO)
    assert not any(_feed(s, seeds))  # not alone: no step to a new epoch without a round
    contribution = s.begin()
    assert contribution.weight == s.target and not contribution.settled
    assert s.finish(contribution.tensors, contribution)
    assert s.epoch == 1 and s.stats.samples == s.target and s.pending() == 0
    assert not s.finish(contribution.tensors, contribution)  # settled: never twice
    s.give_back(contribution)  # a no-op once applied
    assert s.epoch == 1 and s.optimizer.samples == 0

    if mode == "gradient":
        # Averaging with nobody else: the step one process takes on the same samples.
        assert _equal(_params(s), _reference_step(mode, seeds), atol=1e-7)
    else:
        # Inner steps alone, then the first outer Nesterov step on our own delta.
        inner = _reference_step(mode, seeds)
        assert s.stats.inner_steps == INNER_STEPS
        lr, mom = s.settings.outer_lr, s.settings.outer_momentum
        expected = [a - lr * (1 + mom) * (a - b) for a, b in zip(start, inner, strict=True)]
        assert _equal(_params(s), expected, atol=1e-6)
        assert _equal(_params(s), s.digest_tensors())  # the parameters are the new anchor
        assert s.momentum() is not None


@pytest.mark.parametrize("mode", ["gradient", "diloco"])
def test_a_failed_round_gives_everything_back(mode):
    s = _strategy(mode)
    _feed(s, range(s.target // MICRO))
    before, taken = _params(s), s.optimizer.samples + s.pending()
    contribution = s.begin()
    _feed(s, [99])  # served during the round: counts toward the next epoch
    if mode == "gradient":
        assert s.pending() == taken and s.optimizer.samples == MICRO
        assert s.admission(s.pending() + s.optimizer.samples, [], busy=True) is Admission.FULL
    else:
        assert s.admission(s.pending() + s.optimizer.samples, [], busy=False) is Admission.FULL
    s.give_back(contribution)
    assert contribution.settled and s.epoch == 0 and s.stats.samples == 0
    assert _equal(_params(s), before)  # no step
    assert s.pending() + s.optimizer.samples == taken + MICRO  # no sample lost
    if mode == "gradient":
        # The sums went back into .grad: the next step takes all of them.
        reference = _strategy(mode)
        _feed(reference, [*range(s.target // MICRO), 99])
        assert _equal([p.grad for p in s.params], [p.grad for p in reference.params], 1e-6)
    else:
        assert s.admission(s.pending() + s.optimizer.samples, [], busy=False) is Admission.OPEN


@pytest.mark.parametrize("mode", ["gradient", "diloco"])
def test_a_forgone_round_ends_with_no_step_and_nothing_given_back(mode):
    """A forked copy whose group averaged forgoes the round (it downloads a copy that took
    the step): its contribution's samples are in that step, so none come back to count
    again, the round is over, and what was served meanwhile stays for the next epoch."""
    s = _strategy(mode)
    _feed(s, range(s.target // MICRO))
    before = _params(s)
    contribution = s.begin()
    _feed(s, [99])  # served during the round
    s.forgo(contribution)
    assert contribution.settled and s.epoch == 0 and s.stats.samples == 0
    assert _equal(_params(s), before)  # no step of its own
    assert s.pending() + s.optimizer.samples == MICRO  # only the one served meanwhile
    s.give_back(contribution)  # a no-op once forgone
    assert s.pending() + s.optimizer.samples == MICRO
    metadata, tensors = _strategy(mode).capture("donor")  # the copy it then catches up to
    s.apply_state(stage_state.parse(metadata, tensors, s.module, mode=s.mode))
    if mode == "diloco":  # no round in flight: the copy admits and steps again
        assert s.admission(s.pending() + s.optimizer.samples, [], busy=False) is Admission.OPEN


def test_shipped_bytes_counts_the_state_a_peer_downloads():
    for mode in ("gradient", "diloco"):
        s = _strategy(mode)
        _feed(s, range(s.target // MICRO))
        contribution = s.begin()
        s.finish(contribution.tensors, contribution)  # the optimizers now hold their state
        _, tensors = s.capture("me")
        moments = sum(t.numel() * t.element_size() for t in tensors if t.dim() > 0)
        assert stage_state.shipped_bytes(s.module, mode) == moments


@pytest.mark.parametrize("mode", ["gradient", "diloco"])
def test_a_captured_state_makes_an_equal_copy(mode):
    donor, joiner = _strategy(mode), _strategy(mode)
    _feed(donor, range(donor.target // MICRO))
    contribution = donor.begin()
    donor.finish(contribution.tensors, contribution)
    donor.lineage = 42  # a copy forked in a fallback: the joiner's is the same copy
    metadata, tensors = donor.capture("donor")
    state = stage_state.parse(metadata, tensors, joiner.module, mode=joiner.mode)
    joiner.apply_state(state)
    assert joiner.epoch == donor.epoch == 1 and state.source == "donor"
    assert joiner.lineage == 42
    del metadata["lineage"]  # an older peer's state: lineage 0
    assert stage_state.parse(metadata, tensors, joiner.module, mode=joiner.mode).lineage == 0
    assert _equal(joiner.digest_tensors(), donor.digest_tensors())
    assert joiner.optimizer.step_count == donor.optimizer.step_count
    if mode == "diloco":
        assert _equal(joiner.momentum(), donor.momentum())
    with pytest.raises(stage_state.StateError, match="mode"):
        other = "diloco" if mode == "gradient" else "gradient"
        stage_state.parse(metadata, tensors, joiner.module, mode=other)


def test_only_the_gradient_strategy_steps_alone_as_a_micro_batch_completes_the_batch():
    gradient, diloco = _strategy("gradient"), _strategy("diloco")
    assert _feed(gradient, range(TARGET // MICRO), alone=True) == [False, False, False, True]
    assert gradient.epoch == 1 and gradient.stats.alone == 1
    assert not gradient.step_alone()  # stepped already: nothing due
    assert not any(_feed(diloco, range(TARGET // MICRO), alone=True))
    assert diloco.epoch == 0 and diloco.stats.inner_steps == 1
    assert diloco.step_alone() and diloco.epoch == 1 and diloco.stats.alone == 1


def test_gradient_admission_counts_the_peers_at_our_epoch():
    s = _strategy("gradient")
    half = [Progress("a", 0, TARGET // 2)]
    assert s.admission(0, [], busy=False) is Admission.OPEN
    assert s.admission(TARGET // 2, half, busy=False) is Admission.FULL  # together: the batch
    assert s.admission(TARGET // 2, [Progress("a", 0, 0)], busy=False) is Admission.SHARE
    assert s.admission(MICRO, [Progress("a", 0, 10**9)], busy=False) is Admission.FULL  # capped


def test_an_emptied_contribution_weighs_nothing():
    s = _strategy("gradient")
    _feed(s, range(2))
    empty = s.begin().emptied()
    assert empty.weight == 0 and all(float(t.abs().sum()) == 0 for t in empty.tensors)
    s.give_back(empty)
    assert s.optimizer.samples == 0 and all(p.grad is None for p in s.params)


def test_step_with_mean_is_step_on_the_mean_and_keeps_what_accumulated():
    """``step_with_mean(sums / n)`` takes the step ``step()`` takes on ``n`` accumulated
    samples, and leaves gradients accumulated since (``.grad``, ``samples``) in place;
    ``take_accumulated`` / ``restore_accumulated`` move them out and back."""
    spec = make_spec("step-with-mean")
    plain, explicit = (StageOptimizer(_stage(spec), spec.optim) for _ in range(2))
    for seed in range(3):
        plain.accumulated(backward(plain.module, seed))
        explicit.accumulated(backward(explicit.module, seed))
    plain.step()

    n, sums = explicit.take_accumulated()
    assert n == 3 * MICRO and explicit.samples == 0
    assert all(p.grad is None for p in explicit.params)
    explicit.accumulated(backward(explicit.module, 7))  # arrives while the round runs
    pending = [p.grad.clone() for p in explicit.params]
    explicit.step_with_mean([g / n for g in sums])
    assert explicit.step_count == plain.step_count == 1
    assert _equal(explicit.params, plain.params, atol=1e-7)
    assert explicit.samples == MICRO
    assert _equal([p.grad for p in explicit.params], pending)

    explicit.restore_accumulated(n, sums)  # a failed round's sums come back
    assert explicit.samples == MICRO + n
    assert _equal(
        [p.grad for p in explicit.params], [a + b for a, b in zip(pending, sums, strict=True)]
    )
    with pytest.raises(ValueError, match="mean gradients"):
        explicit.step_with_mean(sums[:-1])  # one mean per trainable parameter
    assert explicit.step_count == 1 and explicit.samples == MICRO + n


def _flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in tensors])


@pytest.mark.parametrize("compressed", [False, True])
def test_an_overlapped_round_keeps_the_inner_steps_taken_meanwhile(compressed):
    """With overlap a copy takes inner steps while its round runs; the outer step lands on
    the same anchor as without overlap (what the copies agree on), and the parameters are
    that anchor (minus the residual, compressed) plus the progress since the snapshot."""
    settings = {"density": 0.5, "compression": "uint8"} if compressed else {}
    s, plain = _strategy("diloco", overlap=True, **settings), _strategy("diloco", **settings)
    seeds = range(s.target // MICRO)
    _feed(s, seeds)
    _feed(plain, seeds)
    contribution, plain_contribution = s.begin(), plain.begin()
    snapshot = _params(s)
    assert s.admission(s.pending() + s.optimizer.samples, [], busy=True) is Admission.OPEN
    _feed(s, range(100, 100 + TARGET // MICRO))  # one more inner batch, during the round
    assert s.stats.inner_steps == INNER_STEPS + 1 and s.pending() == s.target + TARGET
    progress = [p - q for p, q in zip(_params(s), snapshot, strict=True)]
    assert float(_flat(progress).abs().sum()) > 0

    assert s.finish(contribution.tensors, contribution)
    plain.finish(plain_contribution.tensors, plain_contribution)
    assert s.epoch == 1 and s.stats.samples == s.target and s.pending() == TARGET
    assert _equal(s.digest_tensors(), plain.digest_tensors())  # the agreed anchor
    kept = s.residual if compressed else torch.zeros(0)
    expected = _flat(s.digest_tensors()) - (kept if compressed else 0) + _flat(progress)
    assert torch.allclose(_flat(s.params), expected, rtol=0, atol=1e-6)
    assert _equal(plain.residual, s.residual)


def test_a_failed_overlapped_round_gives_back_its_samples_and_keeps_the_progress():
    s = _strategy("diloco", overlap=True)
    anchor = [t.clone() for t in s.digest_tensors()]
    _feed(s, range(s.target // MICRO))
    contribution = s.begin()
    _feed(s, range(100, 100 + TARGET // MICRO))
    current = _params(s)
    s.give_back(contribution)
    assert contribution.settled and s.epoch == 0 and s.stats.samples == 0
    assert _equal(_params(s), current) and _equal(s.digest_tensors(), anchor)
    assert s.pending() == s.target + TARGET  # no sample lost
    again = s.begin()  # the next round's delta holds both rounds' inner steps
    assert again.weight == s.target + TARGET
    delta = [a - p for a, p in zip(anchor, current, strict=True)]
    assert _equal(again.tensors, delta, atol=1e-7)
    s.give_back(again)


def test_an_overlapped_copy_that_loads_a_state_drops_its_inner_progress():
    donor, s = _strategy("diloco", overlap=True), _strategy("diloco", overlap=True)
    _feed(s, range(TARGET // MICRO))
    assert s.pending() == TARGET
    metadata, tensors = donor.capture("donor")
    s.apply_state(stage_state.parse(metadata, tensors, s.module, mode="diloco"))
    assert s.pending() == 0 and _equal(_params(s), donor.digest_tensors())
    assert not s.in_flight and s.begin().weight == 0


def test_a_diloco_round_that_held_a_micro_batch_too_long_goes_on_overlapped():
    """Overdue, a round without ``overlap`` admits and steps as an overlapped one does, and
    its outer step keeps those inner steps: the parameters end where an overlapped copy's
    do on the same micro-batches."""
    late, overlapped = _strategy("diloco"), _strategy("diloco", overlap=True)
    for s in (late, overlapped):
        _feed(s, range(s.target // MICRO))
    taken = [s.begin() for s in (late, overlapped)]
    assert late.admission(late.pending() + late.optimizer.samples, [], busy=True) is (
        Admission.FULL
    )
    late.overdue()
    during = range(100, 100 + 2 * late.batch // MICRO)  # two inner steps' batches
    for s in (late, overlapped):
        assert s.admission(s.pending() + s.optimizer.samples, [], busy=True) is Admission.OPEN
        _feed(s, during)
        assert s.stats.inner_steps == INNER_STEPS + 2
    for s, contribution in zip((late, overlapped), taken, strict=True):
        s.finish(contribution.tensors, contribution)
    assert _equal(_params(late), _params(overlapped), atol=1e-6)
    assert late.pending() == overlapped.pending() == 2 * late.batch  # toward the next round
    gradient = _strategy("gradient")
    _feed(gradient, range(gradient.target // MICRO))
    gradient.overdue()  # gradient mode holds the next one again
    assert gradient.admission(gradient.optimizer.samples, [], busy=True) is Admission.FULL


def test_a_speculative_copy_serves_its_own_step_then_takes_the_rounds_exactly():
    """With ``speculate`` a copy steps on its own gradients when its round begins (and
    serves on those parameters: micro-batches then accumulate toward the next step); the
    round's result is then applied from the state before that step, so the copy ends where
    a copy that never speculated ends, bitwise. A failed round goes back to that state."""
    plain, spec = _strategy("gradient"), _strategy("gradient", speculate=True, max_staleness=1)
    seeds = range(TARGET // MICRO)
    for s in (plain, spec):
        _feed(s, seeds)
    start = _params(spec)
    contributions = [s.begin() for s in (plain, spec)]
    assert _equal(_params(plain), start)
    assert not _equal(_params(spec), start)  # it serves on its own step meanwhile
    _feed(spec, [100])  # a micro-batch served during the round: the next step's
    mean = [(a + b) / 2 for a, b in zip(*(c.tensors for c in contributions), strict=True)]
    for s, c in zip((plain, spec), contributions, strict=True):
        assert s.finish(mean, c)
    assert _equal(_params(spec), _params(plain))
    assert spec.optimizer.samples == MICRO and spec.optimizer.step_count == 1

    failed = _strategy("gradient", speculate=True, max_staleness=1)
    _feed(failed, seeds)
    before = _params(failed)
    c = failed.begin()
    assert not _equal(_params(failed), before)
    failed.give_back(c)
    assert _equal(_params(failed), before)
    assert failed.optimizer.samples == TARGET and failed.optimizer.step_count == 0


def test_speculation_needs_gradient_mode_and_max_staleness_1():
    with pytest.raises(ValueError, match="speculate needs averaging.mode gradient"):
        make_spec("spec-diloco", mode="diloco", speculate=True, max_staleness=1)
    with pytest.raises(ValueError, match="max_staleness 1"):
        make_spec("spec-s0", speculate=True)
