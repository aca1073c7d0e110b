"""The live tier: real ``p2pd`` daemons, DHTs, node processes and swarms on 127.0.0.1.

``make test`` runs this tier in three pytest-xdist workers with ``--dist loadfile
--no-loadscope-reorder``: each file runs whole in one worker, its tests in file order
(module-scoped swarms start once), and the files are handed out longest first
(``SECONDS``), each to the next worker that is nearly done, so that no long file starts
last while the other workers sit idle. Most of a file's time is spent waiting on timers
and peers, not on the cores. ``test_averaging.py`` forks hivemind averagers from the test
process itself and runs apart, in a plain pytest process (the Makefile says why).

``--dist loadgroup`` with ``xdist_group`` marks does not work with pytest 9 and
pytest-xdist 3.8: xdist renames items through ``Item._nodeid``, which pytest 9 no longer
reads, so every test went to whichever worker was free, and a file's module-scoped swarm
was started in every worker that ran one of its tests."""

from __future__ import annotations

import pytest

# Seconds per file (the sum of its tests' setup, call and teardown in pytest --durations=0)
# in one run of this tier on a loaded 2-core machine, for the order the files are handed
# out in; a file not listed (a few seconds, or new) counts as ``UNLISTED_S``. Only the
# order matters: within a factor of two is close enough.
SECONDS = {
    "test_relay.py": 380,
    "test_pipeline.py": 330,
    "test_resume.py": 235,
    "test_lone_node.py": 195,
    "test_chaos.py": 190,
    "test_assignment_live.py": 180,
    "test_generate_live.py": 160,
    "test_ops_live.py": 150,
    "test_llama_swarm.py": 145,
    "test_private_run.py": 140,
    "test_node_records.py": 130,
    "test_archive.py": 120,
    "test_no_relay.py": 115,
    "test_parity_live.py": 90,
    "test_limits.py": 75,
    "test_node.py": 65,
    "test_dashboard.py": 65,
    "test_stage_rpc.py": 65,
    "test_nat.py": 60,
    "test_llama_live.py": 45,
    "test_runs.py": 40,
    "test_gossip.py": 35,
    "test_cli.py": 30,
    "test_data_live.py": 30,
    "test_baseline.py": 25,
    "test_bandwidth.py": 25,
}
UNLISTED_S = 30


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Longest files first; a file's tests stay together and in their order."""
    items.sort(key=lambda item: -SECONDS.get(item.path.name, UNLISTED_S))
