"""A node's way to its first stage: what torch imports when a stage's optimizer is first
built (``torch._dynamo``, a heavy import) is imported in a thread while the node chooses
its stage, and is done before the stage is built, so it is off the path to serving."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from models.stages import Stage
from models.training import StageOptimizer
from node.daemon import stages as stage_module
from node.daemon.settings import NodeSettings
from node.daemon.stages import HeldStages, StageLifecycle, import_optimizer_code
from protocol.identity import peer_id_of
from protocol.records import PeerState
from protocol.run_spec import make_run_spec

OWNER = peer_id_of(Ed25519PrivateKey.generate().public_key())
SPEC = make_run_spec("start", "tiny", 2, owner=OWNER)


class _Placement:
    """Chooses stage 1 once the node's import of the optimizer code has started."""

    def __init__(self, started: asyncio.Event) -> None:
        self._started = started
        self.overlapped = False

    async def join(self, on_choice, kept) -> None:
        async with asyncio.timeout(10):  # a node listens to the run's gossip this long at most
            await self._started.wait()
        self.overlapped = True
        on_choice(1)


@pytest.mark.parametrize("pinned", [None, 0])
def test_the_optimizer_code_is_imported_while_the_stage_is_chosen(
    tmp_path: Path, monkeypatch, pinned: int | None
) -> None:
    steps: list[str] = []

    async def run() -> _Placement:
        started = asyncio.Event()

        async def fake_import() -> None:
            steps.append("import started")
            started.set()
            await asyncio.sleep(0.05)
            steps.append("import done")

        async def fake_hold(self, stage: int, role: str) -> None:
            steps.append(f"hold {stage} {role}")

        monkeypatch.setattr(stage_module, "import_optimizer_code", fake_import)
        monkeypatch.setattr(StageLifecycle, "hold", fake_hold)
        placement = _Placement(started)
        states: list[PeerState] = []
        settings = NodeSettings(run=SPEC.run, stage=pinned, two_stage=False)
        stub = SimpleNamespace()
        lifecycle = StageLifecycle(
            HeldStages(), settings, SPEC, stub, stub, stub, stub, None, tmp_path, stub,
            placement, stub, stub, stub, stub, states.append, lambda: None,
        )  # type: ignore[arg-type]  # fmt: skip
        await lifecycle.join()
        return placement

    placement = asyncio.run(run())
    stage = 1 if pinned is None else pinned
    assert steps == ["import started", "import done", f"hold {stage} first"]
    assert placement.overlapped is (pinned is None)


def test_after_that_import_building_a_stage_optimizer_and_stepping_imports_no_dynamo() -> None:
    asyncio.run(import_optimizer_code())
    before = {m for m in sys.modules if m.startswith("torch._dynamo")}
    assert "torch._dynamo" in before
    module = Stage(SPEC.model, SPEC.stage_range(0))
    optimizer = StageOptimizer(module, SPEC.optim)
    for p in module.parameters():
        p.grad = p.detach().clone()
    optimizer.optimizer.step()
    assert {m for m in sys.modules if m.startswith("torch._dynamo")} == before
