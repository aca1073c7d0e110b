"""A node's log, for a person: the terminal and a rotating file in the run's folder.

hivemind logs through its own handler by default; a node routes it through ours, so its
lines land in the same file in the same format. Tracebacks that hivemind attaches to
refused RPCs and reset connections become one line (the exception's type and message)
unless the node runs with ``-v``. Only this process writes the file: the children that
hivemind forks (the DHT, the averagers) inherit the handler, but their records stay on
the terminal, so that two processes never rotate one file.
"""

from __future__ import annotations

import logging
import os
from logging.handlers import RotatingFileHandler
from pathlib import Path

from hivemind.utils.logging import use_hivemind_log_handler

MAX_BYTES = 10 * 2**20  # per file
BACKUPS = 3  # rotated files kept beside the current one
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class OneLineTracebacks(logging.Filter):
    """Folds the traceback of a hivemind record into its message's last words."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and record.name.startswith("hivemind"):
            error = record.exc_info[1]
            if error is not None:
                record.msg = f"{record.getMessage()} ({type(error).__name__}: {error})"
                record.args = ()
            record.exc_info = None
            record.exc_text = None
        return True


class ThisProcess(logging.Filter):
    """Passes the records of the process that made it only."""

    def __init__(self) -> None:
        super().__init__()
        self.pid = os.getpid()

    def filter(self, record: logging.LogRecord) -> bool:
        return record.process == self.pid


def log_to_file(path: Path, *, verbose: bool) -> RotatingFileHandler:
    """Also log to ``path`` (rotated at ``MAX_BYTES``, ``BACKUPS`` kept), with hivemind's
    records in our handlers and, unless ``verbose``, its tracebacks on one line. Returns
    the file's handler (remove and close it to stop)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    use_hivemind_log_handler("nowhere")
    root = logging.getLogger()
    handler = RotatingFileHandler(path, maxBytes=MAX_BYTES, backupCount=BACKUPS)
    handler.setFormatter(logging.Formatter(FORMAT))
    handler.addFilter(ThisProcess())
    root.addHandler(handler)
    if not verbose:
        for h in root.handlers:
            h.addFilter(OneLineTracebacks())
    return handler
