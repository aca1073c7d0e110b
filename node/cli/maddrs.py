"""Checks of the multiaddrs a person types, before any daemon starts: what is wrong with
one, and how to write it, in one line. Light: the command line uses it to parse its
arguments, so it imports nothing heavy at module level."""

from __future__ import annotations

import errno
import re
import socket

_HOST_PORT = re.compile(r"^\[?[\w.:-]*?\]?:\d+$")  # 127.0.0.1:31337, [::1]:31337, host:31337
_PEER_FORM = "/ip4/HOST/tcp/PORT/p2p/PEER_ID"
_LISTEN_FORM = "/ip4/0.0.0.0/tcp/PORT"


def _parse(text: str, form: str = _PEER_FORM, where: str = "a node prints its own at start"):
    from multiaddr import Multiaddr

    try:
        return Multiaddr(text)
    except Exception:  # multiaddr raises several kinds, all with long messages
        what = "not a multiaddr" if _HOST_PORT.match(text) else "not a valid multiaddr"
        raise ValueError(f"{text!r} is {what}: write it as {form} ({where})") from None


def _protocols(maddr) -> list[str]:
    return [p.name for p in maddr.protocols()]


def check_peer_maddr(text: str) -> str:
    """A peer's address to dial: a multiaddr that ends with the peer's id."""
    if "p2p" not in _protocols(_parse(text)):
        raise ValueError(
            f"{text!r} has no /p2p/PEER_ID part: give the whole address a node prints at "
            f"start ({_PEER_FORM})"
        )
    return text


def check_listen_maddr(text: str) -> str:
    """An address of this machine to listen on."""
    protocols = _protocols(_parse(text, _LISTEN_FORM, "0.0.0.0: every interface"))
    if "p2p" in protocols:
        raise ValueError(f"{text!r}: an address to listen on has no /p2p/ part")
    return text


def check_announce_maddr(text: str) -> str:
    """An address others should dial: it needs an explicit port."""
    maddr = _parse(text, "/ip4/PUBLIC_IP/tcp/PORT", "the address and port others reach")
    for proto in ("tcp", "udp"):
        if proto in _protocols(maddr) and maddr.value_for_protocol(proto) == "0":
            raise ValueError(f"{text!r}: an announced address needs an explicit port, not 0")
    return text


_BIND_HINTS = {
    errno.EADDRINUSE: "another program uses that port: choose another in --host-maddrs "
    "(tcp/0 takes any free one)",
    errno.EADDRNOTAVAIL: "it is not an address of this machine: listen on /ip4/0.0.0.0/... "
    "and give the public address with --announce-maddrs",
    errno.EACCES: "ports below 1024 need privileges: choose another in --host-maddrs",
}


def check_can_listen(text: str) -> None:
    """Whether a TCP listen address is free, by binding it for a moment (with
    SO_REUSEADDR, as the daemon does); ``ValueError`` saying why not. Port 0 and other
    transports are not checked."""
    maddr = _parse(text, _LISTEN_FORM, "0.0.0.0: every interface")
    protocols = _protocols(maddr)
    if "tcp" not in protocols or maddr.value_for_protocol("tcp") == "0":
        return
    if "ip4" in protocols:
        family, host = socket.AF_INET, maddr.value_for_protocol("ip4")
    elif "ip6" in protocols:
        family, host = socket.AF_INET6, maddr.value_for_protocol("ip6")
    else:
        return
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, int(maddr.value_for_protocol("tcp"))))
        except OSError as e:
            hint = _BIND_HINTS.get(e.errno, "choose another address in --host-maddrs")
            reason = (e.strerror or str(e)).lower()
            raise ValueError(f"cannot listen on {text}: {reason}; {hint}") from None
