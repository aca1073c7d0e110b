"""A TCP relay that adds latency, jitter and loss: the ``netem`` this kernel lacks.

One relay runs in each host's namespace, in front of its node: the node listens on the
namespace's 127.0.0.1 and announces the relay's address, so every connection to it
crosses the relay. A chunk read from one side is written to the other ``delay`` later,
where ``delay`` is the one-way latency of both ends' access links (the dialer is
recognised by its source address) plus a uniform jitter; a chunk never overtakes the
previous one, as TCP bytes cannot. Loss cannot drop bytes of a TCP stream, so a "lost"
chunk is delivered one round trip late: what a fast retransmit costs the application.
Bandwidth is not limited here: ``tbf`` shapes the namespace's veth.

    python -m scripts.netem.relay --listen 10.77.0.2:4000 --target 127.0.0.1:4001 \
        --hosts 10.77.0.2=home 10.77.0.3=datacenter
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import time
from dataclasses import dataclass

from scripts.netem.profiles import Profile, profile

CHUNK = 64 * 1024
QUEUE_CHUNKS = 64  # up to 4 MiB in flight per direction: more than 1 Gbit/s x 20 ms


@dataclass(frozen=True)
class Link:
    """The link between a dialer and this relay's host: both access links in series."""

    delay_s: float
    jitter_s: float
    loss: float

    @classmethod
    def between(cls, a: Profile | None, b: Profile) -> Link:
        ends = [p for p in (a, b) if p is not None]
        survive = 1.0
        for p in ends:
            survive *= 1 - p.loss
        return cls(
            delay_s=sum(p.delay_ms for p in ends) / 1000,
            jitter_s=sum(p.jitter_ms for p in ends) / 1000,
            loss=1 - survive,
        )

    def latency(self, rng: random.Random) -> float:
        """One chunk's one-way latency: delay, jitter, and a round trip more if lost."""
        d = self.delay_s + rng.uniform(-self.jitter_s, self.jitter_s)
        if rng.random() < self.loss:
            d += 2 * self.delay_s
        return max(d, 0.0)


async def _pump(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, path: Link, rng: random.Random
) -> None:
    """Copy ``reader`` to ``writer``, each chunk delayed by ``path``, in order."""
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(QUEUE_CHUNKS)

    async def deliver() -> None:
        while True:
            due, data = await queue.get()
            if not data:
                if writer.can_write_eof():
                    writer.write_eof()
                return
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            writer.write(data)
            await writer.drain()

    async with asyncio.TaskGroup() as tasks:
        tasks.create_task(deliver())
        last = 0.0
        while True:
            data = await reader.read(CHUNK)
            last = max(time.monotonic() + path.latency(rng), last)
            await queue.put((last, data))
            if not data:
                return


class Relay:
    def __init__(self, target: tuple[str, int], own: Profile, by_address: dict[str, Profile]):
        self.target, self.own, self.by_address = target, own, by_address
        self.rng = random.Random()

    async def handle(self, c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter):
        dialer = c_writer.get_extra_info("peername")[0]
        path = Link.between(self.by_address.get(dialer), self.own)
        try:
            t_reader, t_writer = await asyncio.open_connection(*self.target)
        except OSError:
            c_writer.close()
            return
        try:
            async with asyncio.TaskGroup() as tasks:
                tasks.create_task(_pump(c_reader, t_writer, path, self.rng))
                tasks.create_task(_pump(t_reader, c_writer, path, self.rng))
        except* (OSError, asyncio.IncompleteReadError):
            pass  # one side reset: the other is closed below, as a real link would drop it
        finally:
            for w in (c_writer, t_writer):
                w.close()
                with contextlib.suppress(OSError):
                    await w.wait_closed()


def _address(text: str) -> tuple[str, int]:
    host, port = text.rsplit(":", 1)
    return host, int(port)


async def serve(listen: tuple[str, int], relay: Relay) -> None:
    server = await asyncio.start_server(relay.handle, *listen)
    print(f"relay listening on {listen[0]}:{listen[1]}", flush=True)  # the parent waits for it
    async with server:
        await server.serve_forever()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--listen", type=_address, required=True, metavar="ADDR:PORT")
    p.add_argument("--target", type=_address, required=True, metavar="ADDR:PORT")
    p.add_argument("--hosts", nargs="+", required=True, metavar="ADDR=PROFILE",
                   help="every emulated host's address and profile (this one's too)")  # fmt: skip
    args = p.parse_args()
    by_address = {a: profile(n) for a, n in (h.split("=", 1) for h in args.hosts)}
    own = by_address[args.listen[0]]
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(args.listen, Relay(args.target, own, by_address)))


if __name__ == "__main__":
    main()
