"""A node's start before it serves: which run it joins (``resolve_run``), the invite it
shows (``invite_for``), what its machine can do (``examine_machine``), and how long each
step took (``Steps``)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil

from models.data import Corpus
from models.pretrained import Checkpoint, verify_files
from node.daemon.join import NodeError, member_invite, owned_spec
from node.daemon.settings import NodeSettings
from node.data import training_data
from node.files import load_or_create_key
from node.measure.capacity import Device, pick_device, stage_throughputs
from protocol.identity import peer_id_of
from protocol.ownership import check_run_id
from protocol.records import RecordError
from protocol.run_spec import RunSpec, SignedSpec, make_run_spec, read_spec_file

logger = logging.getLogger(__name__)


def resolve_run(settings: NodeSettings) -> tuple[str, SignedSpec | None]:
    """The run's id, and its signed spec when this node brings it (a spec file, or a new
    public run by name, signed with this machine's owner key). A run started by name
    keeps the spec it was created with (``join.owned_spec``): restarting it with
    other settings is refused, since a run's spec never changes."""
    if settings.spec_file is not None:
        try:
            signed = read_spec_file(settings.spec_file.read_text())
        except (OSError, RecordError) as e:
            raise NodeError(f"cannot use spec file {settings.spec_file}: {e}") from None
        if settings.run not in ("", signed.spec.run):
            raise NodeError(f"--run {settings.run} but the spec file is for {signed.spec.run}")
        return signed.spec.run, signed
    if "@" in settings.run:
        return settings.run, None  # the spec comes from the DHT
    if settings.initial_peers:
        check_run_id(settings.run)  # joining: the run's id, not a name
    owner_key = load_or_create_key(settings.owner_key_path())
    owner = peer_id_of(owner_key.public_key())
    chosen = {} if settings.compression is None else {"compression": settings.compression}
    spec = make_run_spec(settings.run, settings.preset, settings.n_stages, owner=owner, **chosen)
    # What no flag of the node chose stays as the run was created (older defaults too).
    defaulted = ["averaging", *(() if chosen else ("compression",))]
    try:
        return spec.run, owned_spec(settings.owner_key_path(), owner_key, spec, defaulted)
    except ValueError as e:
        raise NodeError(str(e)) from None


def check_pins(settings: NodeSettings, spec: RunSpec) -> None:
    """``NodeError`` unless the stages ``--stage`` and ``--second-stage`` pin are stages of
    ``spec``, and two different ones."""
    s = settings
    for flag, stage in (("--stage", s.stage), ("--second-stage", s.second_stage)):
        if stage is not None and not 0 <= stage < spec.n_stages:
            raise NodeError(f"{flag} {stage}: run {s.run!r} has stages 0..{spec.n_stages - 1}")
    if s.second_stage is not None and s.second_stage == s.stage:
        raise NodeError(f"--second-stage {s.second_stage} is the node's --stage already")


def pretrained_copy(spec: RunSpec, directory: Path | None) -> Checkpoint | None:
    """This machine's copy of the checkpoint ``spec`` starts from, its files checked
    against the spec's hashes; None for a run that starts from seeded weights. ``NodeError``
    naming the flag to give, or the file that is missing or differs."""
    pinned = spec.pretrained
    if pinned is None:
        if directory is not None:
            logger.warning("--pretrained %s: run %s starts from no checkpoint", directory, spec.run)
        return None
    if directory is None:
        raise NodeError(
            f"run {spec.run} starts from a {pinned.architecture} checkpoint: give this "
            f"machine's copy of it with --pretrained DIR ({', '.join(sorted(pinned.files))})"
        )
    directory = directory.expanduser()
    logger.info("checking the checkpoint in %s against the run's hashes", directory)
    try:
        verify_files(directory, pinned.files)
    except ValueError as e:
        raise NodeError(f"--pretrained: {e}") from None
    return Checkpoint(directory, pinned.architecture, spec.model, pinned.tied, dict(pinned.files))


@dataclass(frozen=True)
class MachineFacts:
    """What a node finds out about its machine at start, without asking any peer."""

    pretrained: Checkpoint | None  # this machine's copy of the run's checkpoint, checked
    device: Device
    throughput: tuple[float, ...]  # samples/s per stage: declared, cached or measured
    corpus: Corpus | None  # the training data (None: the node does not train)
    seconds: float  # how long finding all this out took


def examine_machine(settings: NodeSettings, spec: RunSpec) -> MachineFacts:
    """Check this machine's copy of the run's checkpoint (``pretrained_copy``), pick the
    device, take its throughput per stage (``--throughput``, else the cache or a
    measurement: ``stage_throughputs``) and read the training data (with ``train``).
    Blocking, and one step after another: a measurement beside the data being read would
    measure the reading too. ``NodeError`` or ``ValueError`` naming what to fix."""
    started = time.monotonic()
    pretrained = pretrained_copy(spec, settings.pretrained)
    device = pick_device(settings.device)
    if settings.throughput is not None:
        throughput = (float(settings.throughput),) * spec.n_stages
    else:
        throughput = tuple(
            stage_throughputs(spec, device, settings.cache_dir, remeasure=settings.remeasure)
        )
    corpus = training_data(spec, settings.data) if settings.train else None
    return MachineFacts(pretrained, device, throughput, corpus, time.monotonic() - started)


class Steps:
    """How long each step of a sequence took (a node's start, the loading of a stage), for
    one log line. Steps end one after another (``done``), or ran beside the others
    (``done(name, seconds)``: shown, not added to the total)."""

    def __init__(self, before: tuple[str, float] | None = None) -> None:
        """``before``: a first step, (name, seconds), that ended just now."""
        self._last = time.monotonic()
        self._steps: list[tuple[str, float]] = [before] if before else []
        self.total = before[1] if before else 0.0

    def done(self, name: str, seconds: float | None = None) -> None:
        """Step ``name`` ended now (or, with ``seconds``, took that long beside others)."""
        if seconds is None:
            now = time.monotonic()
            seconds, self._last = now - self._last, now
            self.total += seconds
        self._steps.append((name, seconds))

    def line(self) -> str:
        """``"T s (STEP S s, ...)"``."""
        steps = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in self._steps)
        return f"{self.total:.1f} s ({steps})"


def since_process_start() -> float:
    """Seconds since this process started (its imports included)."""
    return max(0.0, time.time() - psutil.Process().create_time())


def invite_for(settings: NodeSettings, peer_id: str) -> Callable[[RunSpec], str | None]:
    """The invite a node shows to join a run: ``--invite``, or in a private run one its
    owner's node makes for itself when it finds the run's owner key (``--owner-key``, by
    default ``~/.swarmtrain/owner.key``): the run's owner needs no invite."""
    return member_invite(settings.invite, settings.owner_key_path(), peer_id)
