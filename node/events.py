"""The node's structured event log: one JSON object per line, the contract that the demo,
the local swarm harness and tests read (human log lines are for people and may change).

Every line is ``{"t": <unix seconds>, "event": <kind>, ...fields}``. The kinds and their
fields:

- ``node.started``: ``run`` (the run id others name to join), ``peer``, ``maddrs``,
  ``dashboard`` (the dashboard page's URL) and ``metrics`` (its Prometheus URL): both
  None with ``--dashboard off``; ``log`` and ``events``: the paths of the node's log file
  (``node.logs``) and of this event log.
- ``node.state``: ``state`` (a ``protocol.records.PeerState`` name).
- ``node.reachability`` (at start, after peers were asked to dial the node back; again,
  every 10 s while the answer is unknown, until one is definite): ``reachable`` (true,
  false, or null: unknown), ``address`` (where peers reached it, or null), ``observed``
  (the IP peers see its connections come from, or null), ``yes`` and ``no`` (peers that
  did and did not reach it), ``declared`` (true: ``--reachable yes`` or ``no`` said so and
  no peer was asked), ``serves`` (false: found unreachable at start, it holds no
  stage and runs as a trainer only, and its DHT stays a client), ``relay`` (null: no
  relay is used; not reachable, it is one found holding the node's reservation),
  ``relays_tried`` (relay peer id -> why it held no reservation for the node, when the
  node looked for one: with ``relay`` null, why it runs as a trainer only).
- ``relay.changed``: ``previous``, ``relay`` (peer ids; ``relay`` null: no initial peer
  holds a reservation for the node now, so routing skips it until one does),
  ``relays_tried`` (as in ``node.reachability``): a node
  serving through a relay found that relay failing its checks and chose another.
- ``relay.link``: ``peer``, ``link`` (``relayed``, ``direct`` or ``none``): how this node
  is linked to a peer that serves through a relay, when that changes.
- ``node.heartbeat`` (every ``--heartbeat`` seconds while serving): ``stage``,
  ``second_stage`` (None when none), ``served`` (micro-batches), ``steps`` (optimizer
  steps of its stages), ``stage_peers`` (peers on its stages, itself included),
  ``run_peers`` (peers in the run, itself included).
- ``peer.joined``: ``peer``, ``stage`` (None before it holds one); ``peer.left``: ``peer``,
  ``announced`` (false: its record has been missing too long). As this node's reads of
  the run's peers see them.
- ``stage.held``: ``stage``, ``role`` (``"first"`` or ``"second"``), ``loaded`` (where its
  state came from: ``"peers"``, ``"archive"``, ``"checkpoint"`` or ``"initial"``),
  ``source`` (the peer or archive node's id, or the checkpoint's path; null for
  ``"initial"``), ``step`` (the optimizer steps that state holds).
- ``stage.released``: ``stage``.
- ``stage.load_failed``: ``stage``, ``error`` (the exception's class and message), ``retry_s``:
  taking the stage as the node's first failed (its live peers handed over no valid state
  in time, say); the node tries again after ``retry_s`` seconds, serving none of it meanwhile.
- ``stage.refused``: ``stage``, ``need`` (bytes training it takes), ``max_memory``
  (``--max-memory``, bytes), ``reason`` (one line): the node refuses to take a stage that
  would not fit (a pinned one, or any of a run none of whose stages fits: it then stops).
- ``placement.chose``: ``stage`` (a joiner's choice), ``resumed`` (true: the stage of its own
  checkpoint, taken without choosing); ``placement.moved``: ``from``, ``to``;
  ``placement.waiting``: ``stage``, ``hold_s``: a node restarted from its checkpoints
  waits up to ``hold_s`` seconds for a peer with ``stage``'s state before taking it as a
  second stage from scratch (``protocol.placement.AwaitSecond``).
- ``averaging.round``: ``stage``, ``epoch`` (the one the copy is at now), ``peers`` (whose
  contributions the step took, us included; 0 for a state loaded), ``ok`` (false: the
  round failed and the copy stepped on its own contribution, or took no step), ``how``
  (``"averaged"``, ``"alone"``, ``"fallback"``, ``"abandoned"``, ``"caught_up"``,
  ``"loaded"``, ``"resync"``: the group averaged, but this copy, forked from the one
  chosen in a fallback, downloads one that took the step instead); ``seconds`` (from the
  round's trigger to its applied step: for
  ``"averaged"``, ``"fallback"`` and a timed ``"alone"``), with them ``idle_s`` (of those
  seconds, how long the stage server's compute thread served no request: the pipeline's
  idle time in the round; absent without a server) and, in DiLoCo, ``inner_steps`` (the
  copy's inner steps meanwhile: without ``AveragingSpec.overlap``, at most the one that
  waited for the round, unless the round held a micro-batch for ``HOLD_S`` and went on
  overlapped); for ``"averaged"`` and ``"fallback"``, the parts of ``seconds`` in order
  (``node.averaging.averager.ROUND_PARTS``), each present once its end was reached:
  ``drain_s`` (waiting for the backwards of the micro-batches admitted at the epoch),
  ``begin_s`` (taking the contribution), ``match_s`` (until the all-reduce of the attempt
  that averaged began: the group had formed), ``allreduce_s``, ``finish_s`` (applying the
  step), with ``attempts`` (tries at averaging) and ``early_match`` (true: the group
  formed in the matchmaking started at the trigger, while the drain ran); for
  ``"averaged"`` also ``ready_s`` (about how long the batch had been complete across the
  group when the round was triggered: since the newest of this peer's last admission and
  its groupmates' progress records); ``digest`` (``hash``: 8 hex
  digits, ``norm``, ``sketch``: 4 floats) of the parameters the copies agree on, when
  digests are on (``SWARMTRAIN_LOG_DIGESTS``), except for ``"abandoned"`` and ``"resync"``;
  ``progress`` (counts since the stage was taken: ``reads`` and ``stores`` of the stage's
  progress records in the DHT, ``pushed`` and ``push_failed``: our records sent straight to
  peers, ``taken``: peers' records pushed to us that updated the view,
  ``admission_reads``: reads before admitting a micro-batch, ``admission_reads_spared``:
  those skipped as every peer in the view had pushed lately).
- ``averaging.part_rejected``: ``reducer`` (a groupmate's peer id), ``reason``: the means
  it returned for the share it reduced cannot be a mean of parts that include ours
  (``protocol.averaging.check_returned``): the round fails; ``refused``: the groupmate is
  refused for a while from now on (at once for non-finite or far-out means, else after
  refusals in several rounds) (written by the averager's process).
- ``averaging.resync``: ``stage``, ``epoch``, ``source`` (a groupmate's peer id): the
  group of the round of ``epoch`` held copies of different lineages (a fallback forked
  them), and this copy downloads ``source``'s (``protocol.averaging.resync_source``).
- ``averaging.held``: ``stage``, ``epoch``, ``seconds``, ``peers`` (peer ids): this copy's
  step at ``epoch`` was due and waited ``seconds`` for ``peers``, behind it and
  downloading the state, to land (``protocol.averaging.Patience``); written when the wait
  ends (they landed, the window closed, or its budget ran out).
- ``averaging.clock_skew``: ``stage``, ``offset_s`` (how far the clocks of the stage's
  peers that push their records are ahead of ours, the median over them; negative:
  behind), ``peers``: at least ``protocol.clock.WARN_S`` apart, which fails rounds; at
  most every ``protocol.clock.REPEAT_S`` while it lasts.
- ``averaging.state_refused``: ``averager`` (its name in log lines: stage and peer),
  ``source`` (the peer the state came from, as the transport knows it), ``reason``: a
  downloaded state did not fit the stage, or claimed an epoch far ahead of the others;
  no state is downloaded from ``source`` for a while.
- ``data.share``: ``trainers`` (live peers counted as trainers, this one included),
  ``ranges`` and ``tokens`` (of the run's training shards this node's trainer now reads:
  ``protocol.data_split``), ``share`` (those ranges, ``[shard, start, end]`` each); in
  runs with shards, whenever the share changes.
- ``train.progress`` (every 10 micro-batches of this node's trainer): ``micro_batches``
  (trained since start), ``loss`` (of the last one).
- ``call.failed``: ``stage``, ``peer``, ``error`` (the exception's class and message): a
  call of this node's trainer failed; that peer is banned from its calls for a while.
  ``call.rerouted``: ``stage``, ``peer``: the failed call was sent again, to ``peer``
  (the same one when the stage has no other).
- ``route.out_of_reach``: ``count``, ``peers`` (their ids), ``reason``: peers that serve
  through a relay, which this node's trainer cannot dial (``--no-relay``), so routes no
  call to; emitted when their number changes.
- ``stage.abandoned``: ``stage``, ``peer`` (the caller), ``micro_batch`` (its id: the
  micro-batch's place in the caller's data stream, unique over its trainer's life), ``kind``,
  ``train``: a request received whole was dropped uncomputed because its caller left (its
  session closed, as a trainer's timed-out call does) while it waited for a step or for
  the compute thread; nothing of it was counted.
- ``peer.banned``: ``peer``, ``service`` (the ``service_name`` whose refusal banned it): a
  caller refused too often; every service of this node refuses it for a while.
- ``rpc.refused``: ``service``, ``peer`` (the caller), ``reason`` (a
  ``protocol.admission.Refusal`` value: ``caller_requests``, ``total_requests``,
  ``caller_bytes``, ``total_bytes``, ``slow``), ``count`` (such refusals of that caller
  since the last event for them): stage requests shed for load, or that did not arrive in
  time; the first of each caller and reason at once, then at most one a second.
- ``record.refused``: ``run``, ``reason``: this node refused to store or read a record of
  its run's DHT keys (written by the node's DHT process). For the run directory, which
  is no run's, ``run`` is null and ``key`` is ``"swarmtrain/runs"``.
- ``spec.conflict``: ``run``, ``changes`` (phrases): the owner signed two specs for the
  run; this node keeps the earlier.
- ``progress.unproven``: ``stage``, ``peers`` (those whose progress records claimed an
  epoch past ours, none of whom handed over a newer state: their records are ignored for
  a while), ``epoch`` (ours).
- ``checkpoint.written``: ``stage``, ``step`` (the optimizer steps it holds), ``path``.
- ``node.stopped``: no fields.

A process holds at most one open log (``open_log``); ``emit`` anywhere in the process
writes to it, and does nothing when none is open, so library code emits unconditionally.
Lines are appended with one ``write`` each on a file opened ``O_APPEND``, so a forked child
(a hivemind averager) may emit into the same file without interleaving; a child opens the
log by its path for each line. A node runs for days: past ``MAX_LOG_BYTES`` the process
that opened the log renames it to ``NAME.1`` (replacing the one before) and opens a new
one, so a child's line lands in one of the two, never lost.

In-process listeners (``listen``; the dashboard counts events this way) get every event
emitted in the process that registered them, log open or not, on the emitting thread;
a forked child's events (``record.refused``, from the DHT's process) reach the log only.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

MAX_LOG_BYTES = 64 * 2**20  # an event log past this is rotated (one older copy kept)

_fd: int | None = None
_path: Path | None = None  # the open log's
_owner: int | None = None  # the pid that opened it: the one process that rotates it
_writing = threading.Lock()  # the owner's writes and rotation (never taken in a child)
Listener = Callable[[dict[str, Any]], None]
_listeners: list[tuple[int, Listener]] = []  # (the pid that registered it, the listener)


def open_log(path: Path) -> None:
    """Open ``path`` (created, appended to) as this process's event log."""
    global _fd, _path, _owner
    close_log()
    path.parent.mkdir(parents=True, exist_ok=True)
    path = path.absolute()  # a child opens it by this path, wherever it runs
    _fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    _path, _owner = path, os.getpid()


