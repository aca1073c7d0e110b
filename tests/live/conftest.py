"""The live tier: real ``p2pd`` daemons, DHTs, node processes and swarms on 127.0.0.1.

``make test`` runs this tier in two pytest-xdist workers with ``--dist loadgroup``: the
long swarm tests in one group, everything else in the other, each group in one worker in
file order. Which tests share a worker process (and its threads, forked children and
hivemind's process-wide state) is then the same on every run. ``test_averaging.py``
forks hivemind averagers from the test process itself and runs apart, in a plain pytest
process (the Makefile says why)."""

from __future__ import annotations

import pytest

# Whole minutes of node processes each; together about as long as the rest of the tier.
LONG = {
    "test_lone_node.py",
    "test_chaos.py",
    "test_parity_live.py",
    "test_node.py",
    "test_resume.py",
    "test_dashboard.py",
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        group = "long" if item.path.name in LONG else "rest"
        item.add_marker(pytest.mark.xdist_group(group))
