"""Peers of one stage for the averaging tests, in this process or as a subprocess.

A peer here is a DHT, one stage (by default the last stage of a small model), its
``StageOptimizer`` and a ``StageAverager``; ``feed`` and ``feed_tokens`` do what a stage
server does for one micro-batch (backward of ``loss * B`` into ``.grad`` under the lock,
then ``on_accumulated``). Its DHT's identity key must be in ``KEYS``: it signs the peer's
progress records and its peer record in the run (peers ignore the progress of peers
without one).

As a script (``python -m tests.averaging_peer --initial-peer MADDR --run NAME``) it is the
victim of the kill test: it joins, accumulates two micro-batches, prints ``READY``, and in
its first all-reduce prints ``ALLREDUCE`` and stalls, waiting to be killed.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hivemind.p2p import P2P

from models.config import ModelConfig, OptimizerConfig
from models.stages import Stage, even_boundaries
from models.training import StageOptimizer
from node.averaging.averager import AveragedStageServer, StageAverager
from node.averaging.process import StageAveragerProcess
from node.files import load_or_create_key
from node.harness.attackers import ReversingReducer  # noqa: F401  (re-exported for the tests)
from node.rpc.dht import SwarmDHT
from protocol.identity import peer_id_of
from protocol.ownership import make_run_id
from protocol.records import MAX_RECORD_AGE_S
from protocol.run_spec import AveragingSpec, RunSpec
from tests.records import peer_info

LOOPBACK = "/ip4/127.0.0.1/tcp/0"
CFG = ModelConfig(block_size=16, n_layer=2, n_head=2, n_embd=32)
STAGE = 1  # the last stage: block 2 and the head, so a micro-batch has a loss
MICRO = 4
TARGET = 16
# Short timeouts keep the fault tests short; matchmaking stays at 4 report periods.
# Uncompressed rounds: these tests check the averaging's exact arithmetic (a test of 8-bit
# rounds names ``compression="uint8"``).
FAST = {
    "compression": "none",
    "matchmaking_s": 1.0,
    "round_timeout_s": 4.0,
    "report_period_s": 0.25,
    "chunk_timeout_s": 1.0,
    "allreduce_timeout_s": 5.0,
}


# The tests' run owner: a fixed key, so that the victim subprocess derives the same run id.
OWNER = peer_id_of(Ed25519PrivateKey.from_private_bytes(bytes(32)).public_key())
KEYS: dict[str, Ed25519PrivateKey] = {}  # the DHTs' identities, by peer id: to sign records


def start_dht(keys_dir: str, name: str, initial_peers: list[str], run: str = "avg") -> SwarmDHT:
    """A DHT of ``run`` on loopback whose identity key (``keys_dir``/``name``.key) is in
    ``KEYS``."""
    path = Path(keys_dir) / f"{name}.key"
    key = load_or_create_key(path)
    dht = SwarmDHT.start(
        run, host_maddrs=[LOOPBACK], initial_peers=initial_peers, identity_path=path
    )
    KEYS[dht.peer_id] = key
    return dht


def start_pair(keys_dir: str, spec: RunSpec, prefix: str) -> tuple[list[SwarmDHT], list[Peer]]:
    """Two DHTs of their own (the second bootstrapped from the first; the caller shuts them
    down) and a peer of ``spec``'s stage on each."""
    first = start_dht(keys_dir, f"{prefix}0", [])
    second = start_dht(keys_dir, f"{prefix}1", first.visible_maddrs())
    return [first, second], [Peer(SwarmDHT(d.dht, spec.run), spec) for d in (first, second)]


async def stop_serving(
    servers: list[AveragedStageServer], client: P2P | None, peers: list[Peer]
) -> None:
    """Shut down the stage servers, the callers' P2P (if started) and the peers' averagers."""
    for server in servers:
        await server.shutdown()
    if client is not None:
        await client.shutdown()
    for peer in peers:
        if peer.averager is not None:
            await peer.averager.shutdown()


def make_spec(name: str, max_staleness: int = 0, **averaging) -> RunSpec:
    """A run of ``CFG`` cut in two, owned by ``OWNER``, with ``FAST`` averaging settings
    and uncompressed stage boundaries."""
    optim = OptimizerConfig(
        micro_batch_size=MICRO, target_batch_size=TARGET, warmup_steps=0,
        max_staleness=max_staleness,
    )  # fmt: skip
    return RunSpec(
        run=make_run_id(name, OWNER),
        owner=OWNER,
        arch=CFG.to_dict(),
        optimizer=optim.to_dict(),
        boundaries=tuple((r.start, r.end) for r in even_boundaries(CFG, 2)),
        compression="none",
        averaging=AveragingSpec(**(FAST | averaging)),
    )


