"""The live tier: real ``p2pd`` daemons, DHTs, node processes and swarms on 127.0.0.1.

``make test`` runs this tier in three pytest-xdist workers with ``--dist loadfile
--no-loadscope-reorder``: each file runs whole in one worker, its tests in file order
(module-scoped swarms start once), and the files are handed out longest first
(``SECONDS``), each to the next worker that is nearly done, so that no long file starts
last while the other workers sit idle. A file alone spends most of its time waiting on
timers and peers; three at once keep two cores busy (the Makefile says what that means).
``test_averaging.py`` forks hivemind averagers from the test process itself and runs
apart, in a plain pytest process (the Makefile says why).

``--dist loadgroup`` with ``xdist_group`` marks does not work with pytest 9 and
pytest-xdist 3.8: xdist renames items through ``Item._nodeid``, which pytest 9 no longer
reads, so every test went to whichever worker was free, and a file's module-scoped swarm
was started in every worker that ran one of its tests."""

from __future__ import annotations

import pytest

# Seconds per file (the sum of its tests' setup, call and teardown) in one run of this tier
# in three workers on an otherwise idle 2-core machine, for the order the files are handed
# out in; a file not listed (a few seconds, or new) counts as ``UNLISTED_S``. Only the
# order matters: within a factor of two is close enough.
SECONDS = {
    "test_node.py": 300,
    "test_generate_live.py": 280,
    "test_relay.py": 250,
    "test_resume.py": 210,
    "test_pipeline.py": 200,
    "test_assignment_live.py": 170,
    "test_lone_node.py": 160,
    "test_ops_live.py": 140,
    "test_private_run.py": 140,
    "test_limits.py": 130,
    "test_chaos.py": 120,
    "test_node_records.py": 120,
    "test_no_relay.py": 90,
    "test_parity_live.py": 80,
    "test_llama_swarm.py": 70,
    "test_llama_live.py": 70,
    "test_cli.py": 60,
    "test_nat.py": 60,
    "test_archive.py": 50,
    "test_dashboard.py": 50,
    "test_stage_rpc.py": 40,
}
UNLISTED_S = 20


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Longest files first; a file's tests stay together and in their order."""
    items.sort(key=lambda item: -SECONDS.get(item.path.name, UNLISTED_S))
