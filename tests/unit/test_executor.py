"""A stage's computation without any RPC: two executors compose to the local model's
loss and gradients, a kept forward graph is used only when nothing changed, and a
request that fails leaves ``.grad`` untouched."""

from __future__ import annotations

import torch

from models.config import ModelConfig
from models.stages import Stage, even_boundaries
from node.pipeline.executor import StageExecutor, count_non_finite
from protocol.stage_messages import (
    BACKWARD,
    FORWARD,
    BackwardRequest,
    ForwardRequest,
    StageContract,
    StageMeta,
)

CFG = ModelConfig(block_size=8, n_layer=2, n_head=2, n_embd=16)
RUN = "executor"


def _pair() -> tuple[list[StageExecutor], list[tuple[tuple[str, int], int]]]:
    torch.manual_seed(0)
    cut = even_boundaries(CFG, 2)
    reported: list[tuple[tuple[str, int], int]] = []
    executors = []
    for i, blocks in enumerate(cut):
        stage = Stage(CFG, blocks)
        contract = StageContract.for_stage(CFG, blocks, i)
        executors.append(StageExecutor(stage, contract, lambda k, n: reported.append((k, n))))
    return executors, reported


def _meta(stage: int, kind: str, mb: int) -> StageMeta:
    return StageMeta(run_id=RUN, stage=stage, kind=kind, micro_batch=mb, train=kind == FORWARD)


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, CFG.vocab_size, (2, CFG.block_size), generator=g),
            torch.randint(0, CFG.vocab_size, (2, CFG.block_size), generator=g))  # fmt: skip


def _train(executors: list[StageExecutor], x, y, mb: int) -> torch.Tensor:
    first, last = executors
    (h,) = first.run(ForwardRequest(_meta(0, FORWARD, mb), x, None), "me")
    loss, grad_h = last.run(ForwardRequest(_meta(1, FORWARD, mb), h.detach(), y), "me")
    first.run(BackwardRequest(_meta(0, BACKWARD, mb), x, grad_h), "me")
    return loss


def test_two_executors_compose_to_the_model_and_reuse_the_kept_graph():
    executors, reported = _pair()
    x, y = _batch(1)
    loss = _train(executors, x, y, mb=7)
    whole = torch.nn.Sequential(*(e.stage for e in executors))
    expected = whole[1](whole[0](x), y)
    assert torch.allclose(loss, expected.detach())
    params = [p for e in executors for p in e.stage.parameters()]
    want = torch.autograd.grad(expected * len(x), params)
    for p, g in zip(params, want, strict=True):
        assert torch.allclose(p.grad, g, atol=1e-6)
    assert executors[0].reused == 1, "the backward used the forward's kept graph"
    assert sorted(reported) == [(("me", 7), 2), (("me", 7), 2)]


def test_a_changed_parameter_means_recompute_and_a_failed_request_changes_nothing():
    executors, _ = _pair()
    first, last = executors
    x, y = _batch(2)
    (h,) = first.run(ForwardRequest(_meta(0, FORWARD, 1), x, None), "me")
    with torch.no_grad():
        next(first.stage.parameters()).add_(0.01)  # a step between forward and backward
    _, grad_h = last.run(ForwardRequest(_meta(1, FORWARD, 1), h.detach(), y), "me")
    first.run(BackwardRequest(_meta(0, BACKWARD, 1), x, grad_h), "me")
    assert first.reused == 0 and first.backward == 1
    before = [p.grad.clone() for p in first.stage.parameters() if p.grad is not None]
    bad = torch.full_like(grad_h, float("nan"))
    try:
        first.run(BackwardRequest(_meta(0, BACKWARD, 2), x, bad), "me")
    except Exception as e:  # StageRequestError: non-finite gradients
        assert "non-finite" in str(e)
    else:
        raise AssertionError("a NaN gradient must be refused")
    after = [p.grad for p in first.stage.parameters() if p.grad is not None]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert first.backward == 1


def test_an_inference_forward_returns_the_last_logits_and_keeps_nothing():
    executors, reported = _pair()
    first, last = executors
    x, _ = _batch(3)
    infer = [StageMeta(RUN, s, FORWARD, 5, infer=True) for s in range(2)]
    (h,) = first.run(ForwardRequest(infer[0], x, None), "me")
    (logits,) = last.run(ForwardRequest(infer[1], h, None), "me")
    with torch.no_grad():
        whole = last.stage.logits(first.stage(x))  # (B, T, vocab)
    assert torch.equal(logits, whole[:, -1]) and not logits.requires_grad
    assert [(e.forward, e.backward, e.inferred) for e in executors] == [(0, 0, 1), (0, 0, 1)]
    assert reported == [] and all(p.grad is None for e in executors for p in e.stage.parameters())
    # Nothing was kept: the backward of that micro-batch recomputes.
    first.run(BackwardRequest(_meta(0, BACKWARD, 5), x, torch.ones_like(h)), "me")
    assert first.reused == 0


def test_non_finite_values_are_counted_exactly_and_overflowing_sums_are_not_taken_for_them():
    big = torch.full((4,), 3e38)  # finite, but its float32 sum overflows
    assert count_non_finite([]) == 0
    assert count_non_finite([torch.ones(3), big]) == 0
    nan, inf = float("nan"), float("inf")
    assert count_non_finite([torch.tensor([1.0, nan, -inf]), big, torch.tensor([inf, -inf])]) == 4
    assert count_non_finite([torch.tensor([1.0, inf], dtype=torch.bfloat16)]) == 1
