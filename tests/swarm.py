"""Helpers for tests on real local swarms: node processes (from
``node.harness.local_swarm``), ``swarmtrain status`` as JSON (once, or watched), a
command's one-line error."""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from subprocess import Popen
from typing import IO, TypeVar

from node.harness.local_swarm import LOCAL, NodeProcess, launch_node, stop_all, wait_until

T = TypeVar("T")

__all__ = [
    "LOCAL",
    "NodeProcess",
    "StatusWatch",
    "cli_error",
    "launch_node",
    "status",
    "stop_all",
    "swarmtrain",
    "wait_until",
]


# What a command prints on stderr when it fails (``node.cli.main``): its one-line error.
_ERROR = re.compile(r"^swarmtrain (\w+): error: (.*)$", re.MULTILINE)


def cli_error(output: str) -> tuple[str, str] | None:
    """The command and message of the last one-line error in ``output`` (a command's
    stderr, or a node's output), or None if there is none."""
    found = _ERROR.findall(output)
    return found[-1] if found else None


def swarmtrain(*args: str, home: str | None = None, stderr: int | IO = subprocess.PIPE) -> Popen:
    """``swarmtrain ARGS`` started in its own process, stdout piped and stderr to ``stderr``
    (piped unless told), as text; ``home``: its HOME (default keys and caches go there)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    if home is not None:
        env["HOME"] = home
    return Popen(
        [sys.executable, "-m", "node.cli", *args],
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        env=env,
    )


def status(
    run: str,
    maddr: str,
    timeout: float = 60,
    *,
    host_maddr: str = LOCAL,
    wrap: Callable[[list[str]], list[str]] | None = None,
) -> dict:
    """``swarmtrain status --json`` as a dict; ``wrap`` turns the command into the one to
    run (e.g. inside a network namespace)."""
    command = [sys.executable, "-m", "node.cli", "status", "--run", run, "--initial-peers",
               maddr, "--host-maddrs", host_maddr, "--json"]  # fmt: skip
    proc = subprocess.run(
        wrap(command) if wrap else command,
        capture_output=True, text=True, timeout=timeout,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


class StatusWatch:
    """``swarmtrain status --json --watch EVERY`` of a run, one process for a whole test:
    each view costs the DHT's lookups only, where each ``status`` call costs a process, its
    imports and its DHT's start (seconds, ten and more on a loaded machine). Use as a
    context manager; the watch stops (Ctrl-C) on exit."""

    def __init__(self, run: str, maddr: str, every: float = 0.5) -> None:
        # stderr to a file: a pipe nobody reads could fill up and block the watch
        self._stderr = tempfile.TemporaryFile("w+")  # noqa: SIM115 (closed by close)
        args = ["--run", run, "--initial-peers", maddr, "--host-maddrs", LOCAL, "--json"]
        self.proc = swarmtrain("status", *args, "--watch", str(every), stderr=self._stderr)
        self._views: queue.Queue[dict | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._views.put(json.loads(line))
        self._views.put(None)  # the watch ended

    def _next(self, deadline: float, what: str) -> dict:
        try:
            view = self._views.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise TimeoutError(f"timed out waiting for {what}") from None
        if view is None:
            code = self.proc.wait()
            self._stderr.seek(0)
            raise RuntimeError(f"status --watch exited {code}:\n{self._stderr.read()[-3000:]}")
        return view

    def next(self, timeout: float = 60) -> dict:
        """The view after the last one read (or one already waiting)."""
        return self._next(time.monotonic() + timeout, "a view from status --watch")

    def view(self, timeout: float = 60) -> dict:
        """A view read after this call: the views already printed are skipped, and the
        next one too (its lookups may have begun before the call)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                self._views.get_nowait()
            except queue.Empty:
                break
        self._next(deadline, "a view from status --watch")
        return self._next(deadline, "a view from status --watch")

    def wait(self, check: Callable[[dict], T], timeout: float, what: str) -> T:
        """The first truthy ``check(view)`` over the views read after this call (as
        ``view``); fail naming ``what`` at the deadline."""
        deadline = time.monotonic() + timeout
        view = self.view(timeout)
        while not (result := check(view)):
            view = self._next(deadline, what)
        return result

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._reader.join(10)
        self._stderr.close()

    def __enter__(self) -> StatusWatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
