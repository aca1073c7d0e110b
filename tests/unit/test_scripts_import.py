"""Every benchmark script imports: a name moved or renamed in a shared module must not
leave a script that fails at its first line."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

import scripts

# py-libp2p runs a subprocess at import, and its protobuf descriptors collide with
# hivemind's: that script is exercised by tests/live/test_gossip.py instead.
APART = {"scripts.watch_gossip"}
MODULES = sorted(
    info.name
    for info in pkgutil.walk_packages(scripts.__path__, prefix="scripts.")
    if info.name not in APART
)


@pytest.mark.parametrize("name", MODULES)
def test_script_imports(name: str) -> None:
    importlib.import_module(name)
