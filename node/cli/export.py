"""``swarmtrain export``: a run's stages, from nodes' checkpoints, as one model in the
Hugging Face format (``GPT2LMHeadModel``: config.json + model.safetensors)."""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from models.hf_export import save_gpt2
from models.stages import Stage
from models.training import StageOptimizer
from node.averaging import state as stage_state
from node.averaging.averager import StageAverager
from node.daemon import checkpoint
from node.daemon.checkpoint import Checkpoint, CheckpointError
from node.daemon.join import NodeError, find_spec
from node.rpc.dht import SwarmDHT
from protocol.ownership import check_run_id
from protocol.run_spec import RunSpec


def _roots(paths: list[Path]) -> list[Path]:
    roots = []
    for path in paths:
        if not path.is_dir():
            raise ValueError(f"--checkpoint {path}: no such directory")
        found = [f.parent for f in sorted(path.rglob(checkpoint.SPEC_FILE))]
        if not found:
            raise ValueError(f"--checkpoint {path}: no node checkpoints in it (no spec.json)")
        roots += found
    return roots


def newest_of_each_stage(paths: list[Path]) -> tuple[checkpoint.SignedSpec, list[Checkpoint]]:
    """The run's spec and, for each of its stages, the newest checkpoint under ``paths``.
    Raises ``ValueError`` if they are of different runs or a stage has none."""
    roots = _roots(paths)
    signed = checkpoint.read_spec(roots[0])
    for root in roots[1:]:
        other = checkpoint.read_spec(root).spec
        if other != signed.spec:
            raise ValueError(
                f"{root} holds run {other.run!r}, {roots[0]} run {signed.spec.run!r}: "
                "export one run at a time"
            )
    spec, chosen = signed.spec, []
    for stage in range(spec.n_stages):
        kept = [c for root in roots if (c := checkpoint.newest(root, spec, stage)) is not None]
        if not kept:
            raise ValueError(f"no checkpoint of stage {stage} of run {spec.run!r} in {paths}")
        chosen.append(max(kept, key=lambda c: c.epoch))
    return signed, chosen


def whole_state(signed, chosen: list[Checkpoint]) -> dict:
    """The whole model's state dict, each stage's part from its checkpoint."""
    spec, state = signed.spec, {}
    for kept in chosen:
        module = Stage(spec.model, spec.stage_range(kept.stage))
        parsed = stage_state.parse(kept.metadata, kept.tensors, module, mode=spec.averaging.mode)
        names = [n for n, _ in stage_state.trainable(module)]
        state.update(zip(names, parsed.params, strict=True))
    return state


async def from_swarm(dht: SwarmDHT, timeout_s: float) -> tuple[RunSpec, dict, list[str]]:
    """The run's spec, its whole model's state downloaded stage by stage from live peers
    (as a joiner downloads it), and one line per stage saying where it came from."""
    spec = (await find_spec(dht, timeout_s)).spec
    if spec.private:
        raise NodeError(
            f"run {spec.run!r} is private: export it from its nodes' checkpoints "
            "(--checkpoint ~/.swarmtrain/NAME/checkpoints on the owner's machine)"
        )
    dht.use_spec(spec)
    state, lines = {}, []
    for stage in range(spec.n_stages):
        module = Stage(spec.model, spec.stage_range(stage))
        optimizer = StageOptimizer(module, spec.optim)
        averager = await StageAverager.create(dht, spec, stage, module, optimizer)
        try:
            fetched = await averager.fetch(timeout_s)
        finally:
            await averager.shutdown()
        if fetched is None:
            raise NodeError(f"no peer of stage {stage} handed over its state in {timeout_s:.0f} s")
        names = [n for n, _ in stage_state.trainable(module)]
        state.update(zip(names, fetched.params, strict=True))
        lines.append(f"stage {stage}: step {fetched.step} from peer {fetched.source}")
    return spec, state, lines


def _from_swarm(args: argparse.Namespace) -> tuple[RunSpec, dict, list[str]]:
    import uvloop

    check_run_id(args.run)
    if not args.initial_peers:
        raise ValueError("--run needs --initial-peers: the address of a node of the run")
    dht = SwarmDHT.start(
        args.run,
        initial_peers=args.initial_peers,
        host_maddrs=args.host_maddrs,
        client_mode=True,
    )
    try:
        return uvloop.run(from_swarm(dht, args.timeout))
    finally:
        dht.shutdown()


def run(args: argparse.Namespace) -> int:
    if args.out.exists() and not args.force:
        raise ValueError(f"--out {args.out} exists: pass --force to replace it")
    if args.run:
        spec, state, lines = _from_swarm(args)
    else:
        try:
            signed, chosen = newest_of_each_stage(args.checkpoint)
        except CheckpointError as e:
            raise ValueError(str(e)) from None
        spec, state = signed.spec, whole_state(signed, chosen)
        lines = [f"stage {c.stage}: step {c.metadata['step']} from {c.path}" for c in chosen]
    if args.out.exists():
        shutil.rmtree(args.out)
    save_gpt2(args.out, state, spec.model)
    print("\n".join(lines))
    print(f"exported run {spec.run!r} to {args.out} (GPT2LMHeadModel)")
    return 0
