"""The base of this node's RPC services on hivemind's P2P: attached once, detached on
shutdown, served under a fixed name."""

from __future__ import annotations

import contextlib
from typing import ClassVar

from hivemind.p2p import P2P, ServicerBase


class NodeServicer(ServicerBase):
    """hivemind names handlers after the concrete class, so a subclass (one that averages,
    one that injects faults) would serve where no client calls: ``service_name`` pins it."""

    service_name: ClassVar[str]
    _p2p: P2P | None = None

    @classmethod
    def _get_handle_name(cls, namespace: str | None, method_name: str) -> str:
        name = f"{cls.service_name}.{method_name}"
        return name if namespace is None else f"{namespace}::{name}"

    async def attach(self, p2p: P2P) -> None:
        await self.add_p2p_handlers(p2p)
        self._p2p = p2p

    async def detach(self) -> None:
        """Stop taking requests (the daemon may already be gone)."""
        if self._p2p is not None:
            with contextlib.suppress(Exception):
                await self.remove_p2p_handlers(self._p2p)
            self._p2p = None

    @property
    def p2p(self) -> P2P | None:
        """The P2P this service is attached to (None once detached)."""
        return self._p2p
