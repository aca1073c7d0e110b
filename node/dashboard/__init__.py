"""The node's dashboard: one HTTP server, in the node's event loop, on 127.0.0.1 by default.

It serves a page a person leaves open (``/``, from ``static/``: no download at run time),
the JSON API that page polls (``/api/state``, documented in docs/dashboard.md) and
Prometheus metrics (``/metrics``). Files:

- ``address``: ``--dashboard ADDR`` (``HOST:PORT``, ``PORT``, ``auto``, ``off``), binding it.
- ``snapshot``: what the node is doing now, read from the ``Node`` (no I/O, no waiting).
- ``tally``: counts of the node's structured events (``node.events``), fed as they happen.
- ``history``: bounded time series (loss, throughput), sampled every few seconds.
- ``state``: the JSON API's document, built from the three above (pure).
- ``metrics``: the Prometheus collector over the same three (pure, per-node registry).
- ``server``: ``Dashboard``, the aiohttp application and the one task it owns.

``address`` imports the standard library only: ``node.cli.args`` imports it, and stays
light (no torch, no hivemind). docs/dashboard.md documents the API and the metrics.
"""