def batch(seed: int, b: int = MICRO) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, CFG.block_size, CFG.n_embd, generator=g)  # (B, T, C) hidden states
    y = torch.randint(0, CFG.vocab_size, (b, CFG.block_size), generator=g)
    return x, y


def backward(stage: Stage, seed: int) -> int:
    x, y = batch(seed)
    (stage(x, y) * len(x)).backward()
    return len(x)


def backward_tokens(stage: Stage, x: torch.Tensor, y: torch.Tensor) -> int:
    """Backward of ``loss * B`` of a stage holding the whole model on tokens (B, T) and
    targets (B, T); the samples."""
    (stage(x, y) * len(x)).backward()
    return len(x)


@dataclass
class Peer:
    dht: SwarmDHT
    spec: RunSpec
    stage: Stage = field(init=False)
    optimizer: StageOptimizer = field(init=False)
    stage_index: int = STAGE
    averager: StageAverager | None = None
    fed: int = 0  # samples fed

    def __post_init__(self) -> None:
        self.stage = Stage(self.spec.model, self.spec.stage_range(self.stage_index))
        self.optimizer = StageOptimizer(self.stage, self.spec.optim)

    async def start(self, record: bool = True, **seams) -> StageAverager:
        """Create the averager (after publishing the peer's record in the run, unless not
        ``record``); ``seams``: ``StageAverager.create``'s fault seams (``process_class``,
        ``outgoing``)."""
        key = KEYS[self.dht.peer_id]
        if record:
            n = self.spec.n_stages
            info = peer_info(self.spec.run, self.dht.peer_id, throughput=(1.0,) * n, stage=None)
            assert await self.dht.publish_peer(info, key, ttl_s=MAX_RECORD_AGE_S)
        self.averager = await StageAverager.create(
            self.dht, self.spec, self.stage_index, self.stage, self.optimizer, key=key, **seams
        )
        return self.averager

    def feed(self, seed: int) -> None:
        """One micro-batch of random hidden states (a last stage of ``CFG``), as a stage
        server serves it (call from any thread)."""
        self._accumulate(lambda: backward(self.stage, seed))

    def feed_tokens(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """One micro-batch of tokens (B, T) and targets (B, T), for a stage that holds the
        whole model."""

        self._accumulate(lambda: backward_tokens(self.stage, x, y))

    def _accumulate(self, backward_fn: Callable[[], int]) -> None:
        assert self.averager is not None
        with self.averager.lock:
            n = backward_fn()
            self.optimizer.accumulated(n)
            self.fed += n
            self.averager.on_accumulated()

    def params(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.stage.named_parameters()}


class _StallingProcess(StageAveragerProcess):
    """Fault: announces its first all-reduce and stalls in it (to be killed there)."""

    async def _run_allreduce_inplace_(self, tensors, group_info, group_id=None, **kwargs):
        print("ALLREDUCE", flush=True)
        await asyncio.sleep(3600)


class Uncritical(StageAveragerProcess):
    """A groupmate that applies whatever its reducers return (a hostile one need not check:
    the noise sender's own checks would refuse honest means, far from its noise)."""

    def check_returned(self, own, shares, weight=None) -> dict:
        return {}


def noise_sender(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Fault (an ``outgoing`` seam): sends random noise of norm 1e3 for its contribution."""
    noise = [torch.randn_like(t, dtype=torch.float32) for t in tensors]
    norm = float(torch.cat([n.reshape(-1) for n in noise]).norm())
    return [(n * (1e3 / norm)).to(t.dtype) for n, t in zip(noise, tensors, strict=True)]


async def _victim(dht: SwarmDHT, spec: RunSpec, seeds: list[int]) -> None:
    peer = Peer(dht, spec)
    averager = await peer.start(process_class=_StallingProcess)
    await averager.load_state()
    for seed in seeds:
        peer.feed(seed)
    print("READY", flush=True)
    await asyncio.sleep(3600)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--run", required=True)
    parser.add_argument("--initial-peer", required=True)
    parser.add_argument("--seeds", type=int, nargs="+", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    spec = make_spec(args.run)
    dht = start_dht(tempfile.mkdtemp(), "victim", [args.initial_peer], spec.run)
    print(f"STARTED {time.time():.3f}", flush=True)
    import uvloop

    uvloop.run(_victim(dht, spec, args.seeds))


if __name__ == "__main__":
    sys.exit(main())
