"""One stage's computation, in torch alone (no I/O, no RPC): forward passes, backward
passes that reuse a kept forward graph or recompute it, and gradient accumulation.

A forward marked ``train`` keeps its autograd graph, up to ``keep_graphs`` of them for
``keep_s`` seconds: a backward from the same caller for the same micro-batch, with the
same inputs and the parameters unchanged since (no step, no averaging), uses it and skips
the recompute. Anything else recomputes, so a kept graph changes the speed, never the
result (``ModelConfig.dropout`` 0 makes the recomputed forward exact). Gradients are
computed into fresh tensors and checked finite before they are added to ``.grad``, so a
request that fails leaves parameters and gradients as they were.

``run`` holds ``lock`` (the stage's: whoever steps or averages the parameters holds it
too) for the whole computation. After a micro-batch's gradients are in ``.grad`` it calls
``accumulated(key, batch_size)``, still holding the lock, which must count the samples
(``StageOptimizer.accumulated``) and may step.

An inference forward (``StageMeta.infer``: generation) keeps nothing, accumulates nothing
and is counted in ``inferred``, not ``forward``; at the last stage it returns the logits
of each sequence's last position, computed as ``Stage.logits`` computes a whole model's.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from models.stages import Stage
from node.measure.capacity import autocast_for
from protocol.stage_messages import (
    BackwardRequest,
    ForwardRequest,
    StageContract,
    StageRequestError,
)

Key = tuple[str, int]  # (caller, micro-batch)


def count_non_finite(tensors: Sequence[torch.Tensor]) -> int:
    """How many values of ``tensors`` (on one device) are not finite. Where all are, it
    costs a float32 sum per tensor and one check: a non-finite value makes its tensor's
    sum non-finite, and a sum that overflows from finite values only sends the tensors to
    the exact count."""
    if not tensors:
        return 0
    sums = torch.stack([t.sum(dtype=torch.float32) for t in tensors])
    if bool(torch.isfinite(sums).all()):
        return 0
    return sum(int((~torch.isfinite(t)).sum()) for t in tensors)


@dataclass(frozen=True)
class _Kept:
    """A forward's autograd graph, kept for the backward of the same micro-batch."""

    inputs: torch.Tensor  # as received; requires grad where the stage takes hidden states
    tokens: torch.Tensor | None  # the token ids that came with them (low-rank boundary)
    outputs: torch.Tensor
    versions: tuple[tuple[int, int], ...]  # the parameters' (id, version) when it ran
    at: float  # time.monotonic() when it ran


