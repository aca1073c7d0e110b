"""Bandwidth probes between two real hivemind P2P daemons on loopback: figures come out
positive and finite, requests over the limits are refused with a clear error, and the
probe keeps serving after them."""

from __future__ import annotations

import asyncio
import contextlib
import math
import time

import pytest
from hivemind.p2p import P2P, P2PDaemonError, P2PHandlerError
from hivemind.proto import runtime_pb2

from node.measure.bandwidth import (
    MAX_PROBE_BYTES,
    BandwidthError,
    BandwidthProbe,
    measure_bandwidth,
)

LOOPBACK = "/ip4/127.0.0.1/tcp/0"


def _run(body, timeout: float = 60.0):
    return asyncio.run(asyncio.wait_for(body, timeout))


@contextlib.asynccontextmanager
async def _pair(**probe_settings):
    """A P2P serving a ``BandwidthProbe`` and a client P2P that knows it."""
    p2ps: list[P2P] = []
    probe = None
    try:
        server = await P2P.create(host_maddrs=[LOOPBACK])
        p2ps.append(server)
        probe = await BandwidthProbe.create(server, **probe_settings)
        client = await P2P.create(
            host_maddrs=[LOOPBACK], initial_peers=await server.get_visible_maddrs()
        )
        p2ps.append(client)
        yield client, server, probe
    finally:
        if probe is not None:
            await probe.shutdown()
        for p2p in p2ps:
            await p2p.shutdown()


def _size(n: int) -> runtime_pb2.ExpertRequest:
    return runtime_pb2.ExpertRequest(metadata=n.to_bytes(8, "big"))


def _assert_sane(figures: tuple[float, float]) -> None:
    assert len(figures) == 2
    for mbps in figures:
        assert isinstance(mbps, float) and math.isfinite(mbps) and mbps > 0, figures


def test_measured_bandwidth_is_positive_and_finite():
    async def body():
        async with _pair() as (client, server, probe):
            _assert_sane(await measure_bandwidth(client, server.peer_id))
            _assert_sane(await measure_bandwidth(client, server.peer_id, nbytes=1, rounds=1))
            _assert_sane(await measure_bandwidth(client, server.peer_id, nbytes=MAX_PROBE_BYTES))
            assert probe.served == 6 + 3 + 6 and probe.refusals == 0

    _run(body())


def test_oversized_and_malformed_requests_are_refused_and_the_probe_keeps_serving():
    async def body():
        async with _pair() as (client, server, probe):
            stub = BandwidthProbe.get_stub(client, server.peer_id)
            refused = [
                (stub.rpc_download, _size(2**40), "a download of 1099511627776 bytes"),
                (stub.rpc_download, _size(MAX_PROBE_BYTES + 1), "the limit is 2097152"),
                (stub.rpc_download, runtime_pb2.ExpertRequest(metadata=b"\1"), "malformed"),
                (stub.rpc_download, runtime_pb2.ExpertRequest(), "malformed"),
                (
                    stub.rpc_upload,
                    runtime_pb2.ExpertRequest(metadata=bytes(MAX_PROBE_BYTES + 1)),
                    "an upload of 2097153 bytes (the limit is 2097152)",
                ),
            ]
            for call, request, what in refused:
                started = time.monotonic()
                with pytest.raises(P2PHandlerError, match="bandwidth probe refused: .*") as e:
                    await call(request)
                assert what in str(e.value)
                assert time.monotonic() - started < 5
            assert probe.refusals == len(refused)

            # Past the daemon's message limit the call fails at the caller: never sent.
            with pytest.raises(P2PDaemonError, match="exceeds set limit"):
                await stub.rpc_upload(runtime_pb2.ExpertRequest(metadata=bytes(5 * 2**20)))

            # The client checks its own arguments the same way, before any call.
            with pytest.raises(ValueError, match="nbytes must be in 1..2097152"):
                await measure_bandwidth(client, server.peer_id, nbytes=MAX_PROBE_BYTES + 1)

            _assert_sane(await measure_bandwidth(client, server.peer_id))  # still serving
            assert probe.refusals == len(refused)

    _run(body())


def test_a_flood_of_downloads_is_refused_once_the_budget_is_spent():
    async def body():
        mib = 2**20
        # A slow refill (a quarter MiB/s), so that the second round finds the budget spent
        # however slowly the first one ran on a loaded machine.
        async with _pair(max_bytes=mib, burst_bytes=mib, rate_bps=mib // 4) as (c, s, probe):
            with pytest.raises(BandwidthError, match="refused the probe: .* busy, try again"):
                await measure_bandwidth(c, s.peer_id, nbytes=mib, rounds=2)
            deadline = time.monotonic() + 20
            while True:  # the budget refills in 4 s: a measurement passes again soon
                try:
                    _assert_sane(await measure_bandwidth(c, s.peer_id, nbytes=mib, rounds=1))
                    break
                except BandwidthError:
                    if time.monotonic() > deadline:
                        raise
                    await asyncio.sleep(0.1)

    _run(body())


def test_a_peer_that_cannot_be_measured_raises_bandwidth_error():
    async def body():
        async with _pair() as (client, server, probe):
            # The server has no probe on the client's side: it is not served there.
            with pytest.raises(BandwidthError, match="unreachable: .*protocols not supported"):
                await measure_bandwidth(server, client.peer_id, timeout=5)
            await probe.shutdown()
            with pytest.raises(BandwidthError, match="unreachable"):
                await measure_bandwidth(client, server.peer_id, timeout=5)

    _run(body())
