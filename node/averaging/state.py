"""A stage's training state as hivemind's averager ships it: (metadata, tensors).

A peer that joins a stage downloads it from a peer of that stage before it serves: the
parameters, the inner optimizer's (AdamW's) per-parameter state, the step count and the
averaging epoch, and in DiLoCo mode the outer optimizer's anchor and momentum. Everything
that arrives is checked against the local stage (names, count, shapes, dtypes,
finiteness) before it replaces anything; ``StateError`` names the first problem.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn

from models.training import StageOptimizer

FORMAT = 1
MAX_COUNT = 2**53
# AdamW's per-parameter state: "step" is a scalar, the moments have the parameter's shape.
ADAMW_KEYS = ("step", "exp_avg", "exp_avg_sq")


class StateError(ValueError):
    """A downloaded state does not fit this stage."""


@dataclass
class StageState:
    epoch: int  # averaging rounds behind these parameters
    step: int  # inner optimizer steps (``StageOptimizer.step_count``)
    params: list[torch.Tensor]  # in the order of ``trainable(module)``
    adamw: dict[int, dict[str, torch.Tensor]]  # parameter index -> AdamW state
    momentum: list[torch.Tensor] | None  # DiLoCo's outer momentum (None before the first)
    source: str  # the peer it came from, as it says
    lineage: int = 0  # of the copy (``protocol.averaging.fork_lineage``); 0: never forked


def trainable(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The parameters that are averaged and shipped, in a fixed order."""
    return [(n, p) for n, p in module.named_parameters() if p.requires_grad]


def shipped_bytes(module: nn.Module, mode: str) -> int:
    """About the bytes of the state ``capture`` ships for ``module`` once its optimizer has
    stepped: the parameters, AdamW's two moments of each, and in DiLoCo the outer momentum,
    each in the parameters' dtype."""
    params = sum(p.numel() * p.element_size() for _, p in trainable(module))
    return params * (4 if mode == "diloco" else 3)


def capture(
    module: nn.Module,
    optimizer: StageOptimizer,
    *,
    epoch: int,
    mode: str,
    peer: str,
    params: list[torch.Tensor] | None = None,
    momentum: list[torch.Tensor] | None = None,
    lineage: int = 0,
) -> tuple[dict, list[torch.Tensor]]:
    """Copies of the state, for a peer to download. The caller holds the stage's lock.

    ``params`` replaces the module's own parameters (DiLoCo ships its anchor: the
    parameters all peers agreed on at the last outer step, not this peer's inner
    progress)."""
    named = trainable(module)
    values = params if params is not None else [p.detach() for _, p in named]
    tensors = [t.detach().cpu().clone() for t in values]
    index = {id(p): i for i, (_, p) in enumerate(named)}
    adamw = []
    for p, state in optimizer.optimizer.state.items():
        for key in ADAMW_KEYS:
            if key in state:
                adamw.append([index[id(p)], key])
                tensors.append(torch.as_tensor(state[key]).detach().cpu().clone())
    if momentum is not None:
        tensors.extend(m.detach().cpu().clone() for m in momentum)
    metadata = {
        "format": FORMAT,
        "mode": mode,
        "epoch": epoch,
        "step": optimizer.step_count,
        "names": [n for n, _ in named],
        "adamw": adamw,
        "momentum": momentum is not None,
        "peer": peer,
        "lineage": lineage,
    }
    return metadata, tensors


def _count(metadata: dict, name: str) -> int:
    value = metadata.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < MAX_COUNT:
        raise StateError(f"state {name} must be an integer in [0, 2**53), got {value!r:.40}")
    return value


