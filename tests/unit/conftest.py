"""The unit tier: no processes, no sockets. Every test here runs with process creation and
socket ``connect``/``bind`` refused, so a test that needs either fails at once and belongs
in ``tests/live``."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import socket
import subprocess

import pytest


class LiveResourceError(RuntimeError):
    """A unit test tried to open a socket or start a process."""


def _refuse(*args, **kwargs):
    raise LiveResourceError("unit tests open no sockets and start no processes: move to tests/live")


@pytest.fixture(autouse=True)
def no_sockets_or_processes(monkeypatch):
    for owner, name in [
        (socket.socket, "connect"),
        (socket.socket, "bind"),
        (subprocess.Popen, "__init__"),
        (asyncio, "create_subprocess_exec"),
        (os, "fork"),
        (multiprocessing.Process, "start"),
    ]:
        monkeypatch.setattr(owner, name, _refuse)
