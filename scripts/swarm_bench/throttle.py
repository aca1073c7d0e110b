"""A CPU cap on a node's processes, to make it a slow peer (cgroup v1 ``cpu``, or v2).

The cap is a CFS quota: the processes may run ``fraction`` of one core's time per
100 ms period, whatever else the machine does.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import psutil

PERIOD_US = 100_000
V1, V2 = Path("/sys/fs/cgroup/cpu"), Path("/sys/fs/cgroup")


class ThrottleUnavailable(RuntimeError):
    """No writable cgroup CPU controller here; the message says what is missing."""


def tree_cpu_times(pid: int) -> list[tuple[psutil.Process, float]]:
    """Each live process of ``pid``'s tree (``pid`` first) with the CPU seconds it has used
    so far; processes that end meanwhile are left out."""
    found = []
    with contextlib.suppress(psutil.NoSuchProcess):
        root = psutil.Process(pid)
        for p in [root, *root.children(recursive=True)]:
            with contextlib.suppress(psutil.NoSuchProcess):
                t = p.cpu_times()
                found.append((p, t.user + t.system))
    return found


def tree_cpu_seconds(pid: int) -> float:
    """CPU seconds used so far by ``pid`` and its descendants."""
    return sum(seconds for _, seconds in tree_cpu_times(pid))


class CpuThrottle:
    def __init__(self, name: str) -> None:
        if (V1 / "cpu.cfs_quota_us").exists():
            self.root, self.v2 = V1, False
        elif "cpu" in (V2 / "cgroup.subtree_control").read_text(errors="ignore").split():
            self.root, self.v2 = V2, True
        else:
            raise ThrottleUnavailable("no cgroup cpu controller (v1 cpu, or v2 with +cpu)")
        if not os.access(self.root, os.W_OK):
            raise ThrottleUnavailable(f"{self.root} is not writable (run as root)")
        self.dir = self.root / f"stn-{name}-{os.getpid()}"

    def apply(self, pid: int, fraction: float) -> None:
        """Cap ``pid`` and its descendants at ``fraction`` of a core."""
        self.dir.mkdir(exist_ok=True)
        quota = max(1000, int(fraction * PERIOD_US))
        if self.v2:
            (self.dir / "cpu.max").write_text(f"{quota} {PERIOD_US}")
        else:
            (self.dir / "cpu.cfs_period_us").write_text(str(PERIOD_US))
            (self.dir / "cpu.cfs_quota_us").write_text(str(quota))
        root = psutil.Process(pid)
        for p in [root, *root.children(recursive=True)]:
            with contextlib.suppress(OSError):
                (self.dir / "cgroup.procs").write_text(str(p.pid))

    def close(self) -> None:
        """Release what is still in the cgroup and remove it."""
        if not self.dir.exists():
            return
        for pid in (self.dir / "cgroup.procs").read_text().split():
            with contextlib.suppress(OSError):
                (self.root / "cgroup.procs").write_text(pid)
        with contextlib.suppress(OSError):
            self.dir.rmdir()
