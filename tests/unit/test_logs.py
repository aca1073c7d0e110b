"""The node's log filters: hivemind's tracebacks on one line, and only this process's
records in the file."""

from __future__ import annotations

import logging
import sys

from node.logs import OneLineTracebacks, ThisProcess


def _record(name: str, exc_info=None, process: int | None = None) -> logging.LogRecord:
    record = logging.LogRecord(
        name, logging.WARNING, __file__, 1, "call to %s failed", ("x",), exc_info
    )
    if process is not None:
        record.process = process
    return record


def test_a_hivemind_traceback_becomes_the_end_of_its_line():
    try:
        raise ConnectionResetError("reset by peer")
    except ConnectionResetError:
        exc_info = sys.exc_info()
    record = _record("hivemind.p2p.servicer", exc_info)
    assert OneLineTracebacks().filter(record)
    assert record.exc_info is None
    assert record.getMessage() == "call to x failed (ConnectionResetError: reset by peer)"
    ours = _record("node.daemon.node", exc_info)
    assert OneLineTracebacks().filter(ours) and ours.exc_info is exc_info  # ours keep theirs


def test_the_file_takes_this_process_records_only():
    only_us = ThisProcess()
    assert only_us.filter(_record("node", process=only_us.pid))
    assert not only_us.filter(_record("node", process=only_us.pid + 1))
