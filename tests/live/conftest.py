"""The live tier: real ``p2pd`` daemons, DHTs, node processes and swarms on 127.0.0.1.

``make test`` runs this tier in three pytest-xdist workers with ``--dist loadgroup``: the
files are dealt into three groups of about equal time (most of it waiting on timers and
peers, not on the cores), each group in one worker in file order. Which tests share a
worker process (and its threads, forked children and hivemind's process-wide state) is
then the same on every run. ``test_averaging.py`` forks hivemind averagers from the test
process itself and runs apart, in a plain pytest process (the Makefile says why)."""

from __future__ import annotations

import pytest

# Seconds per file in recent runs of ``make test`` on a loaded 2-core machine (pytest
# --durations): resume 289, private 227, assignment 204, ops 184, generate 180, records
# 160, pipeline 152, chaos 94-114, parity 97-113, archive 90-123, llama swarm 79-96, node
# 85, nat 68, dashboard 65, cli 64, llama 40; the rest under 25. The lone node took
# 242-256 training three minutes; training one, 115 (258 the old way, run next, at load
# 7-11). Each group sums to about 850.
GROUPS = {
    "test_lone_node.py": "a",
    "test_private_run.py": "a",
    "test_pipeline.py": "a",
    "test_parity_live.py": "a",
    "test_chaos.py": "a",
    "test_runs.py": "a",
    "test_baseline.py": "a",
    "test_llama_live.py": "a",
    "test_resume.py": "b",
    "test_assignment_live.py": "b",
    "test_archive.py": "b",
    "test_node.py": "b",
    "test_nat.py": "b",
    "test_dashboard.py": "b",
    "test_stage_rpc.py": "b",
    "test_bandwidth.py": "b",
    "test_fuzz.py": "b",
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        item.add_marker(pytest.mark.xdist_group(GROUPS.get(item.path.name, "c")))
