"""The per-part checks of an averaging round take one pass over a part (``max_abs``) and
float32 products (``ReturnedShare``), and still catch what they caught."""

from __future__ import annotations

import math

import torch

from protocol.averaging import (
    MAX_ABS_CONTRIBUTION,
    ReturnedShare,
    check_returned,
    max_abs,
    within_bounds,
)


def test_max_abs_tells_finiteness_and_range_in_one_pass():
    assert max_abs(torch.tensor([1.0, -3.0, 2.0])) == 3.0
    assert max_abs(torch.tensor([])) == 0.0
    assert math.isnan(max_abs(torch.tensor([1.0, float("nan"), 5.0])))
    assert max_abs(torch.tensor([1.0, float("-inf")], dtype=torch.float16)) == math.inf
    assert within_bounds([torch.zeros(3), torch.tensor([MAX_ABS_CONTRIBUTION])])
    assert not within_bounds([torch.tensor([float("nan")])])
    assert not within_bounds([torch.tensor([2 * MAX_ABS_CONTRIBUTION])])


def _reference(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[float, float, float]:
    mine = torch.cat([m for m, _ in parts]).double()
    back = torch.cat([r for _, r in parts]).double()
    return float(mine @ mine), float((back - mine) @ (back - mine)), float(back @ mine)


def test_returned_share_sums_match_double_precision():
    g = torch.Generator().manual_seed(0)
    parts = []
    share = ReturnedShare()
    for _ in range(4):
        mine = torch.randn(100_000, generator=g)
        back = mine + 0.3 * torch.randn(100_000, generator=g)
        parts.append((mine, back))
        share.add(mine, back)
    mine_sq, distance_sq, dot = _reference(parts)
    assert math.isclose(share.mine_sq, mine_sq, rel_tol=1e-5)
    assert math.isclose(share.distance_sq, distance_sq, rel_tol=1e-5)
    assert math.isclose(share.dot, dot, rel_tol=1e-5)
    assert check_returned(share) is None


def test_returned_share_still_refuses_bad_means():
    mine = torch.randn(1000, generator=torch.Generator().manual_seed(1))
    negated, scaled, broken = ReturnedShare(), ReturnedShare(), ReturnedShare()
    negated.add(mine, -mine)
    scaled.add(mine, 100 * mine)
    broken.add(mine, torch.full_like(mine, float("nan")))
    assert "against" in check_returned(negated).reason
    assert "norms" in check_returned(scaled).reason
    assert "non-finite" in check_returned(broken).reason
    # Scaled far up or non-finite: refused at once; negated: a strike (``ReducerRecord``).
    assert check_returned(scaled).ban and check_returned(broken).ban
    assert not check_returned(negated).ban
    assert not check_returned(_scaled(mine, 6)).ban  # a little beyond the radius


def _scaled(mine: torch.Tensor, factor: float) -> ReturnedShare:
    share = ReturnedShare()
    share.add(mine, factor * mine)
    return share


def test_non_finite_means_of_a_zero_contribution_are_not_refused():
    """Every sender of weight 0 (no samples yet, as at a slow link's first round): an
    honest reducer's mean is sum / 0, NaN; a sender whose part was zeros cannot tell that
    from a faulty reducer, so it does not refuse (ban) the reducer, while a sender with a
    nonzero part (weight > 0: the honest sum has a positive weight) still does."""
    zeros, nonzero = ReturnedShare(), ReturnedShare()
    zeros.add(torch.zeros(1000), torch.full((1000,), float("nan")))
    nonzero.add(torch.zeros(500), torch.full((500,), float("nan")))
    nonzero.add(torch.ones(500), torch.ones(500))
    assert check_returned(zeros) is None
    assert not zeros.finite
    assert "non-finite" in check_returned(nonzero).reason


def test_a_mean_barely_against_our_part_is_not_refused():
    """Our part of weight 1 beside another of weight 15 nearly orthogonal to it: the honest
    mean's cosine with ours is slightly negative and passes; that mean negated, or a mean
    at cosine -0.5, is refused, also beside a share we reduced at cosine -0.2."""
    g = torch.Generator().manual_seed(2)
    mine = torch.randn(10_000, generator=g)
    other = torch.randn(10_000, generator=g)
    other -= (other @ mine + 0.08 * float(mine @ mine)) / float(mine @ mine) * mine
    mean = (mine + 15 * other) / 16  # other @ mine = -0.08 |mine|^2: cosine about -0.013
    honest, negated, against = ReturnedShare(), ReturnedShare(), ReturnedShare()
    honest.add(mine, mean)
    negated.add(mine, -mine)
    against.add(mine, -0.5 * mine + 0.866 * other / other.norm() * mine.norm())
    assert honest.dot < 0
    assert check_returned(honest) is None
    assert "against" in check_returned(negated).reason
    assert "against" in check_returned(against).reason
    # Our own share's mean at cosine -0.2 (this round's true mean lies against ours):
    # another share's at -0.3 passes; at -0.5 it is still refused.
    own, further = ReturnedShare(), ReturnedShare()
    own.add(mine, -0.2 * mine + 0.98 * other / other.norm() * mine.norm())
    further.add(mine, -0.3 * mine + 0.954 * other / other.norm() * mine.norm())
    assert check_returned(further, own) is None
    assert "against" in check_returned(further).reason
    assert "against" in check_returned(against, own).reason
