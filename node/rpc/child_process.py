"""Child processes that die with their node: hivemind forks one for the DHT and one per
averager, and a node killed by SIGKILL must not leave them (and their ``p2pd``) behind."""

from __future__ import annotations

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent(parent_pid: int) -> None:
    """In a freshly forked child: ask the kernel for SIGKILL when the parent dies."""
    if sys.platform != "linux":
        return
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)
