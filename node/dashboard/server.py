"""``Dashboard``: the node's HTTP server (aiohttp, in the node's event loop).

Routes (all GET, read-only): ``/`` the page, ``/static/NAME`` its script and style (read
from the package once, at start), ``/api/state`` the JSON document (``state``),
``/metrics`` Prometheus' text format (``metrics``). Handlers take a snapshot of the node
and render it: no I/O and no waiting on the node, so a slow or stuck client holds only
its own connection (aiohttp writes each response from its own task), never the loop.

On a loopback address, requests must name a loopback host (``Host: 127.0.0.1:PORT`` or
``localhost``): a web page elsewhere that rebinds its DNS name to 127.0.0.1 is refused.

The dashboard owns one task, the history sampler, and its aiohttp runner; ``close``
cancels and awaits the one and cleans up the other (open connections are given
``SHUTDOWN_S`` to finish).
"""

from __future__ import annotations

import asyncio
import importlib.resources
import json
import logging
import socket
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from node import events
from node.aio import cancel_and_wait
from node.dashboard.address import Address, bind
from node.dashboard.history import CAPACITY, PERIOD_S, History, Totals
from node.dashboard.metrics import NodeCollector, node_registry
from node.dashboard.snapshot import NodeSnapshot
from node.dashboard.state import build_state
from node.dashboard.tally import EventTally

logger = logging.getLogger(__name__)

SHUTDOWN_S = 1.0  # open connections' grace at close
ASSETS = {  # what static/ holds, and its content type
    "index.html": "text/html",
    "dashboard.js": "text/javascript",
    "dashboard.css": "text/css",
}
LOOPBACK_NAMES = {"127.0.0.1", "localhost", "::1"}
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def load_assets() -> dict[str, bytes]:
    """The page's files, from the package (``node/dashboard/static``)."""
    static = importlib.resources.files("node.dashboard") / "static"
    return {name: (static / name).read_bytes() for name in ASSETS}


class Dashboard:
    """The dashboard of one node; build with ``await Dashboard.open(...)``, end with
    ``await close()``. ``source`` returns the node's snapshot (on the event loop)."""

    def __init__(
        self,
        address: Address,
        source: Callable[[], NodeSnapshot],
        assets: dict[str, bytes],
        *,
        period_s: float,
        capacity: int,
    ) -> None:
        self.address = address
        self.period_s = period_s
        self._source = source
        self._assets = assets
        self.tally = EventTally()
        self.history = History(capacity)
        self.registry = node_registry(NodeCollector(source, self.tally, self.history.last))
        self.url = ""  # once bound: http://HOST:PORT/
        self._runner: web.AppRunner | None = None
        self._sampler: asyncio.Task | None = None
        self._unlisten: Callable[[], None] | None = None

    @classmethod
    async def open(
        cls,
        address: Address,
        source: Callable[[], NodeSnapshot],
        *,
        period_s: float = PERIOD_S,
        capacity: int = CAPACITY,
    ) -> Dashboard:
        """Bind ``address`` (a ``ValueError`` naming the port if it is in use), count the
        node's events from now on, start sampling the history, and serve."""
        assets = await asyncio.to_thread(load_assets)
        sock = bind(address)
        self = cls(address, source, assets, period_s=period_s, capacity=capacity)
        try:
            await self._serve(sock)
        except BaseException:
            sock.close()
            await self.close()
            raise
        self.url = address.url(sock.getsockname()[1])
        self._sampler = asyncio.create_task(self._sample_loop(), name="dashboard-history")
        if not address.loopback:
            logger.warning(
                "the dashboard listens on %s: other machines can reach it (it shows the run, "
                "this node and its peers)",
                self.url,
            )
        logger.info("dashboard at %s (Prometheus metrics at %s)", self.url, self.metrics_url)
        return self

    async def _serve(self, sock: socket.socket) -> None:
        self._unlisten = events.listen(self.tally)
        app = web.Application(middlewares=[self._guard], client_max_size=1024)
        app.router.add_get("/", self._page)
        app.router.add_get("/static/{name}", self._static)
        app.router.add_get("/api/state", self._state)
        app.router.add_get("/metrics", self._metrics)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=SHUTDOWN_S)
        await self._runner.setup()
        await web.SockSite(self._runner, sock).start()

    @property
    def metrics_url(self) -> str:
        return self.url + "metrics"

    async def close(self) -> None:
        """Stop counting events and sampling; close the server and its connections."""
        if self._unlisten is not None:
            self._unlisten()
            self._unlisten = None
        if self._sampler is not None:
            await cancel_and_wait(self._sampler, SHUTDOWN_S, "the dashboard's sampler")
            self._sampler = None
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # -- the history ----------------------------------------------------------------

    def sample(self) -> None:
        """Add a point to the history from the node's counters now."""
        self.history.record(Totals.of(self._source()))

    async def _sample_loop(self) -> None:
        while True:
            try:
                self.sample()
            except Exception:  # a bug here must not take the node down: the page shows gaps
                logger.exception("the dashboard could not sample the node")
            await asyncio.sleep(self.period_s)

    # -- HTTP ---------------------------------------------------------------------------

    @web.middleware
    async def _guard(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if self.address.loopback and (request.url.host or "").strip("[]") not in LOOPBACK_NAMES:
            raise web.HTTPForbidden(
                text="this dashboard answers requests for localhost or 127.0.0.1 only\n"
            )
        response = await handler(request)
        response.headers["X-Content-Type-Options"] = "nosniff"
        response.headers["Cache-Control"] = "no-store"
        return response

    def _asset(self, name: str) -> web.Response:
        return web.Response(body=self._assets[name], content_type=ASSETS[name])

    async def _page(self, request: web.Request) -> web.Response:
        response = self._asset("index.html")
        response.headers["Content-Security-Policy"] = "default-src 'self'"
        response.headers["X-Frame-Options"] = "DENY"
        return response

    async def _static(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if name not in self._assets or name == "index.html":
            raise web.HTTPNotFound(text=f"no such file: {name}\n")
        return self._asset(name)

    def state(self) -> dict[str, Any]:
        """The ``/api/state`` document now."""
        return build_state(
            self._source(), self.tally.counts(), self.history.points(), self.period_s
        )

    async def _state(self, request: web.Request) -> web.Response:
        body = json.dumps(self.state(), allow_nan=False, separators=(",", ":"))
        return web.Response(text=body, content_type="application/json")

    async def _metrics(self, request: web.Request) -> web.Response:
        response = web.Response(body=generate_latest(self.registry))
        response.headers["Content-Type"] = CONTENT_TYPE_LATEST
        return response