def _tensor(t: object, shape: tuple[int, ...], what: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise StateError(f"{what} is not a tensor")
    if not t.dtype.is_floating_point:
        raise StateError(f"{what} has dtype {t.dtype}, expected a floating point type")
    if tuple(t.shape) != shape:
        raise StateError(f"{what} has shape {tuple(t.shape)}, expected {shape}")
    if not bool(torch.isfinite(t).all()):
        raise StateError(f"{what} has non-finite values")
    return t


def parse(
    metadata: object, tensors: object, module: nn.Module, *, mode: str, source: str | None = None
) -> StageState:
    """Validate a downloaded state against ``module``; ``StateError`` if it does not fit.
    ``source``: the peer it came from, if known (else the peer the metadata names)."""
    if not isinstance(metadata, dict) or not isinstance(tensors, list | tuple):
        raise StateError("a state is a metadata dict and a list of tensors")
    if metadata.get("format") != FORMAT:
        raise StateError(f"state format {metadata.get('format')!r:.20}, expected {FORMAT}")
    if metadata.get("mode") != mode:
        raise StateError(f"state of averaging mode {metadata.get('mode')!r:.20}, we run {mode}")
    named = trainable(module)
    if metadata.get("names") != [n for n, _ in named]:
        raise StateError("the state's parameter names differ from this stage's")
    epoch, step = _count(metadata, "epoch"), _count(metadata, "step")
    lineage = _count(metadata, "lineage") if "lineage" in metadata else 0  # older peers: 0
    adamw_index = metadata.get("adamw")
    if not isinstance(adamw_index, list) or len(adamw_index) > len(named) * len(ADAMW_KEYS):
        raise StateError("state adamw must be a list of [parameter index, key]")
    has_momentum = metadata.get("momentum")
    if not isinstance(has_momentum, bool) or (has_momentum and mode != "diloco"):
        raise StateError("state momentum must be a boolean, true only in diloco mode")
    expected = len(named) * (2 if has_momentum else 1) + len(adamw_index)
    if len(tensors) != expected:
        raise StateError(f"state carries {len(tensors)} tensors, expected {expected}")

    params = [
        _tensor(t, tuple(p.shape), f"parameter {n}")
        for (n, p), t in zip(named, tensors[: len(named)], strict=True)
    ]
    adamw: dict[int, dict[str, torch.Tensor]] = {}
    rest = tensors[len(named) :]
    for entry, t in zip(adamw_index, rest, strict=False):
        if (
            not isinstance(entry, list | tuple)
            or len(entry) != 2
            or not isinstance(entry[0], int)
            or isinstance(entry[0], bool)
            or not 0 <= entry[0] < len(named)
            or entry[1] not in ADAMW_KEYS
            or entry[1] in adamw.get(entry[0], {})
        ):
            raise StateError(f"bad adamw entry {entry!r:.60}")
        i, key = entry
        shape = () if key == "step" else tuple(named[i][1].shape)
        adamw.setdefault(i, {})[key] = _tensor(t, shape, f"adamw {key} of {named[i][0]}")
    for i, state in adamw.items():
        if set(state) != set(ADAMW_KEYS):
            raise StateError(f"adamw state of {named[i][0]} lacks {set(ADAMW_KEYS) - set(state)}")
        if not 0 <= float(state["step"]) < MAX_COUNT or not math.isfinite(float(state["step"])):
            raise StateError(f"adamw step of {named[i][0]} is out of range")
    momentum = None
    if has_momentum:
        momentum = [
            _tensor(t, tuple(p.shape), f"momentum of {n}")
            for (n, p), t in zip(named, rest[len(adamw_index) :], strict=True)
        ]
    if source is None:
        source = metadata.get("peer")
    return StageState(
        epoch=epoch,
        step=step,
        params=params,
        adamw=adamw,
        momentum=momentum,
        source=source if isinstance(source, str) else "?",
        lineage=lineage,
    )


@torch.no_grad()
def apply(state: StageState, module: nn.Module, optimizer: StageOptimizer) -> None:
    """Replace parameters, AdamW state and step count. The caller holds the stage's lock;
    accumulated gradients (``.grad``, ``optimizer.samples``) are left as they are."""
    named = trainable(module)
    for (_, p), t in zip(named, state.params, strict=True):
        p.copy_(t)
    inner = optimizer.optimizer
    inner.state.clear()
    for i, entries in state.adamw.items():
        p = named[i][1]
        inner.state[p] = {
            "step": entries["step"].to(torch.float32).clone(),
            "exp_avg": entries["exp_avg"].to(p.device, p.dtype).clone(),
            "exp_avg_sq": entries["exp_avg_sq"].to(p.device, p.dtype).clone(),
        }
    optimizer.step_count = state.step
