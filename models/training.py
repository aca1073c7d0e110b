"""The optimizer of one stage and the single-process reference loop.

A stage accumulates gradients summed over samples (each micro-batch back-propagates
``loss * batch_size``) and divides by the samples it saw when it steps. The swarm's
servers use the same ``StageOptimizer``, so the single-process baseline is the same
arithmetic as a swarm with one peer per stage.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn

from models.config import ModelConfig, OptimizerConfig
from models.data import Corpus, eval_batches, sample_batches, stream_seed
from models.stages import Stage, even_boundaries


class StageOptimizer:
    """AdamW with warm-up and clipping over one stage's parameters.

    Gradients accumulate in ``.grad`` as sums over samples; ``accumulated`` counts the
    samples. ``step`` divides by that count and steps. A stage that averages with peers
    instead moves the sums out (``take_accumulated``), steps on the mean gradients its
    peers agreed on (``step_with_mean``), and puts the sums back if the round fails
    (``restore_accumulated``)."""

    def __init__(self, module: nn.Module, config: OptimizerConfig) -> None:
        self.config = config
        self.module = module
        self.params = [p for p in module.parameters() if p.requires_grad]
        # Weight decay on matrices only: decaying gains and biases hurts small models.
        groups = [
            {
                "params": [p for p in self.params if p.dim() >= 2],
                "weight_decay": config.weight_decay,
            },
            {"params": [p for p in self.params if p.dim() < 2], "weight_decay": 0.0},
        ]
        self.optimizer = torch.optim.AdamW(groups, lr=config.lr, betas=config.betas)
        self.step_count = 0
        self.samples = 0  # accumulated since the last step

    def accumulated(self, n_samples: int) -> None:
        """Record that the gradients of ``n_samples`` more samples are in ``.grad``."""
        self.samples += n_samples

    def step(self) -> float:
        """Average the accumulated gradients, clip, and take one AdamW step.

        Returns the gradient norm before clipping.
        """
        if self.samples == 0:
            raise RuntimeError("step() with no accumulated samples")
        params = [p for p in self.module.parameters() if p.grad is not None]
        for p in params:
            p.grad.div_(self.samples)
        norm = self._clip_and_step(params)
        self.samples = 0
        return norm

    def step_with_mean(self, means: Sequence[torch.Tensor]) -> float:
        """One step (clipped, with the schedule's learning rate) on ``means``: a mean
        gradient per trainable parameter, in the order of ``params``. What accumulated
        meanwhile (``.grad`` and ``samples``) stays for the next step. Returns the gradient
        norm before clipping."""
        if len(means) != len(self.params):
            raise ValueError(f"{len(means)} mean gradients for {len(self.params)} parameters")
        pending = [p.grad for p in self.params]
        for p, m in zip(self.params, means, strict=True):
            p.grad = m.to(p.device, p.dtype)
        try:
            return self._clip_and_step(self.params)
        finally:
            for p, g in zip(self.params, pending, strict=True):
                p.grad = g

    def take_accumulated(self) -> tuple[int, list[torch.Tensor | None]]:
        """Move the accumulated gradient sums (one per trainable parameter, None where
        nothing accumulated) and their sample count out: the optimizer then holds none."""
        n, sums = self.samples, [p.grad for p in self.params]
        for p in self.params:
            p.grad = None
        self.samples = 0
        return n, sums

    def restore_accumulated(self, samples: int, sums: Sequence[torch.Tensor | None]) -> None:
        """Add back what ``take_accumulated`` took, to whatever accumulated since."""
        for p, g in zip(self.params, sums, strict=True):
            if g is None:
                continue
            if p.grad is None:
                p.grad = g
            else:
                p.grad.add_(g)
        self.samples += samples

    def snapshot(self) -> OptimizerSnapshot:
        """A copy of the parameters, the AdamW state and the step count, for ``restore``."""
        with torch.no_grad():
            params = [p.detach().clone() for p in self.params]
        state = {
            p: {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
            for p, s in self.optimizer.state.items()
        }
        return OptimizerSnapshot(params, state, self.step_count)

    def restore(self, snapshot: OptimizerSnapshot) -> None:
        """Put back what ``snapshot`` copied (parameters changed in place, so kept forward
        graphs see the change); ``.grad`` and ``samples`` are left as they are. A snapshot
        is restored at most once: its tensors become the optimizer's."""
        with torch.no_grad():
            for p, saved in zip(self.params, snapshot.params, strict=True):
                p.copy_(saved)
        self.optimizer.state.clear()
        self.optimizer.state.update(snapshot.state)
        self.step_count = snapshot.step_count

    def _clip_and_step(self, params: list[nn.Parameter]) -> float:
        max_norm = self.config.grad_clip or math.inf
        norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
        for group in self.optimizer.param_groups:
            group["lr"] = self.config.lr_at(self.step_count)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step_count += 1
        return norm


@dataclass
class OptimizerSnapshot:
    """``StageOptimizer.snapshot``: what ``restore`` puts back."""

    params: list[torch.Tensor]
    state: dict
    step_count: int


def pipeline_loss(stages: Sequence[Stage], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Run ``stages`` in sequence: token ids in, mean loss out."""
    for stage in stages[:-1]:
        x = stage(x)
    return stages[-1](x, y)


@torch.no_grad()
def evaluate(
    stages: Sequence[Stage],
    batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
) -> float:
    """Mean loss over fixed validation batches."""
    losses = [float(pipeline_loss(stages, x, y)) for x, y in batches]
    return sum(losses) / len(losses)


@dataclass(frozen=True)
class StepReport:
    step: int
    samples: int
    train_loss: float
    val_loss: float | None  # only on evaluation steps
    samples_per_s: float


@dataclass
class BaselineResult:
    initial_val_loss: float
    steps: list[StepReport]


def train_baseline(
    model: ModelConfig,
    optim: OptimizerConfig,
    corpus: Corpus,
    steps: int,
    seed: int = 0,
    n_stages: int = 1,
    eval_every: int = 50,
    eval_batches_n: int = 8,
    on_step: Callable[[StepReport], None] | None = None,
) -> BaselineResult:
    """Train the whole model in one process, cut into ``n_stages`` stages that each have
    their own ``StageOptimizer`` (as the swarm's peers do)."""
    stages = [Stage(model, r) for r in even_boundaries(model, n_stages)]
    optimizers = [StageOptimizer(s, optim) for s in stages]
    data: Iterator = sample_batches(
        corpus.train, model.block_size, optim.micro_batch_size, stream_seed(seed, 0)
    )
    val = eval_batches(corpus.val, model.block_size, optim.micro_batch_size, eval_batches_n)
    result = BaselineResult(initial_val_loss=evaluate(stages, val), steps=[])
    micro_per_step = math.ceil(optim.target_batch_size / optim.micro_batch_size)
    started, samples = time.perf_counter(), 0
    for step in range(steps):
        total = 0.0
        for _ in range(micro_per_step):
            x, y = next(data)
            loss = pipeline_loss(stages, x, y)
            (loss * len(x)).backward()
            total += float(loss.detach())
            for o in optimizers:
                o.accumulated(len(x))
            samples += len(x)
        for o in optimizers:
            o.step()
        last = step == steps - 1
        val_loss = evaluate(stages, val) if last or (step + 1) % eval_every == 0 else None
        report = StepReport(
            step=step + 1,
            samples=samples,
            train_loss=total / micro_per_step,
            val_loss=val_loss,
            samples_per_s=samples / (time.perf_counter() - started),
        )
        result.steps.append(report)
        if on_step:
            on_step(report)
    return result
