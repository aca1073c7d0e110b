"""Measures what an emulated link delivers: round-trip time and throughput both ways.

``serve`` runs where a node would (behind the host's relay); ``measure`` runs in another
host's namespace and prints one JSON line. The self-test compares it with the profiles.
``connect`` says (one JSON line) whether a TCP connection to an address opens: what the
NAT test asks from either side of a home router.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

CHUNK = 64 * 1024


async def _serve_one(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        mode = await reader.readexactly(1)
    except asyncio.IncompleteReadError:  # a bare connect (``connect``): nothing to serve
        writer.close()
        return
    if mode == b"e":  # echo 64-byte pings
        while ping := await reader.read(64):
            writer.write(ping)
            await writer.drain()
    elif mode == b"u":  # upload: count until EOF, answer the count
        n = 0
        while data := await reader.read(CHUNK):
            n += len(data)
        writer.write(n.to_bytes(8, "big"))
    elif mode == b"d":  # download: stream for the requested seconds
        seconds = int.from_bytes(await reader.readexactly(4), "big") / 1000
        end, block = time.monotonic() + seconds, bytes(CHUNK)
        while time.monotonic() < end:
            writer.write(block)
            await writer.drain()
    writer.close()


async def serve(port: int, host: str = "127.0.0.1") -> None:
    server = await asyncio.start_server(_serve_one, host, port)
    print("probe listening", flush=True)
    async with server:
        await server.serve_forever()


async def measure(host: str, port: int, seconds: float) -> dict:
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(b"e")
    rtts = []
    for _ in range(20):
        started = time.perf_counter()
        writer.write(bytes(64))
        await reader.readexactly(64)
        rtts.append(time.perf_counter() - started)
    writer.close()

    reader, writer = await asyncio.open_connection(host, port)
    writer.write(b"u")
    started, block = time.perf_counter(), bytes(CHUNK)
    while time.perf_counter() - started < seconds:
        writer.write(block)
        await writer.drain()
    writer.write_eof()
    sent = int.from_bytes(await reader.readexactly(8), "big")
    up = sent * 8 / (time.perf_counter() - started) / 1e6
    writer.close()

    reader, writer = await asyncio.open_connection(host, port)
    writer.write(b"d" + int(seconds * 1000).to_bytes(4, "big"))
    started, got = time.perf_counter(), 0
    while data := await reader.read(CHUNK):
        got += len(data)
    down = got * 8 / (time.perf_counter() - started) / 1e6
    writer.close()
    return {"rtt_ms": statistics.median(rtts) * 1000, "up_mbit": up, "down_mbit": down}


async def connect(host: str, port: int, timeout: float) -> dict:
    """``{"ok": true}`` if a TCP connection to ``host:port`` opens within ``timeout``,
    else ``{"ok": false, "error": ...}``."""
    try:
        async with asyncio.timeout(timeout):
            _, writer = await asyncio.open_connection(host, port)
    except (OSError, TimeoutError) as e:
        return {"ok": False, "error": f"{type(e).__name__}: {e}"}
    writer.close()
    return {"ok": True}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve")
    s.add_argument("--port", type=int, required=True)
    s.add_argument("--host", default="127.0.0.1")
    c = sub.add_parser("connect")
    c.add_argument("--to", required=True, metavar="ADDR:PORT")
    c.add_argument("--timeout", type=float, default=3.0)
    m = sub.add_parser("measure")
    m.add_argument("--to", required=True, metavar="ADDR:PORT")
    m.add_argument("--seconds", type=float, default=3.0)
    args = p.parse_args()
    if args.cmd == "serve":
        asyncio.run(serve(args.port, args.host))
        return
    host, port = args.to.rsplit(":", 1)
    if args.cmd == "connect":
        print(json.dumps(asyncio.run(connect(host, int(port), args.timeout))))
    else:
        print(json.dumps(asyncio.run(measure(host, int(port), args.seconds))))


if __name__ == "__main__":
    main()
