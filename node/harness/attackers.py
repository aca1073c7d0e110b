"""Attackers of a run that hold nothing but free keys and a hivemind client: for live tests
and ``scripts/bench_attacks.py``.

Each writes into a live run's DHT through a raw ``hivemind.DHT`` that checks nothing
(``attacker_dht``: it stores and serves whatever it is given), or calls a node's stage
handlers from its own ``P2P`` (``RequestFlood``), or averages with a stage's peers and
returns -100 x the mean of the share it reduces (``ReversingReducer``; as a script,
``python -m node.harness.attackers --run RUN --initial-peer MADDR --stage S``, a
groupmate of stage S that does so until killed). Nothing here runs in a node; every
attack targets 127.0.0.1 only, as the swarm it attacks is local."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable
from pathlib import Path

import hivemind
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hivemind.p2p import P2P, PeerID
from hivemind.utils import get_dht_time

from models.stages import Stage
from models.training import StageOptimizer
from node.averaging.averager import StageAverager
from node.averaging.process import StageAveragerProcess
from node.files import load_or_create_key
from node.harness.local_swarm import LOCAL, wait_until
from node.rpc.dht import SwarmDHT
from protocol.identity import peer_id_of
from protocol.keys import peers_key
from protocol.progress import Progress, encode_progress, progress_key
from protocol.records import (
    MAX_RECORD_AGE_S,
    PROTOCOL_VERSION,
    PeerInfo,
    PeerState,
    decode_peer_info,
    encode_peer_info,
)

# An attacker's stores in flight at once, at most, and their bytes: more overruns the pipe
# to hivemind's DHT process on a loaded machine (its reader then drops commands: EAGAIN).
IN_FLIGHT = 64
IN_FLIGHT_BYTES = 32 * 2**10


def attacker_dht(maddr: str) -> hivemind.DHT:
    """A DHT peer of the run that checks nothing: it stores and serves whatever it is given."""
    return hivemind.DHT(initial_peers=[maddr], host_maddrs=[LOCAL], start=True)


def fresh_key() -> tuple[Ed25519PrivateKey, str]:
    """A new signing key and the peer id it gives."""
    secret = Ed25519PrivateKey.generate()
    return secret, peer_id_of(secret.public_key())


def peer_info(run: str, peer_id: str, **changes) -> PeerInfo:
    """A serving peer of stage 1 (of 2) with declared figures, dated now unless changed."""
    fields = {
        "peer_id": peer_id,
        "run": run,
        "version": PROTOCOL_VERSION,
        "device": "cpu",
        "throughput": (50.0, 50.0),
        "throughput_source": "declared",
        "bandwidth_up_mbps": 10.0,
        "bandwidth_down_mbps": 10.0,
        "bandwidth_source": "declared",
        "stage": 1,
        "state": PeerState.SERVING,
        "load": 0,
        "timestamp": get_dht_time(),
    }
    return PeerInfo(**{**fields, **changes})


def padded_record(info: PeerInfo, secret: Ed25519PrivateKey, max_bytes: int) -> bytes:
    """``info`` signed, padded to the largest record of at most ``max_bytes`` (within a
    byte of it, if the fields allow): its device name is 64 characters, as many as fit of
    them control characters (6 bytes each in the record's JSON), and ``samples_served``
    takes up what is left. ``ValueError`` if even the shortest padding takes more."""

    def padded(escaped: int, digits: int = 0) -> bytes:
        fields = {"device": "\x01" * escaped + "x" * (64 - escaped), "samples_served": 10**digits}
        return encode_peer_info(info.model_copy(update=fields), secret)

    def most(fits: Callable[[int], bool], hi: int) -> int:
        lo = 0  # the largest n in [0, hi] that fits, by bisection (fits(0) holds)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
        return lo

    if len(padded(0)) > max_bytes:
        raise ValueError(f"the record takes {len(padded(0))} bytes, more than {max_bytes}")
    escaped = most(lambda k: len(padded(k)) <= max_bytes, 64)
    digits = most(lambda d: len(padded(escaped, d)) <= max_bytes, 18)
    return padded(escaped, digits)


def sybil_flood(
    attacker: hivemind.DHT,
    run: str,
    n: int,
    timeout: float = 120.0,
    max_bytes: int | None = None,
    **changes,
) -> int:
    """Store ``n`` sybil records (each from a new key, serving stage ``i % 2``, dated now,
    living as long as a record may) with ``changes``, ``IN_FLIGHT`` stores (or
    ``IN_FLIGHT_BYTES`` of them) at a time;
    with ``max_bytes`` (a run's ``PeerBounds.max_bytes``), each padded to the largest size
    that bound lets through (``padded_record``). Returns the size of one in bytes.
    ``TimeoutError`` if they are not all stored within ``timeout``."""
    key, pending, size = peers_key(run), [], 0
    deadline = time.monotonic() + timeout
    for i in range(n + 1):
        most = max(1, min(IN_FLIGHT, IN_FLIGHT_BYTES // max(size, 1)))
        while len(pending) >= most or (i >= n and pending):
            try:
                pending.pop(0).result(timeout=max(0.1, deadline - time.monotonic()))
            except TimeoutError:
                raise TimeoutError(
                    f"the attacker stored {i - len(pending) - 1} of {n} records in {timeout:.0f} s"
                ) from None
        if i >= n:
            continue
        secret, peer_id = fresh_key()
        now = get_dht_time()
        fields = {"stage": i % 2, "timestamp": now, "ttl_s": MAX_RECORD_AGE_S, **changes}
        info = peer_info(run, peer_id, **fields)
        raw = (
            encode_peer_info(info, secret)
            if max_bytes is None
            else padded_record(info, secret, max_bytes)
        )
        size = len(raw)
        expiration = now + MAX_RECORD_AGE_S
        pending.append(attacker.store(key, raw, expiration, subkey=peer_id, return_future=True))
    return size


def own_record(attacker: hivemind.DHT, run: str, peer_id: str) -> tuple[bytes, float] | None:
    """``peer_id``'s record as the DHT holds it now, and its date (None if none is there)."""
    found = attacker.get(peers_key(run), latest=True)
    item = found.value.get(peer_id) if found and isinstance(found.value, dict) else None
    if item is None:
        return None
    info = decode_peer_info(item.value, subkey=peer_id, run=run, now=get_dht_time(), max_age_s=60)
    return item.value, info.timestamp


def replay_record(
    attacker: hivemind.DHT, run: str, peer_id: str, age_s: float = 5.0, timeout: float = 30.0
) -> bool:
    """Re-store ``peer_id``'s own record once it is ``age_s`` old, to expire 110 s after its
    date (past when the peer's fresh records expire): were it taken, the DHT would keep it
    over them. Whether the attacker's DHT took it (its own storage always does)."""
    raw, dated = wait_until(lambda: own_record(attacker, run, peer_id), timeout, "a record")
    wait_until(lambda: get_dht_time() > dated + age_s, age_s + 10, f"the record to age {age_s} s")
    return bool(
        attacker.store(peers_key(run), subkey=peer_id, value=raw, expiration_time=dated + 110)
    )


def progress_claim(run: str, peer_id: str, key: Ed25519PrivateKey, now: float) -> bytes:
    """A validly signed progress record of ``peer_id`` claiming epoch 2^50."""
    return encode_progress(Progress(peer_id, 2**50, 0), run=run, key=key, timestamp=now)


def forge_progress(attacker: hivemind.DHT, run: str, n_stages: int) -> dict[str, str]:
    """Claims of being at epoch 2^50 on every stage: unsigned (a bare list), signed by a
    key made up for it, and signed by a "member" whose joining record is stored too.
    Returns the peer id of each kind ("unsigned", "stranger", "member"); ``RuntimeError``
    if the member's record was not stored."""
    (_, unsigned), (stranger_key, stranger), (member_key, member) = (
        fresh_key(),
        fresh_key(),
        fresh_key(),
    )
    now = get_dht_time()
    record = peer_info(run, member, stage=None, state=PeerState.JOINING, timestamp=now)
    raw = encode_peer_info(record, member_key)
    if not attacker.store(peers_key(run), raw, now + 100, subkey=member):
        raise RuntimeError("the DHT did not store the member's record")
    for stage in range(n_stages):
        claims = {
            unsigned: [2**50, 0],
            stranger: progress_claim(run, stranger, stranger_key, now),
            member: progress_claim(run, member, member_key, now),
        }
        for liar, value in claims.items():
            attacker.store(progress_key(run, stage), value, now + 100, subkey=liar)
    return {"unsigned": unsigned, "stranger": stranger, "member": member}


class RequestFlood:
    """``concurrency`` stage requests kept in flight at once against one peer, from a
    ``P2P`` of the attacker's own, on a thread of its own while in the ``with`` block:
    ``request(client, peer)`` makes one call (its errors are counted, not raised). What
    became of the calls: ``outcomes`` (error class name or "served" -> count)."""

    def __init__(self, maddr: str, peer_id: str, request, concurrency: int = 200) -> None:
        self.maddr, self.peer = maddr, PeerID.from_base58(peer_id)
        self.request, self.concurrency = request, concurrency
        self.outcomes: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    async def _run(self) -> None:
        client = await P2P.create(host_maddrs=[LOCAL], initial_peers=[self.maddr])

        async def caller() -> None:
            while not self._stop.is_set():
                try:
                    await self.request(client, self.peer)
                    what = "served"
                except Exception as e:  # the flood's calls are expected to fail
                    what = type(e).__name__
                self.outcomes[what] = self.outcomes.get(what, 0) + 1

        try:
            await asyncio.gather(*(caller() for _ in range(self.concurrency)))
        finally:
            with contextlib.suppress(Exception):
                await client.shutdown()

    def __enter__(self) -> RequestFlood:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=120)


def max_forward(run: str, stage: int, block_size: int, n_embd: int, vocab_size: int):
    """A valid evaluation forward to the last stage ``stage`` of the largest size it takes
    (32 sequences of hidden states and targets): its metadata and tensors."""
    from node.pipeline.wire import serialize
    from protocol.stage_messages import FORWARD, StageMeta

    hidden = torch.randn(32, block_size, n_embd)
    targets = torch.randint(0, vocab_size, (32, block_size))
    return StageMeta(run, stage, FORWARD, 0).encode(), [serialize(hidden), serialize(targets)]


class ReversingReducer(StageAveragerProcess):
    """Fault: returns -100 x the mean of the parts it reduces (its groupmates' shares)."""

    def reduce_parts(self, parts: list[torch.Tensor], weights: list[float]) -> torch.Tensor:
        return -100 * super().reduce_parts(parts, weights)


async def _reverse_averages(dht: SwarmDHT, key: Ed25519PrivateKey, stage_index: int) -> None:
    """Join ``stage_index`` of the run as a groupmate that feeds nothing (it averages with
    weight 0) and reverses what it reduces; print ``READY`` once it holds the stage's
    state, then keep its record in the run fresh (peers average only with peers of the
    run) until cancelled."""
    signed = await dht.wait_for_spec(60)
    if signed is None:
        raise RuntimeError(f"no spec of run {dht.run} came within 60 s")
    spec = signed.spec
    dht.use_spec(spec)

    async def publish() -> None:
        info = peer_info(spec.run, dht.peer_id, throughput=(1.0,) * spec.n_stages, stage=None)
        if not await dht.publish_peer(info, key, ttl_s=MAX_RECORD_AGE_S):
            raise RuntimeError("the DHT did not store the reducer's record")

    await publish()
    stage = Stage(spec.model, spec.stage_range(stage_index))
    optimizer = StageOptimizer(stage, spec.optim)
    averager = await StageAverager.create(
        dht, spec, stage_index, stage, optimizer, key=key, process_class=ReversingReducer
    )
    try:
        await averager.load_state()
        print("READY", flush=True)
        while True:
            await asyncio.sleep(MAX_RECORD_AGE_S / 4)
            await publish()
    finally:
        await averager.shutdown()


def main(argv: list[str] | None = None) -> None:
    """A hostile reducer of one stage of a local run (see the module's docstring)."""
    import argparse
    import tempfile

    import uvloop

    p = argparse.ArgumentParser(description="a groupmate that reverses the means it reduces")
    p.add_argument("--run", required=True)
    p.add_argument("--initial-peer", required=True)
    p.add_argument("--stage", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    path = Path(tempfile.mkdtemp(prefix="reducer-")) / "reducer.key"
    key = load_or_create_key(path)
    dht = SwarmDHT.start(
        args.run, host_maddrs=[LOCAL], initial_peers=[args.initial_peer], identity_path=path
    )
    try:
        uvloop.run(_reverse_averages(dht, key, args.stage))
    finally:
        dht.shutdown()


if __name__ == "__main__":
    main()
