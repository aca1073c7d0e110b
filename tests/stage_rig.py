"""A small model split into stages, and stage servers on real ``p2pd`` daemons, for the
stage RPC and fuzz tests."""

from __future__ import annotations

import asyncio
import contextlib

import torch
from hivemind.p2p import P2P
from hivemind.proto import runtime_pb2

from models.config import ModelConfig, OptimizerConfig
from models.stages import Stage, StageRange, even_boundaries, validate_boundaries
from models.training import StageOptimizer
from node.pipeline.server import StageServer
from protocol.routing import BanList
from protocol.stage_messages import (
    StageContract,
)

LOOPBACK = "/ip4/127.0.0.1/tcp/0"

CFG = ModelConfig(block_size=16, n_layer=2, n_head=2, n_embd=32)


OPT = OptimizerConfig(micro_batch_size=4, target_batch_size=8, warmup_steps=0)


TWO = even_boundaries(CFG, 2)  # [0, 2) [2, 4): embedding + block 1 | block 2 + head


RUN = "rpc-test"


B = 4


MAX_TOKENS = B * CFG.block_size


def _batch(b: int = B, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, CFG.vocab_size, (b, CFG.block_size), generator=g)
    y = torch.randint(0, CFG.vocab_size, (b, CFG.block_size), generator=g)
    return x, y


def _run(body, timeout: float = 60.0):
    return asyncio.run(asyncio.wait_for(body, timeout))


def _tensor(dtype: str, size: list[int], buffer: bytes = b"") -> runtime_pb2.Tensor:
    return runtime_pb2.Tensor(dtype=dtype, size=size, buffer=buffer)


THREE = validate_boundaries(CFG, [(0, 1), (1, 3), (3, 4)])  # with a middle stage


@contextlib.asynccontextmanager
async def _swarm(
    cut: tuple[StageRange, ...],
    stage_indices: list[int],
    server_cls=StageServer,
    cfg=CFG,
    max_tokens=MAX_TOKENS,
    shared=False,
    **settings,
):
    """One P2P and server per entry of ``stage_indices`` (built with ``settings``; with
    ``shared``, one P2P for all of them: a peer that serves several stages), and a client
    P2P that knows them."""
    p2ps: list[P2P] = []
    servers: list[StageServer] = []
    try:
        for i in stage_indices:
            if not (shared and p2ps):
                p2ps.append(await P2P.create(host_maddrs=[LOOPBACK]))
            p2p = p2ps[-1]
            stage = Stage(cfg, cut[i])
            contract = StageContract.for_stage(cfg, cut[i], i, max_tokens=max_tokens)
            opt = StageOptimizer(stage, OPT)
            servers.append(await server_cls.create(p2p, stage, opt, contract, RUN, **settings))
        maddrs = [m for p in p2ps for m in await p.get_visible_maddrs()]
        client = await P2P.create(host_maddrs=[LOOPBACK], initial_peers=maddrs)
        p2ps.append(client)
        yield client, servers
    finally:
        for server in servers:
            await server.shutdown()
        for p2p in p2ps:
            await p2p.shutdown()


def _patient() -> BanList:
    """Bans of callers that ban nobody: for tests that send one caller's bad requests by
    the dozen."""
    return BanList(strikes=10**6)


def _assert_same(a: dict, b: dict) -> None:
    """Bitwise equal tensors (or both None), name by name."""
    assert a.keys() == b.keys()
    for name in a:
        if a[name] is None or b[name] is None:
            assert a[name] is None and b[name] is None, name
        else:
            assert torch.equal(a[name], b[name]), name