def close_log() -> None:
    global _fd
    if _fd is not None:
        with contextlib.suppress(OSError):
            os.close(_fd)
        _fd = None


def listen(listener: Listener) -> Callable[[], None]:
    """Call ``listener`` with every event this process emits from now on (the record as
    the log gets it); returns the function that stops it. A listener must be quick and
    thread-safe; what it raises is logged and dropped."""
    entry = (os.getpid(), listener)
    _listeners.append(entry)

    def stop() -> None:
        with contextlib.suppress(ValueError):
            _listeners.remove(entry)

    return stop


def emit(event: str, **fields: Any) -> None:
    """Append one event. Never raises: a full disk costs the event, not the node."""
    record = {"t": round(time.time(), 3), "event": event, **fields}
    if _listeners:
        _notify(record)
    if _fd is None:
        return
    data = (json.dumps(record, default=str) + "\n").encode()
    try:
        if os.getpid() != _owner:  # a forked child: the lock may have been held at the fork
            assert _path is not None
            fd = os.open(_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            try:
                os.write(fd, data)
            finally:
                os.close(fd)
            return
        with _writing:
            os.write(_fd, data)
            if os.fstat(_fd).st_size > MAX_LOG_BYTES:
                _rotate()
    except OSError as e:
        logger.debug("event %s not written: %s", event, e)


def _rotate() -> None:
    """Rename the open log to ``NAME.1`` (replacing the older one) and open a new log at
    its path (holding ``_writing``). A rename that fails empties the log in place instead,
    rather than let it grow or try again at every event."""
    global _fd
    assert _path is not None and _fd is not None
    try:
        os.replace(_path, _path.with_name(_path.name + ".1"))
    except OSError as e:
        logger.warning("could not keep the event log %s (%s): emptying it", _path, e)
        os.ftruncate(_fd, 0)
        return
    fresh = os.open(_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.close(_fd)
    _fd = fresh


def _notify(record: dict[str, Any]) -> None:
    pid = os.getpid()
    for owner, listener in list(_listeners):
        if owner != pid:  # inherited by a fork: its state belongs to the parent
            continue
        try:
            listener(record)
        except Exception:
            logger.exception("an event listener failed on %s", record.get("event"))


def read_events(path: Path, event: str | None = None) -> list[dict[str, Any]]:
    """The events in ``path`` (all, or those of one kind), skipping a torn last line."""
    return list(iter_events(path, event))


def iter_events(path: Path, event: str | None = None) -> Iterator[dict[str, Any]]:
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and (event is None or record.get("event") == event):
            yield record
