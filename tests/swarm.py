"""Helpers for tests on real local swarms: node processes (from
``node.harness.local_swarm``), ``swarmtrain status`` as JSON, a command's one-line error."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from subprocess import Popen

from node.harness.local_swarm import LOCAL, NodeProcess, launch_node, stop_all, wait_until

__all__ = [
    "LOCAL",
    "NodeProcess",
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


def swarmtrain(*args: str, home: str | None = None) -> Popen:
    """``swarmtrain ARGS`` started in its own process, stdout and stderr piped (text);
    ``home``: its HOME (default keys and caches go there)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    if home is not None:
        env["HOME"] = home
    return Popen(
        [sys.executable, "-m", "node.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
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
