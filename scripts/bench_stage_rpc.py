"""Round-trip latency on loopback: hivemind unary vs stream calls, and a stage forward.

    python -m scripts.bench_stage_rpc [--calls 300] [--train-preset small --train-calls 12]

Prints medians measured side by side in one run: an echo of a 4 x 16 float32 tensor as a
unary call and as a stream call, a ``StageServer`` forward of the ``tiny`` preset's stage
0 on a reused stream (a session, what callers use) and on a stream of its own, with the
CPU time per call of this process and of the two ``p2pd`` daemons, against the same
forward run locally, and a training
micro-batch on stage 0 of ``--train-preset`` (a forward marked ``train``, then its
backward, to the same peer) with the server keeping the forward's graph against the same
server recomputing it.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import statistics
import time

# hivemind recognises stream handlers by typing.AsyncIterator, not collections.abc's.
from typing import AsyncIterator  # noqa: UP035

import psutil
import torch
from hivemind.compression import serialize_torch_tensor
from hivemind.p2p import P2P, P2PContext, ServicerBase
from hivemind.proto import runtime_pb2

from models.config import preset, tiny
from models.stages import Stage, even_boundaries
from models.training import StageOptimizer
from node.pipeline import client as stage_client
from node.pipeline.server import StageServer
from node.rpc.hivemind_compat import install
from protocol.stage_messages import StageContract


class Echo(ServicerBase):
    async def rpc_unary(
        self, request: runtime_pb2.ExpertRequest, context: P2PContext
    ) -> runtime_pb2.ExpertResponse:
        return runtime_pb2.ExpertResponse(tensors=request.tensors)

    async def rpc_stream(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        async for request in requests:
            yield runtime_pb2.ExpertResponse(tensors=request.tensors)


def _cpu_s() -> tuple[float, float]:
    """CPU seconds (user + system) of this process and of its children (the daemons)."""
    me = psutil.Process()
    own = sum(me.cpu_times()[:2])
    return own, sum(sum(c.cpu_times()[:2]) for c in me.children(recursive=True))


async def _cpu_ms(call, n: int) -> tuple[float, float]:
    """Milliseconds of CPU per call: this process's, the daemons'."""
    own, daemons = _cpu_s()
    for _ in range(n):
        await call()
    own_after, daemons_after = _cpu_s()
    return 1e3 * (own_after - own) / n, 1e3 * (daemons_after - daemons) / n


async def _median_ms(call, n: int) -> float:
    for _ in range(n // 10):  # warm-up
        await call()
    times = []
    for _ in range(n):
        start = time.perf_counter()
        await call()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


async def _train_ratio(server: P2P, client: P2P, name: str, n: int) -> None:
    model, optim = preset(name)
    blocks = even_boundaries(model, 2)[0]
    stage = Stage(model, blocks)
    tokens = optim.micro_batch_size * model.block_size
    contract = StageContract.for_stage(model, blocks, 0, max_tokens=tokens)
    never = dataclasses.replace(optim, target_batch_size=10**9)  # no step between the two
    stage_server = await StageServer.create(
        server, stage, StageOptimizer(stage, never), contract, "bench"
    )
    try:
        x = torch.randint(0, model.vocab_size, (optim.micro_batch_size, model.block_size))
        ids = itertools.count()
        kw = {"run_id": "bench", "stage": 0, "timeout": 600.0}

        async def micro_batch():
            k = next(ids)
            h = await stage_client.forward(
                client, server.peer_id, x, micro_batch=k, train=True, **kw
            )
            grad = torch.full_like(h, 1e-3)
            await stage_client.backward(client, server.peer_id, x, grad, micro_batch=k, **kw)

        kept_ms = await _median_ms(micro_batch, n)
        stage_server.keep_graphs = 0
        recomputed_ms = await _median_ms(micro_batch, n)
        print(
            f"{name} stage 0 training micro-batch ({tuple(x.shape)}, forward + backward on one "
            f"peer): graph kept {kept_ms:.0f} ms, recomputed {recomputed_ms:.0f} ms, ratio "
            f"{kept_ms / recomputed_ms:.2f}"
        )
    finally:
        await stage_server.shutdown()


async def main(n: int, train_preset: str, train_calls: int) -> None:
    install()  # checks the hivemind version before any daemon starts
    server = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    client = await P2P.create(
        host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=await server.get_visible_maddrs()
    )
    stage_server = None
    try:
        await Echo().add_p2p_handlers(server)
        stub = Echo.get_stub(client, server.peer_id)
        request = runtime_pb2.ExpertRequest(tensors=[serialize_torch_tensor(torch.randn(4, 16))])

        async def unary():
            await stub.rpc_unary(request)

        async def stream():
            async def one():
                yield request

            async for _ in await stub.rpc_stream(one()):
                pass

        unary_ms = await _median_ms(unary, n)
        stream_ms = await _median_ms(stream, n)
        print(f"4x16 float32 echo: unary {unary_ms:.2f} ms, stream {stream_ms:.2f} ms (median)")

        model, optim = tiny()
        blocks = even_boundaries(model, 2)[0]
        stage = Stage(model, blocks)
        contract = StageContract.for_stage(model, blocks, 0)
        stage_server = await StageServer.create(
            server, stage, StageOptimizer(stage, optim), contract, "bench"
        )
        x = torch.randint(0, model.vocab_size, (optim.micro_batch_size, model.block_size))

        async def remote():
            await stage_client.forward(client, server.peer_id, x, run_id="bench", stage=0)

        async def local():
            with torch.no_grad():
                stage(x)

        timed: dict[str, list[float]] = {"reused": [], "own": [], "local": []}
        cpu: dict[str, list[tuple[float, float]]] = {"reused": [], "own": [], "local": []}
        for _ in range(3):  # the ways take turns, so that both see the same machine
            for way in ("reused", "own"):
                stage_client.reuse_streams(client, way == "reused")
                timed[way].append(await _median_ms(remote, n // 3))
                cpu[way].append(await _cpu_ms(remote, n // 3))
            timed["local"].append(await _median_ms(local, n // 3))
            cpu["local"].append(await _cpu_ms(local, n // 3))
        stage_client.reuse_streams(client, True)
        ms = {way: statistics.median(t) for way, t in timed.items()}
        print(
            f"tiny stage 0 forward ({tuple(x.shape)}): remote on a reused stream "
            f"{ms['reused']:.2f} ms, on a stream of its own {ms['own']:.2f} ms, local "
            f"{ms['local']:.2f} ms; ratio reused / own {ms['reused'] / ms['own']:.2f}, "
            f"reused / local {ms['reused'] / ms['local']:.1f}"
        )
        local_cpu = statistics.median(own for own, _ in cpu["local"])
        print(f"  CPU per call: the forward run locally {local_cpu:.2f} ms")
        for way, label in (("reused", "a reused stream"), ("own", "a stream of its own")):
            own, daemons = (statistics.median(c) for c in zip(*cpu[way], strict=True))
            print(
                f"  CPU per call on {label}: this process {own:.2f} ms (both sides and the "
                f"forward), p2pd daemons {daemons:.2f} ms; beyond the forward "
                f"{own + daemons - local_cpu:.2f} ms"
            )
        await stage_server.shutdown()
        stage_server = None
        await _train_ratio(server, client, train_preset, train_calls)
    finally:
        if stage_server is not None:
            await stage_server.shutdown()
        await client.shutdown()
        await server.shutdown()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--train-preset", default="small")
    parser.add_argument("--train-calls", type=int, default=12)
    args = parser.parse_args()
    asyncio.run(main(args.calls, args.train_preset, args.train_calls))
