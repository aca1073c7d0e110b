"""Where the dashboard listens: ``--dashboard ADDR``, parsed and bound.

``ADDR`` is ``HOST:PORT`` (an IP address or ``localhost``; IPv6 in brackets,
``[::1]:8765``), a bare ``PORT`` (on 127.0.0.1), ``auto`` (127.0.0.1, a free port chosen
at start and printed) or ``off``. The default is ``DEFAULT``: loopback only. An address
that other machines can reach is used only when the user names it.

Standard library only: ``node.cli.args`` imports this module to check the flag.
"""

from __future__ import annotations

import errno
import ipaddress
import socket
from dataclasses import dataclass

DEFAULT_PORT = 8765
DEFAULT = f"127.0.0.1:{DEFAULT_PORT}"
OFF = "off"
AUTO = "auto"
_LOCALHOST = "localhost"


@dataclass(frozen=True)
class Address:
    """A host (an IP address, as text) and a port (0: any free port)."""

    host: str
    port: int

    @property
    def family(self) -> socket.AddressFamily:
        return socket.AF_INET6 if ":" in self.host else socket.AF_INET

    @property
    def loopback(self) -> bool:
        """Reachable from this machine only."""
        return ipaddress.ip_address(self.host).is_loopback

    def url(self, port: int | None = None) -> str:
        """``http://HOST:PORT/`` (``port``: the one bound, for port 0)."""
        host = f"[{self.host}]" if self.family is socket.AF_INET6 else self.host
        return f"http://{host}:{self.port if port is None else port}/"


def parse_address(text: str) -> Address | None:
    """The address ``text`` names, or None for ``off``. Raises ``ValueError`` with a
    one-line message for anything else."""
    text = text.strip()
    if text.lower() == OFF:
        return None
    if text.lower() == AUTO:
        return Address("127.0.0.1", 0)
    if text.isdigit():
        return Address("127.0.0.1", _port(text, text))
    if text.startswith("["):
        host, sep, port = text[1:].partition("]:")
    else:
        host, sep, port = text.rpartition(":")
    if not sep or not host:
        raise ValueError(
            f"--dashboard {text!r}: expected HOST:PORT, PORT, {AUTO} or {OFF} (e.g. {DEFAULT})"
        )
    if host.lower() == _LOCALHOST:
        host = "127.0.0.1"
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(
            f"--dashboard {text!r}: the host must be an IP address or {_LOCALHOST}, got {host!r}"
        ) from None
    return Address(str(ip), _port(port, text))


def _port(port: str, text: str) -> int:
    if not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"--dashboard {text!r}: the port must be a number from 0 to 65535")
    return int(port)


def bind(address: Address) -> socket.socket:
    """A listening, non-blocking socket on ``address``. A port in use, or a host that is
    not this machine's, is a ``ValueError`` naming it and what to do."""
    sock = socket.socket(address.family, socket.SOCK_STREAM)
    try:
        # A node restarted at once finds its old connections in TIME_WAIT: not "in use".
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if address.family is socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind((address.host, address.port))
        sock.listen(128)
        sock.setblocking(False)
    except OSError as e:
        sock.close()
        where = address.url().removeprefix("http://").rstrip("/")
        if e.errno == errno.EADDRINUSE:
            raise ValueError(
                f"dashboard port {address.port} is in use ({where}; another node?): choose "
                f"another with --dashboard HOST:PORT, or --dashboard {AUTO} (a free port) "
                f"or --dashboard {OFF}"
            ) from None
        raise ValueError(f"cannot serve the dashboard on {where}: {e.strerror}") from None
    return sock


def check_can_bind(address: Address) -> None:
    """Before anything starts: the same ``ValueError`` ``bind`` would raise, if any (the
    node binds again once its event loop runs)."""
    bind(address).close()
