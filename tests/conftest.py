"""Shared fixtures. Every test leaves no child process behind: whatever a test started
and did not stop (a node, a p2pd daemon, a hivemind DHT process) is killed and reported."""

from __future__ import annotations

import contextlib
import os

import psutil
import pytest


@pytest.fixture(autouse=True)
def reap_children():
    """Kill the processes a test left behind, so one failing test cannot hang the next."""
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    yield
    left = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    for p in left:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    psutil.wait_procs(left, timeout=10)


@pytest.fixture(scope="session", autouse=True)
def reap_session_children():
    yield
    left = psutil.Process().children(recursive=True)
    for p in left:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    psutil.wait_procs(left, timeout=10)


@pytest.fixture(scope="session")
def corpus():
    """The default corpus (the standard library's sources), read once per session."""
    from models.data import load_corpus

    return load_corpus()


def pytest_configure(config):
    # Each test process runs torch on one thread: tests run real multi-process swarms on
    # two cores, and oversubscribed threads make their timings (and timeouts) erratic.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