class StageExecutor:
    """Runs checked requests (``protocol.stage_messages.parse_request``) on one stage."""

    def __init__(
        self,
        stage: Stage,
        contract: StageContract,
        accumulated: Callable[[Key, int], None],
        *,
        lock: threading.Lock | None = None,
        keep_graphs: int = 4,
        keep_s: float = 60.0,
    ) -> None:
        if stage.range != contract.blocks:
            raise ValueError(f"stage holds blocks {stage.range}, the contract {contract.blocks}")
        self.stage = stage
        self.contract = contract
        self.accumulated = accumulated
        self.lock = lock or threading.Lock()
        self.keep_graphs = keep_graphs  # forward graphs kept for their backward (0: none)
        self.keep_s = keep_s  # a kept graph older than this is dropped
        self._kept: OrderedDict[Key, _Kept] = OrderedDict()  # under ``lock``
        self.forward = self.backward = self.reused = 0
        self.inferred = 0  # inference forwards (generation): neither training nor validation

    @property
    def device(self) -> torch.device:
        return next(self.stage.parameters()).device

    def run(self, request: ForwardRequest | BackwardRequest, caller: str) -> list[torch.Tensor]:
        """The outputs of ``request`` from ``caller``: a forward's outputs (the last stage:
        its loss, and in training the gradient w.r.t. its inputs; in inference the logits
        (B, vocab) of each sequence's last position), or a backward's gradient w.r.t. the
        stage's inputs (none for the first stage, which takes tokens).
        ``StageRequestError`` if the request makes the stage non-finite."""
        request = self._on_device(request)
        with self.lock, autocast_for(self.device):
            if isinstance(request, ForwardRequest):
                return self._forward(request, caller)
            return self._backward(request, caller)

    def _on_device(self, request: ForwardRequest | BackwardRequest):
        if self.device.type == "cpu":
            return request
        tensors = ("inputs", "targets", "grad_outputs", "tokens")
        moved = {f: getattr(request, f).to(self.device) for f in tensors
                 if getattr(request, f, None) is not None}  # fmt: skip
        return dataclasses.replace(request, **moved)

    def _finite(self, tensor: torch.Tensor, what: str) -> torch.Tensor:
        """``tensor``, if finite. Finite inputs can still overflow a stage (hidden states
        near the float32 limit): with finite parameters every peer of the stage would do the
        same, so that is a refusal; with non-finite ones this peer is faulty, not the request."""
        n_bad = count_non_finite([tensor])
        if not n_bad:
            return tensor
        if all(bool(torch.isfinite(p).all()) for p in self.stage.parameters()):
            raise StageRequestError(
                f"the request makes the stage's {what} non-finite ({n_bad} values)"
            )
        raise RuntimeError(f"this peer's parameters are non-finite ({what}: {n_bad} values)")

    def _forward(self, request: ForwardRequest, caller: str) -> list[torch.Tensor]:
        x = request.inputs  # (B, T) token ids or (B, T, W) hidden states
        tokens = request.tokens  # (B, T) with hidden states across a low-rank boundary
        key = (caller, request.meta.micro_batch)
        if request.meta.infer:
            with torch.no_grad():
                if self.contract.returns_loss:  # the whole sequence, as a whole model does
                    logits = self.stage.logits(x, tokens)[:, -1]
                    out = self._finite(logits, "logits")  # (B, vocab)
                else:
                    out = self._finite(self.stage(x, tokens=tokens), "outputs")  # (B, T, W)
            self.inferred += 1
            return [out]
        if not self.contract.returns_loss:
            if request.meta.train and self.keep_graphs > 0:
                if not self.contract.takes_tokens:
                    x.requires_grad_()
                out = self._finite(self.stage(x, tokens=tokens), "outputs")  # (B, T, W)
                self._keep(key, _Kept(x, tokens, out, self._versions(), time.monotonic()))
            else:
                with torch.no_grad():
                    out = self._finite(self.stage(x, tokens=tokens), "outputs")
            self.forward += 1
            return [out]
        if not request.meta.train:
            with torch.no_grad():
                loss = self._finite(self.stage(x, request.targets, tokens), "loss")
            self.forward += 1
            return [loss]
        wrt_inputs = not self.contract.takes_tokens
        if wrt_inputs:
            x.requires_grad_()
        loss = self._finite(self.stage(x, request.targets, tokens), "loss")
        grad_x = self._accumulate(loss * len(x), None, x if wrt_inputs else None, len(x), key)
        self.forward += 1
        self.backward += 1
        return [loss] + ([grad_x] if wrt_inputs else [])

    def _backward(self, request: BackwardRequest, caller: str) -> list[torch.Tensor]:
        wrt_inputs = not self.contract.takes_tokens
        key = (caller, request.meta.micro_batch)
        kept = self._kept.pop(key, None)
        if (
            kept is not None
            and kept.versions == self._versions()
            and torch.equal(kept.inputs.detach(), request.inputs)
            and (kept.tokens is None) == (request.tokens is None)
            and (kept.tokens is None or torch.equal(kept.tokens, request.tokens))
        ):
            x, out = kept.inputs, kept.outputs
            self.reused += 1
        else:  # recomputed: this peer may not have served the forward, or not on these
            x = request.inputs  # parameters
            if wrt_inputs:
                x.requires_grad_()
            out = self.stage(x, tokens=request.tokens)
        grad_x = self._accumulate(out, request.grad_outputs, x if wrt_inputs else None, len(x), key)
        self.backward += 1
        return [grad_x] if wrt_inputs else []

    def _versions(self) -> tuple[tuple[int, int], ...]:
        """What changes when any parameter is changed in place (a step, an averaging
        round, a state download), and then invalidates a kept graph."""
        return tuple((id(p), p._version) for p in self.stage.parameters())

    def _keep(self, key: Key, kept: _Kept) -> None:
        """Keep ``kept``, dropping graphs that a parameter change made useless, those past
        ``keep_s``, and then the oldest, so that at most ``keep_graphs`` are held (their
        activations are the memory they cost)."""
        self._kept = OrderedDict(
            (k, g)
            for k, g in self._kept.items()
            if k != key and g.versions == kept.versions and g.at >= kept.at - self.keep_s
        )
        while len(self._kept) >= self.keep_graphs:
            self._kept.popitem(last=False)
        self._kept[key] = kept

    def _accumulate(
        self,
        outputs: torch.Tensor,
        grad_outputs: torch.Tensor | None,
        inputs: torch.Tensor | None,
        batch_size: int,
        key: Key,
    ) -> torch.Tensor | None:
        """Back-propagate into fresh tensors, check them, then add the parameters' share
        to ``.grad`` and report ``batch_size`` samples (``accumulated``). Returns the
        gradient w.r.t. ``inputs``."""
        params = [p for p in self.stage.parameters() if p.requires_grad]
        wrt = params + ([inputs] if inputs is not None else [])
        if grad_outputs is not None:
            grad_outputs = grad_outputs.to(outputs.dtype)  # bf16 under CUDA autocast
        grads = torch.autograd.grad(outputs, wrt, grad_outputs=grad_outputs, allow_unused=True)
        n_bad = count_non_finite([g for g in grads if g is not None])
        if n_bad:
            raise StageRequestError(f"the request's gradients have {n_bad} non-finite values")
        for p, g in zip(params, grads, strict=False):
            if g is None:
                continue
            if p.grad is None:
                p.grad = g.contiguous()
            else:
                p.grad.add_(g)
        self.accumulated(key, batch_size)
        return grads[-1] if inputs is not None else None
