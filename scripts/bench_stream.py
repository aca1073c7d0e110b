"""One libp2p stream through two ``p2pd`` daemons against raw TCP, on one emulated link.

Two hosts with the ``--link`` profile (``scripts.netem``: each host's access link, so a
path crosses two). The receiving host runs a ``p2pd`` (hivemind's ``P2P``, started as a
node starts it, with each of ``--muxers``) behind its latency relay, as a node runs there:
it listens on the namespace's 127.0.0.1 and announces the relay, so the stream sees the
path's round trip as well as its bandwidth. The sender opens a new stream and writes
``--mb`` MB (10^6 bytes) into it, for each of the sizes, ``--repeats`` times per muxer;
the receiver answers the count once it has it all, so a stream's time includes its
opening and one round trip, as an averaging round's part stream does. Raw TCP is
``scripts.netem.probe``'s upload through the same relay, measured in the same run. Prints
each one's MB/s, median [range], and the stream's share of raw TCP: whether a stage call
or an averaging part can fill the link at its round-trip time. Needs root (network
namespaces).

    python -m scripts.bench_stream --link home --mb 2 7 20 --repeats 5
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import subprocess
import sys
import time

from scripts.netem.network import NODE_PORT, RELAY_PORT, Network
from scripts.netem.profiles import PROFILES, profile

HANDLER = "bench-stream-sink"
BLOCK = 1 << 16
WAYS = {"new": "a new stream", "kept": "a stream kept open"}


async def _receive(address: str, muxer: str) -> None:
    """Serve ``HANDLER`` behind this host's relay: read the 8-byte count a stream starts
    with, then that many bytes, and answer how many came."""
    from hivemind.p2p import P2P

    from node.rpc.hivemind_compat import p2pd_options

    with p2pd_options(extra_args=[f"-muxer={muxer}"]):
        p2p = await P2P.create(
            host_maddrs=[f"/ip4/127.0.0.1/tcp/{NODE_PORT}"],
            announce_maddrs=[f"/ip4/{address}/tcp/{RELAY_PORT}"],
        )

    async def sink(_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError):  # the sender closed it
            while True:  # one transfer after another, until the sender closes the stream
                total, n = int.from_bytes(await reader.readexactly(8), "big"), 0
                while n < total and (data := await reader.read(min(BLOCK, total - n))):
                    n += len(data)
                writer.write(n.to_bytes(8, "big"))
                await writer.drain()
        writer.close()

    await p2p.add_binary_stream_handler(HANDLER, sink)
    print(f"/ip4/{address}/tcp/{RELAY_PORT}/p2p/{p2p.peer_id}", flush=True)
    await asyncio.Event().wait()  # until killed


async def _transfer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, total: int) -> int:
    """Send ``total`` bytes, prefixed by their count; the count the receiver answers."""
    writer.write(total.to_bytes(8, "big"))
    block, sent = bytes(BLOCK), 0
    while sent < total:
        writer.write(block[: total - sent])
        await writer.drain()
        sent += min(BLOCK, total - sent)
    return int.from_bytes(await reader.readexactly(8), "big")


async def _send(address: str, muxer: str, maddr: str, sizes: list[int], repeats: int) -> None:
    """Send each of ``sizes`` bytes ``repeats`` times, the sizes taking turns, each into a
    new stream and then into one stream kept open (after one untimed transfer of the
    largest size on it); print each way's and size's MB/s as JSON."""
    from hivemind.p2p import P2P, PeerID

    from node.rpc.hivemind_compat import p2pd_options

    with p2pd_options(extra_args=[f"-muxer={muxer}"]):
        p2p = await P2P.create(host_maddrs=[f"/ip4/{address}/tcp/0"], initial_peers=[maddr])
    peer = PeerID.from_base58(maddr.rsplit("/p2p/", 1)[1])
    rates: dict[str, dict[int, list[float]]] = {w: {n: [] for n in sizes} for w in WAYS}
    try:
        for _ in range(repeats):
            for total in sizes:
                started = time.perf_counter()
                _, reader, writer = await p2p.call_binary_stream_handler(peer, HANDLER)
                got = await _transfer(reader, writer, total)
                rates["new"][total].append(got / 1e6 / (time.perf_counter() - started))
                writer.close()
        _, reader, writer = await p2p.call_binary_stream_handler(peer, HANDLER)
        await _transfer(reader, writer, max(sizes))
        for _ in range(repeats):
            for total in sizes:
                started = time.perf_counter()
                got = await _transfer(reader, writer, total)
                rates["kept"][total].append(got / 1e6 / (time.perf_counter() - started))
        writer.close()
    finally:
        await p2p.shutdown()
    print(json.dumps(rates), flush=True)


def _line(name: str, rates: list[float], raw: float) -> str:
    med = statistics.median(rates)
    return (f"  {name:<42} {med:6.2f} MB/s [{min(rates):.2f}-{max(rates):.2f}], "
            f"n={len(rates)}: {med / raw:.2f} of raw TCP")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--link", default="home", choices=sorted(PROFILES))
    p.add_argument("--mb", type=int, nargs="+", default=[20], help="MB per stream, each size")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--muxers", nargs="+", default=["yamux", "mplex"])
    sub = p.add_subparsers(dest="role")
    r = sub.add_parser("receive")  # inside a namespace: what the benchmark runs
    r.add_argument("address")
    r.add_argument("muxer")
    s = sub.add_parser("send")
    s.add_argument("address")
    s.add_argument("muxer")
    s.add_argument("maddr")
    a = p.parse_args()
    sizes = [mb * 10**6 for mb in a.mb]
    if a.role == "receive":
        asyncio.run(_receive(a.address, a.muxer))
        return
    if a.role == "send":
        asyncio.run(_send(a.address, a.muxer, a.maddr, sizes, a.repeats))
        return

    me = [sys.executable, "-m", "scripts.bench_stream", "--mb", *map(str, a.mb),
          "--repeats", str(a.repeats)]  # fmt: skip
    with Network([profile(a.link)] * 2) as net:
        there, here = net.hosts
        net.start_relay(there)
        raw, rtt = [], []
        for _ in range(a.repeats):
            got = net.probe(here, there)
            raw.append(got["up_mbit"] / 8)
            rtt.append(got["rtt_ms"])
        results = {}
        for muxer in a.muxers:
            receiver = subprocess.Popen(there.exec([*me, "receive", there.address, muxer]),
                                        stdout=subprocess.PIPE, text=True)  # fmt: skip
            try:
                maddr = receiver.stdout.readline().strip()
                out = subprocess.run(
                    here.exec([*me, "send", here.address, muxer, maddr]),
                    capture_output=True, text=True, check=True, timeout=600,
                )  # fmt: skip
                results[muxer] = json.loads(out.stdout.strip().splitlines()[-1])
            finally:
                receiver.kill()
                receiver.wait()
    raw_med = statistics.median(raw)
    print(f"'{a.link}' (two access links), sender to receiver through the receiver's relay; "
          f"round trip {statistics.median(rtt):.0f} ms (median of {len(rtt)})")  # fmt: skip
    print(_line("raw TCP", raw, raw_med))
    for muxer, by_way in results.items():
        for way, by_size in by_way.items():
            for mb, rates in zip(a.mb, by_size.values(), strict=True):
                print(_line(f"p2pd {muxer}, {WAYS[way]}, {mb} MB", rates, raw_med))


if __name__ == "__main__":
    main()
