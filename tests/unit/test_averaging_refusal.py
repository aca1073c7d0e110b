"""What a sender makes of the means its groupmates return (``check_returned``) given its
weight's share of the group (``weight_share``, ``honest_cosine``), and when a reducer is
refused (``ReducerRecord``): honest means of a part of few samples beside many pass, a
negated or scaled mean still fails for the groupmates of most weight."""

from __future__ import annotations

import copy
import math
import time
from types import SimpleNamespace

import torch

from models.config import OptimizerConfig
from models.data import sample_batches
from models.stages import Stage
from models.training import StageOptimizer
from protocol.averaging import (
    AGAINST_COSINE,
    OTHERS_COSINE,
    REFUSED_S,
    STRIKE_ROUNDS,
    STRIKES,
    ReducerRecord,
    Refusal,
    ReturnedShare,
    check_returned,
    honest_cosine,
    weight_share,
)
from tests.averaging_peer import CFG

FEW, MANY = 1, 31  # samples of the two peers' contributions


def _share(mine: torch.Tensor, averaged: torch.Tensor) -> ReturnedShare:
    share = ReturnedShare()
    share.add(mine, averaged)
    return share


def _flat_grad(stage: Stage, samples: int) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in stage.parameters()]) / samples


def _speculating_pair(corpus, rounds: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per round, the mean gradients of two copies of a small model (the whole of ``CFG``)
    on text: one of ``FEW`` samples, one of ``MANY``, each computed after the copy took a
    speculative step on its own previous micro-batch (``averaging.speculate``), so the
    copies lie a little apart; between rounds the model trains on."""
    torch.manual_seed(0)
    optim = OptimizerConfig(lr=1e-2, warmup_steps=0)
    model = Stage(CFG)
    optimizer = StageOptimizer(model, optim)
    batches = sample_batches(corpus.train, CFG.block_size, FEW + MANY, 0)
    pairs = []
    for _ in range(rounds):
        x, y = next(batches)
        previous_x, previous_y = next(batches)
        grads = []
        for part in (slice(0, FEW), slice(FEW, FEW + MANY)):
            stage, opt = copy.deepcopy((model, optimizer))
            n = part.stop - part.start
            (stage(previous_x[part], previous_y[part]) * n).backward()  # the speculative step
            opt.accumulated(n)
            opt.step()
            stage.zero_grad()
            (stage(x[part], y[part]) * n).backward()
            grads.append(_flat_grad(stage, n))
        pairs.append((grads[0], grads[1]))
        model.zero_grad()
        (model(x[:8], y[:8]) * 8).backward()
        optimizer.accumulated(8)
        optimizer.step()
    return pairs


def test_honest_means_of_few_samples_beside_many_pass_and_wrong_ones_fail(corpus):
    """Two peers (1:31 samples, copies a little apart) split the vector in two shares.
    Without its weight's share, the check of the peer of few samples refuses some honest
    means (too far from its sparse part, or pointing against it); with it, none, and the
    peer of many refuses none either. The peer of many still refuses every negated mean
    (a strike) and bans every mean scaled -100x; the peer of few refuses most of those."""
    few_share, many_share = weight_share(FEW, [MANY]), weight_share(MANY, [FEW])
    assert math.isclose(few_share, FEW / (FEW + MANY))
    unaware, negated_few, scaled_few, checks = 0, 0, 0, 0
    for few, many in _speculating_pair(corpus, 16):
        mean = (FEW * few + MANY * many) / (FEW + MANY)
        parts = [t.tensor_split(2) for t in (few, many, mean)]
        for ours in (0, 1):  # the share we reduced ourselves; the other reduces the other
            theirs = 1 - ours
            (f, f_own), (m, m_own), (avg, avg_own) = ((p[theirs], p[ours]) for p in parts)
            checks += 1
            unaware += check_returned(_share(f, avg), _share(f_own, avg_own)) is not None
            assert check_returned(_share(f, avg), _share(f_own, avg_own), few_share) is None
            assert check_returned(_share(m, avg), _share(m_own, avg_own), many_share) is None

            negated = check_returned(_share(m, -avg), _share(m_own, avg_own), many_share)
            assert negated is not None and not negated.ban
            scaled = check_returned(_share(m, -100 * avg), _share(m_own, avg_own), many_share)
            assert scaled is not None and scaled.ban
            negated_few += (
                check_returned(_share(f, -avg), _share(f_own, avg_own), few_share) is not None
            )
            scaled_few += (
                check_returned(_share(f, -100 * avg), _share(f_own, avg_own), few_share) is not None
            )
    assert unaware >= 1, "the reproduction lost its honest refusals"
    assert scaled_few >= 0.75 * checks, (scaled_few, checks)
    assert negated_few >= 1


def test_weight_share_counts_weights_as_robust_mean_does():
    assert weight_share(1, [31]) == 1 / 32
    assert weight_share(3, [1, 0, math.nan, -1]) == 3 / 4  # unusable or zero: not counted
    # Three or more: a weight counts at most CLIP_WEIGHT (2) times the median (1).
    assert weight_share(1, [1, 100]) == 1 / 4
    assert weight_share(100, [1, 1]) == 2 / 4
    assert weight_share(0, [5]) == 0.0
    assert weight_share(0, [0]) is None


def test_honest_cosine_is_the_noise_model_bound():
    """Parts whose norms scale as 1 / sqrt(weight), the others' mean at ``OTHERS_COSINE``
    from ours: the weighted mean's cosine with ours is ``honest_cosine`` of our share; it
    rises from ``OTHERS_COSINE`` (no weight of ours) to 1 (all of it)."""
    g = torch.Generator().manual_seed(0)
    u, z = torch.randn(2, 1000, generator=g, dtype=torch.float64)
    u = u / u.norm()
    z = z - (z @ u) * u
    v = OTHERS_COSINE * u + math.sqrt(1 - OTHERS_COSINE**2) * z / z.norm()
    for w, total in [(1, 32), (1, 4), (1, 2), (3, 4)]:
        x, others = u / math.sqrt(w), v / math.sqrt(total - w)
        mean = (w * x + (total - w) * others) / total
        cosine = float(mean @ x / (mean.norm() * x.norm()))
        assert math.isclose(cosine, honest_cosine(w / total), abs_tol=1e-9)
    assert math.isclose(honest_cosine(0.0), OTHERS_COSINE)
    assert math.isclose(honest_cosine(1.0), 1.0)
    assert honest_cosine(0.5) > AGAINST_COSINE  # equal weights: the usual floor holds
    assert all(honest_cosine(a / 10) < honest_cosine((a + 1) / 10) for a in range(10))


def test_a_reducer_is_refused_at_once_or_after_strikes_in_distinct_rounds():
    strike = Refusal("against", ban=False)
    record = ReducerRecord()
    for attempt in range(5):  # one round's retries count once
        assert not record.reduced("r0", strike, now=attempt)
    assert not record.reduced("r1", None, now=10)
    assert not record.reduced("r2", strike, now=11)
    assert not record.idle(11)
    assert record.reduced("r3", strike, now=12)  # the third refused round of the last ten
    assert record.refuses(12 + REFUSED_S - 1) and not record.refuses(12 + REFUSED_S)
    assert record.idle(12 + REFUSED_S)

    spaced = ReducerRecord()  # refusals further apart than the window: never refused
    for r in range(5 * STRIKE_ROUNDS):
        refused = strike if r % (STRIKE_ROUNDS // (STRIKES - 1)) == 0 else None
        assert not spaced.reduced(f"r{r}", refused, now=r)
    for r in range(STRIKE_ROUNDS):
        spaced.reduced(f"later{r}", None, now=1000)
    assert spaced.idle(1000)

    banned = ReducerRecord()
    assert banned.reduced("r0", Refusal("non-finite", ban=True), now=0)
    assert banned.refuses(REFUSED_S - 1)


def test_an_averager_keeps_reducer_records_of_past_groupmates_within_bounds(monkeypatch):
    """A groupmate's record as a reducer is dropped once it holds nothing (after any round,
    not only one it reduced in), and past ``MAX_REDUCERS`` the oldest records of a refusal
    or two go; a refused groupmate is always kept."""
    from hivemind.p2p import PeerID

    from node.averaging import process
    from protocol.averaging import ReducerRecord

    monkeypatch.setattr(process, "MAX_REDUCERS", 3)
    averager = SimpleNamespace(_round="r")  # what the check reads of the averager
    peers = [PeerID(bytes([i]) * 8) for i in range(7)]
    now = time.monotonic()
    averager._reducers = {
        peers[0]: ReducerRecord(),  # idle: nothing to remember
        peers[1]: ReducerRecord(until=now + 600.0),  # refused
        **{peer: ReducerRecord(rounds={"old": True}) for peer in peers[2:]},  # one refusal
    }
    assert process.StageAveragerProcess.check_returned(averager, None, {}) == {}
    assert list(averager._reducers) == [peers[1], peers[5], peers[6]]
