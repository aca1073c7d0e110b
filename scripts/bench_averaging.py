"""Averaging among the peers of a stage on loopback (``node.averaging.averager``).

    python -m scripts.bench_averaging [--preset tiny] [--rounds 20] [--compression none]
        [--allreduce-mb 100] [--allreduce-peers 2 4] [--micro-batches 800] [--inner-steps 10 50]
        [--gradient-micro-batches N] [--compressed 0.1:uint8 ...] [--repeats N]
        [--matchmaking-s S] [--round-timeout-s S] [--stagger-s 0.2] [--allreduce-timeout-s S]
    python -m scripts.bench_averaging --profile [--part-kib 512 2048] [--profile-repeats 5]
        [--small-kb 482] [--rounds 20] [--allreduce-mb 100] [--allreduce-peers 2 4]

Three measurements in one run (a count of 0 skips one). Every peer is its own hivemind DHT
and averager process, on 127.0.0.1.

1. Rounds (``--rounds``): two peers hold stage 0 of the preset cut in two and are fed
   ``target_batch_size / 2`` samples each per round, peer 1 ``--stagger-s`` after peer 0
   (as the last micro-batch of a batch lands on one peer), each publishing its progress
   once fed (as a server does when it admits one). Printed side by side: a local
   ``StageOptimizer.step`` on the same stage; a round from its start to the applied step
   (``AveragingStats.round_s``: matchmaking, all-reduce, apply); and the time from the
   last micro-batch fed to both copies stepped, which adds the progress report period
   (peers see each other's samples through the DHT). Then the largest difference between
   the two copies.
2. All-reduce throughput (``--allreduce-mb``): 2 and 4 peers average one float32 tensor of
   that many MB (10^6 bytes), uncompressed, with the averager process and round settings
   a stage uses (``StageAveragerProcess``, ``process_settings``), against a raw TCP copy of
   the same bytes over loopback between two threads, measured in the same run. All-reduce
   MB/s is the tensor's size over the round time (all peers call ``step`` -> all hold the
   average); in that time each peer sends and receives 2(n-1)/n of the tensor.
With ``--profile``, the rounds measurement, then, in place of 2 and 3: (P1) the CPU
seconds of a ``--allreduce-mb`` round by kind of process (``_Cpu``: the averagers, the
p2pd daemons, the DHTs, this process) for each part size of ``--part-kib``, alternating
round by round; (P2) a small round of 2 peers (``--small-kb``) split into matchmaking
(``step`` -> the all-reduce seen running) and all-reduce, with its CPU per round.

3. Gradient vs DiLoCo (``--micro-batches``): the demo's training setup in this process:
   the tiny preset, 2 stages x 2 peers, one trainer's data stream, micro-batch i served by
   peer i % 2 of stage 0 and peer (i // 2) % 2 of stage 1 (as a stage server serves it:
   under the stage's lock, then ``on_accumulated``). The same micro-batches in gradient
   mode and in DiLoCo mode for each ``--inner-steps``, dense and with each ``--compressed``
   setting (``density:compression``, e.g. ``0.1:uint8``: compressed DiLoCo,
   ``protocol.sparsify``). Averaging bytes are counted: every frame the averager
   processes send (``node.limits``, purpose ``averaging``: parts and returned means,
   hivemind's framing and failed attempts included). Also printed, for the uncompressed
   runs: the bytes computed from the rounds (per successful round each of a stage's 2
   peers sends half of the stage's tensors and returns the averaged half), and loopback
   bytes (every process on this machine, DHT traffic included) as a cross-check.
   Load-independent figures: counted bytes per successful peer-round, times the
   peer-rounds the schedule makes due per sample (``rounds_due``: gradient mode one round
   per target batch of a stage, DiLoCo one per H target batches of each peer), is the
   bytes per sample as if every due round succeeded; the ratio against gradient mode
   (``--gradient-micro-batches``: its run may be shorter, only its bytes per round count)
   is computed that way for both, next to the counted one, with the failed rounds (steps
   alone, fallbacks, discarded attempts). A note says where a DiLoCo run is due fewer than
   ``MIN_OUTER_STEPS`` outer steps per stage. ``--repeats N`` runs every mode N times, in
   turn, and ends with each figure as median [range] over the runs.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import math
import os
import socket
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hivemind.averaging.control import AveragingStage, StepControl
from hivemind.utils import get_dht_time

from models.data import Corpus, eval_batches, load_corpus, sample_batches, stream_seed
from models.stages import Stage
from models.training import StageOptimizer, evaluate
from node import limits
from node.averaging.averager import StageAverager
from node.averaging.digests import ParamDigest
from node.averaging.process import StageAveragerProcess
from node.averaging.transport import PART_BYTES, process_settings
from node.files import load_or_create_key
from node.rpc.dht import SwarmDHT
from protocol import sparsify
from protocol.averaging import averaging_prefix
from protocol.identity import peer_id_of
from protocol.records import MAX_RECORD_AGE_S, PROTOCOL_VERSION, PeerInfo, PeerState
from protocol.run_spec import AveragingSpec, RunSpec, make_run_spec

LOOPBACK = "/ip4/127.0.0.1/tcp/0"
MB = 10**6
PEERS = 2  # per stage, in the rounds and training measurements
OWNER = peer_id_of(Ed25519PrivateKey.generate().public_key())  # the benchmark's runs


PART_KIB = PART_BYTES // 1024  # a stage's averager's part size

ROUND_SETTINGS: dict[str, float] = {}  # --matchmaking-s, --round-timeout-s, where given


def _spec(name: str, preset: str, **averaging) -> RunSpec:
    """A run's spec, its rounds uncompressed unless ``averaging`` names a compression."""
    settings = AveragingSpec(**({"compression": "none"} | ROUND_SETTINGS | averaging))
    return make_run_spec(name, preset, 2, owner=OWNER, averaging=settings)


