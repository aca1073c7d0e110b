"""``swarmtrain export``: a run's stages, from nodes' checkpoints or downloaded from its
live peers, as one model in the Hugging Face format (``GPT2LMHeadModel`` or
``LlamaForCausalLM``, by the run's model family: config.json +
model.safetensors).

From a live private run, only a member exports: it joins with an invite (the owner's
machine needs none) and announces its membership in a record, since a stage's peers hand
their state to members only."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from models.hf_export import save_hf
from models.hf_format import ARCHITECTURE_OF
from models.stages import Stage
from models.training import StageOptimizer
from node.averaging import state as stage_state
from node.averaging.averager import StageAverager
from node.averaging.process import MEMBERS_REFRESH_S
from node.averaging.state import StageState
from node.cli.client import client_dht
from node.daemon import checkpoint
from node.daemon.checkpoint import Checkpoint, CheckpointError
from node.daemon.join import NodeError, announce_member, join_run, member_invite
from node.files import load_or_create_key
from node.rpc.dht import SwarmDHT
from node.rpc.membership import read_invite
from protocol.ownership import check_run_id
from protocol.records import PeerState
from protocol.run_spec import RunSpec

# Downloads of a stage's state tried before giving up: a private run's peer hands its
# state to peers whose record it has read, and reads records at most every
# MEMBERS_REFRESH_S, so the first try may come before it knows ours.
FETCH_TRIES = 3


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


async def from_swarm(
    dht: SwarmDHT,
    timeout_s: float,
    *,
    invite_for: Callable[[RunSpec], str | None] = lambda _: None,
    key: Ed25519PrivateKey | None = None,
) -> tuple[RunSpec, dict, list[str]]:
    """The run's spec, its whole model's state downloaded stage by stage from live peers
    (as a joiner downloads it), and one line per stage saying where it came from.

    This peer joins the run (``join_run``, with the invite ``invite_for`` gives). In a
    private run it then announces itself as a member that serves no stage
    (``announce_member``, signed with ``key``: ``dht``'s identity key), and as leaving
    once done. ``NodeError`` if it is no member, or a stage hands over no state within
    ``timeout_s``."""
    joined = await join_run(dht, invite_for, spec_timeout_s=timeout_s)
    spec = joined.spec
    if spec.private and key is None:
        raise ValueError("exporting a private run needs the key of the DHT's identity")
    state, lines = {}, []
    try:
        for stage in range(spec.n_stages):
            if spec.private:  # afresh for each stage: a record lives MAX_RECORD_AGE_S
                await announce_member(dht, joined, key)
            module = Stage(spec.model, spec.stage_range(stage))
            fetched = await _fetch(dht, spec, stage, module, timeout_s)
            names = [n for n, _ in stage_state.trainable(module)]
            state.update(zip(names, fetched.params, strict=True))
            lines.append(f"stage {stage}: step {fetched.step} from peer {fetched.source}")
    finally:
        if spec.private:
            with contextlib.suppress(NodeError):  # else it expires
                await announce_member(dht, joined, key, PeerState.LEAVING)
    return spec, state, lines


async def _fetch(
    dht: SwarmDHT, spec: RunSpec, stage: int, module: Stage, timeout_s: float
) -> StageState:
    """Stage ``stage``'s state from one of its peers, tried ``FETCH_TRIES`` times within
    ``timeout_s``; ``NodeError`` if none handed it over."""
    optimizer = StageOptimizer(module, spec.optim)
    averager = await StageAverager.create(dht, spec, stage, module, optimizer)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    try:
        for _ in range(FETCH_TRIES):
            fetched = await averager.fetch(max(1.0, deadline - loop.time()))
            if fetched is not None:
                return fetched
            if deadline - loop.time() < MEMBERS_REFRESH_S:
                break
            await asyncio.sleep(MEMBERS_REFRESH_S)
    finally:
        await averager.shutdown()
    raise NodeError(f"no peer of stage {stage} handed over its state in {timeout_s:.0f} s")


def _from_swarm(args: argparse.Namespace) -> tuple[RunSpec, dict, list[str]]:
    import uvloop

    check_run_id(args.run)
    if not args.initial_peers:
        raise ValueError("--run needs --initial-peers: the address of a node of the run")
    with tempfile.TemporaryDirectory(prefix="swarmtrain-export-") as scratch:
        # A private run's export signs a record: it needs its identity's key.
        identity = args.identity or Path(scratch) / "identity.key"
        with client_dht(args, args.run, identity=identity) as dht:
            key = load_or_create_key(identity)
            invite_for = member_invite(read_invite(args.invite), args.owner_key, dht.peer_id)
            return uvloop.run(from_swarm(dht, args.timeout, invite_for=invite_for, key=key))


def run(args: argparse.Namespace) -> int:
    if args.out.exists() and not args.force:
        raise ValueError(f"--out {args.out} exists: pass --force to replace it")
    if args.checkpoint and (args.initial_peers or args.invite is not None):
        raise ValueError("--initial-peers and --invite go with --run, not --checkpoint")
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
    save_hf(args.out, state, spec.model)
    print("\n".join(lines))
    print(f"exported run {spec.run!r} to {args.out} ({ARCHITECTURE_OF[spec.model.family]})")
    return 0
