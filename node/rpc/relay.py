"""Circuit relays (libp2p circuit relay v2, in ``p2pd``): the daemon flags that offer and
use them, and dialling peers that serve through one.

Every node's ``p2pd`` offers a relay, with the limits of ``RelaySettings`` (they take
effect once its AutoNAT finds it public; before, go-libp2p's own small ones apply:
docs/nat.md). A node that joins through initial peers also runs autorelay on them
(trusted relays, no discovery of others): when its AutoNAT finds it private (behind a
NAT), it reserves a slot on them by itself. A node found unreachable then announces one
of them in its record (``PeerInfo.relay``), and peers dial it at
``RELAY/p2p-circuit/p2p/PEER`` (``connect_relayed``): ``p2pd`` never announces a
``/p2p-circuit`` address itself.

Whether a relay holds this node's reservation is told by no ``p2pd`` call:
``reservation_holds`` dials the node through the relay from a short-lived ``p2pd`` of its
own (a fresh identity, with no connection to the node that a dial could reuse, and no
libp2p DHT through which a failed relayed dial could find the node's direct addresses),
and counts only a relayed connection.

Light to import (hivemind only inside ``connect_relayed``): the CLI's parser reads
``RelaySettings``' defaults.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hivemind.p2p import P2P

    from protocol.records import PeerInfo

logger = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 10.0  # one dial through a relay
PROBE_TIMEOUT_S = 30.0  # a reservation check: a daemon's start, a dial, its shutdown
NO_ROUTING_FLAGS = ("-dhtClient=false",)  # after hivemind's -dhtClient=1: no libp2p DHT


@dataclass(frozen=True)
class RelaySettings:
    """What this node's ``p2pd`` does about relays. ``serve``: offer a relay to others,
    within the limits: ``max_reservations`` slots in all, ``max_circuits`` open relayed
    connections per peer, each reset after ``data_limit_bytes`` in either direction or
    ``time_limit_s`` (the caller's next call opens a new one). ``use``: reserve a slot on
    the trusted relays (the initial peers) when AutoNAT finds this node private."""

    serve: bool = True
    use: bool = True
    max_reservations: int = 4
    max_circuits: int = 4
    data_limit_bytes: int = 64 * 2**20
    time_limit_s: int = 600

    def __post_init__(self) -> None:
        for name in ("max_reservations", "max_circuits", "data_limit_bytes", "time_limit_s"):
            if getattr(self, name) < 1:
                raise ValueError(f"relay {name} must be >= 1, got {getattr(self, name)}")
        if self.use and not self.serve:
            raise ValueError(
                "a node that reserves relay slots (use) runs p2pd's relay code, which also "
                "serves go-libp2p's default relay to others: serve=False needs use=False"
            )

    @property
    def dials_circuits(self) -> bool:
        """Whether the ``p2pd`` these settings start can reach a peer through a relay
        (``RELAY/p2p-circuit/p2p/PEER``): not when it does not serve, as its relay code is
        then off altogether (``flags``), circuit transport included."""
        return self.serve

    def flags(self, trusted_relays: Sequence[str] = ()) -> tuple[str, ...]:
        """``p2pd`` flags (they come after hivemind's on its command line, so they win).
        Autorelay runs only where there are ``trusted_relays`` to reserve on.

        Not serving takes a config file besides the flags (``no_relay_config``): ``p2pd``
        starts go-libp2p's relay (its default limits) whenever its config says relaying
        is enabled, whatever ``-relayService`` says, and its default config says so;
        ``-relay=false`` only leaves the config as it is. Without it the daemon also opens
        no stream over a relayed connection: such a node cannot call peers that serve
        through a relay (docs/nat.md)."""
        serve = (
            (
                "-relayService=true",
                f"-relayMaxReservations={self.max_reservations}",
                f"-relayMaxCircuits={self.max_circuits}",
                f"-relayDataLimit={self.data_limit_bytes}",
                f"-relayTimeLimit={self.time_limit_s}s",
            )
            if self.serve
            else (f"-f={no_relay_config()}", "-relay=false", "-relayService=false")
        )
        use = (
            (
                "-autoRelay=true",
                f"-trustedRelays={','.join(trusted_relays)}",
                "-relayDiscovery=false",
            )
            if self.use and trusted_relays
            else ()
        )
        return serve + use


NO_RELAY_CONFIG = b'{"Relay": {"Enabled": false}}'  # the rest: p2pd's defaults and flags


def no_relay_config() -> Path:
    """A ``p2pd`` config file (``-f``) that turns its relay code off: written once, in the
    system's temporary directory (atomically; the same bytes for every node)."""
    from node.files import write_atomic

    path = Path(tempfile.gettempdir()) / "swarmtrain-p2pd-no-relay.json"
    if not path.exists() or path.read_bytes() != NO_RELAY_CONFIG:
        write_atomic(path, NO_RELAY_CONFIG)
    return path


async def connect_relayed(p2p: P2P, records: Iterable[PeerInfo]) -> dict[str, str]:
    """Connect, through its relay, to every peer of ``records`` that serves through one and
    that we have no connection to (then ``p2pd`` holds the circuit address, and every call
    to the peer, from this process or the averager's, goes through it). Returns how we are
    linked to each such peer now: ``"relayed"`` (through a circuit), ``"direct"`` (the
    peer dialled us, or hole punching replaced the circuit) or ``"none"`` (the dial
    failed: logged, and tried again at the next call)."""
    from hivemind.p2p import P2PDaemonError, PeerID
    from multiaddr import Multiaddr

    from node.rpc.hivemind_compat import connect
    from protocol.reachability import circuit_maddr

    relayed = [r for r in records if r.relay is not None]
    if not relayed:
        return {}
    me = p2p.peer_id.to_base58()
    relayed = [r for r in relayed if r.peer_id != me]

    async def links() -> dict[str, str]:
        found: dict[str, set[str]] = {}
        for peer in await p2p.list_peers():
            via = found.setdefault(peer.peer_id.to_base58(), set())
            via.update("relayed" if "p2p-circuit" in str(a) else "direct" for a in peer.addrs)
        return {p: "direct" if "direct" in v else "relayed" for p, v in found.items() if v}

    async def dial(record: PeerInfo) -> None:
        maddr = circuit_maddr(record.relay, record.peer_id)
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT_S):
                await connect(p2p, PeerID.from_base58(record.peer_id), [Multiaddr(maddr)])
        except (TimeoutError, P2PDaemonError, ValueError, OSError) as e:
            logger.debug("could not reach peer %s through its relay: %s", record.peer_id, e)

    before = await links()
    todo = [r for r in relayed if r.peer_id not in before]
    await asyncio.gather(*(dial(r) for r in todo))
    now = await links() if todo else before
    return {r.peer_id: now.get(r.peer_id, "none") for r in relayed}


def _one_line(text: str, limit: int = 300) -> str:
    """``text`` on one line, at most ``limit`` characters: its start and its end, where a
    dial error says why it failed."""
    text = " ".join(text.split())
    if len(text) <= limit:
        return text
    head = limit // 3
    return f"{text[:head]} ... {text[-(limit - head - 5) :]}"


async def reservation_holds(
    relay: str, peer_id: str, *, timeout_s: float = PROBE_TIMEOUT_S
) -> str | None:
    """None if ``relay`` (its ``/ip4/A/tcp/P/p2p/ID`` address) holds a reservation for
    ``peer_id`` (this node): a fresh ``p2pd`` (a new identity, its own sockets; started,
    used and stopped within ``timeout_s``) connects to ``peer_id`` at
    ``RELAY/p2p-circuit/p2p/PEER``, which the relay forwards only on a reservation, and
    the connection is a relayed one; else why not, in one line. Run it from the node's
    process: the dial goes out as the node's would (from its network namespace, through
    its NAT)."""
    from hivemind.p2p import P2P, P2PDaemonError, PeerID
    from multiaddr import Multiaddr

    from node.rpc.hivemind_compat import connect, p2pd_options
    from protocol.reachability import circuit_maddr

    maddr = circuit_maddr(relay, peer_id)
    target = PeerID.from_base58(peer_id)
    probe: P2P | None = None
    sockets: str | None = None
    try:
        sockets = tempfile.mkdtemp(prefix="relay-probe-", dir="/tmp")  # a full /tmp: an OSError
        async with asyncio.timeout(timeout_s):
            # No libp2p DHT (-dhtClient=false): with one, a failed dial through the
            # relay falls back to the node's addresses found there, and from the
            # node's own network the probe reaches it directly, reservation or not.
            with p2pd_options(socket_dir=sockets, extra_args=NO_ROUTING_FLAGS):
                probe = await P2P.create(
                    host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                    dht_mode="client",
                    auto_nat=False,
                    nat_port_map=False,
                    use_relay=True,
                    startup_timeout=timeout_s,
                )
            await connect(probe, target, [Multiaddr(maddr)])
            links = [str(a) for p in await probe.list_peers() if p.peer_id == target
                     for a in p.addrs]  # fmt: skip
        if not any("p2p-circuit" in a for a in links):
            return f"reached the node, but not through the relay ({', '.join(links)})"[:200]
        return None
    except TimeoutError:
        return f"no connection through the relay within {timeout_s:.0f} s"
    except (P2PDaemonError, ValueError, OSError, EOFError) as e:
        return _one_line(f"{type(e).__name__}: {e}")
    finally:
        if probe is not None:
            with contextlib.suppress(Exception):
                await probe.shutdown()
        if sockets is not None:
            shutil.rmtree(sockets, ignore_errors=True)