KEYS: dict[str, Ed25519PrivateKey] = {}  # the DHTs' identities, by peer id


def _start_dht(keys_dir: str, initial_peers: list[str]) -> SwarmDHT:
    """A DHT on loopback with an identity key of ours (in ``KEYS``), to sign records."""
    path = Path(keys_dir) / f"{len(KEYS)}.key"
    key = load_or_create_key(path)
    dht = SwarmDHT.start(
        "bench", host_maddrs=[LOOPBACK], initial_peers=initial_peers, identity_path=path
    )
    KEYS[dht.peer_id] = key
    return dht


async def _member_averager(
    d: SwarmDHT, spec: RunSpec, stage_index: int, stage: Stage, optimizer: StageOptimizer
) -> StageAverager:
    """An averager of ``stage_index`` on ``d``, after its peer record in ``spec``'s run
    (peers ignore the progress of peers without one)."""
    dht = SwarmDHT(d.dht, spec.run)
    key = KEYS[dht.peer_id]
    info = PeerInfo(
        peer_id=dht.peer_id,
        run=spec.run,
        version=PROTOCOL_VERSION,
        device="cpu",
        throughput=(1.0,) * spec.n_stages,
        throughput_source="declared",
        bandwidth_up_mbps=0.0,
        bandwidth_down_mbps=0.0,
        bandwidth_source="unknown",
        stage=stage_index,
        state=PeerState.SERVING,
        load=0,
        timestamp=get_dht_time(),
    )
    await dht.publish_peer(info, key, ttl_s=MAX_RECORD_AGE_S)
    return await StageAverager.create(dht, spec, stage_index, stage, optimizer, key=key)


def _loopback_bytes() -> int:
    lo = psutil.net_io_counters(pernic=True).get("lo")
    return lo.bytes_sent if lo else 0


# -- 1. rounds ----------------------------------------------------------------------------


