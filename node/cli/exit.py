"""Ending a command's process without the interpreter's slowest teardown.

At exit, CPython collects garbage over every object still alive and tears each module
down; for a process that imported torch and hivemind this takes seconds when other
processes load the cores, and releases nothing the OS does not release anyway."""

from __future__ import annotations

import atexit
import contextlib
import gc
import os
import sys
from typing import NoReturn


def exit_frozen(code: int) -> NoReturn:
    """``sys.exit(code)``, with every object alive now left out of the final garbage
    collection (``gc.freeze``). Everything else of a normal exit happens: ``atexit``
    handlers, module teardown, the finalizers of objects freed by reference counting."""
    gc.freeze()
    sys.exit(code)


def exit_closed(code: int) -> NoReturn:
    """End this process with ``code``, skipping the interpreter's own teardown.

    Call it only when every resource of the process is released: for a node, after
    ``Node.close`` (its stages checkpointed, its child processes reaped, its event log
    closed). The ``atexit`` handlers still run (logging flushes and closes its files,
    multiprocessing reaps any child left), then stdout and stderr are flushed. What is
    skipped is the final garbage collection, the teardown of every module and the
    finalizers of the objects still alive."""
    gc.freeze()  # the handlers below may allocate: no collection of the old objects
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed or broken pipe: nothing to flush
            stream.flush()
    os._exit(code)
