"""Two peers of a stage whose clocks are 2 s apart (one node's shifted with libfaketime,
which its p2pd, a Go binary, does not see): each says so, in a warning and an
``averaging.clock_skew`` event carrying the offset, since rounds fail that far apart."""

from __future__ import annotations

import pytest

from node.harness.local_swarm import shifted_clock
from tests.swarm import launch_node, stop_all, wait_until

SHIFT_S = 2.0
SHIFTED = shifted_clock(SHIFT_S)


@pytest.mark.skipif(SHIFTED is None, reason="needs libfaketime (Debian: apt-get install faketime)")
def test_peers_whose_clocks_differ_say_by_how_much(tmp_path) -> None:
    nodes = []
    try:
        a = launch_node(tmp_path, "a", "clocks", extra=["--stage", "0"])
        nodes.append(a)
        b = launch_node(tmp_path, "b", a.run_id, initial_peers=[a.maddr], extra=["--stage", "0"],
                        wrap=SHIFTED)  # fmt: skip
        nodes.append(b)

        def warned(node) -> list[dict]:
            assert node.alive(), node.output()[-3000:]
            return node.events("averaging.clock_skew")

        for node, sign in ((a, 1), (b, -1)):  # b's clock is ahead of a's
            (event, *_) = wait_until(lambda n=node: warned(n), 120, f"{node.name}'s warning")
            assert event["stage"] == 0 and event["peers"] == 1, event
            assert abs(event["offset_s"] - sign * SHIFT_S) < 0.3, event
            assert "make sure time synchronization is on" in node.output()
    finally:
        stop_all(nodes)
