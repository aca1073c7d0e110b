"""Where a run's records live in the DHT. Subkeys are peer ids, so each peer owns one slot.

One key belongs to no run: ``RUNS_KEY``, the run directory, where public runs announce
themselves (``protocol.announce``), one subkey per run id (no run's key can equal it:
theirs all end in a further ``/PART``, and a run's name holds no ``/``)."""

from __future__ import annotations

from protocol.records import check_run_name

RUNS_KEY = "swarmtrain/runs"  # the run directory: ``RunAnnouncement``s by run id


def spec_key(run: str) -> str:
    """The run's ``RunSpec``."""
    return f"swarmtrain/{check_run_name(run)}/spec"


def peers_key(run: str) -> str:
    """The run's ``PeerInfo`` records, one subkey per peer id."""
    return f"swarmtrain/{check_run_name(run)}/peers"


def revocations_key(run: str) -> str:
    """The owner's latest ``Revocations`` (private runs)."""
    return f"swarmtrain/{check_run_name(run)}/revoked"


def archives_key(run: str) -> str:
    """The run's ``ArchiveRecord``s (protocol.archive), one subkey per archive node."""
    return f"swarmtrain/{check_run_name(run)}/archives"
