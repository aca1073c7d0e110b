"""A node's start, from launch to serving its stage, of two source trees side by side: a
one-node run of the ``tiny`` preset (``node.harness.local_swarm.launch_node``, throughput
declared) started from each tree in turn, ``--repeat`` times, with the seconds from launch
to ``node.started`` to ``SERVING`` (``node.state``) and the stage's "built" step (its log
line ``stage N held in ... (built X s, ...)``), and the per-pair ratio of the two trees.

    git archive OLD_COMMIT | tar -x -C /tmp/before
    python -m scripts.bench_startup /tmp/before . [--repeat 6]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import tempfile
import time
from pathlib import Path

from node.harness.local_swarm import launch_node, stop_all, wait_until

BUILT = re.compile(r"held in [\d.]+ s \(built ([\d.]+) s")


def start_once(tree: Path, name: str) -> tuple[float, float, float]:
    """Seconds from launch to ``node.started``, from it to ``SERVING``, and the stage's
    built step, of one node started from ``tree``."""
    os.environ["PYTHONPATH"] = str(tree)  # launch_node runs ``python -m node.cli``
    os.chdir(tree)
    with tempfile.TemporaryDirectory(prefix="bench_startup_") as d:
        launched = time.time()
        node = launch_node(Path(d), "a", name, wait=False)
        try:
            serving = wait_until(
                lambda: [e for e in node.events("node.state") if e["state"] == "SERVING"],
                180,
                "the node to serve",
            )[0]["t"]
            started = node.events("node.started")[0]["t"]
            built = BUILT.search(node.output())
            return (
                started - launched,
                serving - started,
                float(built.group(1)) if built else float("nan"),
            )
        finally:
            stop_all([node])


def _median(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} [{min(values):.2f}, {max(values):.2f}]"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("before", type=Path, help="a source tree (e.g. git archive of a commit)")
    p.add_argument("after", type=Path, help="another source tree")
    p.add_argument("--repeat", type=int, default=6)
    args = p.parse_args()
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    runs: dict[str, list[tuple[float, float, float]]] = {name: [] for name in trees}
    for i in range(args.repeat):
        for name, tree in trees.items():
            runs[name].append(start_once(tree, f"startup{i}"))
            launched, serving, built = runs[name][-1]
            print(f"{i} {name}: launch->started {launched:.2f} s, started->SERVING "
                  f"{serving:.2f} s, built {built:.2f} s", flush=True)  # fmt: skip
    for name, rows in runs.items():
        total = [a + b for a, b, _ in rows]
        print(f"{name}: launch->SERVING {_median(total)} s, started->SERVING "
              f"{_median([b for _, b, _ in rows])} s, built {_median([c for *_, c in rows])} s "
              f"(median [range] over {len(rows)})")  # fmt: skip
    ratio = [
        b[1] / a[1] for a, b in zip(runs["before"], runs["after"], strict=True)
    ]  # started->SERVING, after / before, per pair
    print(f"started->SERVING after/before per pair: {_median(ratio)}")


if __name__ == "__main__":
    main()
