"""The single-process baseline learns, and its command line reports it."""

import dataclasses
import math

from models.config import preset
from models.training import train_baseline


def test_tiny_baseline_learns(corpus):
    model, optim = preset("tiny")
    result = train_baseline(model, optim, corpus, steps=30, eval_every=30, n_stages=2)
    final = result.steps[-1].val_loss
    assert result.initial_val_loss > math.log(256) - 0.1  # starts near uniform bytes
    assert final < 3.3, final  # and learns the bytes of Python source


def test_stage_cut_does_not_change_learning(corpus):
    """One stage or two: the same arithmetic, so the same loss curve (clipping is per stage,
    as in the swarm, so it is off here)."""
    model, optim = preset("tiny")
    optim = dataclasses.replace(optim, grad_clip=0.0)
    one = train_baseline(model, optim, corpus, steps=5, n_stages=1)
    two = train_baseline(model, optim, corpus, steps=5, n_stages=2)
    for a, b in zip(one.steps, two.steps, strict=True):
        assert abs(a.train_loss - b.train_loss) < 1e-4
