"""Averaging between peers whose clocks differ: how many rounds a stage's two peers average
when one node's clock is shifted (libfaketime; its ``p2pd``, a Go binary, keeps the true
time), and what each node says about it.

    python -m scripts.bench_clock [--shifts 0 1 -1 2 -2] [--seconds 60] [--runs 1]

Per shift and run: a 2-stage run on 127.0.0.1 with two peers of stage 0 (``a``, which
trains, and ``b``, its clock shifted by SHIFT s with libfaketime) and one of stage 1;
after all serve, ``--seconds`` of training, then the stage-0 epoch ``a`` reached, the rounds it
averaged with ``b`` (``averaging.round`` with ``how`` averaged and 2 peers) and those it
stepped alone or fell back in, and the offsets each node reported
(``averaging.clock_skew``). A shift beyond 3 s is refused at join by hivemind's DHT, so
the script prints the node's error line instead. Needs libfaketime (Debian package
``faketime``).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from node.harness.local_swarm import NodeProcess, launch_node, shifted_clock, stop_all


def _error_line(node: NodeProcess) -> str:
    lines = [x for x in node.output().splitlines() if x.startswith("swarmtrain node:")]
    return lines[-1] if lines else node.output()[-300:]


def run_once(shift: float, seconds: float, workdir: Path) -> str:
    """One swarm with ``b``'s clock shifted by ``shift`` seconds; its line of figures."""
    nodes: list[NodeProcess] = []
    try:
        a = launch_node(workdir, "a", "clocks", extra=["--stage", "0"], train=True)
        nodes.append(a)
        run = a.run_id
        c = launch_node(workdir, "c", run, initial_peers=[a.maddr], extra=["--stage", "1"])
        nodes.append(c)
        b = launch_node(workdir, "b", run, initial_peers=[a.maddr], extra=["--stage", "0"],
                        wrap=shifted_clock(shift) if shift else None, wait=False)  # fmt: skip
        nodes.append(b)
        try:
            b.wait_started()
        except RuntimeError:
            return f"b did not join: {_error_line(b)}"
        for n in nodes:
            n.wait_serving(180)
        began = time.time()  # a's clock, which the events of a carry
        time.sleep(seconds)
        rounds = [r for r in a.events("averaging.round") if r["t"] >= began]
        how = Counter(r["how"] for r in rounds)
        averaged = sum(1 for r in rounds if r["how"] == "averaged" and r["peers"] == 2)
        epoch = rounds[-1]["epoch"] if rounds else None
        said = {n.name: [e["offset_s"] for e in n.events("averaging.clock_skew")] for n in (a, b)}
        return (
            f"a's epoch {epoch}, {len(rounds)} rounds in {seconds:.0f} s: averaged with b "
            f"{averaged}, {dict(how)}; offsets reported: a {said['a'][:1]}, b {said['b'][:1]}"
        )
    finally:
        stop_all(nodes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shifts", type=float, nargs="+", default=[0, 1, -1, 2, -2])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--runs", type=int, default=1)
    args = parser.parse_args()
    if shifted_clock(0) is None:
        sys.exit("bench_clock: needs libfaketime (Debian: apt-get install faketime)")
    for run in range(args.runs):
        for shift in args.shifts:
            with tempfile.TemporaryDirectory(prefix="bench-clock-") as tmp:
                line = run_once(shift, args.seconds, Path(tmp))
            print(f"run {run + 1}, b's clock {shift:+g} s: {line}", flush=True)


if __name__ == "__main__":
    main()
