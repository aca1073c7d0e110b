"""Shared fixtures. Every test leaves no child process behind: whatever a test started
and did not stop (a node, a p2pd daemon, a hivemind DHT process) is killed and reported."""

from __future__ import annotations

import contextlib
import os
import signal

import psutil
import pytest

# torch's shared-memory manager (hivemind shares tensors through it) is not a leftover: it
# exits by itself with its last client, and a tensor freed after it was killed aborts the
# process ("terminate called ... Broken pipe"), even after every test passed.
_KEEP = {"torch_shm_manager"}


def _leftovers(exclude: set[int]) -> list[psutil.Process]:
    result = []
    for p in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            if p.pid not in exclude and p.name() not in _KEEP:
                result.append(p)
    return result


@pytest.fixture(autouse=True)
def _sigint_reaches_children() -> None:
    """Children inherit an ignored SIGINT, and Python then never raises KeyboardInterrupt
    in them: hivemind's ``run_in_background`` ignores SIGINT in the process that calls it,
    so a test that started an averager in-process left every later CLI in its worker deaf
    to Ctrl-C. Each test starts with the default handler."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(autouse=True)
def reap_children():
    """Kill the processes a test left behind, so one failing test cannot hang the next."""
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    yield
    left = _leftovers(before)
    for p in left:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    psutil.wait_procs(left, timeout=10)


@pytest.fixture(scope="session", autouse=True)
def reap_session_children():
    yield
    left = _leftovers(set())
    for p in left:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    psutil.wait_procs(left, timeout=10)


@pytest.fixture
def event_log(tmp_path):
    """This process's event log (``node.events``), open for the test: what the node code a
    test runs in-process (a trainer, a service, a DHT) reports there."""
    from node import events

    path = tmp_path / "events.jsonl"
    events.open_log(path)
    try:
        yield path
    finally:
        events.close_log()


@pytest.fixture(scope="session")
def corpus():
    """The default corpus (the standard library's sources), read once per session."""
    from models.data import load_corpus

    return load_corpus()


def pytest_configure(config):
    # Each test process runs torch on one thread: tests run real multi-process swarms on
    # two cores, and oversubscribed threads make their timings (and timeouts) erratic.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
