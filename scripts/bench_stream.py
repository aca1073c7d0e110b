"""One libp2p stream through two ``p2pd`` daemons against raw TCP, on one emulated link.

Two hosts with the ``--link`` profile (``scripts.netem``: each host's access link, so a
path crosses two) and, on them, a receiving and a sending ``p2pd`` (hivemind's ``P2P``,
started as a node starts it, with each of ``--muxers``). The sender writes ``--mb`` MB
(10^6 bytes) into one stream, ``--repeats`` times per muxer; the receiver answers the
count once it has it all. Raw TCP is ``scripts.netem.probe``'s upload over the same path,
measured in the same run. Prints each one's MB/s, median [range], and the stream's share
of raw TCP: whether a stage call or an averaging part can fill the link at its round-trip
time. Needs root (network namespaces).

    python -m scripts.bench_stream --link home --mb 20 --repeats 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time

from scripts.netem.network import Network
from scripts.netem.profiles import PROFILES, profile

HANDLER = "bench-stream-sink"
PROBE_PORT = 7301
BLOCK = 1 << 16


async def _receive(address: str, muxer: str, total: int) -> None:
    """Serve ``HANDLER``: read ``total`` bytes per stream, answer their count."""
    from hivemind.p2p import P2P

    from node.rpc.hivemind_compat import p2pd_options

    with p2pd_options(extra_args=[f"-muxer={muxer}"]):
        p2p = await P2P.create(host_maddrs=[f"/ip4/{address}/tcp/0"])

    async def sink(_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        n = 0
        while n < total and (data := await reader.read(BLOCK)):
            n += len(data)
        writer.write(n.to_bytes(8, "big"))
        await writer.drain()
        writer.close()

    await p2p.add_binary_stream_handler(HANDLER, sink)
    print((await p2p.get_visible_maddrs())[0], flush=True)
    await asyncio.Event().wait()  # until killed


async def _send(address: str, muxer: str, maddr: str, total: int, repeats: int) -> None:
    """Send ``total`` bytes into a new stream ``repeats`` times; print the MB/s as JSON."""
    from hivemind.p2p import P2P, PeerID

    from node.rpc.hivemind_compat import p2pd_options

    with p2pd_options(extra_args=[f"-muxer={muxer}"]):
        p2p = await P2P.create(host_maddrs=[f"/ip4/{address}/tcp/0"], initial_peers=[maddr])
    peer = PeerID.from_base58(maddr.rsplit("/p2p/", 1)[1])
    rates = []
    try:
        for _ in range(repeats):
            _, reader, writer = await p2p.call_binary_stream_handler(peer, HANDLER)
            started, sent, block = time.perf_counter(), 0, bytes(BLOCK)
            while sent < total:
                writer.write(block)
                await writer.drain()
                sent += len(block)
            got = int.from_bytes(await reader.readexactly(8), "big")
            rates.append(got / 1e6 / (time.perf_counter() - started))
            writer.close()
    finally:
        await p2p.shutdown()
    print(json.dumps(rates), flush=True)


def _line(name: str, rates: list[float], raw: float) -> str:
    med = statistics.median(rates)
    return (f"  {name:<12} {med:6.2f} MB/s [{min(rates):.2f}-{max(rates):.2f}], "
            f"n={len(rates)}: {med / raw:.2f} of raw TCP")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--link", default="home", choices=sorted(PROFILES))
    p.add_argument("--mb", type=int, default=20, help="MB per stream")
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
    total = a.mb * 10**6
    if a.role == "receive":
        asyncio.run(_receive(a.address, a.muxer, total))
        return
    if a.role == "send":
        asyncio.run(_send(a.address, a.muxer, a.maddr, total, a.repeats))
        return

    me = [sys.executable, "-m", "scripts.bench_stream", "--mb", str(a.mb)]
    with Network([profile(a.link)] * 2) as net:
        there, here = net.hosts
        probe = subprocess.Popen(there.exec([sys.executable, "-m", "scripts.netem.probe",
                                             "serve", "--host", there.address,
                                             "--port", str(PROBE_PORT)]),
                                 stdout=subprocess.PIPE, text=True)  # fmt: skip
        try:
            probe.stdout.readline()
            raw = []
            for _ in range(a.repeats):
                measure = [sys.executable, "-m", "scripts.netem.probe", "measure",
                           "--to", f"{there.address}:{PROBE_PORT}"]  # fmt: skip
                out = subprocess.run(
                    here.exec(measure), capture_output=True, text=True, check=True, timeout=60
                )
                raw.append(json.loads(out.stdout)["up_mbit"] / 8)
        finally:
            probe.kill()
        results = {}
        for muxer in a.muxers:
            receiver = subprocess.Popen(there.exec([*me, "receive", there.address, muxer]),
                                        stdout=subprocess.PIPE, text=True)  # fmt: skip
            try:
                maddr = receiver.stdout.readline().strip()
                out = subprocess.run(
                    here.exec([*me, "--repeats", str(a.repeats), "send", here.address, muxer,
                               maddr]),
                    capture_output=True, text=True, check=True, timeout=600,
                )  # fmt: skip
                results[muxer] = json.loads(out.stdout.strip().splitlines()[-1])
            finally:
                receiver.kill()
    raw_med = statistics.median(raw)
    print(f"one stream of {a.mb} MB on '{a.link}' (two access links), sender to receiver:")
    print(_line("raw TCP", raw, raw_med))
    for muxer, rates in results.items():
        print(_line(f"p2pd {muxer}", rates, raw_med))


if __name__ == "__main__":
    main()
