"""Ending a daemon's process once it has closed everything it owns."""

from __future__ import annotations

import atexit
import contextlib
import gc
import os
import sys
from typing import NoReturn


def exit_closed(code: int) -> NoReturn:
    """End this process with ``code``, skipping the interpreter's own teardown.

    Call it only when every resource of the process is released: for a node, after
    ``Node.close`` (its stages checkpointed, its child processes reaped, its event log
    closed). The ``atexit`` handlers still run (logging flushes and closes its files,
    multiprocessing reaps any child left), then stdout and stderr are flushed. What is
    skipped is the final garbage collection and the teardown of every module, which
    release nothing the OS does not, and which take seconds for a node's objects when
    other processes load the cores."""
    gc.freeze()  # the handlers below may allocate: no collection of the old objects
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed or broken pipe: nothing to flush
            stream.flush()
    os._exit(code)
