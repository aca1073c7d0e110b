"""The DHT client that commands which talk to a run (status, train, generate, export,
runs, run revoke) start from their ``--initial-peers`` and ``--host-maddrs``."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from node.files import load_or_create_key
from node.rpc.dht import SwarmDHT


@contextmanager
def client_dht(
    args: argparse.Namespace,
    run: str | None,
    *,
    identity: Path | None = None,
    startup_timeout_s: float = 60.0,
) -> Iterator[SwarmDHT]:
    """A client of ``run``'s DHT (``None``: no run, as ``swarmtrain runs`` reads), joined
    through ``args.initial_peers`` and listening on ``args.host_maddrs``; shut down on exit.

    ``identity``: the key file the client's peer id comes from (created if missing);
    ``None`` means a fresh identity. Blocking, from the main thread (``SwarmDHT.start``)."""
    if identity is not None:
        load_or_create_key(identity)
    dht = SwarmDHT.start(
        run,
        initial_peers=args.initial_peers,
        host_maddrs=args.host_maddrs,
        identity_path=identity,
        client_mode=True,
        startup_timeout_s=startup_timeout_s,
    )
    try:
        yield dht
    finally:
        dht.shutdown()