def _backward(stage: Stage, optimizer: StageOptimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    b, t = optimizer.config.micro_batch_size, stage.config.block_size
    x = torch.randint(0, stage.config.vocab_size, (b, t), generator=g)  # (B, T) token ids
    out = stage(x)  # (B, T, C)
    out.backward(torch.randn(out.shape, generator=g))
    optimizer.accumulated(b)


def _feed(stage: Stage, optimizer: StageOptimizer, averager: StageAverager, seed: int) -> None:
    """One micro-batch, as a stage server serves it (which publishes our progress as it
    admits one: here, once it is in)."""
    with averager.lock:
        _backward(stage, optimizer, seed)
        averager.on_accumulated()
    averager.progress_changed()


async def _rounds(spec: RunSpec, dhts: list[SwarmDHT], rounds: int, stagger_s: float) -> None:
    stages = [Stage(spec.model, spec.stage_range(0)) for _ in dhts]
    optimizers = [StageOptimizer(s, spec.optim) for s in stages]
    averagers: list[StageAverager] = []
    try:
        for d, s, o in zip(dhts, stages, optimizers, strict=True):
            averagers.append(await _member_averager(d, spec, 0, s, o))
            await averagers[-1].load_state()
        while not all(a.peers == 1 for a in averagers):
            await asyncio.sleep(0.05)

        local = Stage(spec.model, spec.stage_range(0))
        local_opt = StageOptimizer(local, spec.optim)
        local_s = []
        for i in range(5):
            _backward(local, local_opt, 10_000 + i)
            started = time.perf_counter()
            local_opt.step()
            local_s.append(time.perf_counter() - started)

        per_peer = spec.optim.target_batch_size // spec.optim.micro_batch_size // 2
        fed_to_step = []
        for r in range(rounds):
            for k, (s, o, a) in enumerate(zip(stages, optimizers, averagers, strict=True)):
                if k:  # the last micro-batch lands on peer 1 a while after peer 0's
                    await asyncio.sleep(stagger_s)
                for j in range(per_peer):
                    _feed(s, o, a, 1000 * r + 100 * k + j)
            fed = time.perf_counter()
            while not all(a.epoch == r + 1 and not a.busy for a in averagers):
                await asyncio.sleep(0.005)
            fed_to_step.append(time.perf_counter() - fed)

        n_params = sum(p.numel() for p in stages[0].parameters())
        round_s = averagers[0].stats.round_s
        diff = max(
            (p - q).abs().max().item()
            for p, q in zip(stages[0].parameters(), stages[1].parameters(), strict=True)
        )
        print(f"1. rounds: stage 0 of {spec.model.n_layer}-layer preset: {n_params:,} parameters, "
              f"compression {spec.averaging.compression}, {rounds} rounds, peer 1 fed "
              f"{stagger_s * 1e3:.0f} ms after peer 0")  # fmt: skip
        print(f"  local optimizer step        median {statistics.median(local_s) * 1e3:7.1f} ms")
        print(f"  round (start -> applied)    median {statistics.median(round_s) * 1e3:7.1f} ms"
              f"  (max {max(round_s) * 1e3:.1f})")  # fmt: skip
        print(f"  last sample fed -> stepped  median {statistics.median(fed_to_step) * 1e3:7.1f} ms"
              f"  (range {min(fed_to_step) * 1e3:.0f}-{max(fed_to_step) * 1e3:.0f}; report "
              f"period {spec.averaging.report_period_s * 1e3:.0f} ms)")  # fmt: skip
        print(f"  rounds averaged / alone / caught up: {averagers[0].stats.rounds} / "
              f"{averagers[0].stats.alone} / {averagers[0].stats.catch_ups}")  # fmt: skip
        print(f"  largest difference between the copies: {diff:.2e}")
    finally:
        for a in averagers:
            await a.shutdown()


# -- 2. all-reduce throughput -----------------------------------------------------------


def _raw_tcp_s(nbytes: int, repeats: int) -> list[float]:
    """Seconds to copy ``nbytes`` through one loopback TCP connection, thread to thread."""
    payload = os.urandom(nbytes)
    times = []
    with socket.create_server(("127.0.0.1", 0)) as server:
        for _ in range(repeats):
            sink = bytearray(nbytes)

            def receive(sink: bytearray = sink) -> None:
                conn, _ = server.accept()
                with conn:
                    view, got = memoryview(sink), 0
                    while got < nbytes and (n := conn.recv_into(view[got:])):
                        got += n

            receiver = threading.Thread(target=receive)
            receiver.start()
            with socket.create_connection(server.getsockname()) as conn:
                started = time.perf_counter()
                conn.sendall(payload)
                receiver.join()
                times.append(time.perf_counter() - started)
            assert sink == payload, "the raw TCP copy lost bytes"
    return times


def _wait_allreduce(controls: list[StepControl], timeout: float) -> float:
    """Wait for every step; the time (perf_counter) the first all-reduce began."""
    began, deadline = None, time.monotonic() + timeout
    while not all(c.done() for c in controls):
        if began is None and any(
            c.stage in (AveragingStage.RUNNING_ALLREDUCE, AveragingStage.FINISHED) for c in controls
        ):
            began = time.perf_counter()
        if time.monotonic() > deadline:
            raise TimeoutError(f"the all-reduce did not end within {timeout:.0f} s")
        time.sleep(0.002)
    for c in controls:
        gathered = c.result()
        if not isinstance(gathered, dict) or len(gathered) != len(controls):
            raise RuntimeError(f"a round averaged {len(gathered or ())} of {len(controls)} peers")
    return began if began is not None else time.perf_counter()


_EPOCHS = itertools.count()  # the all-reduce rounds' epochs, one per round of the bench


@dataclass
class _Round:
    """One all-reduce round of the throughput measurement."""

    seconds: float  # all peers call ``step`` -> all hold the average
    allreduce: float  # from the first peer seen running the all-reduce to the end
    cpu: dict[str, float]  # CPU seconds spent in the round, by kind of process (``_Cpu``)


class _Cpu:
    """CPU seconds (user + system) of the processes taking part in the bench's rounds, by
    kind: ``averager`` (the peers' averager processes), ``p2pd`` (the daemons, which carry
    the averagers' streams and the DHTs'), ``dht`` (every DHT process of the bench) and
    ``bench`` (this process: it calls ``step`` and waits)."""

    def __init__(self, averagers: list[StageAveragerProcess], dhts: list[SwarmDHT]) -> None:
        dht_processes = [psutil.Process(d.dht.pid) for d in dhts]
        self.kinds: dict[str, list[psutil.Process]] = {
            "averager": [psutil.Process(p.pid) for p in averagers],
            "p2pd": [
                c for d in dht_processes for c in d.children(recursive=True) if "p2pd" in c.name()
            ],
            "dht": dht_processes,
            "bench": [psutil.Process()],
        }

    def seconds(self) -> dict[str, float]:
        """Each kind's CPU seconds so far (a process that is gone counts 0)."""
        result = {}
        for kind, processes in self.kinds.items():
            total = 0.0
            for process in processes:
                try:
                    times = process.cpu_times()
                except psutil.Error:
                    continue
                total += times.user + times.system
            result[kind] = total
        return result


def _allreduce_s(
    spec: RunSpec,
    dhts: list[SwarmDHT],
    n: int,
    nbytes: int,
    repeats: int,
    part_bytes: int | None = None,
) -> list[_Round]:
    """``repeats`` rounds (after a warm-up) of ``n`` peers averaging ``nbytes`` of float32,
    with the round settings a stage uses (``part_bytes``: hivemind's part size instead of
    theirs)."""
    settings = process_settings(spec.averaging)
    if part_bytes is not None:
        settings["part_size_bytes"] = part_bytes
    g = torch.Generator().manual_seed(n)
    processes: list[StageAveragerProcess] = []
    rounds = []
    try:
        for d in dhts[:n]:
            processes.append(
                StageAveragerProcess(
                    [torch.randn(nbytes // 4, generator=g)],
                    d.dht,
                    start=False,
                    state_source=lambda: ({}, []),
                    prefix=averaging_prefix(spec.run, n),
                    allow_state_sharing=False,
                    **settings,
                )
            )
            processes[-1].start()
        for p in processes:
            p.wait_until_ready(60)
        cpu = _Cpu(processes, dhts)
        for r in range(repeats + 1):  # the first round is a warm-up
            epoch = next(_EPOCHS)  # never one a group of earlier processes declared
            for p in processes:
                p.set_round(epoch, n)
            before = cpu.seconds()
            started = time.perf_counter()
            controls = [p.step(weight=1.0, allow_retries=False, wait=False) for p in processes]
            try:
                began = _wait_allreduce(controls, 120.0)
            except Exception as e:  # a loaded machine can time a round out: the next one
                print(f"  a round of {n} peers failed: {e!r:.120}")
                continue
            ended = time.perf_counter()
            after = cpu.seconds()
            if r:
                spent = {k: after[k] - before[k] for k in after}
                rounds.append(_Round(ended - started, ended - began, spent))
    finally:
        for p in processes:
            p.shutdown()
            p.join(10)
    return rounds


def _median(values: list[float]) -> str:
    """A median with its range: ``m [lo-hi]``."""
    return f"{statistics.median(values):.2f} [{min(values):.2f}-{max(values):.2f}]"


def _throughput(spec: RunSpec, dhts: list[SwarmDHT], mb: int, peers: list[int]) -> None:
    nbytes, repeats = mb * MB, 3
    raw = statistics.median(_raw_tcp_s(nbytes, repeats))
    print(f"2. all-reduce of {mb} MB of float32, compression none, median of {repeats} rounds")
    print(f"  raw TCP over loopback (thread to thread): {nbytes / raw / MB:7.1f} MB/s")
    for n in peers:
        rounds = _allreduce_s(spec, dhts, n, nbytes, repeats)
        round_s = statistics.median(r.seconds for r in rounds)
        mb_s = nbytes / round_s / MB
        print(f"  {n} peers: round {round_s:6.2f} s ({mb_s:6.1f} MB/s, "
              f"{mb_s * MB / (nbytes / raw):.3f} of raw TCP), of which all-reduce "
              f"{statistics.median(r.allreduce for r in rounds):6.2f} s; each peer sends and "
              f"receives {2 * (n - 1) / n * mb:.0f} MB")  # fmt: skip
    print("  MB/s of all-reduce: MB of the averaged tensor per second of round time "
          "(all peers call step -> all hold the average)")  # fmt: skip


def _profile(
    spec: RunSpec, dhts: list[SwarmDHT], mb: int, peers: list[int], parts_kib: list[int],
    repeats: int, small_kb: int,
) -> None:  # fmt: skip
    """Where a round's time and CPU go (``--profile``)."""
    nbytes = mb * MB
    raw = statistics.median(_raw_tcp_s(nbytes, 3))
    kinds = ("averager", "p2pd", "dht", "bench")
    print(f"P1. CPU of a {mb} MB round (float32, compression none), {repeats} rounds per "
          f"setting after a warm-up, settings alternating; median [range]; raw loopback TCP "
          f"{nbytes / raw / MB:,.0f} MB/s")  # fmt: skip
    print(f"  {'peers':>5} {'part KiB':>8} {'round s':>17} {'MB/s':>7} {'of TCP':>6} "
          f"{'CPU s/round':>18} " + " ".join(f"{k:>17}" for k in kinds))  # fmt: skip
    for n in peers:
        results: dict[int, list[_Round]] = {kib: [] for kib in parts_kib}
        for _ in range(repeats):  # alternate the settings round by round (load drifts)
            for kib in parts_kib:
                results[kib] += _allreduce_s(spec, dhts, n, nbytes, 1, part_bytes=kib * 1024)
        for kib, rounds in results.items():
            seconds = [r.seconds for r in rounds]
            total = [sum(r.cpu.values()) for r in rounds]
            mb_s = nbytes / statistics.median(seconds) / MB
            by_kind = " ".join(f"{_median([r.cpu[k] for r in rounds]):>17}" for k in kinds)
            if not rounds:
                print(f"  {n:>5} {kib:>8} every round failed")
                continue
            print(f"  {n:>5} {kib:>8} {_median(seconds):>17} {mb_s:>7.1f} "
                  f"{mb_s * MB / (nbytes / raw):>6.3f} {_median(total):>18} {by_kind}")  # fmt: skip
    print(
        "  CPU s/round: all processes of the bench together (every peer's); by kind: the "
        "averager processes, the p2pd daemons\n  (averaging streams and DHT traffic), the "
        "DHT processes, this process; CPU seconds are load-independent, wall time is not"
    )
    small = small_kb * 1000
    rounds = _allreduce_s(spec, dhts, 2, small, max(repeats, 5) * 4)
    seconds = [r.seconds * 1e3 for r in rounds]
    allreduce = [r.allreduce * 1e3 for r in rounds]
    matchmaking = [s - a for s, a in zip(seconds, allreduce, strict=True)]
    print(f"P2. a {small_kb} kB round of 2 peers (the tiny preset's stage 0 is 482 kB), "
          f"{len(rounds)} rounds, ms, median [range]:")  # fmt: skip
    print(f"  step -> all averaged {_median(seconds)}; matchmaking (step -> all-reduce "
          f"seen) {_median(matchmaking)}; all-reduce {_median(allreduce)}")  # fmt: skip
    # CPU times tick every 10 ms: a small round's CPU is the mean over all of them
    mean = {k: sum(r.cpu[k] for r in rounds) / len(rounds) * 1e3 for k in kinds}
    print(
        f"  CPU ms per round (mean over the rounds), all processes: {sum(mean.values()):.0f}; "
        + ", ".join(f"{k} {v:.0f}" for k, v in mean.items())
    )


# -- 3. gradient vs DiLoCo on the demo's setup -----------------------------------------


@dataclass
class Trained:
    label: str
    samples: int
    seconds: float
    val: tuple[float, float]  # before, after (through the copies of peer 0 of each stage)
    val_other: float  # after, through the copies of peer 1
    epochs: list[int]  # per stage
    rounds: int  # successful peer-rounds, all peers
    alone: int  # steps alone (no other peer at our epoch), all peers
    fallbacks: int  # rounds that found no result in time and applied our own, all peers
    discarded: int  # attempts whose result was thrown away (failed), all peers
    averaging_bytes: int  # counted: every averaging frame sent, all peers
    computed_bytes: int | None  # from the rounds (uncompressed runs only)
    loopback_bytes: int
    distance: list[float]  # per stage: relative distance between the copies at the end
    due_per_sample: float  # peer-rounds the schedule makes due per sample (``rounds_due``)
    sent_values: float  # values a peer sends per round (its groupmate's share), mean per round
    part_bytes: float | None  # of those, in 8-bit blocks (uint8 runs only), mean per round

    @property
    def per_round(self) -> float:
        """Counted bytes per successful peer-round (failed attempts' bytes included: an
        upper bound); NaN without a successful round."""
        return self.averaging_bytes / self.rounds if self.rounds else math.nan

    @property
    def scheduled(self) -> float:
        """Bytes per sample as if every round the schedule makes due had succeeded."""
        return self.per_round * self.due_per_sample

    @property
    def counted(self) -> float:
        """Counted bytes per sample (rounds that failed or stepped alone sent little)."""
        return self.averaging_bytes / self.samples

    @property
    def returned_per_value(self) -> float:
        """Bytes per value of what a round sends besides the 8-bit parts (the returned
        means, and framing): uint8 runs only, else NaN."""
        if self.part_bytes is None or not self.rounds:
            return math.nan
        return (self.per_round - self.part_bytes) / self.sent_values


def shares(averaging: AveragingSpec, size: int, peers: int) -> tuple[float, float | None]:
    """What one peer of a stage of ``size`` parameters sends in a round of ``peers``, as
    computed: the values of its groupmates' shares, and their bytes in ``sparsify.encode``'s
    8-bit blocks (one per value, two per block of ``CODEC_BLOCK``; None unless the values
    are rounded to 8 bits)."""
    n = sparsify.sent_count(size, averaging.density) if averaging.mode == "diloco" else size
    values = n * (peers - 1) / peers
    if averaging.compression != "uint8":
        return values, None
    return values, values + 2 * values / sparsify.CODEC_BLOCK


def rounds_due(averaging: AveragingSpec, target_batch: int, n_stages: int, peers: int) -> float:
    """Peer-rounds of averaging per sample that the schedule makes due, with ``peers``
    peers in each of ``n_stages`` stages and every sample through every stage: gradient
    mode averages once per ``target_batch`` of a stage's samples, DiLoCo once per
    ``inner_steps`` batches of each peer's own (``inner_steps x target_batch x peers``
    of the stage's); each round is one peer-round per peer of the stage."""
    if averaging.mode == "diloco":
        per_round = averaging.inner_steps * target_batch * peers
    else:
        per_round = target_batch
    return n_stages * peers / per_round


def outer_steps_due(averaging: AveragingSpec, target_batch: int, peers: int, samples: int) -> int:
    """Whole DiLoCo outer steps per stage that ``samples`` make due (``rounds_due``)."""
    return samples // (averaging.inner_steps * target_batch * peers)


async def _train(
    spec: RunSpec, dhts: list[SwarmDHT], corpus: Corpus, micro_batches: int, label: str
) -> Trained:
    model, optim = spec.model, spec.optim
    copies: list[list[StageAverager]] = []
    try:
        for s in range(spec.n_stages):
            copies.append([])
            for k in range(PEERS):
                stage = Stage(model, spec.stage_range(s))
                averager = await _member_averager(
                    dhts[PEERS * s + k], spec, s, stage, StageOptimizer(stage, optim)
                )
                copies[-1].append(averager)
                await averager.load_state()
        everyone = [a for row in copies for a in row]
        while not all(a.peers == PEERS - 1 for a in everyone):
            await asyncio.sleep(0.05)
        val = eval_batches(corpus.val, model.block_size, optim.micro_batch_size, 8)
        before = evaluate([row[0].module for row in copies], val)
        data = sample_batches(
            corpus.train, model.block_size, optim.micro_batch_size, stream_seed(spec.seed, 0)
        )

        def train() -> None:
            for i in range(micro_batches):
                x, y = next(data)
                first, last = copies[0][i % PEERS], copies[1][(i // PEERS) % PEERS]
                with first.lock, torch.no_grad():
                    hidden = first.module(x)  # (B, T, C)
                hidden.requires_grad_()
                with last.lock:
                    (last.module(hidden, y) * len(x)).backward()
                    last.optimizer.accumulated(len(x))
                    last.on_accumulated()
                with first.lock:  # recomputed, as a server does for a backward call
                    first.module(x).backward(hidden.grad)
                    first.optimizer.accumulated(len(x))
                    first.on_accumulated()

        lo_before, started = _loopback_bytes(), time.perf_counter()
        counted = limits.traffic.counts().bytes[(limits.AVERAGING, limits.SENT)]
        await asyncio.to_thread(train)
        seconds = time.perf_counter() - started
        deadline = time.monotonic() + 60
        while any(a.busy for a in everyone) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        loopback = _loopback_bytes() - lo_before
        counted = limits.traffic.counts().bytes[(limits.AVERAGING, limits.SENT)] - counted
        sizes = [sum(p.numel() for p in row[0].module.parameters()) for row in copies]
        width = 2 if spec.averaging.compression == "float16" else 4
        dense = spec.averaging.density == 1 and spec.averaging.compression != "uint8"
        return Trained(
            label=label,
            samples=micro_batches * optim.micro_batch_size,
            seconds=seconds,
            val=(before, evaluate([row[0].module for row in copies], val)),
            val_other=evaluate([row[1].module for row in copies], val),
            epochs=[row[0].epoch for row in copies],
            rounds=sum(a.stats.rounds for a in everyone),
            alone=sum(a.stats.alone for a in everyone),
            fallbacks=sum(a.stats.fallbacks for a in everyone),
            discarded=sum(a.stats.discarded for a in everyone),
            averaging_bytes=counted,
            # per round, each peer sends half the stage and returns the averaged half
            computed_bytes=sum(
                a.stats.rounds * 2 * (PEERS - 1) * width * size // PEERS
                for row, size in zip(copies, sizes, strict=True)
                for a in row
            )
            if dense
            else None,
            loopback_bytes=loopback,
            distance=[
                ParamDigest.of(list(row[0].module.parameters())).distance(
                    ParamDigest.of(list(row[1].module.parameters()))
                )
                for row in copies
            ],
            due_per_sample=rounds_due(
                spec.averaging, optim.target_batch_size, spec.n_stages, PEERS
            ),
            sent_values=_per_round([shares(spec.averaging, n, PEERS)[0] for n in sizes], copies),
            part_bytes=None
            if spec.averaging.compression != "uint8"
            else _per_round([shares(spec.averaging, n, PEERS)[1] or 0.0 for n in sizes], copies),
        )
    finally:
        for row in copies:
            for a in row:
                await a.shutdown()


def _per_round(per_stage: list[float], copies: list[list[StageAverager]]) -> float:
    """The mean over the successful peer-rounds of a per-stage figure."""
    rounds = [sum(a.stats.rounds for a in row) for row in copies]
    return sum(x * r for x, r in zip(per_stage, rounds, strict=True)) / max(sum(rounds), 1)


def _compressed(text: str) -> tuple[float, str]:
    """``density:compression`` (``--compressed``)."""
    density, _, compression = text.partition(":")
    return float(density), compression or "none"


def _runs(args: argparse.Namespace, repeat: int) -> list[tuple[str, RunSpec, int]]:
    """(label, spec, micro-batches) of one repeat: gradient mode, then for each H dense
    DiLoCo and each ``--compressed`` setting. Run names carry the repeat, so that no
    repeat matches with an earlier one's records."""
    tag = f"r{repeat}"
    gradient = _spec(f"bench-gradient-{tag}", "tiny", compression=args.compression)
    runs = [("gradient", gradient, args.gradient_micro_batches or args.micro_batches)]
    for h in args.inner_steps:
        dense = _spec(
            f"bench-diloco-{h}-{tag}", "tiny", mode="diloco", inner_steps=h,
            compression=args.compression,
        )  # fmt: skip
        runs.append((f"diloco H={h}", dense, args.micro_batches))
        for density, compression in args.compressed:
            name = f"bench-zip-{h}-{density:g}-{compression}-{tag}"
            spec = _spec(
                name, "tiny", mode="diloco", inner_steps=h, density=density, compression=compression
            )
            runs.append((f"H={h} d={density:g} {compression}", spec, args.micro_batches))
    return runs


def _dense_of(r: Trained, results: list[Trained]) -> Trained | None:
    """The uncompressed DiLoCo run at ``r``'s H (None for gradient mode)."""
    h = r.label.removeprefix("diloco ").split()[0]
    return next((d for d in results if d.label == f"diloco {h}"), None)


def _ratio(a: float, b: float) -> float:
    return a / b if b and not math.isnan(b) else math.nan


@dataclass(frozen=True)
class _Figures:
    """What the summary gives for one run of one mode, against the same repeat's others."""

    per_round: float
    scheduled: float  # bytes per sample, every due round succeeded
    counted: float  # bytes per sample, counted
    vs_gradient: float  # gradient's scheduled bytes / sample over this one's
    vs_gradient_counted: float  # the same with counted bytes
    val: float
    vs_loss: float  # val after over uncompressed DiLoCo's at the same H
    returned: float  # bytes per value sent besides the 8-bit parts (uint8 runs)
    rounds: int
    failed: int  # alone + fallbacks + discarded attempts
    epochs: int  # the least over the stages


def figures(results: list[Trained]) -> dict[str, _Figures]:
    """Each run's figures against the gradient run (``results[0]``) and the dense DiLoCo
    run at its H, all from one repeat."""
    base = results[0]
    out = {}
    for r in results:
        dense = _dense_of(r, results)
        out[r.label] = _Figures(
            per_round=r.per_round,
            scheduled=r.scheduled,
            counted=r.counted,
            vs_gradient=_ratio(base.scheduled, r.scheduled),
            vs_gradient_counted=_ratio(base.counted, r.counted),
            val=r.val[1],
            vs_loss=_ratio(r.val[1], dense.val[1]) if dense is not None else math.nan,
            returned=r.returned_per_value,
            rounds=r.rounds,
            failed=r.alone + r.fallbacks + r.discarded,
            epochs=min(r.epochs),
        )
    return out


def spread(values: list[float], fmt: str = ",.0f") -> str:
    """``median [least-largest]`` of the finite ``values`` (``-`` if none)."""
    finite = [v for v in values if not math.isnan(v)]
    if not finite:
        return "-"
    m, lo, hi = statistics.median(finite), min(finite), max(finite)
    return f"{m:{fmt}} [{lo:{fmt}}-{hi:{fmt}}]"


def _print_run(args: argparse.Namespace, results: list[Trained], repeat: int) -> None:
    gradient = args.gradient_micro_batches or args.micro_batches
    print(f"3. gradient vs DiLoCo (run {repeat + 1} of {args.repeats}): tiny, 2 stages x "
          f"{PEERS} peers in this process, {args.micro_batches} micro-batches (gradient "
          f"mode {gradient}), compression {args.compression} (where the label names none); "
          f"load {_load()}")  # fmt: skip
    print(f"  {'mode':<22} {'val before':>10} {'val after':>10} {'(peer 1)':>9} {'epochs':>9} "
          f"{'rounds':>6} {'alone':>5} {'fallb':>5} {'disc':>4} {'bytes/round':>11} "
          f"{'B/sample due':>12} {'counted':>9} {'(computed)':>10} {'vs gradient':>11} "
          f"{'vs loss':>7} {'ret B/v':>7} {'lo/sample':>9} {'samples/s':>9} "
          f"{'apart':>7}")  # fmt: skip
    table = figures(results)
    for r in results:
        f = table[r.label]
        computed = "-" if r.computed_bytes is None else f"{r.computed_bytes / r.samples:,.0f}"
        print(f"  {r.label:<22} {r.val[0]:>10.3f} {r.val[1]:>10.3f} {r.val_other:>9.3f} "
              f"{'/'.join(map(str, r.epochs)):>9} {r.rounds:>6} {r.alone:>5} {r.fallbacks:>5} "
              f"{r.discarded:>4} {f.per_round:>11,.0f} {f.scheduled:>12,.1f} "
              f"{f.counted:>9,.1f} {computed:>10} {f.vs_gradient:>10,.0f}x "
              f"{f.vs_loss:>7.3f} {f.returned:>7.2f} {r.loopback_bytes / r.samples:>9,.0f} "
              f"{r.samples / r.seconds:>9.0f} {max(r.distance):>7.1e}")  # fmt: skip


def _print_summary(args: argparse.Namespace, runs: list[list[Trained]]) -> None:
    tables = [figures(results) for results in runs]
    print(f"3. summary over {len(runs)} runs: median [least-largest]")
    print(f"  {'mode':<22} {'bytes/peer-round':>24} {'bytes/sample due':>24} "
          f"{'vs gradient (due)':>22} {'vs gradient (counted)':>22} {'val after':>20} "
          f"{'vs loss':>20} {'ret B/value':>18} {'rounds':>14} {'failed':>14} "
          f"{'epochs':>10}")  # fmt: skip
    for label in tables[0]:
        rows = [t[label] for t in tables if label in t]

        def col(name: str, fmt: str, rows: list[_Figures] = rows) -> str:
            return spread([float(getattr(f, name)) for f in rows], fmt)

        print(f"  {label:<22} {col('per_round', ',.0f'):>24} {col('scheduled', ',.1f'):>24} "
              f"{col('vs_gradient', ',.0f'):>22} {col('vs_gradient_counted', ',.0f'):>22} "
              f"{col('val', '.3f'):>20} {col('vs_loss', '.3f'):>20} {col('returned', '.2f'):>18} "
              f"{col('rounds', '.0f'):>14} "
              f"{col('failed', '.0f'):>14} {col('epochs', '.0f'):>10}")  # fmt: skip
    print(_LEGEND)


_LEGEND = """\
  bytes/round: counted averaging bytes (every frame the averager processes sent: parts and
  returned means, framing and failed attempts included) per successful peer-round;
  B/sample due: bytes/round x the peer-rounds the schedule makes due per sample (gradient:
  2 stages x 2 peers per target batch; DiLoCo: per H x target batch x 2 peers of a stage's
  samples), as if every due round succeeded; counted: counted bytes / samples (rounds that
  failed or stepped alone send little, so under load this is low); (computed): from the
  rounds, uncompressed runs only; vs gradient: gradient mode's B/sample due over this row's
  (the summary also gives the counted ratio); vs loss: validation loss after over that of
  uncompressed DiLoCo at the same H; ret B/value (uint8 runs): bytes/round less the 8-bit
  parts (computed: a byte per value sent and two per block of 64) per value sent, i.e. the
  returned means and framing; failed: steps alone + fallbacks + discarded attempts,
  all peers; epochs: outer steps (DiLoCo) or steps reached, least stage; lo/sample: all
  loopback traffic on the machine during training; apart: relative distance between the
  two copies of a stage at the end (DiLoCo: after the last inner steps)"""


def _load() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


async def _modes(args: argparse.Namespace, dhts: list[SwarmDHT]) -> None:
    corpus = load_corpus()
    runs = []
    for repeat in range(args.repeats):
        results = []
        for label, spec, micro_batches in _runs(args, repeat):
            results.append(await _train(spec, dhts, corpus, micro_batches, label))
        _print_run(args, results, repeat)
        runs.append(results)
    if args.repeats > 1:
        _print_summary(args, runs)


MIN_OUTER_STEPS = 4  # per stage, in a DiLoCo run whose figures are a headline


def few_outer_steps(micro_batches: int, inner_steps: list[int]) -> list[str]:
    """A line for each H at which ``micro_batches`` make fewer than ``MIN_OUTER_STEPS``
    outer steps per stage due (its figures then rest on few rounds)."""
    optim = _spec("check", "tiny").optim
    samples = micro_batches * optim.micro_batch_size
    lines = []
    for h in inner_steps if micro_batches else ():
        due = outer_steps_due(AveragingSpec(mode="diloco", inner_steps=h), optim.target_batch_size,
                              PEERS, samples)  # fmt: skip
        if due < MIN_OUTER_STEPS:
            need = MIN_OUTER_STEPS * h * optim.target_batch_size * PEERS
            lines.append(
                f"note: --micro-batches {micro_batches} makes {due} outer steps per stage due "
                f"at H = {h}; {MIN_OUTER_STEPS} need {math.ceil(need / optim.micro_batch_size)}"
            )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="tiny", help="for the rounds measurement")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--stagger-s", type=float, default=0.2,
                        help="rounds: peer 1 is fed this long after peer 0")  # fmt: skip
    parser.add_argument("--compression", default="none", choices=["none", "float16"])
    parser.add_argument("--allreduce-mb", type=int, default=100)
    parser.add_argument("--allreduce-peers", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--micro-batches", type=int, default=800, help="gradient vs DiLoCo")
    parser.add_argument("--gradient-micro-batches", type=int,
                        help="gradient mode's micro-batches (default: --micro-batches); its "
                        "bytes per round are what the comparison uses")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=1,
                        help="gradient vs DiLoCo: whole runs of every mode, then each figure "
                        "as median [range]")  # fmt: skip
    parser.add_argument("--inner-steps", type=int, nargs="+", default=[10, 50])
    parser.add_argument("--compressed", type=_compressed, nargs="*", default=[],
                        help="density:compression of compressed DiLoCo runs at each H, "
                        "e.g. 0.1:uint8")  # fmt: skip
    parser.add_argument("--matchmaking-s", type=float, help="averaging.matchmaking_s of every run")
    parser.add_argument("--round-timeout-s", type=float, help="averaging.round_timeout_s")
    parser.add_argument("--allreduce-timeout-s", type=float, help="averaging.allreduce_timeout_s")
    parser.add_argument("--profile", action="store_true",
                        help="where a round's time and CPU go (with the rounds measurement, "
                        "in place of the throughput and gradient vs DiLoCo ones)")  # fmt: skip
    parser.add_argument("--part-kib", type=int, nargs="+", default=[PART_KIB],
                        help="--profile: hivemind part sizes to compare")  # fmt: skip
    parser.add_argument("--profile-repeats", type=int, default=5, help="--profile: rounds each")
    parser.add_argument("--small-kb", type=int, default=482, help="--profile: a small round")
    args = parser.parse_args()
    for key in ("matchmaking_s", "round_timeout_s", "allreduce_timeout_s"):
        if getattr(args, key) is not None:
            ROUND_SETTINGS[key] = getattr(args, key)
    for line in few_outer_steps(args.micro_batches, args.inner_steps):
        print(line)
    limits.install()  # count the averaging frames of the processes forked from here on
    torch.set_num_threads(1)
    n_dhts = max([PEERS * 2 if args.micro_batches else 0, PEERS, *args.allreduce_peers])
    keys = tempfile.mkdtemp(prefix="bench-keys-")
    dhts = [_start_dht(keys, [])]  # before the event loop: forks
    while len(dhts) < n_dhts:
        dhts.append(_start_dht(keys, dhts[0].visible_maddrs()))
    try:
        import uvloop

        if args.rounds:
            spec = _spec(f"bench-{args.preset}", args.preset, compression=args.compression)
            uvloop.run(_rounds(spec, dhts[:PEERS], args.rounds, args.stagger_s))
        if args.profile:
            _profile(_spec("bench-profile", "tiny"), dhts, args.allreduce_mb, args.allreduce_peers,
                     args.part_kib, args.profile_repeats, args.small_kb)  # fmt: skip
            return
        if args.allreduce_mb:
            _throughput(_spec("bench-allreduce", "tiny"), dhts, args.allreduce_mb,
                        args.allreduce_peers)  # fmt: skip
        if args.micro_batches:
            uvloop.run(_modes(args, dhts))
    finally:
        for d in dhts:
            d.shutdown()


if __name__ == "__main__":
    main()
